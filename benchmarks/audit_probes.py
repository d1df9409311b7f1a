"""The audit on the planted-defect set (issue 17, "Tests and measurements").

    python benchmarks/audit_probes.py [--tasks tests/data/audit-tasks] [--store /tmp/audit-store]
        [--out /tmp/audit-bench] [--jobs 2] [--controls examples/tasks] [--repair]

1. builds every task's image (with its build-time checks) into ``--store``;
2. runs ``tmax audit`` (the deterministic probes alone, no teacher) on a private fleet and
   compares each label with tests/data/audit-tasks/expected.yaml: the detection rate of each
   planted kind, the clean controls flagged (their own, and optionally ``--controls``: a
   folder of tasks counted as clean controls, e.g. the shipped examples);
3. with ``--repair``: ``tmax repair`` without a teacher (answer leaks only), counting the
   repairs that held;
4. prints one JSON object: per kind found/planted, false flags, sandbox seconds per task,
   tasks per minute of audit wall time, the machine.

Every audit is fresh (a new ``--out`` folder each run); images are reused when unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TMAX = [sys.executable, "-c", "from tmax.cli import main; main()"]


def tmax(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TMAX, *args], capture_output=True, text=True, cwd=REPO,
                          check=False, start_new_session=True)


def audit(tasks: list[str], store: str, out: Path, jobs: int) -> tuple[dict, float]:
    t0 = time.monotonic()
    got = tmax("audit", *tasks, "--store", store, "--out", str(out), "--jobs", str(jobs),
               "-o", "json", "--no-progress")
    wall = time.monotonic() - t0
    if got.returncode not in (0, 1):
        sys.exit(f"tmax audit failed:\n{got.stderr[-3000:]}")
    return json.loads(got.stdout), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=str(REPO / "tests/data/audit-tasks"))
    p.add_argument("--store", default="/tmp/audit-store")
    p.add_argument("--out", default="/tmp/audit-bench")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--controls", default=None,
                   help="A folder of tasks counted as clean controls (e.g. examples/tasks).")
    p.add_argument("--repair", action="store_true")
    args = p.parse_args()
    expected = yaml.safe_load((Path(args.tasks) / "expected.yaml").read_text())
    specs = [args.tasks] + ([args.controls] if args.controls else [])

    t0 = time.monotonic()
    built = tmax("images", "build", *specs, "--store", args.store, "-j", "1", "-o", "json")
    if built.returncode not in (0, 1):
        sys.exit(f"tmax images build failed:\n{built.stderr[-3000:]}")
    build_s = time.monotonic() - t0

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    result, wall = audit(specs, args.store, out / "audit", args.jobs)
    records = {r["task"]: r for r in result["records"]}

    kinds: dict[str, dict[str, int]] = defaultdict(lambda: {"planted": 0, "found": 0})
    wrong, false_flags, not_audited = [], [], []
    for task, rec in records.items():
        if rec["error"]:
            not_audited.append({"task": task, "error": rec["error"][:200]})
            continue
        want = expected.get(task, {"kind": "clean (controls)", "label": None})
        kind = want["kind"]
        kinds[kind]["planted"] += 1
        if rec["label"] == want["label"]:
            kinds[kind]["found"] += 1
        elif want["label"] is None:
            false_flags.append({"task": task, "label": rec["label"],
                                "evidence": [f["evidence"][:200] for f in rec["findings"]]})
        else:
            wrong.append({"task": task, "want": want["label"], "got": rec["label"]})
    defects = [k for k in kinds if not k.startswith("clean")]
    planted = sum(kinds[k]["planted"] for k in defects)
    found = sum(kinds[k]["found"] for k in defects)
    leaks_weak = [k for k in defects if k == "leak" or k.startswith("weak")]
    lw_planted = sum(kinds[k]["planted"] for k in leaks_weak)
    lw_found = sum(kinds[k]["found"] for k in leaks_weak)
    sandbox = sum(r["sandbox_s"] for r in records.values())
    report = {
        "machine": f"{os.cpu_count()} CPUs, {os.uname().nodename}",
        "tasks": len(records),
        "by_kind": dict(kinds),
        "detected": f"{found}/{planted}",
        "leaks_and_weak_verifiers_detected": f"{lw_found}/{lw_planted}",
        "clean_controls_flagged": false_flags,
        "mislabelled": wrong,
        "not_audited": not_audited,
        "sandbox_s_per_task": round(sandbox / max(1, len(records)), 2),
        "sandboxes_per_task": round(sum(r["sandboxes"] for r in records.values())
                                    / max(1, len(records)), 1),
        "audit_wall_s": round(wall, 1),
        "tasks_per_minute": round(60 * len(records) / wall, 1),
        "image_build_s": round(build_s, 1),
    }
    if args.repair:
        t1 = time.monotonic()
        got = tmax("repair", *specs, "--store", args.store, "--audit", str(out / "audit"),
                   "--out", str(out / "clean"), "-o", "json", "--no-progress")
        if got.returncode != 0:
            sys.exit(f"tmax repair failed:\n{got.stderr[-3000:]}")
        repaired = json.loads(got.stdout)
        report["repair"] = {"actions": repaired["actions"], "before": repaired["before"],
                            "after": repaired["after"], "repaired": repaired["repaired"],
                            "drop_reasons": repaired["drop_reasons"],
                            "wall_s": round(time.monotonic() - t1, 1)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
