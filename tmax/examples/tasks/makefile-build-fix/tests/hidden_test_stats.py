import math
import unittest

import mathlib
from mathlib import mean, median, variance


class HiddenStatsTest(unittest.TestCase):
    def test_version_string(self):
        self.assertIsInstance(mathlib.__version__, str)
        self.assertEqual(mathlib.__version__, "1.4.2")

    def test_variance_sample(self):
        self.assertAlmostEqual(variance([1, 2, 3, 4]), 5 / 3)
        self.assertAlmostEqual(variance([10.0, 10.0]), 0.0)
        self.assertAlmostEqual(variance(x for x in [1, 3]), 2.0)

    def test_variance_too_short(self):
        with self.assertRaises(ValueError):
            variance([1])

    def test_mean_median(self):
        self.assertEqual(mean([5]), 5)
        self.assertEqual(median([7, 1, 5, 3]), 4)
        self.assertTrue(math.isclose(mean([0.1, 0.2, 0.3]), 0.2))


if __name__ == "__main__":
    unittest.main()
