"""Where workers come from: a *provider* starts, polls and ends worker jobs; the *scaler*
decides how many there should be.

A provider has three blocking calls (the scaler runs them in threads) and two poll
intervals:

- ``submit(name, index) -> job id``: start one worker called ``name`` (the index staggers
  Slurm walltimes);
- ``poll(job_ids) -> {job id: pending | running | ended}``: ONE call for every job (a
  batched ``squeue``), ``None`` when the answer is unknown this time;
- ``cancel(job_id)``: end one job this fleet started, by id (never by name or user).

``LocalProvider`` runs workers as processes on this machine, each leading its own process
group, named by (pid, start time) so a reused pid is never signalled. ``SlurmProvider``
renders ``slurm/sandfleet-worker.sbatch`` (``set -e``; ``sandfleet up --dry-run`` prints
the exact script), submits it with ``sbatch --parsable``, polls with one ``squeue --me -j
<ids>``, and cancels with ``scancel <id>``; every call is an argv list with a timeout.

The ``Scaler`` (in the controller's loop): desired workers = ceil((queued + held) CPUs /
cpus_per_node) within [min_nodes, max_nodes]; it submits the shortfall (a few per tick),
releases workers idle past ``idle_s`` (and pending jobs nobody needed for as long), and
cancels the job of a lost worker, which the shortfall then replaces. The poll interval
doubles while nothing changes, from the provider's minimum to its maximum.

Draining (Slurm): a worker whose job ends within ``slurm.drain_before_s`` (its ``ends_at``,
reported at registration) is marked ``draining``: no new leases; the ones it holds keep
working until released or until the job really ends. Neither it nor its leases count
toward capacity and demand, so the shortfall submits a replacement when leases need one
(draining jobs still count toward ``max_nodes``). Once it holds no lease it is released like
an idle worker (shut down, job cancelled by id). Not journaled: ``ends_at`` is, so a
restarted controller marks the same nodes draining on its first tick.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from sandfleet.config import FleetConfig
from sandfleet.runtime.base import kill_group, proc_start_time

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
SBATCH_TEMPLATE = REPO / "slurm" / "sandfleet-worker.sbatch"


class Provider(Protocol):
    name: str
    poll_min_s: float
    poll_max_s: float

    def submit(self, name: str, index: int) -> str:
        """Start one worker; its job id."""

    def poll(self, job_ids: Sequence[str]) -> dict[str, str] | None:
        """Every job's state (pending, running, ended), in one call; None if unknown."""

    def cancel(self, job_id: str) -> None:
        """End one job this fleet started (idempotent)."""


def worker_argv(python: str, state_dir: Path, name: str) -> list[str]:
    return [python, "-m", "sandfleet.cli", "-v", "worker", "--state-dir", str(state_dir),
            "--name", name]


# ---- local


class LocalProvider:
    """Workers as local processes, each in its own session; job id ``<pid>.<start time>``."""

    name = "local"
    poll_min_s = 0.5
    poll_max_s = 2.0

    def __init__(self, state_dir: Path, *, python: str | None = None, grace_s: float = 15.0):
        self.state_dir = Path(state_dir).resolve()
        self.python = python or sys.executable
        self.grace_s = grace_s
        self._procs: dict[str, subprocess.Popen] = {}

    def submit(self, name: str, index: int) -> str:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"worker-{name}.log", "ab") as out:
            proc = subprocess.Popen(worker_argv(self.python, self.state_dir, name),
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        job_id = f"{proc.pid}.{proc_start_time(proc.pid, zombie_ok=True) or 0}"
        self._procs[job_id] = proc
        return job_id

    @staticmethod
    def _parse(job_id: str) -> tuple[int, int]:
        pid, _, start = job_id.partition(".")
        return int(pid), int(start or 0)

    def alive(self, job_id: str) -> bool:
        proc = self._procs.get(job_id)
        if proc is not None:
            proc.poll()  # reap our own child once it exits
        pid, start = self._parse(job_id)
        return proc_start_time(pid) == start

    def poll(self, job_ids: Sequence[str]) -> dict[str, str]:
        return {job_id: "running" if self.alive(job_id) else "ended" for job_id in job_ids}

    def cancel(self, job_id: str) -> None:
        pid, start = self._parse(job_id)
        if not self.alive(job_id):
            return
        kill_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self.alive(job_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc_start_time(pid) == start:
            log.warning("worker %s ignored SIGTERM for %.0fs: SIGKILL", job_id, self.grace_s)
            kill_group(pid, signal.SIGKILL)
        proc = self._procs.pop(job_id, None)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


# ---- slurm

SBATCH_OPTIONS = ("job_name", "output", "nodes", "ntasks", "cpus_per_task", "mem", "time",
                  "partition", "account", "qos", "signal", "open_mode")
_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")
SQUEUE_STATES = {"PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending",
                 "REQUEUE_HOLD": "pending", "RESV_DEL_HOLD": "pending",
                 "REQUEUE_FED": "pending", "SUSPENDED": "pending",
                 "RUNNING": "running", "COMPLETING": "running", "STAGE_OUT": "running",
                 "RESIZING": "running", "SIGNALING": "running"}


def sbatch_lines(extra: Sequence[str] = (), **options: Any) -> list[str]:
    """``#SBATCH`` lines for ``options`` (keywords of ``SBATCH_OPTIONS``; None skipped)
    and ``extra`` (``--key=value`` strings). Unknown keywords fail with the valid list."""
    unknown = set(options) - set(SBATCH_OPTIONS)
    if unknown:
        raise ValueError(f"unknown sbatch options {sorted(unknown)}; valid: "
                         f"{', '.join(SBATCH_OPTIONS)}")
    lines = []
    for key in SBATCH_OPTIONS:
        value = options.get(key)
        if value is None:
            continue
        text = str(value)
        if "\n" in text or not text.strip():
            raise ValueError(f"bad sbatch value for {key}: {text!r}")
        lines.append(f"#SBATCH --{key.replace('_', '-')}={text}")
    for item in extra:
        if not item.startswith("--") or "\n" in item:
            raise ValueError(f"extra sbatch option must look like --key=value: {item!r}")
        lines.append(f"#SBATCH {item}")
    return lines


def staggered_minutes(config: FleetConfig, index: int) -> int:
    """Walltime of worker ``index``: cycles down from ``time_min`` in stagger steps."""
    s = config.slurm
    step = index % s.stagger_steps
    return max(5, s.time_min - round(step * s.stagger_min / s.stagger_steps))


def render_template(template: str, values: dict[str, str]) -> str:
    """Fill ``{{key}}`` placeholders; a placeholder without a value is an error."""
    def sub(match: re.Match) -> str:
        key = match.group(1)
        if key not in values:
            raise ValueError(f"template placeholder {{{{{key}}}}} has no value")
        return values[key]

    return re.sub(r"\{\{(\w+)\}\}", sub, template)


class SlurmProvider:
    """Worker jobs on a Slurm cluster (see the module doc)."""

    name = "slurm"

    def __init__(self, state_dir: Path, config: FleetConfig, *,
                 template: Path = SBATCH_TEMPLATE, env: dict[str, str] | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.config = config
        self.template = Path(template)
        self.env = env
        self.poll_min_s = config.slurm.poll_min_s
        self.poll_max_s = config.slurm.poll_max_s
        self.fleet = _fleet_key(self.state_dir)

    def script(self, name: str, index: int) -> str:
        """The exact batch script of worker ``name`` (what ``--dry-run`` prints)."""
        c, s = self.config, self.config.slurm
        lines = sbatch_lines(
            s.extra_options, job_name=f"sandfleet-{self.fleet}-{name}",
            output=str(self.state_dir / "logs" / f"slurm-{name}-%j.out"), nodes=1, ntasks=1,
            cpus_per_task=c.cpus_per_node, mem=f"{c.memory_mb_per_node}M",
            time=staggered_minutes(c, index), partition=s.partition, account=s.account,
            qos=s.qos, signal="B:TERM@120", open_mode="append")
        python = s.python or sys.executable
        return render_template(self.template.read_text(), {
            "sbatch_options": "\n".join(lines),
            "setup": "\n".join(s.setup) if s.setup else "# (no setup lines)",
            "worker": shlex.join(worker_argv(python, self.state_dir, name)),
            "state_dir": shlex.quote(str(self.state_dir)),
            "name": shlex.quote(name),
        })

    def _run(self, argv: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, **(self.env or {})}
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env,
                              timeout=self.config.slurm.command_timeout_s,
                              start_new_session=True, check=False)

    def submit(self, name: str, index: int) -> str:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / f"worker-{name}.sbatch"
        path.write_text(self.script(name, index))
        out = self._run(["sbatch", "--parsable", str(path)])
        match = _JOB_ID.match(out.stdout.strip())
        if out.returncode != 0 or not match:
            raise RuntimeError(f"sbatch {path} failed ({out.returncode}): "
                               f"{out.stderr.strip()[-2000:] or out.stdout.strip()}")
        return match.group(1)

    def poll(self, job_ids: Sequence[str]) -> dict[str, str] | None:
        if not job_ids:
            return {}
        out = self._run(["squeue", "--me", "-h", "-j", ",".join(job_ids), "-o", "%i %T %N"])
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:
                return {job_id: "ended" for job_id in job_ids}
            log.warning("squeue failed (%d): %s", out.returncode, out.stderr.strip()[-500:])
            return None
        seen = {}
        for line in out.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2:
                seen[parts[0]] = SQUEUE_STATES.get(parts[1], "ended")
        return {job_id: seen.get(job_id, "ended") for job_id in job_ids}

    def own_jobs(self) -> list[str]:
        """This user's queued or running jobs named after this fleet (for ``gc``)."""
        out = self._run(["squeue", "--me", "-h", "-o", "%i %j"])
        prefix = f"sandfleet-{self.fleet}-"
        return [line.split()[0] for line in out.stdout.splitlines()
                if len(line.split()) == 2 and line.split()[1].startswith(prefix)] \
            if out.returncode == 0 else []

    def cancel(self, job_id: str) -> None:
        if not job_id.isdigit():
            raise ValueError(f"not a Slurm job id: {job_id!r}")
        out = self._run(["scancel", job_id])
        if out.returncode != 0 and "Invalid job id" not in out.stderr \
                and "already completing" not in out.stderr:
            log.warning("scancel %s failed (%d): %s", job_id, out.returncode,
                        out.stderr.strip()[-500:])


def _fleet_key(state_dir: Path) -> str:
    from sandfleet.worker import fleet_key

    return fleet_key(state_dir)


def make_provider(config: FleetConfig, state_dir: Path) -> LocalProvider | SlurmProvider:
    if config.provider == "local":
        return LocalProvider(state_dir)
    return SlurmProvider(state_dir, config)


# ---- the scaler


class Scaler:
    """Keeps the number of worker jobs at the demand (see the module doc)."""

    def __init__(self, controller: Any, provider: Provider):
        self.c = controller
        self.provider = provider
        self.config: FleetConfig = controller.config
        self._interval = provider.poll_min_s
        self._poll_due = 0.0
        self._cancels: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._crashes = 0
        """Jobs in a row that ended before their worker registered."""
        self._submit_after = 0.0

    def kick(self) -> None:
        """Run the next tick now (an acquire is queued)."""
        self._wake.set()

    def _by_name(self, name: str):
        for job in self.c.jobs.values():
            if job.name == name:
                return job
        return None

    def registered(self, node) -> None:
        job = self._by_name(node.name)
        if job is not None:
            job.registered = True
            if job.state == "pending":
                job.state = "running"
        self._crashes = 0
        self._submit_after = 0.0

    def node_lost(self, node) -> None:
        job = self._by_name(node.name)
        if job is not None and job.state != "ended":
            self._cancel(job, "its worker was lost")

    def _cancel(self, job, why: str) -> None:
        if job.releasing and job.state == "ended":
            return
        log.info("cancelling job %s (%s): %s", job.job_id, job.name, why)
        job.releasing = True
        job.state = "ended"
        task = asyncio.create_task(self._do_cancel(job))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _do_cancel(self, job) -> None:
        try:
            await asyncio.to_thread(self.provider.cancel, job.job_id)
        except Exception as e:  # noqa: BLE001 - logged; the scaler keeps going
            log.warning("cancel %s: %s", job.job_id, e)
        self.c.jobs.pop(job.job_id, None)
        await self.c._log({"e": "job_end", "job_id": job.job_id})

    async def cancel_all(self) -> None:
        for job in list(self.c.jobs.values()):
            if not (job.releasing and job.state == "ended"):
                self._cancel(job, "fleet down")
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("scaler tick failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.scale_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()

    async def _poll(self) -> None:
        live = [j for j in self.c.jobs.values() if j.state != "ended"]
        mono = time.monotonic()
        if not live or mono < self._poll_due:
            return
        states = await asyncio.to_thread(self.provider.poll, [j.job_id for j in live])
        changed = False
        for job in live:
            state = (states or {}).get(job.job_id)
            if state is None or state == job.state:
                continue
            changed = True
            if state == "ended":
                job.state = "ended"
                if not job.registered and not job.releasing:
                    self._crashed(job)
                for node in list(self.c.nodes.values()):
                    if node.name == job.name and node.state in ("up", "draining"):
                        self.c._node_lost(node, f"its job {job.job_id} ended")
                self.c.jobs.pop(job.job_id, None)
                await self.c._log({"e": "job_end", "job_id": job.job_id})
            elif job.state == "pending":
                job.state = state
        self._interval = self.provider.poll_min_s if changed else \
            min(self._interval * 2, self.provider.poll_max_s)
        self._poll_due = time.monotonic() + self._interval

    def _crashed(self, job) -> None:
        """A worker that died before registering: back off before the next submission, so
        a broken setup never turns into a submission storm."""
        self._crashes += 1
        delay = min(2.0 ** self._crashes, 120.0)
        self._submit_after = time.monotonic() + delay
        message = (f"worker {job.name} (job {job.job_id}) ended before registering; see "
                   f"{self.c.state_dir / 'logs'}; next submission in {delay:.0f}s")
        log.error("%s", message)
        self.c.failures["worker_start"] += 1
        self.c.recent.append({"t": time.time(), "cause": "worker_start", "lease_id": None,
                              "message": message})

    def desired(self) -> int:
        """Workers wanted for the queued leases and those held outside draining nodes."""
        from sandfleet.controller import desired_nodes

        held = 0
        for lease in self.c.leases.values():
            node = self.c.nodes.get(lease.worker_id)
            if node is None or node.state != "draining":
                held += lease.cpus
        return desired_nodes(self.c.queued_cpus(), held, self.config)

    def drain_before_s(self) -> float:
        """How long before its job's end a worker drains (as the controller's placement)."""
        return self.config.slurm.drain_before_s if self.config.provider == "slurm" else 0.0

    async def _drain(self) -> None:
        """Mark workers whose job ends within ``drain_before_s`` draining; release those of
        them that hold no lease (the idle release's path)."""
        now, before = time.time(), self.drain_before_s()
        for node in list(self.c.nodes.values()):
            if node.state == "up" and node.ends_at is not None and node.ends_at - now < before:
                log.info("worker %s (job %s) drains: its job ends in %.0fs",
                         node.worker_id, node.job_id or "-", node.ends_at - now)
                node.state = "draining"
                self.c._index(node)
        for node in [n for n in self.c.nodes.values() if n.state == "draining"]:
            if not node.leases and self.c.nodes.get(node.worker_id) is node \
                    and node.state == "draining":
                await self._release(node, self._by_name(node.name), "drained")

    async def tick(self) -> None:
        if self.c._stopping.is_set():
            return
        await self._poll()
        await self._drain()
        want = self.desired()
        draining = {n.name for n in self.c.nodes.values() if n.state == "draining"}
        live = [j for j in self.c.jobs.values() if not j.releasing and j.state != "ended"]
        jobs = [j for j in live if j.name not in draining]
        names = {j.name for j in self.c.jobs.values()}
        unmanaged = [n for n in self.c.nodes.values()  # workers started by hand
                     if n.state == "up" and n.name not in names]
        have = len(jobs) + len(unmanaged)
        if have < want:
            if time.monotonic() < self._submit_after:
                return
            room = self.config.max_nodes - len(live) - len(unmanaged)
            for _ in range(min(want - have, room, self.config.submit_per_tick)):
                await self._submit()
            return
        excess = have - want
        mono = time.monotonic()
        if excess <= 0:
            return
        registered = {n.name: n for n in self.c.nodes.values() if n.state in ("up", "draining")}
        for job in sorted(jobs, key=lambda j: -j.submitted_at):  # newest first
            if excess <= 0:
                break
            node = registered.get(job.name)
            if node is None:
                if job.state == "pending" and time.time() - job.submitted_at > \
                        self.config.idle_s:
                    self._cancel(job, "not needed any more")
                    excess -= 1
                continue
            if not node.leases and node.state == "up" and \
                    mono - node.idle_since > self.config.idle_s:
                await self._release(node, job)
                excess -= 1

    async def _submit(self) -> None:
        index = self.c.next_index
        self.c.next_index += 1
        name = f"w{index}"
        try:
            job_id = await asyncio.to_thread(self.provider.submit, name, index)
        except Exception as e:  # noqa: BLE001 - logged; the scaler keeps going
            log.error("submitting worker %s failed: %s", name, e)
            self.c.recent.append({"t": time.time(), "cause": "submit", "lease_id": None,
                                  "message": str(e)[:500]})
            return
        from sandfleet.controller import Job

        self.c.jobs[job_id] = Job(job_id, name, index)
        await self.c._log({"e": "job", "job_id": job_id, "name": name, "index": index})
        log.info("submitted worker %s as job %s", name, job_id)
        self._interval = self.provider.poll_min_s
        self._poll_due = time.monotonic() + self._interval

    async def _release(self, node, job, why: str = "idle") -> None:
        """Shut down a worker that holds no lease, forget it and cancel its job (if the
        fleet started one)."""
        from sandfleet.protocol import Shutdown, new_id

        log.info("releasing %s worker %s (job %s)", why, node.worker_id,
                 job.job_id if job is not None else "-")
        node.state = "draining"
        self.c._index(node)
        try:
            await self.c._worker_rpc(node, Shutdown(id=new_id(), reason=why), timeout=10)
        except Exception as e:  # noqa: BLE001 - logged; the scaler keeps going
            log.debug("shutdown %s: %s", node.worker_id, e)
        self.c.node_gone(node, f"released: {why}")
        if job is not None:
            self._cancel(job, why)
