"""One function over many arguments as a Slurm job array, through submitit.

``run_array(fn, args, folder, options)`` submits ``fn(*args[i])`` as array task i (one
``sbatch --array``), shows a progress bar while they run, and returns each task's outcome in
order: its result, or the error and the log to read. It waits for every task and never
cancels a job it did not submit; interrupted (Ctrl-C), it cancels its unfinished
tasks by id and re-raises. ``tmax gen --array N`` and ``tmax audit --array N`` use
it to run their N shards; ``tmax demo`` to build the example images.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArrayOptions:
    """The sbatch options of every task of one array (None: the cluster's default)."""

    name: str = "tmax"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus: int = 1
    mem: str | None = None
    """Memory per node, e.g. 16G."""
    time_min: int = 120
    setup: tuple[str, ...] = ()
    """Shell lines each task runs first (module loads, venv activation)."""
    parallelism: int = 256
    """Array tasks running at once (``%N``)."""

    def submitit_parameters(self) -> dict[str, Any]:
        """submitit's ``update_parameters`` keywords for these options."""
        params: dict[str, Any] = {"name": self.name, "timeout_min": self.time_min,
                                  "cpus_per_task": self.cpus, "nodes": 1, "tasks_per_node": 1,
                                  "slurm_array_parallelism": self.parallelism}
        params |= {key: value for key, value in (
            ("slurm_partition", self.partition), ("slurm_account", self.account),
            ("slurm_qos", self.qos), ("slurm_mem", self.mem)) if value is not None}
        if self.setup:
            params["slurm_setup"] = list(self.setup)
        return params


@dataclass
class Outcome:
    """What one array task came back with."""

    index: int
    job_id: str
    result: Any = None
    error: str | None = None
    log: str = ""
    """The task's stderr file (submitit writes stdout beside it)."""


def run_array(fn: Callable[..., Any], args: Sequence[Sequence[Any]], folder: Path,
              options: ArrayOptions, *, progress: bool = True,
              poll_s: float = 1.0) -> list[Outcome]:
    """``fn(*args[i])`` as task i of one job array; every task's outcome, in order."""
    import submitit
    from tqdm.auto import tqdm

    if not args:
        return []
    # A cluster without accounting (e.g. the local one) makes submitit warn on every poll
    # that sacct failed; outcomes still come back through its own files.
    logging.getLogger("submitit").setLevel(logging.ERROR)
    executor = submitit.AutoExecutor(folder=Path(folder) / "%j", cluster="slurm")
    executor.update_parameters(**options.submitit_parameters())
    pending: set[int] = set()
    chatter = Path(folder) / "slurm-client.log"
    try:
        # sbatch/squeue/sacct's own stderr (e.g. "Slurm accounting storage is disabled" on
        # every poll) goes to a log, not the terminal; the progress bar still does
        with _stderr_to(chatter) as terminal:
            jobs = executor.map_array(fn, *zip(*args, strict=True))
            pending = set(range(len(jobs)))
            with tqdm(total=len(jobs), desc=options.name, unit="job", file=terminal,
                      disable=not progress) as bar:
                while pending:
                    done = {i for i in pending if jobs[i].done()}
                    bar.update(len(done))
                    pending -= done
                    if pending:
                        time.sleep(poll_s)
    except BaseException:  # Ctrl-C: the array dies with its launcher, by job id
        if pending:
            for i in sorted(pending):
                jobs[i].cancel(check=False)
            log.warning("%s: cancelled %d unfinished array tasks (%s)", options.name,
                        len(pending), ", ".join(jobs[i].job_id for i in sorted(pending)))
        raise
    return [_outcome(i, job) for i, job in enumerate(jobs)]


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[TextIO]:
    """File descriptor 2 (what child processes write to) appended to ``path`` for the
    block; yields a stream on the terminal's stderr as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1)
    try:
        with open(path, "ab") as sink:
            sys.stderr.flush()
            os.dup2(sink.fileno(), 2)
            yield terminal
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        terminal.close()


def _outcome(index: int, job: Any) -> Outcome:
    from submitit.core.utils import FailedJobError, UncompletedJobError

    out = Outcome(index, str(job.job_id), log=str(job.paths.stderr))
    try:
        out.result = job.result()
    except (FailedJobError, UncompletedJobError) as e:  # its exception, or why it stopped
        out.error = failure_line(str(e)) or type(e).__name__
    return out


def failure_line(text: str) -> str:
    """The line that says what went wrong in submitit's report of a failed job: the last
    line of its traceback (``ValueError: ...``), before the part that lists the logs."""
    body = text.split("You can check full logs", 1)[0]
    lines = [line.strip() for line in body.splitlines()
             if line.strip() and not set(line.strip()) <= {"-"}]
    return lines[-1] if lines else ""
