"""The scaler: keeps the number of worker jobs at the demand.

Desired workers = ceil((queued + held) CPUs / cpus_per_node) within [min_nodes,
max_nodes]; it submits the shortfall (a few per tick), releases workers idle past
``idle_s`` (and pending jobs nobody needed for as long), and cancels the job of a lost
worker, which the shortfall then replaces. One batched provider poll per interval; the
interval doubles while nothing changes, from the provider's minimum to its maximum. A
worker that dies before registering backs the next submission off (2, 4, ... 120 s), so a
broken setup never turns into a submission storm.

Draining (Slurm): a worker whose job ends within ``slurm.drain_before_s`` (its ``ends_at``,
reported at registration) is marked ``draining``: no new leases; the ones it holds keep
working until released or until the job really ends. Neither it nor its leases count
toward capacity and demand, so the shortfall submits a replacement when leases need one
(draining jobs still count toward ``max_nodes``). Once it holds no lease it is released like
an idle worker (shut down, job cancelled by id). Not journaled: ``ends_at`` is, so a
restarted controller marks the same nodes draining on its first tick.

The scaler sees the controller only through ``FleetView``: read-only mappings of nodes,
leases and jobs, and a few named calls to act. The ``Job`` records are its own: it updates
their fields; the controller journals their start and end and shows them in the status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from sandfleet.config import FleetConfig
from sandfleet.controller.placement import desired_nodes, drain_before_s
from sandfleet.controller.state import Job, Lease, Node
from sandfleet.providers.base import Provider

log = logging.getLogger(__name__)


class FleetView(Protocol):
    """What the scaler sees of the controller, and the calls it acts through."""

    @property
    def config(self) -> FleetConfig: ...

    @property
    def state_dir(self) -> Path: ...

    @property
    def stopping(self) -> bool:
        """The controller is going down: no more scaling."""

    @property
    def nodes(self) -> Mapping[str, Node]: ...

    @property
    def leases(self) -> Mapping[str, Lease]: ...

    @property
    def jobs(self) -> Mapping[str, Job]: ...

    def queued_cpus(self) -> int:
        """CPUs of the acquires waiting for a slot."""

    def take_worker_index(self) -> int:
        """The next worker's index (names ``w<index>``; never handed out twice)."""

    async def add_job(self, job: Job) -> None:
        """A job was submitted: keep it (journaled)."""

    async def job_ended(self, job_id: str) -> None:
        """A job ended or was cancelled: forget it (journaled)."""

    def node_lost(self, node: Node, reason: str) -> None:
        """End the node's leases as lost (its job ended under it)."""

    def drain_node(self, node: Node) -> None:
        """No new leases on ``node``; the ones it holds go on."""

    async def release_node(self, node: Node, why: str) -> None:
        """Shut down a worker that holds no lease and forget it (no failure)."""

    def note_failure(self, cause: str, message: str, *, count: bool = True) -> None:
        """Show a failure in the status (and count it unless ``count`` is off)."""


class Scaler:
    """Keeps the number of worker jobs at the demand (see the module doc)."""

    def __init__(self, fleet: FleetView, provider: Provider):
        self.fleet = fleet
        self.provider = provider
        self.config: FleetConfig = fleet.config
        self._interval = provider.poll_min_s
        self._poll_due = 0.0
        self._cancels: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._crashes = 0
        """Jobs in a row that ended before their worker registered."""
        self._submit_after = 0.0

    # ---- what the controller tells it

    def kick(self) -> None:
        """Run the next tick now (an acquire is queued)."""
        self._wake.set()

    def worker_registered(self, node: Node) -> None:
        job = self._by_name(node.name)
        if job is not None:
            job.registered = True
            if job.state == "pending":
                job.state = "running"
        self._crashes = 0
        self._submit_after = 0.0

    def worker_lost(self, node: Node) -> None:
        job = self._by_name(node.name)
        if job is not None and job.state != "ended":
            self._cancel(job, "its worker was lost")

    async def cancel_all(self) -> None:
        for job in list(self.fleet.jobs.values()):
            if not (job.releasing and job.state == "ended"):
                self._cancel(job, "fleet down")
        if self._cancels:
            await asyncio.gather(*self._cancels, return_exceptions=True)

    # ---- the loop

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

    def desired(self) -> int:
        """Workers wanted for the queued leases and those held outside draining nodes."""
        held = 0
        for lease in self.fleet.leases.values():
            node = self.fleet.nodes.get(lease.worker_id)
            if node is None or node.state != "draining":
                held += lease.cpus
        return desired_nodes(self.fleet.queued_cpus(), held, self.config)

    async def tick(self) -> None:
        fleet = self.fleet
        if fleet.stopping:
            return
        await self._poll()
        await self._drain()
        want = self.desired()
        draining = {n.name for n in fleet.nodes.values() if n.state == "draining"}
        live = [j for j in fleet.jobs.values() if not j.releasing and j.state != "ended"]
        jobs = [j for j in live if j.name not in draining]
        names = {j.name for j in fleet.jobs.values()}
        unmanaged = [n for n in fleet.nodes.values()  # workers started by hand
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
        registered = {n.name: n for n in fleet.nodes.values() if n.state in ("up", "draining")}
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

    # ---- the steps

    def _by_name(self, name: str) -> Job | None:
        for job in self.fleet.jobs.values():
            if job.name == name:
                return job
        return None

    async def _poll(self) -> None:
        live = [j for j in self.fleet.jobs.values() if j.state != "ended"]
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
                for node in list(self.fleet.nodes.values()):
                    if node.name == job.name and node.state in ("up", "draining"):
                        self.fleet.node_lost(node, f"its job {job.job_id} ended")
                await self.fleet.job_ended(job.job_id)
            elif job.state == "pending":
                job.state = state
        self._interval = self.provider.poll_min_s if changed else \
            min(self._interval * 2, self.provider.poll_max_s)
        self._poll_due = time.monotonic() + self._interval

    def _crashed(self, job: Job) -> None:
        """A worker that died before registering: back off before the next submission."""
        self._crashes += 1
        delay = min(2.0 ** self._crashes, 120.0)
        self._submit_after = time.monotonic() + delay
        message = (f"worker {job.name} (job {job.job_id}) ended before registering; see "
                   f"{self.fleet.state_dir / 'logs'}; next submission in {delay:.0f}s")
        log.error("%s", message)
        self.fleet.note_failure("worker_start", message)

    async def _drain(self) -> None:
        """Mark workers whose job ends within ``drain_before_s`` draining; release those of
        them that hold no lease (the idle release's path)."""
        now, before = time.time(), drain_before_s(self.config)
        for node in list(self.fleet.nodes.values()):
            if node.state == "up" and node.ends_at is not None and node.ends_at - now < before:
                log.info("worker %s (job %s) drains: its job ends in %.0fs",
                         node.worker_id, node.job_id or "-", node.ends_at - now)
                self.fleet.drain_node(node)
        for node in [n for n in self.fleet.nodes.values() if n.state == "draining"]:
            if not node.leases and self.fleet.nodes.get(node.worker_id) is node \
                    and node.state == "draining":
                await self._release(node, self._by_name(node.name), "drained")

    async def _submit(self) -> None:
        index = self.fleet.take_worker_index()
        name = f"w{index}"
        try:
            job_id = await asyncio.to_thread(self.provider.submit, name, index)
        except Exception as e:  # noqa: BLE001 - logged; the scaler keeps going
            log.error("submitting worker %s failed: %s", name, e)
            self.fleet.note_failure("submit", str(e)[:500], count=False)
            return
        await self.fleet.add_job(Job(job_id, name, index))
        log.info("submitted worker %s as job %s", name, job_id)
        self._interval = self.provider.poll_min_s
        self._poll_due = time.monotonic() + self._interval

    async def _release(self, node: Node, job: Job | None, why: str = "idle") -> None:
        """Shut down a worker that holds no lease, forget it and cancel its job (if the
        fleet started one)."""
        log.info("releasing %s worker %s (job %s)", why, node.worker_id,
                 job.job_id if job is not None else "-")
        await self.fleet.release_node(node, why)
        if job is not None:
            self._cancel(job, why)

    def _cancel(self, job: Job, why: str) -> None:
        if job.releasing and job.state == "ended":
            return
        log.info("cancelling job %s (%s): %s", job.job_id, job.name, why)
        job.releasing = True
        job.state = "ended"
        task = asyncio.create_task(self._do_cancel(job))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _do_cancel(self, job: Job) -> None:
        try:
            await asyncio.to_thread(self.provider.cancel, job.job_id)
        except Exception as e:  # noqa: BLE001 - logged; the scaler keeps going
            log.warning("cancel %s: %s", job.job_id, e)
        await self.fleet.job_ended(job.job_id)
