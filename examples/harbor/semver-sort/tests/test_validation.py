"""Sub-score "validation": invalid lines reported on stderr, exit status 1, the rest sorted."""

import os
import random

import pytest
from semver_ref import expected, run, versions

SEED = int(os.environ.get("VSORT_SEED", "7"))
INVALID = ["1.2", "1.2.3.4", "01.2.3", "1.02.3", "1.2.03", "1.2.3-", "1.2.3-01", "1.2.3-a..b",
           "1.2.3+", "1.2.3+a..b", "v1.2.3", "1.2.3-a_b", "1.2.3+\u00e9", "1.2.-3", "-1.2.3",
           "1.2.3-rc.1+b.1+c", "1.2.3-00", "a.b.c", "1.2.3-\u0663", "\u0661.2.3", "1..3",
           "1.2.3 beta"]
VALID_ODDITIES = ["1.2.3-0a", "1.2.3--", "1.2.3-a-b", "1.2.3+001", "1.2.3-alpha.0valid",
                  "1.2.3-0.0", "0.0.0"]


def test_each_invalid_line_is_reported():
    lines = ["2.0.0"] + INVALID + ["1.0.0"]
    assert run(lines) == ("1.0.0\n2.0.0\n", [f"invalid: {v}" for v in INVALID], 1)


def test_odd_but_valid_versions_are_kept():
    assert run(VALID_ODDITIES) == expected(VALID_ODDITIES)
    assert run(VALID_ODDITIES)[2] == 0


def test_empty_lines_are_skipped():
    assert run(["1.0.0", "", "0.1.0", ""]) == ("0.1.0\n1.0.0\n", [], 0)


@pytest.mark.parametrize("case", range(10))
def test_generated_mixtures(case):
    rng = random.Random(SEED * 3000 + case)
    lines = versions(rng, rng.randint(0, 30), pre=0.4, meta=0.2)
    for bad in rng.sample(INVALID, rng.randint(1, 6)):
        lines.insert(rng.randint(0, len(lines)), bad)
    assert run(lines) == expected(lines)
