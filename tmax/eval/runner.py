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
  the resolved agent config, the trials and the task ids (skipped tasks included, so a
  rerun after fixing them resumes). Resuming with other values is an ``EvalError`` (use
  another results path); the records themselves stay plain trajectories, so every
  trajectory reader reads the file.
- Tasks that cannot run are skipped, not fatal (``preflight``): an image that cannot be
  planned (``unmapped_base``, ``image_definition``), is not built (``image_missing``) or
  failed its build-time checks (``checks_failed``); the caller adds tasks that did not load
  (``invalid_task``). They go to the sidecar ``<results>.skipped.json`` (rewritten by each
  run) with their reasons; ``strict=True`` refuses the evaluation instead. A policy that
  needs a reference solution (the oracle) skips tasks without one (``no_solution``). A
  verifier that cannot grade is a ``verifier_error`` (a task problem), recorded and never
  re-run.
- TMax's own errors (``internal_error``: a bug, not the policy's or the fleet's failure)
  are recorded with their traceback and never re-run; once ``max_internal_errors`` of them
  have happened in this invocation, the evaluation stops with ``InternalErrors`` naming
  the first (the finished episodes stay in the results file). A resume runs such episodes
  again (after a fix, they may pass).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tmax.agent.config import AgentConfig
from tmax.agent.policy import Policy
from tmax.rollout.run import ImageMissing, TaskImages, plan_errors, rollout
from tmax.rollout.trajectory import Trajectory, append_jsonl, read_jsonl
from tmax.tasks.model import Task

log = logging.getLogger(__name__)
META_VERSION = 1
RETRY_BACKOFF_S = (1.0, 5.0, 15.0, 30.0)
"""Wait before the n-th re-run of an infra-failed attempt (the last value repeats)."""


class EvalError(Exception):
    """An evaluation that cannot run as asked (a mismatched results file, no task that can
    run, skipped tasks under ``strict``)."""


class InternalErrors(EvalError):
    """``count`` episodes ended in TMax's own error (``internal_error``); ``first`` is the
    first of them (its record, traceback included, is in the results file)."""

    def __init__(self, count: int, first: Trajectory, results: Path):
        self.count, self.first = count, first
        err = first.internal_error or {}
        tail = "\n".join(str(err.get("traceback", "")).rstrip().splitlines()[-6:])
        super().__init__(
            f"stopped after {count} internal errors (TMax's own, not the policy's or the "
            f"fleet's; --max-internal-errors); the first, {first.task} trial {first.trial}: "
            f"{err.get('message', '?')}\n{tail}\n(every traceback is in {results}, field "
            "internal_error; please report it)")


SKIP_KINDS = ("invalid_task", "unmapped_base", "image_definition", "image_missing",
              "checks_failed", "no_solution")


@dataclass(frozen=True)
class Skipped:
    """A task left out of an evaluation, and why (``kind`` is one of ``SKIP_KINDS``)."""

    task: str
    kind: str
    reason: str
    path: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Skipped:
        return cls(**{k: str(data.get(k, "")) for k in ("task", "kind", "reason", "path")})


def meta_path(results_path: str | Path) -> Path:
    p = Path(results_path)
    return p.with_name(p.name + ".meta.json")


def skipped_path(results_path: str | Path) -> Path:
    p = Path(results_path)
    return p.with_name(p.name + ".skipped.json")


def read_skipped(results_path: str | Path) -> list[Skipped]:
    """The tasks the last run of the evaluation in ``results_path`` skipped."""
    path = skipped_path(results_path)
    if not path.is_file():
        return []
    return [Skipped.from_dict(d) for d in json.loads(path.read_text()).get("skipped", [])]


def write_skipped(results_path: str | Path, skipped: Sequence[Skipped]) -> None:
    _write_atomic(skipped_path(results_path),
                  json.dumps({"skipped": [s.to_dict() for s in skipped]}, indent=2) + "\n")


def config_hash(config: AgentConfig) -> str:
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True)
                          .encode()).hexdigest()


def eval_meta(tasks: Sequence[Task], policy: Policy, config: AgentConfig,
              trials: int, skipped: Sequence[Skipped] = ()) -> dict[str, Any]:
    ids = {t.task_id for t in tasks} | {s.task for s in skipped}
    return {"version": META_VERSION, "policy": policy.name, "agent_config": config_hash(config),
            "trials": trials, "tasks": sorted(ids)}


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


def preflight(tasks: Sequence[Task], images: TaskImages, policy: Policy | None = None
              ) -> tuple[list[Task], list[Skipped]]:
    """The tasks whose images can run, and the others with their reasons: an image that
    cannot be planned, is not built (or is out of date, or corrupt), or failed its
    build-time checks; for a ``policy`` that ``needs_solution`` (the oracle), a task (or a
    step) without a reference solution. Never raises for one task's problem."""
    from tmax.images.bases import BaseMappingError

    runnable, skipped = [], []
    for task in tasks:
        where = str(task.root)
        if policy is not None and getattr(policy, "needs_solution", False) and \
                not _has_solution(task):
            skipped.append(Skipped(task.task_id, "no_solution",
                                   f"{policy.name}: the task has no reference solution "
                                   "(solution/solve.sh, or one per step)", where))
            continue
        try:
            entry = images.entry(task)
        except ImageMissing as e:
            skipped.append(Skipped(task.task_id, "image_missing", e.reason, where))
            continue
        except plan_errors() as e:
            kind = "unmapped_base" if isinstance(e, BaseMappingError) else "image_definition"
            skipped.append(Skipped(task.task_id, kind, str(e), where))
            continue
        except Exception as e:  # one task's image (a bug, maybe), not the whole evaluation
            log.debug("%s: planning its image failed", task.task_id, exc_info=True)
            skipped.append(Skipped(task.task_id, "image_definition",
                                   f"{type(e).__name__}: {e}", where))
            continue
        if entry.checks is not None and not entry.checks.ok:
            skipped.append(Skipped(task.task_id, "checks_failed",
                                   f"build-time checks failed: {entry.checks.reason}"
                                   + (f" (log {images.builds.store.path(entry.checks.log)})"
                                      if entry.checks.log else ""), where))
            continue
        runnable.append(task)
    return runnable, skipped


def _has_solution(task: Task) -> bool:
    return all(s.solve_script.is_file() for s in task.steps) if task.steps \
        else task.has_solution


def skipped_text(skipped: Sequence[Skipped], store: str | Path | None = None) -> str:
    """One line per skipped task (the first line of its reason), and what to do."""
    lines = [f"  {s.task} [{s.kind}]: {s.reason.strip().splitlines()[0] if s.reason else ''}"
             for s in skipped]
    kinds = {s.kind for s in skipped}
    hints = []
    if "invalid_task" in kinds:
        hints.append("check tasks with `tmax tasks validate`")
    if kinds & {"image_missing", "checks_failed"}:
        hints.append("build images with `tmax images build TASKS"
                     + (f" --store {store}`" if store else "`"))
    if "unmapped_base" in kinds:
        hints.append("map the FROM image to a local base: --base-map FILE, $TMAX_BASE_MAP "
                     "or configs/base-images.yaml (images/README.md lists the bases)")
    return "\n".join(lines + ([f"  ({'; '.join(hints)})"] if hints else []))


@dataclass
class _Progress:
    """Running totals for the progress bar."""

    bar: Any
    reward_sum: float = 0.0
    scored: int = 0
    infra: int = 0
    verifier_errors: int = 0
    internal: int = 0

    def add(self, t: Trajectory, *, done: bool) -> None:
        if t.scored:
            self.reward_sum += t.score
            self.scored += 1
        elif not t.valid:
            self.infra += 1
        elif t.internal_error is not None:
            self.internal += 1
        else:
            self.verifier_errors += 1
        if self.bar is not None:
            mean = self.reward_sum / self.scored if self.scored else float("nan")
            self.bar.set_postfix(reward=f"{mean:.3f}", infra=self.infra,
                                 verifier_err=self.verifier_errors, internal=self.internal,
                                 refresh=False)
            self.bar.update(1 if done else 0)


async def run_eval(tasks: Sequence[Task], policy: Policy, fleet: Any, images: TaskImages,
                   agent_config: AgentConfig, *, trials: int, concurrency: int,
                   results_path: str | Path, max_infra_retries: int = 3,
                   max_internal_errors: int = 3,
                   progress: bool = True, skipped: Sequence[Skipped] = (),
                   strict: bool = False) -> list[Trajectory]:
    """Run ``trials`` episodes of every task with ``policy`` on ``fleet`` (an
    ``AsyncFleetClient``), ``concurrency`` at a time; every attempt goes to ``results_path``.
    Tasks that cannot run (``preflight``) are skipped and, with ``skipped`` (tasks the
    caller could not load), written to ``<results>.skipped.json``; with ``strict`` any of
    them is an ``EvalError`` before anything runs, and so is having no task that can run.
    Once ``max_internal_errors`` episodes of this invocation ended in TMax's own error, the
    others are cancelled and ``InternalErrors`` is raised.
    Returns every record of the results file (earlier runs' included), in file order."""
    if trials < 1 or concurrency < 1 or max_infra_retries < 0 or max_internal_errors < 1:
        raise ValueError("trials and concurrency must be >= 1, max_infra_retries >= 0, "
                         "max_internal_errors >= 1")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise EvalError(f"duplicate task ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    results_path = Path(results_path)
    meta = eval_meta(tasks, policy, agent_config, trials, skipped)
    asked = len(tasks) + len(skipped)
    runnable, unusable = await asyncio.to_thread(preflight, tasks, images, policy)
    skipped = [*skipped, *unusable]
    store = images.builds.store.root
    if skipped and strict:
        raise EvalError(f"{len(skipped)} of {asked} tasks cannot run (--strict: nothing was "
                        "run):\n" + skipped_text(skipped, store))
    if not runnable:
        raise EvalError("no task can run; all were skipped:\n" + skipped_text(skipped, store))
    earlier = await asyncio.to_thread(open_results, results_path, meta)
    await asyncio.to_thread(write_skipped, results_path, skipped)
    for s in skipped:
        log.info("skipping %s [%s]: %s", s.task, s.kind, s.reason)
    tasks = runnable

    done = {(r.task, r.trial) for r in earlier if r.valid and r.internal_error is None}
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
    internal: list[Trajectory] = []
    stop = asyncio.Event()

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
            if t.internal_error is not None:  # TMax's bug: never re-run as a node failure
                internal.append(t)
                log.error("%s trial %d: internal error %s", task.task_id, trial,
                          t.internal_error.get("message"))
                if len(internal) >= max_internal_errors:
                    stop.set()
                return
            if t.valid:
                return
            log.warning("%s trial %d attempt %d: infra failure (%s)%s", task.task_id, trial,
                        t.attempt, (t.infra_failure or {}).get("cause"),
                        "; giving up" if last else "; running it again")

    jobs = [asyncio.create_task(one(task, trial)) for task, trial in todo]
    try:
        everything = asyncio.gather(*jobs)
        everything.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        stopped = asyncio.create_task(stop.wait())
        waiting: list[asyncio.Future[Any]] = [everything, stopped]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if stop.is_set():
            raise InternalErrors(len(internal), internal[0], results_path)
        await everything
    except BaseException:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return [Trajectory.from_dict(r) for r in read_jsonl(results_path)]


__all__ = ["SKIP_KINDS", "EvalError", "InternalErrors", "Skipped", "config_hash", "eval_meta", "meta_path",
           "open_results", "preflight", "read_skipped", "run_eval", "skipped_path",
           "skipped_text", "write_skipped"]
