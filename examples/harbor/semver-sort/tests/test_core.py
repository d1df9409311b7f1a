"""Sub-score "core": release versions ordered by MAJOR, MINOR, PATCH as numbers."""

import os
import random

import pytest
from semver_ref import expected, release, run

SEED = int(os.environ.get("VSORT_SEED", "7"))


def test_numbers_not_strings():
    lines = ["1.10.0", "1.9.0", "10.0.0", "2.0.0", "1.9.10", "1.9.9", "0.0.1"]
    assert run(lines) == ("0.0.1\n1.9.0\n1.9.9\n1.9.10\n1.10.0\n2.0.0\n10.0.0\n", [], 0)


def test_numbers_beyond_64_bits():
    lines = ["18446744073709551616.0.0", "18446744073709551615.0.0", "9.0.0",
             "1.99999999999999999999999.0"]
    assert run(lines) == expected(lines)


@pytest.mark.parametrize("case", range(15))
def test_generated_releases(case):
    rng = random.Random(SEED * 1000 + case)
    lines = [release(rng) for _ in range(rng.randint(1, 60))]
    assert run(lines) == expected(lines)
