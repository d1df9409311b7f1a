import unittest

from intervals import merge_intervals, total_covered


class MergeTest(unittest.TestCase):
    def test_overlap(self):
        self.assertEqual(merge_intervals([(1, 3), (2, 6), (8, 10)]), [(1, 6), (8, 10)])

    def test_touching(self):
        self.assertEqual(merge_intervals([(1, 2), (2, 4)]), [(1, 4)])

    def test_unsorted(self):
        self.assertEqual(merge_intervals([(5, 7), (1, 2)]), [(1, 2), (5, 7)])

    def test_empty(self):
        self.assertEqual(merge_intervals([]), [])

    def test_total(self):
        self.assertEqual(total_covered([(0, 10), (2, 3)]), 10)


if __name__ == "__main__":
    unittest.main()
