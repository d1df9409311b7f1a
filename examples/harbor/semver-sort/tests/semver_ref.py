"""The reference the graders compare /app/vsort with: SemVer 2.0.0 parsing and precedence,
case generators, and a runner."""

import random
import re
import subprocess

VSORT = "/app/vsort"
NUM = r"(?:0|[1-9][0-9]*)"
IDENT = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
SEMVER = re.compile(rf"({NUM})\.({NUM})\.({NUM})(?:-({IDENT}(?:\.{IDENT})*))?"
                    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?")


def precedence(version: str) -> tuple:
    major, minor, patch, pre, _build = SEMVER.fullmatch(version).groups()
    core = (int(major), int(minor), int(patch))
    if pre is None:
        return (*core, 1, ())
    ids = tuple((0, int(i), "") if i.isdigit() else (1, 0, i) for i in pre.split("."))
    return (*core, 0, ids)


def expected(lines: list[str]) -> tuple[str, list[str], int]:
    """(stdout, stderr lines, exit status) for these input lines."""
    valid = [v for v in lines if v and SEMVER.fullmatch(v)]
    invalid = [f"invalid: {v}" for v in lines if v and not SEMVER.fullmatch(v)]
    out = "".join(v + "\n" for v in sorted(valid, key=precedence))
    return out, invalid, 1 if invalid else 0


def run(lines: list[str]) -> tuple[str, list[str], int]:
    proc = subprocess.run([VSORT], input="".join(v + "\n" for v in lines).encode(),
                          capture_output=True, check=False, timeout=60)
    return (proc.stdout.decode(errors="replace"),
            proc.stderr.decode(errors="replace").splitlines(), proc.returncode)


def release(rng: random.Random) -> str:
    """MAJOR.MINOR.PATCH from small ranges (so 1.10.0 and 1.9.0 meet), now and then huge."""
    parts = [rng.choice([0, 1, 2, 9, 10, 11, 19, 100]) if rng.random() < 0.8
             else rng.randint(0, 10 ** rng.randint(1, 24)) for _ in range(3)]
    return ".".join(map(str, parts))


def prerelease(rng: random.Random) -> str:
    pool = ["alpha", "beta", "rc", "0", "1", "2", "10", "11", "x-y", "0a", "a1", "-", "RC",
            "alpha-2", "9" * 21]
    return ".".join(rng.choice(pool) for _ in range(rng.randint(1, 3)))


def build(rng: random.Random) -> str:
    pool = ["001", "build", "sha-5114f85", "20250620", "x", "exp-sha"]
    return ".".join(rng.choice(pool) for _ in range(rng.randint(1, 2)))


def versions(rng: random.Random, n: int, pre: float, meta: float) -> list[str]:
    """n valid versions; a share pre with a pre-release, a share meta with build metadata."""
    base = [release(rng) for _ in range(max(2, n // 3))]
    out = []
    for _ in range(n):
        v = rng.choice(base)
        if rng.random() < pre:
            v += "-" + prerelease(rng)
        if rng.random() < meta:
            v += "+" + build(rng)
        out.append(v)
    return out
