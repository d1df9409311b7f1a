"""Interval utilities used by the booking service."""


def merge_intervals(intervals):
    """Merge overlapping or touching closed intervals.

    ``intervals`` is an iterable of ``(start, end)`` pairs (numbers, ``start <= end``) in any
    order. Returns a new list of ``(start, end)`` tuples sorted by start in which no two
    intervals overlap or touch. The input is not modified.

    >>> merge_intervals([(1, 3), (2, 6), (8, 10)])
    [(1, 6), (8, 10)]
    >>> merge_intervals([(1, 2), (2, 4)])
    [(1, 4)]
    """
    result = []
    for start, end in intervals:
        if result and start < result[-1][1]:
            result[-1] = (result[-1][0], end)
        else:
            result.append((start, end))
    return result


def total_covered(intervals):
    """Total length covered by the union of the intervals."""
    return sum(end - start for start, end in merge_intervals(intervals))
