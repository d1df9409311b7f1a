"""The controller's records (nodes, leases, waiters, jobs) and the registry that holds them.

The registry is plain bookkeeping, no I/O and no event loop: which nodes are up and how
full, which leases are held where, why ended leases ended (so a late renew learns it), the
worker jobs, failure counts. ``restore`` builds it from a replayed journal and
``snapshot`` writes it back as the events of a compacted journal.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from sandfleet.controller.journal import (
    Event,
    JobSubmitted,
    LeaseEnded,
    LeaseGranted,
    Meta,
    NodeJoined,
    Replayed,
)
from sandfleet.errors import NodeLost
from sandfleet.wire.messages import Acquire

ENDED_KEEP = 100_000
"""Ended leases remembered (so a late renew learns why its lease ended)."""
RECENT_FAILURES = 200
SNAPSHOT_ENDS = 1000
"""Ended leases a snapshot keeps."""


@dataclass
class Node:
    worker_id: str
    name: str
    address: str
    node: str
    slots: int
    memory_mb: int
    job_id: str = ""
    ends_at: float | None = None
    registered_at: float = 0.0
    state: str = "up"
    """up | draining (no new leases; released when idle) | lost | gone."""
    last_seen: float = field(default_factory=time.monotonic)
    used_cpus: int = 0
    used_mb: int = 0
    leases: set[str] = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)
    unschedulable_until: float = 0.0
    bucket: int | None = None
    """Its key in the registry's free-CPU index (None when not schedulable)."""

    def record(self, t: float | None = None) -> NodeJoined:
        return NodeJoined(self.worker_id, self.name, self.address, self.node, self.slots,
                          self.memory_mb, self.job_id, self.ends_at, self.registered_at, t=t)

    def fits(self, cpus: int, memory_mb: int) -> bool:
        return self.used_cpus + cpus <= self.slots and self.used_mb + memory_mb <= self.memory_mb


@dataclass
class Lease:
    lease_id: str
    request_id: str
    client: str
    worker_id: str
    node: str
    address: str
    spec: dict
    cpus: int
    memory_mb: int
    ttl_s: float
    granted_at: float = 0.0
    queued_s: float = 0.0
    renewed_at: float = 0.0
    state: str = "starting"
    """starting | held."""
    pinned: bool = False

    @property
    def expires_at(self) -> float:
        return self.renewed_at + self.ttl_s

    def grant(self) -> dict:
        """A ``Grant``'s fields (built as a dict: this runs for every acquire and renew)."""
        return {"lease_id": self.lease_id, "sandbox_id": self.lease_id,
                "worker_id": self.worker_id, "worker_address": self.address, "node": self.node,
                "granted_at": self.granted_at, "queued_s": self.queued_s,
                "expires_at": self.expires_at, "ttl_s": self.ttl_s}

    def record(self, t: float | None = None) -> LeaseGranted:
        return LeaseGranted(self.lease_id, self.request_id, self.client, self.worker_id,
                            self.node, self.address, self.spec, self.cpus, self.memory_mb,
                            self.ttl_s, self.granted_at, self.queued_s, t=t)


@dataclass(eq=False)
class Waiter:
    request: Acquire
    client: str
    future: asyncio.Future
    wait_s: float
    enqueued: float = field(default_factory=time.monotonic)
    attempts: int = 0
    queued: bool = True
    """In its client's queue (not placed yet)."""
    timer: asyncio.TimerHandle | None = None
    """``CapacityTimeout`` at ``enqueued + wait_s``; armed only once it has to wait."""


@dataclass
class Job:
    """A worker job the scaler submitted. Its fields are the scaler's to update; the
    registry keeps it so the journal, the snapshot and the status see it."""

    job_id: str
    name: str
    index: int
    state: str = "pending"
    """pending | running | ended (the provider's view)."""
    submitted_at: float = field(default_factory=time.time)
    releasing: bool = False
    registered: bool = False
    """Its worker registered at least once."""

    def record(self, t: float | None = None) -> JobSubmitted:
        return JobSubmitted(self.job_id, self.name, self.index, t=t)


class Registry:
    """Nodes, leases and jobs, with the indexes placement and idempotent requests need."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.free: dict[int, dict[str, Node]] = {}
        """Schedulable nodes by free CPUs: placement scans buckets, not every node."""
        self.by_name: dict[str, str] = {}
        self.leases: dict[str, Lease] = {}
        self.ended: OrderedDict[str, dict] = OrderedDict()
        self.by_request: dict[str, str] = {}
        self.jobs: dict[str, Job] = {}
        self.next_index = 0
        self.failures: Counter = Counter()
        self.recent: deque[dict] = deque(maxlen=RECENT_FAILURES)

    # ---- nodes and slots

    def index(self, node: Node) -> None:
        """File ``node`` under its free CPUs (or nowhere unless it is up)."""
        if node.bucket is not None:
            bucket = self.free.get(node.bucket)
            if bucket is not None:
                bucket.pop(node.worker_id, None)
                if not bucket:
                    del self.free[node.bucket]
            node.bucket = None
        if node.state == "up" and self.nodes.get(node.worker_id) is node:
            node.bucket = node.slots - node.used_cpus
            self.free.setdefault(node.bucket, {})[node.worker_id] = node

    def reserve(self, lease: Lease, node: Node) -> None:
        """Hold ``lease``'s slot on ``node``."""
        self.leases[lease.lease_id] = lease
        node.leases.add(lease.lease_id)
        node.used_cpus += lease.cpus
        node.used_mb += lease.memory_mb

    def unreserve(self, lease: Lease, node: Node) -> None:
        """Free ``lease``'s slot (if it still holds one on ``node``)."""
        if self.leases.get(lease.lease_id) is lease:
            del self.leases[lease.lease_id]
            node.leases.discard(lease.lease_id)
            node.used_cpus -= lease.cpus
            node.used_mb -= lease.memory_mb
            self.index(node)
            if not node.leases:
                node.idle_since = time.monotonic()

    # ---- ended leases and failures

    def remember_end(self, lease_id: str, cause: str, error: dict,
                     request_id: str | None = None) -> None:
        self.ended[lease_id] = {"cause": cause, "error": error, "request_id": request_id}
        self.ended.move_to_end(lease_id)
        if request_id:
            self.by_request[request_id] = lease_id
        while len(self.ended) > ENDED_KEEP:
            _, old = self.ended.popitem(last=False)
            if old.get("request_id"):
                self.by_request.pop(old["request_id"], None)

    def note(self, cause: str, message: str, *, lease_id: str | None = None,
             node: str | None = None, count: bool = True) -> None:
        """Count a failure (unless ``count`` is off) and keep it among the recent ones."""
        if count:
            self.failures[cause] += 1
        entry = {"t": time.time(), "cause": cause, "lease_id": lease_id}
        if node is not None:
            entry["node"] = node
        entry["message"] = message
        self.recent.append(entry)

    # ---- the journal's view

    def restore(self, replayed: Replayed, now: float, mono: float) -> None:
        """Take the state a journal replayed to. Renewals are not journaled, so leases count
        as renewed now (downtime never expires a lease) and nodes as seen now (they get
        ``lost_after_s`` to heartbeat again). A lease whose worker is gone ends as lost."""
        for ev in replayed.nodes.values():
            self.nodes[ev.worker_id] = Node(ev.worker_id, ev.name, ev.address, ev.node,
                                            ev.slots, ev.memory_mb, ev.job_id, ev.ends_at,
                                            ev.registered_at, last_seen=mono, idle_since=mono)
        for g in replayed.leases.values():
            lease = Lease(g.lease_id, g.request_id, g.client, g.worker_id, g.node,
                          g.address, g.spec, g.cpus, g.memory_mb, g.ttl_s, g.granted_at,
                          g.queued_s, renewed_at=now, state="held")
            node = self.nodes.get(lease.worker_id)
            if node is None:
                self.remember_end(lease.lease_id, "node_lost", NodeLost(
                    lease.node, "its worker was gone when the controller restarted").to_dict(),
                    lease.request_id)
                continue
            self.reserve(lease, node)
            self.by_request[lease.request_id] = lease.lease_id
        for node in self.nodes.values():
            self.index(node)
            self.by_name[node.name] = node.worker_id
        for end in list(replayed.ends.values())[-ENDED_KEEP:]:
            self.remember_end(end.lease_id, end.cause, end.error, end.request_id)
            if end.cause not in ("released", "expired"):
                self.failures[end.cause] += 1
        for job in replayed.jobs.values():
            self.jobs[job.job_id] = Job(job.job_id, job.name, int(job.index), state="running",
                                        submitted_at=now if job.t is None else job.t,
                                        registered=True)
        self.next_index = max(self.next_index, replayed.next_index)

    def snapshot(self, now: float) -> list[Event]:
        """The journal of the present state: what a compacted journal holds."""
        return ([Meta(self.next_index, t=now)]
                + [j.record(t=j.submitted_at)
                   for j in self.jobs.values() if j.state != "ended"]
                + [n.record(t=now) for n in self.nodes.values()
                   if n.state in ("up", "draining")]
                + [lease.record(t=now) for lease in self.leases.values()
                   if lease.state == "held"]
                + [LeaseEnded(lease_id, ended["cause"], ended["error"], ended["request_id"],
                              t=now)
                   for lease_id, ended in list(self.ended.items())[-SNAPSHOT_ENDS:]])
