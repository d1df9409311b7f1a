import unittest

import mathlib
from mathlib import mean, median, variance


class StatsTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_median(self):
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_variance(self):
        self.assertAlmostEqual(variance([2, 4, 4, 4, 5, 5, 7, 9]), 32 / 7)

    def test_version(self):
        with open("VERSION") as f:
            self.assertEqual(mathlib.__version__, f.read().strip())


if __name__ == "__main__":
    unittest.main()
