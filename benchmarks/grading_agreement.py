"""Build-time checks and evaluation side by side, per task (issue 30, "Measure and show").

    python benchmarks/grading_agreement.py --store STORE --eval nop=RUN --eval oracle=RUN
        [--json OUT.json]

STORE is the image store the tasks were built (and checked) into; each RUN is the --out
folder of a ``tmax eval --policy nop|oracle`` over those tasks with that store. For every
task the table shows the checks' nop and oracle rewards and each evaluation's outcome
(``Trajectory.outcome``: scored, policy_failure, verifier_error, internal_error,
infra_failure; ``skipped`` with its kind) and reward, and whether they agree: a check's
reward and the evaluation's scored reward are the same number. Below it: the number of
episodes each outcome class holds, per policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tmax.eval.runner import read_skipped  # noqa: E402
from tmax.eval.summary import final_records  # noqa: E402
from tmax.images.store import ImageStore  # noqa: E402
from tmax.rollout.trajectory import Trajectory, read_jsonl  # noqa: E402


def rows(store: Path, runs: dict[str, Path]) -> list[dict]:
    manifest = ImageStore(store).read().tasks
    attempts = {p: [Trajectory.from_dict(d) for d in read_jsonl(run / "results.jsonl")]
                for p, run in runs.items()}
    episodes = {p: {t: r for (t, _), r in final_records(a).items()}
                for p, a in attempts.items()}
    failed = {p: {r.task: r for r in a if not r.valid} for p, a in attempts.items()}
    skipped = {p: {s.task: s for s in read_skipped(run / "results.jsonl")}
               for p, run in runs.items()}
    tasks = sorted(set().union(*episodes.values(), *skipped.values(), *failed.values()))
    out = []
    for task in tasks:
        checks = manifest[task].checks if task in manifest else None
        row: dict = {"task": task, "checks_ok": checks.ok if checks else None,
                     "checks_reason": checks.reason if checks else "not built"}
        for policy in runs:
            check = getattr(checks, f"{policy}_reward", None) if checks else None
            r = episodes[policy].get(task)
            if r is None and task in failed[policy]:  # infra failures only
                cause = (failed[policy][task].infra_failure or {}).get("cause", "?")
                outcome, reward = f"infra_failure:{cause}", None
            elif r is None:
                s = skipped[policy].get(task)
                outcome, reward = (f"skipped:{s.kind}" if s else "absent"), None
            else:
                outcome, reward = r.outcome, r.reward
            why = failed[policy].get(task)
            row[policy] = {"check": check, "outcome": outcome, "reward": reward,
                           "note": (r.grading_note or r.verifier_error
                                    or (r.internal_error or {}).get("message")
                                    or r.contradicted_reward or "") if r else
                           ((why.infra_failure or {}).get("message", "") if why else ""),
                           "agree": r is not None and r.scored and check == reward}
        out.append(row)
    return out


def show(table: list[dict], policies: list[str]) -> str:
    lines = [f"{'task':48} " + "  ".join(f"{p + ' check/eval':34}" for p in policies)]
    for row in table:
        cells = []
        for p in policies:
            c = row[p]
            check = "-" if c["check"] is None else f"{c['check']:g}"
            reward = "-" if c["reward"] is None else f"{c['reward']:g}"
            mark = "=" if c["agree"] else "!"
            cells.append(f"{check:>4} {mark} {reward:>4} {c['outcome']:22}")
        lines.append(f"{row['task'][:48]:48} " + "  ".join(f"{x:34}" for x in cells))
    for p in policies:
        counts = Counter(row[p]["outcome"] for row in table)
        agree = sum(row[p]["agree"] for row in table)
        lines.append(f"{p}: episodes by outcome {dict(sorted(counts.items()))}; "
                     f"check and eval agree on {agree} of {len(table)} tasks")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--eval", action="append", required=True, metavar="POLICY=RUN",
                    help="nop=RUN or oracle=RUN (a tmax eval --out folder)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    runs = {}
    for item in args.eval:
        policy, _, run = item.partition("=")
        if policy not in ("nop", "oracle") or not run:
            ap.error(f"--eval {item!r}: write nop=RUN or oracle=RUN")
        runs[policy] = Path(run)
    table = rows(args.store, runs)
    print(show(table, list(runs)))
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()
