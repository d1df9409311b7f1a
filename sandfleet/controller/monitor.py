"""Liveness: which nodes went silent, which leases ran out, what a heartbeat says, and the
status report. Decisions only (pure functions over the records); the controller acts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from sandfleet.controller.state import Lease, Node, Registry
from sandfleet.errors import LeaseExpired, SandboxLost
from sandfleet.wire.messages import LeaseActivity

FORGET_LOST_AFTER_S = 600.0
"""A lost node stays in the status this long."""


def silent_nodes(nodes: Iterable[Node], mono: float, lost_after_s: float
                 ) -> tuple[list[tuple[Node, str]], list[Node]]:
    """(nodes now lost, with why; lost nodes to forget) by their last heartbeat."""
    lost, forget = [], []
    for node in nodes:
        silent = mono - node.last_seen
        if node.state in ("up", "draining") and silent > lost_after_s:
            lost.append((node, f"no heartbeat for {silent:.1f}s"))
        elif node.state == "lost" and silent > FORGET_LOST_AFTER_S:
            forget.append(node)
    return lost, forget


def due_leases(leases: Iterable[Lease], now: float) -> list[tuple[Lease, str, dict]]:
    """Held leases past their end: (lease, cause, error) for each. A lease past its max
    lifetime ends even when pinned; an unpinned one past its expiry expires."""
    due = []
    for lease in leases:
        if lease.state != "held":
            continue
        if now > lease.granted_at + lease.spec["max_lifetime_s"]:
            due.append((lease, "sandbox_lost",
                        SandboxLost(lease.lease_id, "max lifetime reached").to_dict()))
        elif not lease.pinned and now > lease.expires_at:
            due.append((lease, "expired", LeaseExpired(
                lease.lease_id, f"lease expired: not renewed for {lease.ttl_s:g}s "
                "(ttl)").to_dict()))
    return due


def reconcile(node: Node, reported: Mapping[str, LeaseActivity], lost: Mapping[str, str],
              leases: Mapping[str, Lease], *, now: float, heartbeat_s: float
              ) -> tuple[list[str], list[tuple[Lease, str]]]:
    """What a worker's report means: the lease ids it should keep (those it reports active
    are renewed and pinned as it says, here) and the leases it lost, with why (those it
    says it lost, and held ones it no longer reports once a grant has had time to reach
    it: two heartbeats)."""
    keep = []
    for lease_id, activity in reported.items():
        lease = leases.get(lease_id)
        if lease is None or lease.worker_id != node.worker_id or lease_id in lost:
            continue
        keep.append(lease_id)
        lease.pinned = activity.pinned
        if lease.state == "held":
            lease.renewed_at = max(lease.renewed_at, now - activity.idle_s)
    gone = []
    for lease_id, reason in lost.items():
        lease = leases.get(lease_id)
        if lease is not None and lease.worker_id == node.worker_id:
            gone.append((lease, reason))
    for lease_id in list(node.leases):
        lease = leases.get(lease_id)
        if lease is not None and lease.state == "held" and lease_id not in reported \
                and lease_id not in lost and now - lease.granted_at > 2 * heartbeat_s + 1:
            gone.append((lease, f"worker {node.worker_id} no longer runs it"))
    return keep, gone


def status_report(reg: Registry, *, queued: int, queued_by_client: dict[str, int],
                  now: float, mono: float) -> dict:
    """The fleet's part of a ``Status`` reply: nodes, leases, jobs, failures."""
    held = sum(1 for lease in reg.leases.values() if lease.state == "held")
    return {
        "nodes": [{"worker_id": n.worker_id, "name": n.name, "node": n.node,
                   "address": n.address, "state": n.state, "slots": n.slots,
                   "used_cpus": n.used_cpus, "leases": len(n.leases), "job_id": n.job_id,
                   "last_seen_s": round(mono - n.last_seen, 2),
                   "idle_s": round(mono - n.idle_since, 1) if not n.leases else 0.0,
                   "ends_in_s": round(n.ends_at - now) if n.ends_at is not None else None}
                  for n in reg.nodes.values()],
        "leases": {"held": held, "starting": len(reg.leases) - held, "queued": queued,
                   "queued_by_client": queued_by_client},
        "jobs": [{"job_id": j.job_id, "name": j.name, "state": j.state}
                 for j in reg.jobs.values()],
        "failures": dict(reg.failures),
        "recent_failures": list(reg.recent)[-20:],
    }
