"""The verifier's start against an older revision's: ``runtime.verify`` of a trivial test.sh
(``echo 1 > /logs/verifier/reward.txt``) in a running sandbox of the slim Debian base, both
implementations measured in one run, in blocks that alternate (the order flips every
round) so a slow spell of the machine hits both alike.

    .venv/bin/python benchmarks/verify_bench.py [--old-rev 7290737] [--new-rev HEAD]
        [--rounds 4] [--block 10] [--out FILE.json]

Run as root. Each revision runs from a git worktree made under a fresh /tmp folder (removed
at the end), in an agent process of its own whose ``sandfleet`` is that tree's. The figure
is the wall time of the ``verify`` call, taken inside the agent: the view (set-aside pass,
mounts; since b9374bd the agent's top-level entries bound one by one, since 02fa2e2 the
immutable flags), bwrap, test.sh, the copy of its logs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

REPO = Path(__file__).resolve().parents[1]
STORE = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax")) / "test-store"

AGENT = r'''
import json, sys, tempfile, time
from pathlib import Path
from sandfleet.runtime import get_runtime
from sandfleet.runtime.base import SandboxSpec
state, image = Path(sys.argv[1]), sys.argv[2]
rt = get_runtime("local", state_dir=state)
rt.start("vb", SandboxSpec(image=image))
tests = state / "tests"
tests.mkdir(exist_ok=True)
(tests / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
path = "/usr/local/bin:/usr/bin:/bin"
try:
    for line in sys.stdin:
        times = []
        for i in range(int(line)):
            with tempfile.TemporaryDirectory(dir=state) as logs:
                t = time.monotonic()
                r = rt.verify("vb", ["/bin/bash", "/tests/test.sh"], tests=tests,
                              logs=Path(logs), timeout=60, env={"PATH": path})
                times.append(time.monotonic() - t)
                assert r.exit_code == 0 and (Path(logs) / "reward.txt").read_text() == "1\n", r
        print(json.dumps(times), flush=True)
finally:
    rt.stop("vb")
'''


def base_sif() -> Path:
    """The tests' slim Debian base (``bin/tmax-dev test`` builds it once per machine)."""
    sys.path.insert(0, str(REPO))
    from tmax.images.store import ImageStore

    store = ImageStore(STORE)
    return store.path(store.read().bases["debian-slim"].sif)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-rev", default="7290737")
    parser.add_argument("--new-rev", default="HEAD")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    start = machine()
    image = base_sif()
    with tempfile.TemporaryDirectory(prefix="verify-bench-") as tmp:
        agents, trees = {}, []
        try:
            for name, rev in (("old", args.old_rev), ("new", args.new_rev)):
                tree = Path(tmp) / name
                subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                                str(tree), rev], check=True)
                trees.append(tree)
                (Path(tmp) / f"state-{name}").mkdir()
                agents[name] = subprocess.Popen(
                    [sys.executable, "-c", AGENT, str(Path(tmp) / f"state-{name}"),
                     str(image)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
            times: dict[str, list[float]] = {"old": [], "new": []}
            for rnd in range(args.rounds):
                for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                    agent = agents[name]
                    assert agent.stdin and agent.stdout
                    agent.stdin.write(f"{args.block}\n")
                    agent.stdin.flush()
                    times[name] += json.loads(agent.stdout.readline())
        finally:
            for agent in agents.values():
                if agent.stdin:
                    agent.stdin.close()
                agent.wait(timeout=120)
            for tree in trees:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tree)], check=False)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {"machine": start, "old_rev": args.old_rev, "new_rev": args.new_rev,
              "n": {k: len(v) for k, v in times.items()}, "median_s": med,
              "ratio_new_over_old": med["new"] / med["old"]}
    table = "\n".join(f"{k:4s} n={len(v):3d}  median {med[k] * 1000:7.1f} ms  "
                      f"p90 {statistics.quantiles(v, n=10)[-1] * 1000:7.1f} ms"
                      for k, v in times.items())
    emit(report, f"verify of a trivial test.sh, {start}", table +
         f"\nnew / old: {report['ratio_new_over_old']:.2f}", args.out)


if __name__ == "__main__":
    main()
