"""Sandfleet under faults, with real processes: kill -9 of a worker and of the
controller, a controller gone past the workers' grace, Slurm nodes scaled and drained on the
local cluster, and a private fleet whose owner is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from sandfleet.client import FleetClient
from sandfleet.errors import (
    ControllerUnreachable,
    NodeLost,
    SandboxLost,
)
from sandfleet.runtime.base import proc_start_time
from tests.fleet_harness import FAST


@pytest.mark.slow
@pytest.mark.sandbox
def test_killed_worker_raises_node_lost_promptly_and_is_replaced(make_fleet, base_sif):
    fleet = make_fleet(max_nodes=2, cpus_per_node=2)
    with FleetClient(fleet.state) as client:
        idle = client.acquire(base_sif)
        busy = client.acquire(base_sif)
        assert idle.node and idle.worker_address != busy.worker_address  # one per node
        status = fleet.status()
        victim_name = next(n["name"] for n in status["nodes"]
                           if n["address"] == busy.worker_address)
        victim = next(j for j in status["jobs"] if j["name"] == victim_name)
        pid = int(victim["job_id"].split(".")[0])
        running = {}

        def long_command() -> None:
            try:
                running["result"] = busy.run("sleep 60", timeout=90)
            except Exception as e:  # noqa: BLE001 - the test inspects it
                running["error"] = e

        thread = threading.Thread(target=long_command)
        thread.start()
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        thread.join(20)
        detected = time.monotonic() - killed
        assert isinstance(running.get("error"), NodeLost), running
        assert detected < 4 * FAST["lost_after_s"] + 2, detected
        print(f"kill -9 of a worker: NodeLost after {detected:.2f}s "
              f"(heartbeat {FAST['heartbeat_s']}s, lost after {FAST['lost_after_s']}s)")
        with pytest.raises(NodeLost):
            busy.run("true")
        assert idle.run("echo unaffected").output == "unaffected\n"
        assert fleet.status()["failures"].get("node_lost") == 1
        # the scaler replaces the lost worker; the replacement reaps its orphans
        fresh = client.acquire(base_sif, wait_s=30)
        assert fresh.run("echo replaced").output == "replaced\n"
        fleet.wait_for(lambda: not [p for p in fleet.sandboxes() if busy.lease_id in p.name],
                       20, "the dead worker's sandbox to be reaped")
        fresh.release()
        idle.release()


@pytest.mark.slow
@pytest.mark.sandbox
def test_controller_kill9_and_restart_keeps_held_leases(make_fleet, base_sif):
    fleet = make_fleet(min_nodes=1)
    with FleetClient(fleet.state) as client:
        lease = client.acquire(base_sif, ttl_s=3)
        lease.run("cd /tmp && echo before > note")
        old = fleet.info()
        os.kill(old.pid, signal.SIGKILL)
        fleet.wait_for(lambda: proc_start_time(old.pid) != old.pid_start, 10, "the kill")
        assert lease.run("cat note").output == "before\n"  # workers serve on their own
        time.sleep(1)
        fleet.restart()
        new = fleet.info()
        assert new.pid != old.pid and new.token == old.token
        time.sleep(2 * FAST["lost_after_s"])
        assert lease.run("pwd; cat note").output == "/tmp\nbefore\n"
        lease.renew()
        status = fleet.status()
        assert status["leases"]["held"] == 1 and len(status["nodes"]) == 1
        assert status["nodes"][0]["state"] == "up" and status["failures"] == {}
        time.sleep(4)  # past the ttl: the background renewal found the new controller
        assert lease.run("echo renewed").output == "renewed\n"
        other = client.acquire(base_sif)
        assert other.run("echo new").output == "new\n"
        other.release()
        lease.release()
    assert len(fleet.worker_pids()) == 1  # the same worker, not orphaned or doubled


@pytest.mark.slow
@pytest.mark.sandbox
def test_workers_outlive_a_dead_controller_only_for_the_grace_and_gc_cleans_up(
        make_fleet, base_sif):
    fleet = make_fleet(min_nodes=1, worker_grace_s=2)
    with FleetClient(fleet.state) as client:
        lease = client.acquire(base_sif)
        assert fleet.sandboxes()
        info = fleet.info()
        os.kill(info.pid, signal.SIGKILL)
        fleet.wait_for(lambda: [p for p in fleet.processes() if " worker " in p] == [], 15,
                       "the orphaned worker to stop by itself")
        assert fleet.sandboxes() == []  # it stopped its sandboxes on the way out
        with pytest.raises((NodeLost, SandboxLost, ControllerUnreachable)):
            lease.run("true")
    partial = fleet.cache / "rootfs" / ".6d524ae9a92cb66bde4c899a.3n_2w_mq"  # older versions
    (partial / "usr").mkdir(parents=True)  # unpacked images; a worker killed mid-unpack
    out = fleet.cli("gc").stdout
    assert "removed controller.json" in out
    assert f"removed unpacked image cache {fleet.cache / 'rootfs'}" in out
    assert not (fleet.cache / "rootfs").exists()
    assert fleet.info() is None


# ---- Slurm


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.slurm
def test_slurm_scales_from_zero_to_one_node_and_back(local_slurm, make_fleet, base_sif):
    fleet = make_fleet(provider="slurm", cpus_per_node=2, memory_mb_per_node=1024,
                       max_nodes=2, idle_s=3,
                       slurm={"time_min": 10, "poll_min_s": 0.5, "poll_max_s": 2.0,
                              "drain_before_s": 0})
    assert fleet.status()["nodes"] == [] and fleet.status()["jobs"] == []
    with FleetClient(fleet.state) as client:
        started = time.monotonic()
        with client.lease(base_sif, memory_mb=512, wait_s=90) as lease:
            took = time.monotonic() - started
            assert lease.run("echo from slurm").output == "from slurm\n"
            status = fleet.status()
            assert len(status["jobs"]) == 1 and status["nodes"][0]["job_id"] == \
                status["jobs"][0]["job_id"]
            first_job = status["jobs"][0]["job_id"]
        print(f"scale from zero: lease granted after {took:.1f}s")
        # preemption: the node's job is cancelled under a held lease
        lease = client.acquire(base_sif, memory_mb=512, wait_s=90)
        subprocess.run(["scancel", first_job], env=local_slurm.env, check=True, timeout=30)
        cancelled = time.monotonic()
        with pytest.raises(NodeLost):
            while time.monotonic() - cancelled < 30:
                lease.run("true")
                time.sleep(0.1)
        assert time.monotonic() - cancelled < 10
        with client.lease(base_sif, memory_mb=512, wait_s=90) as replacement:
            assert replacement.run("echo replaced").output == "replaced\n"
            status = fleet.status()
            job_id = next(n["job_id"] for n in status["nodes"]
                          if n["address"] == replacement.worker_address)
            assert job_id != first_job
            assert [n["state"] for n in status["nodes"] if n["job_id"] == first_job] == \
                ["lost"]

    def released() -> bool:
        s = fleet.status()
        return not s["jobs"] and not [n for n in s["nodes"] if n["state"] != "lost"]

    fleet.wait_for(released, 40, "the idle node to be released")
    squeue = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                            text=True, env=local_slurm.env, timeout=30, check=False)
    assert squeue.stdout.strip() in ("", "COMPLETING"), squeue.stdout


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.slurm
def test_slurm_drains_a_node_before_its_time_limit_and_replaces_it(local_slurm, make_fleet,
                                                                    base_sif):
    # 5-minute jobs that drain 280 s before their end: about 20 s after they start
    fleet = make_fleet(provider="slurm", cpus_per_node=2, memory_mb_per_node=1024,
                       max_nodes=2, idle_s=60,
                       slurm={"time_min": 5, "stagger_min": 0, "drain_before_s": 280,
                              "poll_min_s": 0.5, "poll_max_s": 2.0})

    def node_of(job_id: str) -> dict | None:
        return next((n for n in fleet.status()["nodes"] if n["job_id"] == job_id), None)

    with FleetClient(fleet.state) as client:
        first = client.acquire(base_sif, memory_mb=512, wait_s=90)
        node = next(n for n in fleet.status()["nodes"] if n["address"] == first.worker_address)
        first_job = node["job_id"]
        assert 200 < node["ends_in_s"] < 300  # the worker read its job's end time
        ends_at = time.time() + node["ends_in_s"]
        print(f"first lease granted {ends_at - time.time():.0f}s before the job's end")
        fleet.wait_for(lambda: (node_of(first_job) or {}).get("state") == "draining", 60,
                       "the node to drain")
        drained = time.time()
        print(f"drained {ends_at - drained:.0f}s before the job's end")
        assert ends_at - drained < 280 + 5
        second = client.acquire(base_sif, memory_mb=512, wait_s=90)  # a new node, not it
        assert second.worker_address != first.worker_address
        status = fleet.status()
        second_job = next(n["job_id"] for n in status["nodes"]
                          if n["address"] == second.worker_address)
        assert second_job != first_job and len(status["jobs"]) == 2
        assert first.run("echo still here").output == "still here\n"  # draining, not gone
        first.release()
        fleet.wait_for(lambda: node_of(first_job) is None, 20, "the drained node's release")

        def left_squeue() -> bool:
            out = subprocess.run(["squeue", "-h", "-j", first_job, "-o", "%T"],
                                 capture_output=True, text=True, env=local_slurm.env,
                                 timeout=30, check=False)
            return out.stdout.strip() in ("", "COMPLETING")

        fleet.wait_for(left_squeue, 20, "the drained node's job to be cancelled")
        fleet.wait_for(lambda: [j["job_id"] for j in fleet.status()["jobs"]] == [second_job],
                       10, "the cancelled job to be forgotten")
        assert fleet.status()["failures"] == {}  # released, not lost
        assert second.run("echo unaffected").output == "unaffected\n"
        second.release()


@pytest.mark.sandbox
def test_a_private_fleet_goes_down_when_its_owner_is_killed(make_fleet, base_sif):
    owner = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        fleet = make_fleet(owner_pid=owner.pid, owner_start=proc_start_time(owner.pid),
                           min_nodes=1)
        fleet.wait_for(lambda: fleet.status()["nodes"], 30, "the worker to register")
        with FleetClient(fleet.state) as client:
            lease = client.acquire(base_sif, ttl_s=60)
            assert lease.run("echo up", timeout=10).output == "up\n"
        owner.kill()                      # SIGKILL: the owner's cleanup never runs
        owner.wait()
        fleet.wait_for(lambda: not fleet.processes(), 30,
                       "the controller and its worker to exit")
        assert fleet.sandboxes() == [] or all(
            not (p / "sandbox.json").exists() for p in fleet.sandboxes())
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
