"""Sub-score "prerelease": pre-release precedence, build metadata ignored, stable ties."""

import os
import random

import pytest
from semver_ref import expected, run, versions

SEED = int(os.environ.get("VSORT_SEED", "7"))


def test_semver_spec_example():
    order = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2",
             "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0"]
    lines = order[::-1]
    assert run(lines) == ("".join(v + "\n" for v in order), [], 0)


def test_build_metadata_ties_keep_input_order():
    lines = ["1.0.0+zzz", "1.0.0-rc.1+b", "1.0.0+aaa", "1.0.0", "1.0.0-rc.1+a", "0.9.0+x"]
    assert run(lines) == ("0.9.0+x\n1.0.0-rc.1+b\n1.0.0-rc.1+a\n1.0.0+zzz\n1.0.0+aaa\n1.0.0\n",
                          [], 0)


def test_identifier_kinds():
    lines = ["1.0.0-a", "1.0.0-2", "1.0.0-10", "1.0.0-0a", "1.0.0-A", "1.0.0--", "1.0.0-1.a",
             "1.0.0-1", "1.0.0-" + "9" * 25, "1.0.0-" + "9" * 24]
    assert run(lines) == expected(lines)


@pytest.mark.parametrize("case", range(15))
def test_generated_prereleases(case):
    rng = random.Random(SEED * 2000 + case)
    lines = versions(rng, rng.randint(2, 60), pre=0.7, meta=0.3)
    assert run(lines) == expected(lines)
