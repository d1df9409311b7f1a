"""The one Slurm client of sandfleet and tmax: batch scripts rendered from templates, and
sbatch, squeue, scontrol, sacct, scancel as argv lists with a timeout.

- **Rendering** is pure: ``sbatch_lines`` turns keywords (``SBATCH_OPTIONS``) and flags
  (``SBATCH_FLAGS``) into ``#SBATCH`` lines, refusing an unknown keyword (with the valid
  list) and a value with a space or a newline (sbatch splits an ``#SBATCH`` line at
  whitespace; a newline would start a line of its own); ``render_template`` fills the
  ``{{key}}`` placeholders of a template (``template_text`` reads one shipped as package
  data), refusing a placeholder without a value.
- **Calls** (``SlurmClient``): ``submit`` (``sbatch --parsable``), ``queue`` (one squeue
  for any number of job ids), ``states`` (squeue for all, then scontrol, then one sacct
  for the jobs squeue no longer lists), ``cancel`` (``scancel ID``, by job id only),
  ``requeue`` (``scontrol requeue ID``), ``end_time``, ``node_address``. Each runs with
  stdin closed, in its own session, under a timeout; its stderr goes to this module's
  debug log, never the terminal. A failure raises ``SlurmError`` carrying the argv, the
  exit status and the stderr.
- **Polling** (``Poller``): every watched job still running in one ``states`` call, at
  most once per interval; the interval starts at ``min_s``, doubles while no state
  changes, up to ``max_s``, and starts over at ``min_s`` when one does (or on ``reset``,
  after a submit or a cancel). tmax's launcher polls with ``min_s = max_s =
  slurm.poll_s`` (as before: a failed job is seen within one ``poll_s``).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SBATCH_OPTIONS = ("job_name", "output", "nodes", "ntasks", "ntasks_per_node",
                  "gpus_per_node", "cpus_per_task", "mem", "time", "partition", "account",
                  "qos", "constraint", "gres", "signal", "open_mode")
"""The keywords of ``sbatch_lines``, in the order their lines are written."""
SBATCH_FLAGS = ("requeue",)

ACTIVE = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                    "RESIZING", "RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT",
                    "SIGNALING", "PREEMPTED"})
"""Job states of a job that is (or will be again) running."""
PENDING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD",
                     "REQUEUE_FED", "SUSPENDED"})
RUNNING = frozenset({"RUNNING", "COMPLETING", "STAGE_OUT", "RESIZING", "SIGNALING"})
UNKNOWN = "UNKNOWN"
"""The state of a job Slurm no longer knows (squeue, scontrol and sacct all silent)."""

_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")
_GONE = ("Invalid job id", "already completing")
"""scancel's stderr for a job that has ended (or is ending): not a failure."""


class SlurmError(Exception):
    """A Slurm command failed or could not run: its argv, exit status (None when it did
    not run or timed out) and stderr."""

    def __init__(self, argv: Sequence[str], reason: str, *, returncode: int | None = None,
                 stderr: str = ""):
        self.argv, self.reason = list(argv), reason
        self.returncode, self.stderr = returncode, stderr
        super().__init__(f"{shlex.join(self.argv)}: {reason}")


class SubmitError(SlurmError):
    """sbatch refused a script (or printed no job id); ``script`` is its path."""

    def __init__(self, argv: Sequence[str], script: Path, returncode: int | None, stderr: str,
                 stdout: str = ""):
        super().__init__(argv, f"exit {returncode}", returncode=returncode, stderr=stderr)
        self.script = script
        self.message = (f"sbatch {script} failed ({returncode}): "
                        f"{stderr.strip()[-2000:] or stdout.strip()}")

    def __str__(self) -> str:
        return self.message

# --------------------------------------------------------------------------- rendering


def sbatch_lines(extra: Sequence[str] = (), flags: Sequence[str] = (),
                 **options: Any) -> list[str]:
    """``#SBATCH`` lines for ``options`` (keywords of ``SBATCH_OPTIONS``; None skipped),
    ``flags`` (of ``SBATCH_FLAGS``) and ``extra`` (``--key=value`` strings, verbatim).
    An unknown keyword, an empty value, or one with a space or a newline is a ValueError."""
    unknown = (set(options) - set(SBATCH_OPTIONS)) | (set(flags) - set(SBATCH_FLAGS))
    if unknown:
        raise ValueError(f"unknown sbatch options {sorted(unknown)}; valid: "
                         f"{', '.join(SBATCH_OPTIONS + SBATCH_FLAGS)}")
    lines = []
    for key in SBATCH_OPTIONS:
        value = options.get(key)
        if value is None:
            continue
        text = str(value)
        if not text.strip() or any(c in text for c in " \t\n\r"):
            raise ValueError(f"bad sbatch value for {key}: {text!r} (empty, or holds a "
                             "space or a newline: sbatch would split it; choose a value "
                             "without one, e.g. a path without spaces)")
        lines.append(f"#SBATCH --{key.replace('_', '-')}={text}")
    lines += [f"#SBATCH --{f}" for f in SBATCH_FLAGS if f in flags]
    for item in extra:
        if not item.startswith("--") or "\n" in item or "\r" in item:
            raise ValueError(f"extra sbatch option must look like --key=value: {item!r}")
        lines.append(f"#SBATCH {item}")
    return lines


def render_template(template: str, values: dict[str, str]) -> str:
    """Fill ``{{key}}`` placeholders; a placeholder without a value is a ValueError."""
    def sub(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            raise ValueError(f"template placeholder {{{{{key}}}}} has no value; given: "
                             f"{', '.join(sorted(values)) or 'none'}")
        return values[key]

    return re.sub(r"\{\{(\w+)\}\}", sub, template)


def template_text(package: str, name: str) -> str:
    """The text of template ``name`` shipped in ``package``'s ``templates/`` folder."""
    return resources.files(package).joinpath("templates", name).read_text()


def job_id_of(stdout: str) -> str | None:
    """The job id ``sbatch --parsable`` printed (``ID`` or ``ID;CLUSTER``), else None."""
    match = _JOB_ID.match(stdout.strip())
    return match.group(1) if match else None


def check_job_id(job_id: str) -> str:
    """``job_id`` if it is a Slurm job id (digits), else a ValueError: nothing but one job
    is ever named to scancel or scontrol."""
    if not job_id.isdigit():
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    return job_id


# --------------------------------------------------------------------------- calls


@dataclass(frozen=True)
class Job:
    """One line of squeue."""

    job_id: str
    state: str
    name: str = ""
    user: str = ""
    nodes: str = ""


class SlurmClient:
    """Slurm's commands as argv lists with a timeout (see the module doc); ``env`` is
    added to the environment of every call (e.g. a ``SLURM_CONF``)."""

    def __init__(self, timeout_s: float = 60.0, env: dict[str, str] | None = None):
        self.timeout_s, self.env = timeout_s, env

    def run(self, argv: list[str]) -> subprocess.CompletedProcess:
        """``argv`` with stdin closed, in its own session; stderr to the debug log.
        Raises ``SlurmError`` when it cannot start or times out (not on an exit status)."""
        env = {**os.environ, **self.env} if self.env else None
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s,
                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                 check=False, env=env)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmError(argv, str(e)) from None
        if out.stderr.strip():
            log.debug("%s: %s", argv[0], out.stderr.strip()[-1000:])
        return out

    def submit(self, script: Path) -> str:
        """``sbatch --parsable SCRIPT``; the job id. Raises ``SubmitError``."""
        argv = ["sbatch", "--parsable", str(script)]
        out = self.run(argv)
        job_id = job_id_of(out.stdout)
        if out.returncode != 0 or job_id is None:
            raise SubmitError(argv, Path(script), out.returncode, out.stderr, out.stdout)
        return job_id

    def queue(self, job_ids: Iterable[str] | None = None, *, me: bool = True) -> dict[str, Job]:
        """One squeue: the listed jobs (all of this user's with ``job_ids`` None), id ->
        ``Job``. A job squeue does not list has ended (or never was). Raises
        ``SlurmError`` when squeue fails for another reason than an unknown job id."""
        ids = None if job_ids is None else [check_job_id(j) for j in job_ids]
        if ids == []:
            return {}
        argv = ["squeue", "-h", *(["--me"] if me else []),
                *(["-j", ",".join(ids)] if ids else []), "-o", "%i|%T|%u|%N|%j"]
        out = self.run(argv)
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:
                return {}
            raise SlurmError(argv, f"exit {out.returncode}: {out.stderr.strip()[-1000:]}",
                             returncode=out.returncode, stderr=out.stderr)
        jobs = {}
        for line in out.stdout.splitlines():
            parts = line.strip().split("|", 4)
            if len(parts) == 5 and (ids is None or parts[0] in ids):
                jobs[parts[0]] = Job(parts[0], parts[1], name=parts[4], user=parts[2],
                                     nodes=parts[3])
        return jobs

    def states(self, job_ids: Sequence[str]) -> dict[str, str]:
        """Each job's state (``RUNNING``, ``PENDING``, ``COMPLETED``, ``FAILED`` ...;
        ``UNKNOWN`` when Slurm no longer knows it): one squeue for all, scontrol for each
        job squeue no longer lists, one sacct for those scontrol forgot too."""
        ids = list(dict.fromkeys(check_job_id(j) for j in job_ids if j))
        found: dict[str, str] = {}
        try:
            found = {j: job.state for j, job in self.queue(ids, me=False).items()}
        except SlurmError as e:
            log.debug("%s", e)  # scontrol and sacct may still know
        for j in (j for j in ids if j not in found):
            out = self.run(["scontrol", "-o", "show", "job", j])
            m = re.search(r"\bJobState=(\S+)", out.stdout)
            if m:
                found[j] = m.group(1)
        missing = [j for j in ids if j not in found]
        if missing:
            out = self.run(["sacct", "-n", "-X", "-P", "-j", ",".join(missing),
                            "-o", "JobID,State"])
            for line in out.stdout.splitlines() if out.returncode == 0 else []:
                job, _, state = line.partition("|")
                if job in missing and state and job not in found:
                    found[job] = state.split()[0]  # "CANCELLED by 1000" -> CANCELLED
        return {j: found.get(j, UNKNOWN) for j in ids}

    def cancel(self, job_id: str) -> None:
        """``scancel ID``. A job that has ended already is no failure; any other refusal
        raises ``SlurmError``."""
        argv = ["scancel", check_job_id(job_id)]
        out = self.run(argv)
        if out.returncode != 0 and not any(g in out.stderr for g in _GONE):
            raise SlurmError(argv, f"exit {out.returncode}: {out.stderr.strip()[-500:]}",
                             returncode=out.returncode, stderr=out.stderr)

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue ID`` (the job goes back to the queue, same id)."""
        argv = ["scontrol", "requeue", check_job_id(job_id)]
        out = self.run(argv)
        if out.returncode != 0:
            raise SlurmError(argv, f"exit {out.returncode}: {out.stderr.strip()[-500:]}",
                             returncode=out.returncode, stderr=out.stderr)

    def end_time(self, job_id: str) -> float | None:
        """When job ``job_id`` hits its time limit (epoch seconds), None when unknown."""
        try:
            out = self.run(["squeue", "-h", "-j", check_job_id(job_id), "-o", "%e"])
            return time.mktime(time.strptime(out.stdout.strip(), "%Y-%m-%dT%H:%M:%S"))
        except (SlurmError, ValueError):
            return None

    def node_address(self, node: str) -> str | None:
        """Node ``node``'s address as Slurm knows it (NodeAddr), None when unknown."""
        try:
            out = self.run(["scontrol", "-o", "show", "node", node])
        except SlurmError:
            return None
        m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
        return m.group(1) if m else None


# --------------------------------------------------------------------------- polling


class Poller:
    """The states of every watched job, from one ``SlurmClient.states`` call per poll,
    polled at most once per interval (backing off from ``min_s`` to ``max_s`` while no
    state changes; see the module doc). A job in a final state (ended: not ``ACTIVE``, not
    ``UNKNOWN``) is not asked about again unless ``fresh``. Thread-safe; ``clock`` is for
    tests."""

    def __init__(self, client: SlurmClient, min_s: float, max_s: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.min_s = client, min_s
        self.max_s = max(min_s, max_s if max_s is not None else min_s)
        self.clock = clock
        self.interval = min_s
        self.watched: dict[str, None] = {}
        self.last: dict[str, str] = {}
        self._next = 0.0
        self._lock = threading.Lock()

    def watch(self, job_ids: Iterable[str]) -> None:
        for j in job_ids:
            if j and j not in self.watched:
                self.watched[check_job_id(j)] = None
                self._next = 0.0  # a new job: the next call asks Slurm

    def reset(self) -> None:
        """Poll at the next call, then from ``min_s`` again (after a submit or cancel)."""
        self.interval, self._next = self.min_s, 0.0

    def states(self, job_ids: Sequence[str] = (), *, fresh: bool = False) -> dict[str, str]:
        """The states of ``job_ids`` (watched from now on; all watched jobs when empty):
        cached within the interval, else one poll of every watched job still running;
        ``fresh``: now, ``job_ids`` included whatever their last state."""
        with self._lock:
            self.watch(job_ids)
            wanted = [j for j in job_ids if j] or list(self.watched)
            if fresh or self.clock() >= self._next or any(j not in self.last for j in wanted):
                self._poll(wanted if fresh else [])
            return {j: self.last.get(j, UNKNOWN) for j in wanted}

    def _poll(self, also: Sequence[str]) -> None:
        ids = [j for j in self.watched if j in also or not _final(self.last.get(j))]
        now = self.client.states(ids) if ids else {}
        changed = any(self.last.get(j) != s for j, s in now.items())
        self.interval = self.min_s if changed else min(self.interval * 2, self.max_s)
        self.last.update(now)
        self._next = self.clock() + self.interval


def _final(state: str | None) -> bool:
    return state is not None and state != UNKNOWN and state not in ACTIVE
