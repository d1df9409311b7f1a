"""Sandfleet end to end: a real controller and worker (``sandfleet up``, local provider),
real bubblewrap sandboxes from the base SIF, clients over TCP: leases, queueing, expiry,
results and refusals. Faults (kill -9, Slurm nodes) are in test_fleet_faults.py, the pure
parts in test_fleet_parts.py."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time

import pytest

from sandfleet.client import AsyncFleetClient, FleetClient
from sandfleet.errors import (
    BadRequest,
    CapacityTimeout,
    ImageMissing,
    LeaseClosed,
    LeaseExpired,
    SandboxLost,
    Unauthorized,
)
from sandfleet.runtime.base import proc_start_time
from sandfleet.wire.frames import PREFIX
from sandfleet.wire.messages import Exec, Ping, Put, Status, new_id
from sandfleet.wire.transport import Connection
from tests.fleet_harness import Fleet


@pytest.fixture(scope="module")
def shared(tmp_path_factory, fleet_cache):
    """One fleet for the tests that leave it as they found it: one worker, 4 slots."""
    with Fleet(tmp_path_factory.mktemp("shared"), fleet_cache, min_nodes=1).running() as fleet:
        yield fleet


@pytest.fixture
def client(shared):
    with FleetClient(shared.state) as fleet:
        yield fleet


@pytest.mark.sandbox
def test_lease_runs_a_persistent_shell_and_releases(shared, client, base_sif, tmp_path):
    with client.lease(base_sif, ttl_s=30) as lease:
        assert lease.queued_s >= 0 and lease.granted_at <= time.time()
        assert lease.run("echo hi").output == "hi\n"
        lease.run("mkdir -p /srv/app && cd /srv/app && export GREETING=hello")
        result = lease.run("pwd; echo $GREETING; (exit 3)")
        assert (result.output, result.exit_code) == ("/srv/app\nhello\n", 3)
        slow = lease.run("sleep 30; echo never", timeout=1)  # a policy outcome: a result
        assert slow.timed_out and slow.exit_code == 124 and "never" not in slow.output
        assert lease.run("echo still here").output == "still here\n"
        big = lease.run("seq 1 300000").output  # ~2 MB: capped, head and tail kept
        assert big.startswith("1\n2\n") and big.endswith("\n300000\n")
        assert "bytes cut" in big and len(big) < 1_100_000
        # files in and out, directories as tar streams
        src = tmp_path / "tests"
        (src / "sub").mkdir(parents=True)
        (src / "test.sh").write_text("echo ok\n")
        (src / "sub" / "data.txt").write_text("x" * 100_000)
        lease.put_file(src, "/tests")
        assert lease.run("cat /tests/test.sh; wc -c < /tests/sub/data.txt").output == \
            "echo ok\n100000\n"
        lease.run("mkdir -p /logs/verifier && echo 0.75 > /logs/verifier/reward.txt")
        got = lease.get_file("/logs/verifier", tmp_path / "verifier")
        assert (got / "reward.txt").read_text() == "0.75\n"
        with pytest.raises(FileNotFoundError):
            lease.get_file("/no/such/file", tmp_path / "nothing")
        status = shared.status()
        assert status["leases"]["held"] == 1
        lease_id = lease.lease_id
    lease.release()  # idempotent
    with pytest.raises(LeaseClosed):
        lease.run("true")
    status = shared.status()
    assert status["leases"]["held"] == 0
    shared.wait_for(lambda: not [p for p in shared.sandboxes() if lease_id in p.name], 10,
                    "the released sandbox to be destroyed")


@pytest.mark.sandbox
def test_a_lease_of_a_layered_image_runs_and_is_graded_over_its_layers(client, layered_base,
                                                                      tmp_path):
    """A task image as builds store it (a layers file: a task layer over the base SIF),
    through the controller and a worker: the agent sees the layer, not what it removes;
    the verifier grades the agent's files over the image."""
    from tests.conftest import LAYER_MARK

    with client.lease(layered_base, ttl_s=60) as lease:
        assert lease.run(f"cat {LAYER_MARK}; ls /etc/motd").output.startswith("layered\n")
        lease.run("echo done > /root/answer")
        tests = tmp_path / "tests"
        tests.mkdir()
        (tests / "test.sh").write_text(
            f'[ "$(cat /root/answer)" = done ] && grep -q layered {LAYER_MARK} && '
            "! [ -e /etc/motd ] && echo 1 > /logs/verifier/reward.txt\n")
        result, logs = lease.verify(tests, ["sh", "/tests/test.sh"], timeout=60,
                                    dest=tmp_path / "logs")
        assert result.exit_code == 0, result.output
        assert (logs / "reward.txt").read_text() == "1\n"


@pytest.mark.sandbox
def test_missing_image_is_an_infra_error(client, tmp_path):
    with pytest.raises(ImageMissing):
        client.acquire(tmp_path / "nope.sif", wait_s=10)


@pytest.mark.sandbox
def test_full_fleet_queues_then_grants_on_release_and_times_out(shared, base_sif):
    with FleetClient(shared.state) as a, FleetClient(shared.state) as b:
        first = a.acquire(base_sif, cpus=4)  # the whole node
        got = {}

        def wait() -> None:
            got["lease"] = b.acquire(base_sif, cpus=2, wait_s=30)

        waiter = threading.Thread(target=wait)
        waiter.start()
        shared.wait_for(lambda: shared.status()["leases"]["queued"] == 1, 10, "a queued lease")
        with pytest.raises(CapacityTimeout):
            b.acquire(base_sif, cpus=2, wait_s=0.5)
        time.sleep(0.5)
        first.release()
        waiter.join(20)
        lease = got["lease"]
        assert lease.queued_s >= 1.0
        assert lease.run("echo granted").output == "granted\n"
        lease.release()
        failures = shared.status()["failures"]
        assert failures.get("capacity", 0) >= 1


@pytest.mark.slow
@pytest.mark.sandbox
def test_renewal_keeps_a_lease_and_expiry_reaps_it(shared, client, base_sif):
    kept = client.acquire(base_sif, ttl_s=1.5)  # background renewal every 0.5 s
    left = client.acquire(base_sif, ttl_s=1.5)
    left.aio._renewer.cancel()  # a client that stopped renewing (hung, or gone)
    for _ in range(3):  # each exec renews too
        assert left.run("true").exit_code == 0
        time.sleep(0.7)
    assert left.run("sleep 2.5; echo pinned").output == "pinned\n"  # running: pinned
    time.sleep(3)
    assert kept.run("echo alive").output == "alive\n"
    with pytest.raises(LeaseExpired, match="expired") as expired:
        left.run("true")
    assert isinstance(expired.value, SandboxLost) and expired.value.cause == "lease_expired"
    shared.wait_for(lambda: not [p for p in shared.sandboxes() if left.lease_id in p.name],
                    10, "the expired sandbox to be reaped")
    kept.release()


@pytest.mark.sandbox
def test_oom_is_a_result_and_a_killed_sandbox_is_sandbox_lost(shared, client, base_sif):
    with client.lease(base_sif, memory_mb=200) as lease:
        result = lease.run("python3 -c 'b = bytearray(400 << 20); print(\"survived\")'")
        survived = "survived" in result.output.splitlines()
        if result.oom:  # only where the memory cgroup is writable
            assert result.exit_code == 137 and not survived
        else:
            assert survived
        assert lease.run("echo after").output == "after\n"
        record = next(shared.work.glob(f"*/*/runtime/sandboxes/*-{lease.lease_id}"))
        init_pid = json.loads((record / "sandbox.json").read_text())["init"][0]
        os.kill(init_pid, signal.SIGKILL)  # the sandbox dies under its lease
        deadline = time.monotonic() + 10  # its pid namespace is torn down asynchronously
        while proc_start_time(init_pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(SandboxLost):
            lease.run("true")
        with pytest.raises(SandboxLost):
            lease.run("true")
    assert shared.status()["failures"].get("sandbox_lost", 0) >= 1


@pytest.mark.slow
@pytest.mark.sandbox
def test_queued_acquires_are_served_round_robin_across_clients(make_fleet, base_sif):
    """One slot; A queues three acquires (and one that times out), then B one: the grants
    interleave (A1, B1, A2, A3), they are not FIFO across clients."""
    fleet = make_fleet(min_nodes=1, cpus_per_node=2)
    fleet.wait_for(lambda: fleet.status()["nodes"], 30, "the worker to register")

    async def go() -> list[str]:
        async with AsyncFleetClient(fleet.state, client_id="holder") as holder, \
                AsyncFleetClient(fleet.state, client_id="A") as a, \
                AsyncFleetClient(fleet.state, client_id="B") as b:
            held = await holder.acquire(base_sif, cpus=2, memory_mb=512)
            tasks: dict[str, asyncio.Task] = {}

            async def queued() -> dict[str, int]:
                return (await holder.status())["leases"]["queued_by_client"]

            async def enqueue(label: str, client: AsyncFleetClient, **kwargs) -> None:
                before = (await queued()).get(client.client_id, 0)
                tasks[label] = asyncio.create_task(
                    client.acquire(base_sif, cpus=2, memory_mb=512, **kwargs))
                deadline = time.monotonic() + 10
                while (await queued()).get(client.client_id, 0) != before + 1:
                    assert time.monotonic() < deadline, f"{label} never queued"
                    await asyncio.sleep(0.05)

            for label, client, kwargs in [("A1", a, {}), ("Ax", a, {"wait_s": 2}),
                                          ("A2", a, {}), ("A3", a, {}), ("B1", b, {})]:
                await enqueue(label, client, **kwargs)
            assert await queued() == {"A": 4, "B": 1}
            with pytest.raises(CapacityTimeout):  # its wait ends; the others keep their place
                await tasks.pop("Ax")
            assert await queued() == {"A": 3, "B": 1}
            await held.release()
            order = []
            pending = set(tasks.values())
            while pending:
                done, pending = await asyncio.wait(pending, timeout=60,
                                                   return_when=asyncio.FIRST_COMPLETED)
                assert len(done) == 1, f"{len(done)} grants at once on one slot ({order})"
                task = done.pop()
                label = next(k for k, v in tasks.items() if v is task)
                lease = task.result()
                assert (await lease.run(f"echo {label}")).output == f"{label}\n"
                order.append(label)
                await lease.release()
            return order

    assert asyncio.run(go()) == ["A1", "B1", "A2", "A3"]


CLIENT_THAT_DIES = """
import sys, time
from sandfleet.client import FleetClient
fleet = FleetClient(sys.argv[1])
lease = fleet.acquire(sys.argv[2], ttl_s=1.5)
print(lease.lease_id, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_client_that_dies_without_release_loses_its_lease_to_expiry(shared, base_sif):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_THAT_DIES, str(shared.state),
                             str(base_sif)], stdout=subprocess.PIPE, text=True)
    try:
        lease_id = proc.stdout.readline().strip()
        assert lease_id.startswith("L"), lease_id
        assert shared.status()["leases"]["held"] == 1
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    shared.wait_for(lambda: shared.status()["leases"]["held"] == 0, 10, "the lease to expire")
    recent = shared.status()["recent_failures"]
    assert any(f["lease_id"] == lease_id and f["cause"] == "expired" for f in recent)
    shared.wait_for(lambda: not [p for p in shared.sandboxes() if lease_id in p.name], 10,
                    "the sandbox to be reaped")


@pytest.mark.sandbox
def test_wrong_token_and_malformed_frames_leave_other_clients_alone(shared, client,
                                                                    base_sif):
    info = shared.info()
    host, port = info.address.rsplit(":", 1)
    with client.lease(base_sif) as lease:

        async def attacks():
            bad = await Connection.open(info.address, "another-fleets-token")
            with pytest.raises(Unauthorized):
                await bad.request(Status(id=new_id()))
            worker = await Connection.open(lease.worker_address, "another-fleets-token")
            with pytest.raises(Unauthorized):
                await worker.request(Exec(id=new_id(), lease_id=lease.lease_id,
                                          command="echo pwned > /tmp/pwned", timeout=5))
            good = await Connection.open(info.address, info.token)
            with pytest.raises(BadRequest, match="lease_id"):  # no such field on ping
                await good.request(Ping(id=new_id()).model_copy(update={"type": "renew"}))
            assert (await good.request(Ping(id=new_id())))[0]["role"] == "controller"
            for conn in (bad, worker, good):
                await conn.close()

        asyncio.run(attacks())
        garbage = [PREFIX.pack(0xFFFFFFF0, 0), b"\x00" * 7, PREFIX.pack(5, 0) + b"nope!",
                   PREFIX.pack(20, 0) + b'{"v": 1, "id": 3}' + b" " * 3]
        for data in garbage:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(5)
                reply = sock.recv(65536)
                if reply:  # an error reply (bad token), never a crash
                    assert b"Unauthorized" in reply or b"BadRequest" in reply
            assert lease.run("echo fine").output == "fine\n"
        assert lease.run("test -e /tmp/pwned && echo yes || echo no").output == "no\n"
        assert shared.status()["leases"]["held"] == 1


@pytest.mark.sandbox
def test_put_rejects_path_traversal(shared, client, base_sif, tmp_path):
    def tar_of(*members: tarfile.TarInfo) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for member in members:
                data = b"evil\n" if member.isfile() else None
                if data:
                    member.size = len(data)
                tar.addfile(member, io.BytesIO(data) if data else None)
        return buf.getvalue()

    escape = tmp_path / "escaped"
    dotdot = tarfile.TarInfo(f"x/../../../../../../../..{escape}")
    absolute = tarfile.TarInfo(str(escape))
    link = tarfile.TarInfo("x/link")
    link.type, link.linkname = tarfile.SYMTYPE, str(escape)
    inside = tarfile.TarInfo("x")
    inside.type = tarfile.DIRTYPE
    through = tarfile.TarInfo("x/link/file")
    info = shared.info()
    with client.lease(base_sif) as lease:

        async def attempts():
            conn = await Connection.open(lease.worker_address, info.token)
            for members in ([dotdot], [absolute], [inside, link], [inside, link, through]):
                put = Put(id=new_id(), lease_id=lease.lease_id, path="/dest", name="x")
                with pytest.raises(BadRequest):
                    await conn.request(put, tar_of(*members))
            with pytest.raises(BadRequest, match="absolute"):
                await conn.request(Put(id=new_id(), lease_id=lease.lease_id, path="rel",
                                       name="x"), tar_of(tarfile.TarInfo("x")))
            await conn.close()

        asyncio.run(attempts())
        assert not escape.exists()
        assert "No such file" in lease.run("ls /dest").output

