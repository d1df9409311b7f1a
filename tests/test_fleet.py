"""Sandfleet end to end: a real controller and real workers (``sandfleet up``, local
provider, and Slurm on the local cluster), real bubblewrap sandboxes from the base SIF,
clients over TCP. Faults are real too: kill -9 of a worker and of the controller."""

from __future__ import annotations

import asyncio
import contextlib
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
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sandfleet.client import AsyncFleetClient, FleetClient
from sandfleet.config import FleetConfig, load_config
from sandfleet.discovery import read_controller_info
from sandfleet.errors import (
    BadRequest,
    CapacityTimeout,
    ControllerUnreachable,
    ImageMissing,
    LeaseClosed,
    LeaseExpired,
    NodeLost,
    ProtocolError,
    SandboxLost,
    Unauthorized,
    error_from_dict,
)
from sandfleet.runtime.base import proc_start_time
from sandfleet.wire.frames import PREFIX, encode_frame, read_frame
from sandfleet.wire.messages import Acquire, Exec, Ping, Put, Status, new_id
from sandfleet.wire.transport import Connection

REPO = Path(__file__).resolve().parents[1]
SANDFLEET = [sys.executable, "-m", "sandfleet.cli"]

FAST = {"heartbeat_s": 0.3, "lost_after_s": 1.2, "scale_interval_s": 0.3, "idle_s": 60,
        "worker_grace_s": 20, "lease_ttl_s": 30, "acquire_wait_s": 30}


# ---- pure parts: frames, messages, config


def _frames(*chunks: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    return reader


def test_frames_roundtrip_and_limits_are_checked_before_reading():
    async def go():
        frame = encode_frame({"a": 1}, b"\x00payload")
        assert await read_frame(_frames(frame)) == ({"a": 1}, b"\x00payload")
        assert await read_frame(_frames(b"")) is None
        with pytest.raises(ProtocolError, match="header length"):  # 4 GiB claimed: no read
            await read_frame(_frames(PREFIX.pack(0xFFFFFFFF, 0)))
        with pytest.raises(ProtocolError, match="payload length"):
            await read_frame(_frames(PREFIX.pack(10, 0xFFFFFFFF)), max_payload=1 << 20)
        with pytest.raises(ProtocolError, match="not JSON"):
            await read_frame(_frames(PREFIX.pack(3, 0) + b"{{{"))
        with pytest.raises(ProtocolError, match="object"):
            await read_frame(_frames(PREFIX.pack(2, 0) + b"[]"))
        with pytest.raises(ProtocolError, match="truncated"):
            await read_frame(_frames(PREFIX.pack(50, 0) + b"{}"))

    asyncio.run(go())


def test_messages_are_strict_and_errors_survive_the_wire():
    with pytest.raises(ValueError, match="colour"):
        Acquire(id="x", image="/i.sif", colour="red")
    with pytest.raises(ValueError):
        Acquire(id="", image="/i.sif")
    err = error_from_dict(NodeLost("n1", "gone").to_dict())
    assert isinstance(err, NodeLost) and err.node == "n1" and err.cause == "node_lost"
    assert isinstance(error_from_dict({"error": "BadRequest", "message": "m"}), BadRequest)
    assert isinstance(error_from_dict({"error": "FileNotFoundError", "message": "m"}),
                      FileNotFoundError)
    odd = error_from_dict({"error": "SystemExit", "message": "m"})  # not on any allow-list
    assert type(odd).__name__ == "RemoteError" and "SystemExit" in str(odd)


def test_every_fleet_config_parses_and_unknown_keys_fail(tmp_path):
    config = load_config(REPO / "configs" / "fleet.yaml")
    assert config.provider == "local" and config.max_nodes >= 1
    cluster = load_config(REPO / "configs" / "fleet-slurm.yaml")  # the cluster example
    assert (cluster.provider, cluster.runtime, cluster.host) == ("slurm", "apptainer", "0.0.0.0")
    assert cluster.slurm.partition and cluster.slurm.setup
    for name, field in FleetConfig.model_fields.items():
        assert field.description, f"field {name} has no docstring"
    bad = tmp_path / "bad.yaml"
    bad.write_text("provider: local\nmax_nodez: 3\n")
    with pytest.raises(ValueError, match="max_nodez"):
        load_config(bad)


def test_scaling_arithmetic_and_sbatch_options_are_strict():
    from sandfleet.controller import desired_nodes
    from sandfleet.providers import sbatch_lines, staggered_minutes

    config = FleetConfig(cpus_per_node=8, min_nodes=1, max_nodes=4)
    assert [desired_nodes(q, h, config) for q, h in [(0, 0), (2, 0), (8, 2), (30, 40)]] == \
        [1, 1, 2, 4]
    minutes = [staggered_minutes(config, k) for k in range(5)]
    assert minutes == [240, 235, 230, 225, 240]
    assert sbatch_lines(["--constraint=cpu"], time=10, partition=None) == \
        ["#SBATCH --time=10", "#SBATCH --constraint=cpu"]
    with pytest.raises(ValueError, match="valid: job_name"):
        sbatch_lines(walltime=10)
    with pytest.raises(ValueError):
        sbatch_lines(["--x=1\n#SBATCH --uid=0"])


def test_journal_recovery_skips_a_torn_line_and_compacts(tmp_path):
    from sandfleet.controller import JOURNAL, Controller

    state = tmp_path / "state"
    state.mkdir()
    spec = {"image": "/i.sif", "cpus": 2, "memory_mb": 512, "network": False,
            "max_lifetime_s": 3600.0, "env": {}, "workdir": "/", "hostname": "sandbox"}

    def grant(lease_id: str, worker: str) -> dict:
        return {"e": "grant", "lease_id": lease_id, "request_id": f"a-{lease_id}",
                "client": "c", "worker_id": worker, "node": "n1", "address": "127.0.0.1:1",
                "spec": spec, "cpus": 2, "memory_mb": 512, "ttl_s": 60.0,
                "granted_at": time.time(), "queued_s": 0.1}

    events = [{"e": "job", "job_id": "11", "name": "w4", "index": 4},
              {"e": "node", "worker_id": "w4-x", "name": "w4", "address": "127.0.0.1:1",
               "node": "n1", "slots": 8, "memory_mb": 4096, "job_id": "11", "ends_at": None,
               "registered_at": time.time()},
              grant("L1", "w4-x"), grant("L2", "w4-x"), grant("L3", "gone-worker"),
              {"e": "end", "lease_id": "L2", "cause": "released", "request_id": "a-L2",
               "error": {"error": "LeaseClosed", "message": "lease released"}}]
    text = "".join(json.dumps(e) + "\n" for e in events) + '{"e": "gra'  # torn by a crash
    (state / JOURNAL).write_text(text)
    for _ in range(2):  # recover, then recover again from the compacted journal
        controller = Controller(state, FleetConfig())
        controller.recover()
        reg = controller.reg
        assert set(reg.leases) == {"L1"}
        assert reg.leases["L1"].state == "held"
        assert reg.by_request["a-L1"] == "L1"
        assert reg.ended["L2"]["cause"] == "released"
        assert reg.ended["L3"]["cause"] == "node_lost"  # its worker is unknown
        node = reg.nodes["w4-x"]
        assert (node.used_cpus, node.leases, node.bucket) == (2, {"L1"}, 6)
        assert list(reg.jobs) == ["11"] and reg.next_index == 5
        lines = (state / JOURNAL).read_text().splitlines()
        assert all(json.loads(line) for line in lines)  # the torn line is gone


def test_slurm_dry_run_prints_the_exact_script(tmp_path):
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump({"provider": "slurm", "cpus_per_node": 4,
                                   "slurm": {"partition": "cpu", "account": "proj",
                                             "setup": ["module load apptainer"]}}))
    out = subprocess.run([*SANDFLEET, "up", "--config", str(cfg), "--state-dir",
                          str(tmp_path / "s"), "--dry-run"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    script = out.split("# worker job script (worker w0)\n", 1)[1]
    assert script.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --partition=cpu", "#SBATCH --account=proj",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --time=240", "set -euo pipefail",
                 "module load apptainer", "-m sandfleet.cli -v worker --state-dir"):
        assert line in script, line
    assert not (tmp_path / "s" / "controller.json").exists()  # nothing started


# ---- fleets of real processes


class Fleet:
    """A fleet started with the CLI in a tmp state dir; ``down`` checks nothing is left."""

    def __init__(self, root: Path, cache: Path, **overrides):
        self.root, self.cache = root, cache
        root.mkdir(parents=True, exist_ok=True)
        self.state = root / "state"
        self.work = root / "work"
        data = {"provider": "local", "max_nodes": 1, "cpus_per_node": 4,
                "memory_mb_per_node": 8192, "cache_dir": str(cache), "work_dir": str(self.work),
                **FAST, **overrides}
        self.config_path = root / "fleet.yaml"
        self.config_path.write_text(yaml.safe_dump(data))
        self.env = dict(os.environ)

    def cli(self, *args: str, check: bool = True, timeout: float = 120):
        out = subprocess.run([*SANDFLEET, *args, "--state-dir", str(self.state)],
                             capture_output=True, text=True, timeout=timeout, env=self.env,
                             stdin=subprocess.DEVNULL, check=False)
        if check and out.returncode != 0:
            raise AssertionError(f"sandfleet {' '.join(args)} failed:\n{out.stdout}\n"
                                 f"{out.stderr}\n{self.logs()}")
        return out

    def up(self) -> Fleet:
        self.cli("up", "--config", str(self.config_path))
        return self

    @contextlib.contextmanager
    def running(self) -> Iterator[Fleet]:
        """Up, with its first worker registered; down (and checked clean) at the end."""
        try:
            self.up()
            self.wait_for(lambda: self.status()["nodes"], 30, "the worker to register")
            yield self
        finally:
            self.down()

    def restart(self) -> None:
        self.cli("up")  # no --config: the state dir's saved config

    def info(self):
        return read_controller_info(self.state)

    def status(self) -> dict:
        return json.loads(self.cli("status", "-o", "json").stdout)

    def worker_pids(self) -> list[int]:
        return [int(j["job_id"].split(".")[0]) for j in self.status()["jobs"]]

    def logs(self) -> str:
        text = []
        for path in sorted((self.state / "logs").glob("*.log")):
            text.append(f"== {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(text)

    def wait_for(self, predicate, timeout: float = 20, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def processes(self) -> list[str]:
        """Command lines of the live processes that name this fleet's state dir."""
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                try:
                    cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if str(self.state) in cmdline and "sandfleet" in cmdline:
                    found.append(f"{proc.name}: {cmdline}")
        return found

    def sandboxes(self) -> list[Path]:
        return sorted(self.work.glob("*/*/runtime/sandboxes/*"))

    def down(self) -> None:
        self.cli("down")
        assert self.info() is None
        self.wait_for(lambda: not self.processes(), 20, "every fleet process to exit")
        self.cli("gc")
        assert self.sandboxes() == [], f"sandboxes left: {self.sandboxes()}"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fleet-cache")


@pytest.fixture
def make_fleet(tmp_path, cache):
    fleets = []

    def make(**overrides) -> Fleet:
        fleet = Fleet(tmp_path / f"f{len(fleets)}", cache, **overrides)
        fleets.append(fleet)
        return fleet.up()

    yield make
    errors = []
    for fleet in fleets:
        try:
            fleet.down()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="module")
def shared(tmp_path_factory, cache):
    """One fleet for the tests that leave it as they found it: one worker, 4 slots."""
    with Fleet(tmp_path_factory.mktemp("shared"), cache, min_nodes=1).running() as fleet:
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
