"""Run an evaluation: every (task, trial) through the fleet, recorded as it finishes.

- Each attempt's trajectory is appended to the results file (``append_jsonl``) the moment
  it ends, failed attempts included, with its ``attempt`` number.
- An attempt that failed on infrastructure (``not t.valid``) is run again, after a short
  backoff, up to ``max_infra_retries`` more times in this invocation. Policy outcomes
  (step limit, format errors, a wrong answer) are results and never re-run.
- Resume: the records already in the results file count. A (task, trial) with a valid
  record is done; one with only infra-failed records goes on at the next attempt number
  (with a fresh retry budget, so a resume after a fleet outage tries again). A torn last
  line (a crash mid-write) is cut off before anything is appended.
- The results file has a sidecar ``<results>.meta.json``: the policy name, the sha256 of
  the resolved agent config, the trials and the task ids. Resuming with other values is an
  ``EvalError`` (use another results path); the records themselves stay plain
  trajectories, so every trajectory reader reads the file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmax.agent.config import AgentConfig
from tmax.agent.policy import Policy
from tmax.rollout.run import TaskImages, rollout
from tmax.rollout.trajectory import Trajectory, append_jsonl, read_jsonl
from tmax.tasks.model import Task

log = logging.getLogger(__name__)
META_VERSION = 1
RETRY_BACKOFF_S = (1.0, 5.0, 15.0, 30.0)
"""Wait before the n-th re-run of an infra-failed attempt (the last value repeats)."""


class EvalError(Exception):
    """An evaluation that cannot run as asked (a mismatched results file, missing images)."""


def meta_path(results_path: str | Path) -> Path:
    p = Path(results_path)
    return p.with_name(p.name + ".meta.json")


def config_hash(config: AgentConfig) -> str:
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True)
                          .encode()).hexdigest()


def eval_meta(tasks: Sequence[Task], policy: Policy, config: AgentConfig,
              trials: int) -> dict[str, Any]:
    return {"version": META_VERSION, "policy": policy.name, "agent_config": config_hash(config),
            "trials": trials, "tasks": sorted(t.task_id for t in tasks)}


def open_results(results_path: str | Path, meta: dict[str, Any]) -> list[Trajectory]:
    """The records of an earlier run of the same evaluation (none for a new file); writes
    the sidecar for a new file; ``EvalError`` when the file belongs to another evaluation."""
    path, mpath = Path(results_path), meta_path(results_path)
    has_records = path.exists() and path.stat().st_size > 0
    if mpath.exists():
        old = json.loads(mpath.read_text())
        diff = [k for k in meta if old.get(k) != meta[k]]
        if diff:
            shown = "; ".join(f"{k}: {_short(old.get(k))} there, {_short(meta[k])} now"
                              for k in diff)
            raise EvalError(f"{path} holds another evaluation ({shown}); pass a new results "
                            "path (--out) or remove the old one")
    elif has_records:
        raise EvalError(f"{path} has records but no {mpath.name}, so it cannot be checked "
                        "to be the same evaluation; pass a new results path (--out)")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(mpath, json.dumps(meta, indent=2) + "\n")
    if has_records:
        _cut_torn_tail(path)
    return [Trajectory.from_dict(r) for r in read_jsonl(path)]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cut_torn_tail(path: Path) -> None:
    """Drop an unterminated last line, so the next append starts on a line of its own."""
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        data_end = max(0, size - 65536)
        while True:
            f.seek(data_end)
            chunk = f.read(size - data_end)
            cut = chunk.rfind(b"\n")
            if cut >= 0 or data_end == 0:
                keep = data_end + cut + 1  # 0 when the whole file is one torn line
                break
            data_end = max(0, data_end - 65536)
        log.warning("%s: dropping a torn last record (%d bytes)", path, size - keep)
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())


def check_images(tasks: Sequence[Task], images: TaskImages) -> None:
    """``EvalError`` naming every task whose image is not built (or out of date)."""
    from sandfleet.errors import ImageMissing

    missing = []
    for task in tasks:
        try:
            images.resolve(task)
        except ImageMissing as e:
            missing.append(f"{task.task_id} ({e.reason})")
    if missing:
        raise EvalError(f"{len(missing)} task image(s) missing in {images.builds.store.root}: "
                        + "; ".join(missing[:10]) + ("; ..." if len(missing) > 10 else "")
                        + "; build them with `tmax images build TASKS --store "
                        f"{images.builds.store.root}`")


@dataclass
class _Progress:
    """Running totals for the progress bar."""

    bar: Any
    reward_sum: float = 0.0
    scored: int = 0
    infra: int = 0

    def add(self, t: Trajectory, *, done: bool) -> None:
        if t.valid:
            self.reward_sum += t.score
            self.scored += 1
        else:
            self.infra += 1
        if self.bar is not None:
            mean = self.reward_sum / self.scored if self.scored else float("nan")
            self.bar.set_postfix(reward=f"{mean:.3f}", infra=self.infra, refresh=False)
            self.bar.update(1 if done else 0)


async def run_eval(tasks: Sequence[Task], policy: Policy, fleet: Any, images: TaskImages,
                   agent_config: AgentConfig, *, trials: int, concurrency: int,
                   results_path: str | Path, max_infra_retries: int = 3,
                   progress: bool = True) -> list[Trajectory]:
    """Run ``trials`` episodes of every task with ``policy`` on ``fleet`` (an
    ``AsyncFleetClient``), ``concurrency`` at a time; every attempt goes to ``results_path``.
    Returns every record of the results file (earlier runs' included), in file order."""
    if trials < 1 or concurrency < 1 or max_infra_retries < 0:
        raise ValueError("trials and concurrency must be >= 1, max_infra_retries >= 0")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise EvalError(f"duplicate task ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    results_path = Path(results_path)
    meta = eval_meta(tasks, policy, agent_config, trials)
    await asyncio.to_thread(check_images, tasks, images)
    earlier = await asyncio.to_thread(open_results, results_path, meta)

    done = {(r.task, r.trial) for r in earlier if r.valid}
    next_attempt: dict[tuple[str, int], int] = {}
    for r in earlier:
        key = (r.task, r.trial)
        next_attempt[key] = max(next_attempt.get(key, 0), r.attempt + 1)
    todo = [(task, trial) for trial in range(trials) for task in tasks
            if (task.task_id, trial) not in done]
    if len(todo) < len(tasks) * trials:
        log.info("%s: resuming, %d of %d episodes already done", results_path,
                 len(tasks) * trials - len(todo), len(tasks) * trials)

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(tasks) * trials, initial=len(tasks) * trials - len(todo),
                   desc=f"eval {policy.name}", unit="ep", dynamic_ncols=True)
    totals = _Progress(bar)
    for r in earlier:
        totals.add(r, done=False)
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task, trial: int) -> None:
        first = next_attempt.get((task.task_id, trial), 0)
        for n in range(max_infra_retries + 1):
            if n:
                await asyncio.sleep(RETRY_BACKOFF_S[min(n, len(RETRY_BACKOFF_S)) - 1])
            async with slots:
                t = await rollout(task, policy, fleet, images, agent_config, trial=trial,
                                  attempt=first + n)
            await asyncio.to_thread(append_jsonl, results_path, t.to_dict())
            last = t.valid or n == max_infra_retries
            totals.add(t, done=last)
            if t.valid:
                return
            log.warning("%s trial %d attempt %d: infra failure (%s)%s", task.task_id, trial,
                        t.attempt, (t.infra_failure or {}).get("cause"),
                        "; giving up" if last else "; running it again")

    jobs = [asyncio.create_task(one(task, trial)) for task, trial in todo]
    try:
        await asyncio.gather(*jobs)
    except BaseException:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return [Trajectory.from_dict(r) for r in read_jsonl(results_path)]


__all__ = ["EvalError", "check_images", "config_hash", "eval_meta", "meta_path",
           "open_results", "run_eval"]
