"""Queueing and placement: who is served next and on which node; how many nodes to want.

Acquires queue FIFO per client and clients are served round-robin (``Queues``); a lease
goes to the best-fitting node (``best_fit``: the fewest free CPUs that still hold it, so
idle nodes stay idle and can be released). Apart from ``Queues``, everything here is a
pure function of its arguments.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from sandfleet.config import FleetConfig
from sandfleet.controller.state import Node, Waiter
from sandfleet.wire.messages import Acquire


def desired_nodes(queued_cpus: int, held_cpus: int, config: FleetConfig) -> int:
    """Workers wanted for this demand: ceil(CPUs / cpus_per_node) within the bounds."""
    wanted = math.ceil((queued_cpus + held_cpus) / config.cpus_per_node)
    return max(config.min_nodes, min(config.max_nodes, wanted))


def drain_before_s(config: FleetConfig) -> float:
    """How long before its job's end a worker takes no new lease (Slurm walltimes only)."""
    return config.slurm.drain_before_s if config.provider == "slurm" else 0.0


def best_fit(free: dict[int, dict[str, Node]], cpus: int, memory_mb: int, *, now: float,
             mono: float, drain_s: float) -> Node | None:
    """Best fit in the free-CPU index ``free``: a node with the fewest free CPUs that still
    holds the lease; among equals the one filed last (the node that went idle most recently
    before those idle longer). Skipped: nodes marked unschedulable until after ``mono``
    and those whose job ends within ``drain_s`` of ``now``."""
    for bucket in sorted(k for k in free if k >= cpus):
        for node in reversed(free[bucket].values()):
            if node.unschedulable_until > mono or not node.fits(cpus, memory_mb):
                continue
            if node.ends_at is not None and node.ends_at - now < drain_s:
                continue
            return node
    return None


def sandbox_spec(req: Acquire, config: FleetConfig) -> dict:
    """What the worker is asked to start for ``req`` (the fleet's caps applied)."""
    max_life = min(req.max_lifetime_s or config.max_lease_s, config.max_lease_s)
    return {"image": req.image, "cpus": req.cpus, "memory_mb": req.memory_mb,
            "storage_mb": req.storage_mb or config.storage_mb, "network": req.network,
            "max_lifetime_s": max_life, "env": dict(req.env), "workdir": req.workdir,
            "hostname": "sandbox", "user": req.user, "allowed_hosts": req.allowed_hosts}


def too_big(req: Acquire, config: FleetConfig) -> str | None:
    """Why no node of this fleet could ever hold ``req``; None if one could."""
    max_cpus, max_mb = config.cpus_per_node, config.memory_mb_per_node
    if req.cpus > max_cpus or req.memory_mb > max_mb:
        return (f"no node can hold {req.cpus} CPUs and {req.memory_mb} MB "
                f"(nodes have {max_cpus} CPUs, {max_mb} MB)")
    return None


class Queues:
    """Waiting acquires: FIFO per client, clients round-robin."""

    def __init__(self) -> None:
        self._by_client: OrderedDict[str, deque[Waiter]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._by_client)

    def __iter__(self) -> Iterator[Waiter]:
        for queue in self._by_client.values():
            yield from queue

    def count(self) -> int:
        return sum(len(q) for q in self._by_client.values())

    def cpus(self) -> int:
        return sum(w.request.cpus for q in self._by_client.values() for w in q)

    def by_client(self) -> dict[str, int]:
        return {c: len(q) for c, q in self._by_client.items()}

    def push(self, waiter: Waiter) -> None:
        """Queue ``waiter`` last in its client's queue."""
        self._by_client.setdefault(waiter.client, deque()).append(waiter)

    def push_front(self, waiter: Waiter) -> None:
        """Queue ``waiter`` again first of all (its start failed on the node it got)."""
        self._by_client.setdefault(waiter.client, deque()).appendleft(waiter)
        self._by_client.move_to_end(waiter.client, last=False)
        waiter.queued = True

    def withdraw(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out if it still waits (not placed yet); whether it did."""
        queue = self._by_client.get(waiter.client)
        if not waiter.queued or queue is None or waiter not in queue:
            return False
        waiter.queued = False
        queue.remove(waiter)
        if not queue:
            del self._by_client[waiter.client]
        return True

    def clear(self) -> None:
        self._by_client.clear()

    def schedule(self, place: Callable[[int, int], Node | None],
                 grant: Callable[[Waiter, Node], None]) -> None:
        """Grant what fits: each client's first waiter in turn goes where ``place`` puts it
        (``grant`` takes the slot before the next is placed), until none fits."""
        queues = self._by_client
        progress = True
        while progress and queues:
            progress = False
            for client in list(queues):
                queue = queues.get(client)
                if not queue:
                    queues.pop(client, None)
                    continue
                waiter = queue[0]
                node = place(waiter.request.cpus, waiter.request.memory_mb)
                if node is None:
                    continue
                queue.popleft()
                waiter.queued = False
                if not queue:
                    del queues[client]
                else:
                    queues.move_to_end(client)  # round-robin: this client goes last
                progress = True
                grant(waiter, node)
