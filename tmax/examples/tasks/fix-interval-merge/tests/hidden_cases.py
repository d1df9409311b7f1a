"""Hidden test cases; each one fails with the original buggy implementation."""
import json
import sys

sys.path.insert(0, "/app")
from intervals import merge_intervals, total_covered


def case_unsorted():
    return merge_intervals([(8, 10), (1, 3), (2, 6)]) == [(1, 6), (8, 10)]


def case_contained():
    return merge_intervals([(1, 10), (2, 3), (4, 5)]) == [(1, 10)]


def case_touching_chain():
    return merge_intervals([(0, 1), (1, 2), (2, 3), (5, 6)]) == [(0, 3), (5, 6)]


def case_input_untouched():
    data = [(7, 9), (3, 4), (1, 2)]
    return merge_intervals(data) == [(1, 2), (3, 4), (7, 9)] and data == [(7, 9), (3, 4), (1, 2)]


def case_floats_and_generator():
    return merge_intervals(x for x in [(2.5, 3.5), (0.5, 1.0), (1.0, 2.5)]) == [(0.5, 3.5)]


def case_total_unsorted():
    return total_covered([(10, 20), (0, 5), (4, 12)]) == 20


def case_total_nested():
    return total_covered([(0, 100), (10, 20), (30, 40), (99, 101)]) == 101


def case_big_random():
    import random
    r = random.Random(5)
    iv = [(a, a + r.randint(0, 7)) for a in (r.randint(0, 200) for _ in range(60))]
    covered = set()
    for a, b in iv:
        covered.update(range(a, b))  # unit cells [k, k+1)
    res = merge_intervals(iv)
    ok_sorted = all(res[i][1] < res[i + 1][0] for i in range(len(res) - 1))
    cells = set()
    for a, b in res:
        cells.update(range(a, b))
    points = {p for a, b in iv for p in (a, b)}
    ok_points = all(any(a <= p <= b for a, b in res) for p in points)
    return ok_sorted and cells == covered and ok_points and total_covered(iv) == len(covered)


if __name__ == "__main__":
    results = {}
    for name, fn in sorted(globals().items()):
        if name.startswith("case_"):
            try:
                results[name] = bool(fn())
            except Exception:
                results[name] = False
    print(json.dumps(results))
