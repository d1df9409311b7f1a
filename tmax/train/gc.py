"""``tmax gc``: collect what training runs whose launcher is gone left behind. Safe from
cron on a shared cluster: it acts only on this user's run folders, jobs and processes, and
only on those a run recorded, by id.

A run folder is a folder holding ``jobs.json`` (every Slurm job a launcher submitted, see
``tmax.train.slurm``) or ``processes.json`` (the launcher and its local children, see
``tmax.train.processes.write_processes``). Whether its launcher is alive:

- ``processes.json`` names it: ``host``, ``launcher`` (pid), ``launcher_start`` (its start
  time in clock ticks since boot) and ``launcher_job`` (the Slurm job it runs in, if any).
  On this host it is alive iff a process with that pid *and* start time exists (a pid the
  kernel gave to someone else since is not the launcher; a record without a start time
  and a live pid is taken as alive: it cannot be told apart). On another host it is alive
  iff its Slurm job is still queued or running (``--detach``: the launcher is a job);
  without a job it is left alone with a note: its pid means nothing here, and its jobs
  stop by themselves once its heartbeat is stale (``distributed.stale_after_s``).
- no ``processes.json`` (the launcher died before it wrote one): the run's newest
  orchestrator job (``--detach``) if it has one, else its heartbeat
  (``handover/alive/orchestrator``): fresher than ``distributed.stale_after_s`` = alive.

For a run whose launcher is gone, gc

1. cancels the run's jobs that are still queued or running, by id: ids of ``jobs.json``
   that ``squeue --me`` lists (this user's; one squeue for every run), ``scancel ID``
   (both through sandfleet's Slurm client);
2. ends its leftover local processes (``processes.json``, this host only): a pid is
   signalled only when its start time is the recorded one, it is this user's and it leads
   its own process group (the launcher starts each child in its own session): SIGTERM to
   the group, SIGKILL after ``--grace`` seconds;
3. stops its private fleet if it recorded one (``RUN/fleet.json``: ``{"state_dir": ...,
   "private": true}``) with ``sandfleet down --state-dir``; a fleet the run joined
   (``fleet.state_dir``) is shared and never touched;
4. marks the run in ``RUN/gc.json`` (atomically), naming the launcher and jobs it
   collected: a second gc skips the run, unless a new launcher (a resume) has written
   ``processes.json`` or submitted jobs since.

A run whose actions did not all succeed is not marked (the next gc tries again) and gc
exits with status 1. ``--dry-run`` reports what it would do and changes nothing.

The command line (``tmax gc``) is ``tmax.train.cli.gc_cmd``; this module is the library.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandfleet import proc_start_time, read_controller_info
from sandfleet import slurm as slurm_api
from tmax.train.runfiles import read_jobs as _read_jobs

MARK = "gc.json"
FLEET_RECORD = "fleet.json"
RUN_FILES = ("jobs.json", "processes.json")
MAX_DEPTH = 4
"""How deep below a runs root gc looks for run folders."""
COMMAND_TIMEOUT_S = 60.0
FLEET_DOWN_TIMEOUT_S = 300.0
DEFAULT_STALE_S = 120.0
"""``distributed.stale_after_s`` when a run's config.yaml cannot be read."""


SlurmQueryError = slurm_api.SlurmError
"""squeue (or scancel) could not run or failed: argv, exit status and stderr."""


@dataclass
class Action:
    """One thing gc did, would do (``--dry-run``), or left alone, and why."""

    what: str
    """``scancel``, ``SIGTERM``, ``SIGKILL``, ``fleet down``, ``mark`` or ``skip``."""
    target: str
    reason: str = ""
    done: bool = False
    error: str | None = None

    def line(self, dry_run: bool) -> str:
        verb = f"would {self.what}" if dry_run and self.what != "skip" else self.what
        text = f"{verb} {self.target}" + (f": {self.reason}" if self.reason else "")
        return text + (f" FAILED: {self.error}" if self.error else "")


@dataclass
class RunReport:
    run: str
    verdict: str
    """``alive``, ``other-host``, ``not-mine``, ``already``, ``collected`` (``would-collect``
    with --dry-run) or ``incomplete`` (an action failed: not marked)."""
    reason: str
    actions: list[Action] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(a.error for a in self.actions)


@dataclass(frozen=True)
class Launcher:
    """What a run's ``processes.json`` says of the process that launched it."""

    host: str
    pid: int | None
    start: int | None
    job: str | None


# --------------------------------------------------------------------------- finding runs


def default_roots() -> list[Path]:
    """The runs root of the embedded train config (``out_dir`` without its ``{name}``)."""
    from tmax.train.config import load_train_config  # heavy: the config pulls in torch

    return [load_train_config(None).run_dir.parent]


def is_run(folder: Path) -> bool:
    return any((folder / name).is_file() for name in RUN_FILES)


def find_runs(roots: Iterable[Path], max_depth: int = MAX_DEPTH) -> list[Path]:
    """Run folders at or below each root (not below a run folder, not in hidden folders,
    no symlinks followed), sorted."""
    found: set[Path] = set()
    for root in roots:
        root = Path(root).absolute()
        if is_run(root):
            found.add(root)
            continue
        for top, dirs, _ in os.walk(root):
            here = Path(top)
            if is_run(here):
                found.add(here)
                dirs.clear()
                continue
            depth = len(here.relative_to(root).parts)
            dirs[:] = [] if depth >= max_depth else \
                sorted(d for d in dirs if not d.startswith("."))
    return sorted(found)


# --------------------------------------------------------------------------- liveness


def proc_start(pid: int) -> int | None:
    return proc_start_time(pid)


def proc_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_launcher(run: Path) -> Launcher | None:
    """The launcher ``processes.json`` names, or None (no file, or no launcher in it)."""
    doc = read_json(run / "processes.json")
    if doc is None or not (doc.get("launcher") or doc.get("launcher_job")):
        return None
    pid, start = doc.get("launcher"), doc.get("launcher_start")
    return Launcher(host=str(doc.get("host") or ""), pid=int(pid) if pid else None,
                    start=int(start) if start is not None else None,
                    job=str(doc["launcher_job"]) if doc.get("launcher_job") else None)


def stale_after_s(run: Path) -> float:
    from tmax.train.config import (  # heavy: the config pulls in torch
        TrainConfigError,
        load_train_config,
    )

    try:
        return load_train_config(run / "config.yaml").distributed.stale_after_s
    except (TrainConfigError, ValueError):
        return DEFAULT_STALE_S


class Queue:
    """This user's queued and running jobs (``squeue --me``), asked once, when first
    needed: id -> state."""

    def __init__(self, timeout_s: float = COMMAND_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._jobs: dict[str, str] | None = None

    def jobs(self) -> dict[str, str]:
        if self._jobs is None:
            self._jobs = my_queued_jobs(self.timeout_s)
        return self._jobs


def my_queued_jobs(timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, str]:
    """``squeue -h --me``: this user's jobs Slurm still lists (queued, running, requeued,
    completing ...), id -> state. A line of another user (never expected) is dropped.
    Raises ``SlurmQueryError``."""
    me = pwd.getpwuid(os.getuid()).pw_name
    jobs = slurm_api.SlurmClient(timeout_s).queue()
    return {j.job_id: j.state for j in jobs.values() if j.user == me}


def launcher_state(run: Path, launcher: Launcher | None, queue: Queue
                   ) -> tuple[str, str]:
    """(``alive`` | ``gone`` | ``other-host``, why)."""
    here = socket.gethostname()
    if launcher is not None and launcher.pid and launcher.host == here:
        start = proc_start(launcher.pid)
        if start is None:
            return "gone", f"launcher pid {launcher.pid} on {here} has ended"
        if launcher.start is None:
            return "alive", (f"launcher pid {launcher.pid} on {here} is running (no start "
                             "time recorded: a reused pid cannot be told apart)")
        if start != launcher.start:
            return "gone", (f"launcher pid {launcher.pid} on {here} has ended (the pid now "
                            "names another process)")
        return "alive", f"launcher pid {launcher.pid} on {here} is running"
    job = launcher.job if launcher is not None else newest_orchestrator_job(run)
    if job is not None:
        state = queue.jobs().get(job)
        if state is not None:
            return "alive", f"launcher job {job} is {state}"
        return "gone", f"launcher job {job} is no longer queued or running"
    if launcher is not None and launcher.host != here:
        return "other-host", (f"launcher pid {launcher.pid} runs on {launcher.host}, not "
                              f"here ({here}): run gc there; its jobs stop by themselves "
                              f"once its heartbeat is stale")
    stale = stale_after_s(run)
    beat = run / "handover" / "alive" / "orchestrator"
    try:
        age = time.time() - beat.stat().st_mtime
    except OSError:
        return "gone", "no launcher recorded (processes.json) and no orchestrator heartbeat"
    if age < stale:
        return "alive", f"no launcher recorded, but the orchestrator's heartbeat is {age:.0f} s old"
    return "gone", (f"no launcher recorded, and the orchestrator's heartbeat is {age:.0f} s old "
                    f"(stale after {stale:.0f} s)")


def newest_orchestrator_job(run: Path) -> str | None:
    jobs = [j for j in _read_jobs(run) if j.get("role") == "orchestrator"]
    return str(jobs[-1]["job_id"]) if jobs else None


# --------------------------------------------------------------------------- actions


def cancel_jobs(run: Path, queue: Queue, dry_run: bool) -> list[Action]:
    """scancel, by id, each job of ``jobs.json`` that squeue still lists as this user's."""
    jobs = _read_jobs(run)
    if not jobs:
        return []
    try:
        live = queue.jobs()
    except SlurmQueryError as e:
        return [Action("skip", f"the run's {len(jobs)} job(s)", "cannot tell which are "
                       "running", error=str(e))]
    actions = []
    for job in jobs:
        job_id, name = str(job["job_id"]), job.get("name") or job.get("role") or "?"
        state = live.get(job_id)
        if state is None or state == "COMPLETING":
            continue
        action = Action("scancel", f"job {job_id} ({name})", f"{state}, launcher gone")
        if not dry_run:
            out = _scancel(job_id)
            action.done, action.error = out is None, out
        actions.append(action)
    return actions


def _scancel(job_id: str) -> str | None:
    """``scancel ID``; None when it worked (or the job had just ended), else the error."""
    try:
        slurm_api.SlurmClient(COMMAND_TIMEOUT_S).cancel(job_id)
    except (slurm_api.SlurmError, ValueError) as e:
        return str(e)
    return None


def recorded_processes(run: Path) -> dict[str, tuple[int, int | None]]:
    """The launcher's children in processes.json: name -> (pid, recorded start time)."""
    doc = read_json(run / "processes.json") or {}
    starts = doc.get("start_times") or {}
    procs = {f"trainer-{i}": int(p) for i, p in enumerate(doc.get("trainer") or [])}
    procs.update({str(k): int(v) for k, v in (doc.get("inference") or {}).items()})
    return {name: (pid, starts.get(str(pid))) for name, pid in procs.items()}


def _ours(pid: int, start: int | None) -> str | None:
    """Why ``pid`` must not be signalled as the recorded process, or None if it may."""
    now = proc_start(pid)
    if now is None:
        return "gone"
    if start is None:
        return "no start time recorded: it may be another process with a reused pid"
    if now != start:
        return "its start time differs: the pid now names another process"
    if proc_uid(pid) != os.getuid():
        return "owned by another user"
    try:
        if os.getpgid(pid) != pid:
            return "does not lead its own process group"
    except OSError:
        return "gone"
    return None


def end_processes(run: Path, dry_run: bool, grace_s: float) -> list[Action]:
    """SIGTERM, then SIGKILL after ``grace_s``, to each recorded child's process group,
    only while the pid is still the recorded process (see ``_ours``)."""
    actions, termed = [], {}
    for name, (pid, start) in recorded_processes(run).items():
        why = _ours(pid, start)
        if why == "gone":
            continue
        if why is not None:
            actions.append(Action("skip", f"pid {pid} ({name})", f"left alone: {why}"))
            continue
        action = Action("SIGTERM", f"process group {pid} ({name})", "launcher gone")
        actions.append(action)
        if dry_run:
            continue
        try:
            os.killpg(pid, signal.SIGTERM)
            action.done = True
            termed[pid] = (name, start, action)
        except OSError as e:
            action.error = str(e)
    deadline = time.monotonic() + grace_s
    t0 = time.monotonic()
    while any(_ours(p, s) is None for p, (_, s, _) in termed.items()) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, (name, start, term) in termed.items():
        if _ours(pid, start) is not None:
            term.reason += f"; gone after {time.monotonic() - t0:.1f} s"
            continue
        kill = Action("SIGKILL", f"process group {pid} ({name})",
                      f"still there {grace_s:.0f} s after SIGTERM")
        try:
            os.killpg(pid, signal.SIGKILL)
            kill.done = True
        except OSError as e:
            kill.error = str(e)
        actions.append(kill)
    return actions


def stop_private_fleet(run: Path, dry_run: bool) -> list[Action]:
    """``sandfleet down --state-dir`` of the private fleet in ``RUN/fleet.json``."""
    doc = read_json(run / FLEET_RECORD)
    if not doc or not doc.get("state_dir"):
        return []
    state = Path(doc["state_dir"])
    if not doc.get("private"):
        return [Action("skip", f"fleet {state}", "left alone: a fleet the run joined, "
                       "not its own")]
    if not (state / "controller.json").exists():
        return []  # down already (or never up)
    info = read_controller_info(state)
    here = socket.gethostname()
    if info is not None and info.host and info.host != here:
        return [Action("skip", f"fleet {state}", f"left alone: its controller runs on "
                       f"{info.host}, not here ({here})")]
    action = Action("fleet down", f"{state}", "the run's private fleet, launcher gone")
    if dry_run:
        return [action]
    argv = [sys.executable, "-m", "sandfleet.cli", "down", "--state-dir", str(state)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=FLEET_DOWN_TIMEOUT_S,
                             stdin=subprocess.DEVNULL, start_new_session=True, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        action.error = str(e)
        return [action]
    if out.returncode != 0:
        action.error = f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[-1000:]}"
    else:
        action.done = True
        said = "; ".join(out.stdout.split("\n")).strip("; ")
        action.reason += f" ({said})" if said else ""
    return [action]


# --------------------------------------------------------------------------- the mark


def identity(run: Path, launcher: Launcher | None) -> dict[str, Any]:
    """What a gc collected: the launcher and the run's job ids. A resume changes it."""
    return {"launcher": asdict(launcher) if launcher else None,
            "jobs": sorted(str(j["job_id"]) for j in _read_jobs(run))}


def read_mark(run: Path) -> dict[str, Any] | None:
    return read_json(run / MARK)


def write_mark(run: Path, ident: dict[str, Any], actions: list[Action]) -> None:
    doc = {"gc_at": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
           **ident, "actions": [asdict(a) for a in actions]}
    tmp = run / f".{MARK}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, run / MARK)
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------- one run, all


def collect_run(run: Path, queue: Queue, *, dry_run: bool = False,
                grace_s: float = 10.0) -> RunReport:
    """Decide and act for one run folder (see the module docstring)."""
    owner = run.stat().st_uid
    if owner != os.getuid():
        return RunReport(str(run), "not-mine", f"left alone: owned by uid {owner}")
    launcher = read_launcher(run)
    ident = identity(run, launcher)
    mark = read_mark(run)
    if mark is not None and {k: mark.get(k) for k in ident} == ident:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(mark.get("gc_at", 0)))
        return RunReport(str(run), "already", f"collected already ({when}, {MARK})")
    try:
        state, why = launcher_state(run, launcher, queue)
    except SlurmQueryError as e:
        return RunReport(str(run), "incomplete", "cannot tell whether its launcher runs",
                         [Action("skip", "the run", "launcher job unknown", error=str(e))])
    if state != "gone":
        return RunReport(str(run), state, f"left alone: {why}")
    if (run / "handover" / "done" / "trainer").exists():
        why += "; the trainer had finished"
    actions = cancel_jobs(run, queue, dry_run)
    if launcher is not None and launcher.host == socket.gethostname():
        actions += end_processes(run, dry_run, grace_s)
    actions += stop_private_fleet(run, dry_run)
    report = RunReport(str(run), "would-collect" if dry_run else "collected", why, actions)
    if report.failed:
        report.verdict = "incomplete"
        return report
    if not dry_run:
        write_mark(run, ident, actions)
        report.actions.append(Action("mark", str(run / MARK), done=True))
    return report


def gc(roots: Iterable[Path], *, dry_run: bool = False, grace_s: float = 10.0,
       queue: Queue | None = None) -> list[RunReport]:
    """``collect_run`` for every run folder under ``roots``; a run whose records cannot be
    read is reported (``incomplete``), the others are still collected."""
    queue = queue or Queue()
    reports = []
    for run in find_runs(roots):
        try:
            reports.append(collect_run(run, queue, dry_run=dry_run, grace_s=grace_s))
        except (OSError, ValueError, TypeError, KeyError) as e:
            reports.append(RunReport(str(run), "incomplete", "its records cannot be read", [
                Action("skip", "the run", error=f"{type(e).__name__}: {e}")]))
    return reports


def format_report(report: RunReport, dry_run: bool) -> str:
    lines = [f"{report.run}: {report.verdict}: {report.reason}"]
    lines += [f"  {a.line(dry_run)}" for a in report.actions]
    if report.verdict in ("collected", "would-collect") and not any(
            a.what != "mark" for a in report.actions):
        lines.append("  nothing of it was left running")
    return "\n".join(lines)
