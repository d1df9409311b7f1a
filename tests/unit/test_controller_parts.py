"""The controller's parts on their own: the journal's one replay (hand-written journals ->
the state they mean), the registry it restores, queueing and placement, and the scaler's
decisions through a fake ``FleetView`` (hand-computed)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from sandfleet.config import FleetConfig
from sandfleet.controller import journal
from sandfleet.controller.journal import (
    JobSubmitted,
    LeaseEnded,
    LeaseGranted,
    NodeJoined,
    load,
    replay,
)
from sandfleet.controller.placement import Queues, best_fit, desired_nodes
from sandfleet.controller.scaler import Scaler
from sandfleet.controller.state import Job, Lease, Node, Registry, Waiter
from sandfleet.wire.messages import Acquire

SPEC = {"image": "/i.sif", "cpus": 2, "memory_mb": 512, "storage_mb": 1024,
        "network": False, "max_lifetime_s": 3600.0, "env": {}, "workdir": "/",
        "hostname": "sandbox"}


def grant_line(lease_id: str, worker: str, t: float = 100.0) -> dict:
    return {"e": "grant", "lease_id": lease_id, "request_id": f"a-{lease_id}", "client": "c",
            "worker_id": worker, "node": "n1", "address": "127.0.0.1:1", "spec": SPEC,
            "cpus": 2, "memory_mb": 512, "ttl_s": 60.0, "granted_at": t, "queued_s": 0.1,
            "t": t}


def node_line(worker: str, name: str, job_id: str = "", t: float = 90.0) -> dict:
    return {"e": "node", "worker_id": worker, "name": name, "address": "127.0.0.1:1",
            "node": "n1", "slots": 8, "memory_mb": 4096, "job_id": job_id, "ends_at": None,
            "registered_at": t, "t": t}


def end_line(lease_id: str, cause: str = "released") -> dict:
    return {"e": "end", "lease_id": lease_id, "cause": cause,
            "error": {"error": "LeaseClosed", "message": "lease released"},
            "request_id": f"a-{lease_id}", "t": 120.0}


def write_journal(path: Path, lines: list[dict], torn: str = "") -> Path:
    path.write_bytes(b"".join(json.dumps(d, separators=(",", ":")).encode() + b"\n"
                              for d in lines) + torn.encode())
    return path


# ---- the journal


def test_every_event_reencodes_to_the_bytes_it_was_read_from(tmp_path):
    lines = [{"e": "meta", "next_index": 3, "t": 1.5},
             {"e": "job", "job_id": "11", "name": "w4", "index": 4, "t": 2.0},
             node_line("w4-x", "w4", "11"), grant_line("L1", "w4-x"), end_line("L1"),
             {"e": "node_end", "worker_id": "w4-x", "reason": "released: idle", "t": 3.0},
             {"e": "job_end", "job_id": "11", "t": 4.0}, {"e": "down", "t": 5.25},
             {"e": "down"}]
    path = write_journal(tmp_path / "j", lines)
    events = load(path)
    assert [type(e).__name__ for e in events] == [
        "Meta", "JobSubmitted", "NodeJoined", "LeaseGranted", "LeaseEnded", "NodeEnded",
        "JobEnded", "FleetDown", "FleetDown"]
    assert b"".join(journal.encode(e) for e in events) == path.read_bytes()
    journal.rewrite(tmp_path / "k", events)
    assert (tmp_path / "k").read_bytes() == path.read_bytes()
    for cls in journal.EVENTS.values():  # what encode's field order rests on
        assert [f.name for f in dataclasses.fields(cls)][-1] == "t", cls


def test_replay_folds_a_hand_written_journal_with_a_torn_last_line(tmp_path, caplog):
    lines = [
        {"e": "job", "job_id": "7", "name": "w0", "index": 0, "t": 1.0},
        node_line("old", "w0", "7"), grant_line("L0", "old"),
        {"e": "down", "t": 50.0},  # everything before is over
        {"e": "meta", "next_index": 3, "t": 60.0},
        {"e": "job", "job_id": "11", "name": "w4", "index": 4, "t": 61.0},
        {"e": "job", "job_id": "12", "name": "w5", "index": 5, "t": 62.0},
        {"e": "job_end", "job_id": "12", "t": 63.0},
        node_line("w4-x", "w4", "11"), node_line("w9-y", "w9"),
        {"e": "node_end", "worker_id": "w9-y", "reason": "no heartbeat", "t": 95.0},
        grant_line("L1", "w4-x"), grant_line("L2", "w4-x"), grant_line("L3", "w9-y"),
        end_line("L2"), end_line("L4", "node_lost"),
        end_line("L2"),  # replayed again after a snapshot: keeps its place
        {"e": "sandbox_moved", "lease_id": "L1"},  # a kind this code does not know
    ]
    path = write_journal(tmp_path / "journal.jsonl", lines, torn='{"e": "gra')
    state = replay(load(path))
    assert list(state.jobs) == ["11"] and state.jobs["11"] == JobSubmitted("11", "w4", 4, 61.0)
    assert state.next_index == 6  # job index 5 was handed out, then ended
    assert list(state.nodes) == ["w4-x"]
    assert state.nodes["w4-x"] == NodeJoined(**{k: v for k, v in node_line("w4-x", "w4", "11")
                                                .items() if k != "e"})
    assert list(state.leases) == ["L1", "L3"]  # L3's worker is gone: the registry decides
    assert state.leases["L1"] == LeaseGranted(**{k: v for k, v in grant_line("L1", "w4-x")
                                                 .items() if k != "e"})
    assert list(state.ends) == ["L2", "L4"]
    assert state.ends["L4"] == LeaseEnded("L4", "node_lost", end_line("L4")["error"], "a-L4",
                                          120.0)
    assert "line 19 unreadable" in caplog.text and "sandbox_moved" in caplog.text


def test_registry_restores_the_replayed_state_and_snapshots_it_back(tmp_path):
    lines = [{"e": "job", "job_id": "11", "name": "w4", "index": 4, "t": 61.0},
             node_line("w4-x", "w4", "11"), grant_line("L1", "w4-x"),
             grant_line("L2", "w4-x"), grant_line("L3", "gone"), end_line("L2")]
    reg = Registry()
    reg.restore(replay(load(write_journal(tmp_path / "j", lines))), now=1000.0, mono=5.0)
    assert set(reg.leases) == {"L1"}
    lease = reg.leases["L1"]
    assert (lease.state, lease.renewed_at, lease.expires_at) == ("held", 1000.0, 1060.0)
    assert reg.by_request == {"a-L1": "L1", "a-L2": "L2", "a-L3": "L3"}
    assert reg.ended["L2"]["cause"] == "released"
    assert reg.ended["L3"]["cause"] == "node_lost"
    assert reg.ended["L3"]["error"]["error"] == "NodeLost"
    assert list(reg.ended) == ["L3", "L2"]  # the lost one was remembered first
    assert dict(reg.failures) == {}  # counted only for ends the journal holds (none here)
    node = reg.nodes["w4-x"]
    assert (node.used_cpus, node.used_mb, node.leases, node.bucket) == (2, 512, {"L1"}, 6)
    assert (node.last_seen, node.idle_since) == (5.0, 5.0)
    assert reg.free == {6: {"w4-x": node}} and reg.by_name == {"w4": "w4-x"}
    assert reg.jobs["11"] == Job("11", "w4", 4, state="running", submitted_at=61.0,
                                 registered=True)
    assert reg.next_index == 5
    snap = [e.to_dict() for e in reg.snapshot(2000.0)]
    assert [d["e"] for d in snap] == ["meta", "job", "node", "grant", "end", "end"]
    assert snap[0] == {"e": "meta", "next_index": 5, "t": 2000.0}
    assert snap[1] == {"e": "job", "job_id": "11", "name": "w4", "index": 4, "t": 61.0}
    assert snap[3] == {**grant_line("L1", "w4-x"), "t": 2000.0}
    again = Registry()  # the snapshot replays to the same state
    again.restore(replay(reg.snapshot(2000.0)), now=1000.0, mono=5.0)
    assert again.leases == reg.leases and again.ended == reg.ended
    assert again.jobs == reg.jobs and again.next_index == reg.next_index


# ---- queueing and placement


def make_node(worker: str, slots: int = 8, used: int = 0, **kw) -> Node:
    return Node(worker, worker, "127.0.0.1:1", "n1", slots, 8192, used_cpus=used, **kw)


def test_best_fit_takes_the_fullest_node_that_holds_the_lease():
    reg = Registry()
    for node in (make_node("a", used=0), make_node("b", used=4), make_node("c", used=6),
                 make_node("d", used=4)):
        reg.nodes[node.worker_id] = node
        reg.index(node)
    assert sorted(reg.free) == [2, 4, 8]

    def place(cpus: int, **kw) -> str | None:
        args = {"now": 0.0, "mono": 0.0, "drain_s": 0.0, **kw}
        node = best_fit(reg.free, cpus, 512, **args)
        return node and node.worker_id

    assert place(2) == "c"
    assert place(3) == "d"  # among equals the one filed last
    assert place(5) == "a"
    assert place(9) is None
    reg.nodes["d"].unschedulable_until = 10.0
    assert place(3, mono=5.0) == "b"
    reg.nodes["b"].ends_at = 100.0
    assert place(3, mono=5.0, now=50.0, drain_s=60.0) == "a"  # b's job ends too soon


def waiter(client: str, cpus: int = 2) -> Waiter:
    req = Acquire(id=f"{client}-{cpus}-{time.perf_counter_ns()}", image="/i.sif", cpus=cpus)
    return Waiter(req, client, asyncio.Future(loop=asyncio.new_event_loop()), 30.0)


def test_queues_serve_clients_round_robin_and_fifo_within_each():
    queues = Queues()
    a1, a2, a3, b1, c1 = (waiter("a"), waiter("a"), waiter("a"), waiter("b"),
                          waiter("c", cpus=4))
    for w in (a1, a2, a3, b1, c1):
        queues.push(w)
    assert (queues.count(), queues.cpus(), queues.by_client()) == (5, 12, {"a": 3, "b": 1,
                                                                          "c": 1})
    slots = [2, 2, 2, 2]  # four nodes of 2 CPUs: c's 4-CPU acquire never fits
    granted = []

    def place(cpus: int, memory_mb: int):
        return next((i for i, free in enumerate(slots) if free >= cpus), None)

    def grant(w: Waiter, node: int) -> None:
        slots[node] -= w.request.cpus
        granted.append(w)

    queues.schedule(place, grant)
    assert granted == [a1, b1, a2, a3]
    assert not any(w.queued for w in granted) and list(queues) == [c1]
    assert queues.withdraw(c1) and not queues and not queues.withdraw(c1)
    queues.push(a1)
    queues.push(b1)
    queues.push_front(c1)  # a failed start goes first again
    assert list(queues) == [c1, a1, b1] and c1.queued


def test_desired_nodes_is_the_ceiling_within_the_bounds():
    config = FleetConfig(cpus_per_node=4, min_nodes=1, max_nodes=3)
    assert [desired_nodes(q, h, config) for q, h in [(0, 0), (1, 0), (4, 1), (6, 2),
                                                     (40, 0)]] == [1, 1, 2, 2, 3]


# ---- the scaler through a fake view


class FakeProvider:
    name = "fake"
    poll_min_s = 0.0
    poll_max_s = 0.0

    def __init__(self, states: dict[str, str] | None = None):
        self.states = states or {}
        self.submitted: list[tuple[str, int]] = []
        self.cancelled: list[str] = []

    def submit(self, name: str, index: int) -> str:
        self.submitted.append((name, index))
        return f"job-{name}"

    def poll(self, job_ids: Sequence[str]) -> dict[str, str]:
        return {j: self.states.get(j, "running") for j in job_ids}

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)


class FakeView:
    """A ``FleetView`` over plain dicts that records every call the scaler makes."""

    def __init__(self, config: FleetConfig, *, queued_cpus: int = 0, next_index: int = 0):
        self.config = config
        self.state_dir = Path("/fleet")
        self.stopping = False
        self.nodes: dict[str, Node] = {}
        self.leases: dict[str, Lease] = {}
        self.jobs: dict[str, Job] = {}
        self._queued = queued_cpus
        self._next = next_index
        self.calls: list[tuple] = []

    def queued_cpus(self) -> int:
        return self._queued

    def take_worker_index(self) -> int:
        self._next += 1
        return self._next - 1

    async def add_job(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        self.calls.append(("add_job", job.job_id, job.name, job.index))

    async def job_ended(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        self.calls.append(("job_ended", job_id))

    def node_lost(self, node: Node, reason: str) -> None:
        node.state = "lost"
        self.calls.append(("node_lost", node.worker_id, reason))

    def drain_node(self, node: Node) -> None:
        node.state = "draining"
        self.calls.append(("drain_node", node.worker_id))

    async def release_node(self, node: Node, why: str) -> None:
        self.nodes.pop(node.worker_id, None)
        self.calls.append(("release_node", node.worker_id, why))

    def note_failure(self, cause: str, message: str, *, count: bool = True) -> None:
        self.calls.append(("note_failure", cause, count))

    # helpers for the tests
    def add_node(self, name: str, **kw) -> Node:
        node = make_node(f"{name}-id", **kw)
        node.name = name
        self.nodes[node.worker_id] = node
        return node

    def add_lease(self, lease_id: str, node: Node, cpus: int = 2) -> None:
        self.leases[lease_id] = Lease(lease_id, "r", "c", node.worker_id, node.node,
                                      node.address, SPEC, cpus, 512, 60.0, state="held")
        node.leases.add(lease_id)


def run(coro):
    return asyncio.run(coro)


async def ticks(scaler: Scaler, n: int = 1) -> None:
    for _ in range(n):
        await scaler.tick()
    await asyncio.gather(*scaler._cancels)  # the cancels it started


def test_scaler_submits_the_shortfall_a_few_per_tick_with_fresh_indices():
    config = FleetConfig(cpus_per_node=4, min_nodes=0, max_nodes=3, submit_per_tick=2)
    view = FakeView(config, queued_cpus=10, next_index=5)  # ceil(10 / 4) = 3 wanted
    provider = FakeProvider()
    scaler = Scaler(view, provider)

    async def main():
        await scaler.tick()
        assert provider.submitted == [("w5", 5), ("w6", 6)]  # two per tick
        await scaler.tick()
        assert provider.submitted == [("w5", 5), ("w6", 6), ("w7", 7)]  # max_nodes 3
        await scaler.tick()
        assert len(provider.submitted) == 3

    run(main())
    assert [c[0] for c in view.calls] == ["add_job"] * 3
    assert sorted(view.jobs) == ["job-w5", "job-w6", "job-w7"]


def test_scaler_demand_leaves_out_leases_on_draining_nodes():
    config = FleetConfig(cpus_per_node=4, min_nodes=0, max_nodes=4)
    view = FakeView(config, queued_cpus=2)
    up, draining = view.add_node("w0"), view.add_node("w1", state="draining")
    view.add_lease("L1", up)
    view.add_lease("L2", up)
    view.add_lease("L3", draining, cpus=4)
    scaler = Scaler(view, FakeProvider())
    assert scaler.desired() == 2  # ceil((2 queued + 4 held on w0) / 4); L3 drains
    view.leases.clear()
    view._queued = 0
    assert scaler.desired() == 0


def test_scaler_releases_an_idle_worker_and_cancels_its_job():
    config = FleetConfig(cpus_per_node=4, min_nodes=1, max_nodes=3, idle_s=60)
    view = FakeView(config)
    now = time.monotonic()
    busy = view.add_node("w0", idle_since=now - 1000)
    view.add_lease("L1", busy)
    idle_new = view.add_node("w1", idle_since=now - 10)
    idle_old = view.add_node("w2", idle_since=now - 1000)
    for i, name in enumerate(("w0", "w1", "w2")):
        view.jobs[f"j{i}"] = Job(f"j{i}", name, i, state="running", submitted_at=100.0 + i,
                                 registered=True)
    provider = FakeProvider()
    scaler = Scaler(view, provider)
    run(ticks(scaler))
    # want ceil(2 / 4) = 1, have 3: w2 is idle past idle_s; w1 too recently; w0 holds L1
    assert view.calls == [("release_node", idle_old.worker_id, "idle"), ("job_ended", "j2")]
    assert provider.cancelled == ["j2"] and idle_new.worker_id in view.nodes
    run(ticks(scaler))
    assert provider.cancelled == ["j2"]  # one excess left, but nobody else is idle enough


def test_scaler_handles_jobs_that_end_and_backs_off_after_a_crash():
    config = FleetConfig(cpus_per_node=4, min_nodes=2, max_nodes=2)
    view = FakeView(config, next_index=2)
    node = view.add_node("w0")
    view.jobs["j0"] = Job("j0", "w0", 0, state="running", registered=True)
    view.jobs["j1"] = Job("j1", "w1", 1, state="pending")  # never registered
    provider = FakeProvider({"j0": "ended", "j1": "ended"})
    scaler = Scaler(view, provider)
    run(ticks(scaler))
    assert view.calls == [("node_lost", node.worker_id, "its job j0 ended"),
                          ("job_ended", "j0"), ("note_failure", "worker_start", True),
                          ("job_ended", "j1")]
    assert provider.submitted == []  # the crash backs the next submission off (2 s)
    scaler._submit_after = 0.0  # the back-off is over
    run(ticks(scaler))
    assert provider.submitted == [("w2", 2), ("w3", 3)]
    scaler.worker_registered(view.add_node("w2"))
    assert view.jobs["job-w2"].state == "running" and view.jobs["job-w2"].registered


def test_scaler_cancels_the_job_of_a_lost_worker_once():
    view = FakeView(FleetConfig(min_nodes=0))
    node = view.add_node("w0")
    view.jobs["j0"] = Job("j0", "w0", 0, state="running", registered=True)
    provider = FakeProvider()
    scaler = Scaler(view, provider)

    async def main():
        scaler.worker_lost(node)
        scaler.worker_lost(node)
        await asyncio.gather(*scaler._cancels)

    run(main())
    assert provider.cancelled == ["j0"] and view.calls == [("job_ended", "j0")]


@pytest.mark.parametrize("ends_in, leases, expected", [
    (3600.0, 0, []),
    (600.0, 1, [("drain_node", "w0-id")]),
    (600.0, 0, [("drain_node", "w0-id"), ("release_node", "w0-id", "drained"),
                ("job_ended", "j0")]),
])
def test_scaler_drains_slurm_workers_near_their_time_limit(ends_in, leases, expected):
    config = FleetConfig(provider="slurm", cpus_per_node=4, min_nodes=1, max_nodes=4,
                         slurm={"drain_before_s": 900})
    view = FakeView(config)
    node = view.add_node("w0", ends_at=time.time() + ends_in)
    for i in range(leases):
        view.add_lease(f"L{i}", node)
    view.jobs["j0"] = Job("j0", "w0", 0, state="running", registered=True)
    provider = FakeProvider()
    scaler = Scaler(view, provider)

    async def main():
        await scaler._drain()
        await asyncio.gather(*scaler._cancels)

    run(main())
    assert view.calls == expected
    assert provider.cancelled == (["j0"] if expected[-1:] == [("job_ended", "j0")] else [])


def test_scaler_does_nothing_while_the_controller_stops():
    view = FakeView(FleetConfig(min_nodes=2), queued_cpus=100)
    view.stopping = True
    provider = FakeProvider()
    run(ticks(Scaler(view, provider)))
    assert provider.submitted == [] and view.calls == []


def test_the_controller_offers_every_member_of_the_fleet_view(tmp_path):
    from sandfleet.controller import Controller, FleetView

    members = {n for n in vars(FleetView) if not n.startswith("_")}
    assert {"nodes", "leases", "jobs", "node_lost", "add_job", "release_node"} <= members
    controller = Controller(tmp_path, FleetConfig())
    assert [m for m in sorted(members) if not hasattr(controller, m)] == []
