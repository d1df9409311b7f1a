"""Descriptive statistics for lists of numbers."""


def mean(xs):
    """Arithmetic mean of a non-empty sequence."""
    xs = list(xs)
    if not xs:
        raise ValueError("mean of empty data")
    return sum(xs) / len(xs)


def median(xs):
    """Median of a non-empty sequence (mean of the two middle values for even length)."""
    xs = sorted(xs)
    if not xs:
        raise ValueError("median of empty data")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def variance(xs):
    """Sample variance (divides by n - 1) of a sequence with at least two values."""
    xs = list(xs)
    if len(xs) < 2:
        raise ValueError("variance needs at least two values")
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)
