"""The wire format, pinned: every request and reply against frames written out by hand.

A rolling restart mixes versions (old clients on a new controller), so the bytes must not
change by accident: each request is encoded with the code and compared with its frame
below, each reply comes from a real ``Server`` (the controller's own handler where it can
answer in-process) and is compared byte for byte, and each result parses into its
request's ``Result`` model with nothing left over. A change of the format fails here; make
it on purpose, with a protocol version or a field every older peer ignores.

Then the other direction: a reply that carries fields this code does not know (a newer
controller's) still parses on the client, sync and async, and the fields are kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from pathlib import Path

import pytest

from sandfleet.client import AsyncFleetClient, FleetClient
from sandfleet.config import FleetConfig
from sandfleet.controller.core import Controller
from sandfleet.controller.state import Lease
from sandfleet.discovery import CONTROLLER_FILE, ControllerInfo, read_controller_info
from sandfleet.errors import NodeLost
from sandfleet.runtime.base import SandboxSpec
from sandfleet.wire import server as wire_server
from sandfleet.wire.frames import PREFIX, decode_header, encode_frame, recv_frame
from sandfleet.wire.messages import (
    REQUEST,
    Acquire,
    ExecReply,
    FileReply,
    Get,
    Grant,
    Heartbeat,
    LeaseActivity,
    Ping,
    Put,
    RegisterReply,
    Release,
    Renew,
    Reply,
    SandboxSpecModel,
    Shutdown,
    StartReply,
    StartSandbox,
    Status,
    StatusReply,
    StopReply,
    StopSandbox,
    Verify,
    VerifyReply,
)
from sandfleet.wire.messages import Exec as ExecRequest
from sandfleet.wire.messages import Register as RegisterRequest
from sandfleet.wire.server import Server

TOKEN = "tok"


def frame(header: str, payload: bytes = b"") -> bytes:
    """A frame as the format defines it, built by hand from the header's JSON text."""
    raw = header.encode()
    return len(raw).to_bytes(4, "big") + len(payload).to_bytes(4, "big") + raw + payload


SPEC = {"image": "/x.sif", "cpus": 2, "memory_mb": 512, "storage_mb": 10240,
        "network": False, "max_lifetime_s": 14400.0, "env": {"A": "1"}, "workdir": "/",
        "hostname": "sandbox", "user": ""}

REQUESTS = [
    (Ping(id="r1", token=TOKEN), b"",
     '{"v":1,"id":"r1","token":"tok","type":"ping"}'),
    (Acquire(id="a1", token=TOKEN, image="/x.sif", cpus=2, memory_mb=512, storage_mb=64,
             ttl_s=60.0, network=False, wait_s=5.0, client="c0", env={"A": "1"},
             workdir="/app", max_lifetime_s=600.0, user="agent:staff"), b"",
     ('{"v":1,"id":"a1","token":"tok","type":"acquire","image":"/x.sif","cpus":2,'
      '"memory_mb":512,"storage_mb":64,"ttl_s":60.0,"network":false,"wait_s":5.0,'
      '"client":"c0","env":{"A":"1"},"workdir":"/app","max_lifetime_s":600.0,'
      '"user":"agent:staff"}')),
    (Acquire(id="a2", image="/x.sif"), b"",
     ('{"v":1,"id":"a2","token":"","type":"acquire","image":"/x.sif","cpus":2,'
      '"memory_mb":2048,"storage_mb":null,"ttl_s":null,"network":false,"wait_s":null,'
      '"client":"","env":{},"workdir":"/","max_lifetime_s":null,"user":""}')),
    (Renew(id="r2", token=TOKEN, lease_id="L1"), b"",
     '{"v":1,"id":"r2","token":"tok","type":"renew","lease_id":"L1"}'),
    (Release(id="r3", token=TOKEN, lease_id="L1"), b"",
     '{"v":1,"id":"r3","token":"tok","type":"release","lease_id":"L1"}'),
    (Status(id="r4", token=TOKEN), b"",
     '{"v":1,"id":"r4","token":"tok","type":"status"}'),
    (Shutdown(id="r5", token=TOKEN, reason="down"), b"",
     '{"v":1,"id":"r5","token":"tok","type":"shutdown","reason":"down"}'),
    (RegisterRequest(id="r6", token=TOKEN, worker_id="w1", name="local-0",
                     address="127.0.0.1:5000", node="n1", slots=4, memory_mb=8192,
                     job_id="j1", ends_at=1000.5,
                     leases={"L1": LeaseActivity(idle_s=1.5, pinned=True)}), b"",
     ('{"v":1,"id":"r6","token":"tok","type":"register","worker_id":"w1","name":"local-0",'
      '"address":"127.0.0.1:5000","node":"n1","slots":4,"memory_mb":8192,"job_id":"j1",'
      '"ends_at":1000.5,"leases":{"L1":{"idle_s":1.5,"pinned":true}}}')),
    (Heartbeat(id="r7", token=TOKEN, worker_id="w1", leases={"L1": LeaseActivity(idle_s=0.25)},
               lost={"L2": "died"}), b"",
     ('{"v":1,"id":"r7","token":"tok","type":"heartbeat","worker_id":"w1",'
      '"leases":{"L1":{"idle_s":0.25,"pinned":false}},"lost":{"L2":"died"},"leaving":""}')),
    (StartSandbox(id="r8", token=TOKEN, lease_id="L1", spec=SPEC), b"",  # type: ignore[arg-type]
     ('{"v":1,"id":"r8","token":"tok","type":"start_sandbox","lease_id":"L1",'
      '"spec":{"image":"/x.sif","cpus":2,"memory_mb":512,"storage_mb":10240,"network":false,'
      '"max_lifetime_s":14400.0,"env":{"A":"1"},"workdir":"/","hostname":"sandbox",'
      '"user":""}}')),
    (StopSandbox(id="r9", token=TOKEN, lease_id="L1", reason="released"), b"",
     ('{"v":1,"id":"r9","token":"tok","type":"stop_sandbox","lease_id":"L1",'
      '"reason":"released"}')),
    (ExecRequest(id="r10", token=TOKEN, lease_id="L1", command="echo hi", timeout=30.0), b"",
     ('{"v":1,"id":"r10","token":"tok","type":"exec","lease_id":"L1","command":"echo hi",'
      '"timeout":30.0}')),
    (Put(id="r11", token=TOKEN, lease_id="L1", path="/tests", name="tests"), b"P",
     ('{"v":1,"id":"r11","token":"tok","type":"put","lease_id":"L1","path":"/tests",'
      '"name":"tests"}')),
    (Get(id="r12", token=TOKEN, lease_id="L1", path="/logs"), b"",
     '{"v":1,"id":"r12","token":"tok","type":"get","lease_id":"L1","path":"/logs"}'),
    (Verify(id="r13", token=TOKEN, lease_id="L1", name="tests",
            command=["bash", "/tests/test.sh"], cwd="/app", env={"B": "2"}, timeout=60.0,
            agent_system=True, user="agent"), b"P",
     ('{"v":1,"id":"r13","token":"tok","type":"verify","lease_id":"L1","name":"tests",'
      '"command":["bash","/tests/test.sh"],"cwd":"/app","env":{"B":"2"},"timeout":60.0,'
      '"agent_system":true,"user":"agent"}')),
]


@pytest.mark.parametrize(("message", "payload", "header"), REQUESTS,
                         ids=[f"{m.type}-{m.id}" for m, _, _ in REQUESTS])
def test_each_request_encodes_to_its_hand_written_frame_and_back(message, payload, header):
    expected = frame(header, payload)
    assert encode_frame(message, payload) == expected
    header_len, _ = PREFIX.unpack_from(expected)
    assert REQUEST.validate_python(decode_header(expected[8:8 + header_len])) == message


def test_the_sandbox_spec_model_is_the_runtime_spec_field_for_field():
    def default(f: dataclasses.Field) -> object:
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default

    runtime = [(f.name, default(f)) for f in dataclasses.fields(SandboxSpec)]
    model = [(name, info.get_default(call_default_factory=True))
             for name, info in SandboxSpecModel.model_fields.items()]
    assert [n for n, _ in model] == [n for n, _ in runtime]
    assert model[1:] == runtime[1:]  # the image has no default in either
    assert SandboxSpec.from_dict(SandboxSpecModel(**SPEC).model_dump()).to_dict() == SPEC


# ---- replies: a real server, the controller's own handler where it answers in-process

GRANT = ('"lease_id":"L1","sandbox_id":"L1","worker_id":"w1","worker_address":'
         '"127.0.0.1:5000","node":"n1","granted_at":1000.25,"queued_s":0.5,'
         '"expires_at":1060.25,"ttl_s":60.0')

REPLIES = [  # (request, reply header as JSON text, reply payload, its Result)
    (Ping(id="p", token=TOKEN),
     ('{"type":"reply","v":1,"id":"p","ok":true,"result":{"role":"controller","address":""},'
      '"error":null}'), b""),
    (Acquire(id="a", token=TOKEN, image="/x.sif"),  # a repeated id: answered as a renew
     '{"type":"reply","v":1,"id":"a","ok":true,"result":{' + GRANT + ',"state":"starting"},'
     '"error":null}', b""),
    (Renew(id="r", token=TOKEN, lease_id="L1"),
     '{"type":"reply","v":1,"id":"r","ok":true,"result":{' + GRANT + ',"state":"starting"},'
     '"error":null}', b""),
    (Release(id="rl", token=TOKEN, lease_id="L9"),
     ('{"type":"reply","v":1,"id":"rl","ok":true,"result":{"released":true,"was":null},'
      '"error":null}'), b""),
    (Heartbeat(id="h", token=TOKEN, worker_id="nobody"),
     '{"type":"reply","v":1,"id":"h","ok":true,"result":{"known":false},"error":null}', b""),
    (Status(id="s", token=TOKEN),
     ('{"type":"reply","v":1,"id":"s","ok":false,"result":{},"error":{"error":"NodeLost",'
      '"cause":"node_lost","message":"node n1: gone","node":"n1","reason":"gone"}}'), b""),
    (RegisterRequest(id="rg", token=TOKEN, worker_id="w", address="a:1", node="n", slots=1,
                     memory_mb=16),
     ('{"type":"reply","v":1,"id":"rg","ok":true,"result":{"known":true,"keep":["L1"],'
      '"heartbeat_s":2.0},"error":null}'), b""),
    (StartSandbox(id="st", token=TOKEN, lease_id="L1", spec=SPEC),  # type: ignore[arg-type]
     '{"type":"reply","v":1,"id":"st","ok":true,"result":{"started":true},"error":null}', b""),
    (StopSandbox(id="sp", token=TOKEN, lease_id="L1"),
     '{"type":"reply","v":1,"id":"sp","ok":true,"result":{"stopped":true},"error":null}', b""),
    (ExecRequest(id="e", token=TOKEN, lease_id="L1", command="x", timeout=1),
     ('{"type":"reply","v":1,"id":"e","ok":true,"result":{"exit_code":0,"timed_out":false,'
      '"oom":false,"duration_s":0.125},"error":null}'), b"hi\n"),
    (Put(id="pu", token=TOKEN, lease_id="L1", path="/t", name="t"),
     ('{"type":"reply","v":1,"id":"pu","ok":true,"result":{"path":"/tests","bytes":1},'
      '"error":null}'), b""),
    (Get(id="g", token=TOKEN, lease_id="L1", path="/l"),
     ('{"type":"reply","v":1,"id":"g","ok":true,"result":{"path":"/logs","bytes":3},'
      '"error":null}'), b"tar"),
    (Verify(id="v", token=TOKEN, lease_id="L1", name="t", command=["x"], timeout=1),
     ('{"type":"reply","v":1,"id":"v","ok":true,"result":{"exit_code":1,"timed_out":false,'
      '"oom":true,"duration_s":2.5,"output":"F"},"error":null}'), b"tar"),
    (Shutdown(id="sd", token=TOKEN),
     '{"type":"reply","v":1,"id":"sd","ok":true,"result":{"stopping":true},"error":null}', b""),
]

REFUSALS = [  # raw request headers a server refuses, and its reply
    ('{"v":2,"id":"bad","token":"tok","type":"ping"}',
     ('{"type":"reply","v":1,"id":"bad","ok":false,"result":{},"error":{"error":"BadRequest",'
      '"message":"protocol version 2 not supported (this compat speaks 1)"}}')),
    ('{"v":1,"id":"bad2","token":"tok","type":"ping","extra":1}',
     ('{"type":"reply","v":1,"id":"bad2","ok":false,"result":{},"error":{"error":"BadRequest",'
      '"message":"ping.extra: Extra inputs are not permitted"}}')),
    ('{"v":1,"id":"bad3","token":"nope","type":"ping"}',  # last: the connection closes
     ('{"type":"reply","v":1,"id":"bad3","ok":false,"result":{},"error":{"error":'
      '"Unauthorized","message":"bad or missing fleet token"}}')),
]


def controller_with_a_lease(tmp_path: Path) -> Controller:
    """A controller (not started) that holds lease L1, starting, asked for by request a."""
    controller = Controller(tmp_path, FleetConfig())
    lease = Lease("L1", "a", "c0", "w1", "n1", "127.0.0.1:5000", dict(SPEC), 2, 512, 60.0,
                  granted_at=1000.25, queued_s=0.5, renewed_at=1000.25)
    controller.reg.leases["L1"] = lease
    controller.reg.by_request["a"] = "L1"
    return controller


def handler_for(controller: Controller):
    """The controller's handler for what it serves; the worker's results for the rest (the
    same models its handlers return)."""
    worker = {
        "register": RegisterReply(known=True, keep=["L1"], heartbeat_s=2.0),
        "start_sandbox": StartReply(),
        "stop_sandbox": StopReply(),
        "exec": (ExecReply(exit_code=0, timed_out=False, oom=False, duration_s=0.125), b"hi\n"),
        "put": FileReply(path="/tests", bytes=1),
        "get": (FileReply(path="/logs", bytes=3), b"tar"),
        "verify": (VerifyReply(exit_code=1, timed_out=False, oom=True, duration_s=2.5,
                               output="F"), b"tar"),
    }

    def handle(request, payload, peer):
        if request.type == "status":
            raise NodeLost("n1", "gone")
        if request.type in worker:
            return worker[request.type]
        return controller.handle(request, payload, peer)

    return handle


def test_each_reply_is_its_hand_written_frame_and_parses_whole(tmp_path):
    controller = controller_with_a_lease(tmp_path)

    async def go() -> None:
        server = Server(handler_for(controller), TOKEN, name="compat")
        _, port = await server.start("127.0.0.1")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for request, header, payload in REPLIES:
                writer.write(encode_frame(request))
                assert await read_raw(reader) == frame(header, payload), request.type
                reply = Reply.model_validate_json(header)
                if reply.ok:
                    result = request.Result.model_validate(reply.result)
                    assert result.model_extra == {}, request.type  # nothing left unknown
            for raw_request, header in REFUSALS:
                writer.write(frame(raw_request))
                assert await read_raw(reader) == frame(header)
        finally:
            writer.close()
            await server.close()

    asyncio.run(go())


async def read_raw(reader: asyncio.StreamReader) -> bytes:
    prefix = await reader.readexactly(PREFIX.size)
    header_len, payload_len = PREFIX.unpack(prefix)
    return prefix + await reader.readexactly(header_len + payload_len)


def test_the_controllers_results_are_their_models_exactly(tmp_path):
    controller = controller_with_a_lease(tmp_path)
    lease = controller.reg.leases["L1"]
    grant = Grant.model_validate(lease.grant())
    assert grant.model_dump(exclude={"state"}) == lease.grant()
    assert json.loads("{" + GRANT + "}") == lease.grant()
    status = StatusReply.model_validate(controller.status())
    assert status.model_extra == {} and status.leases.starting == 1


def test_a_grant_without_sandbox_id_reads_it_as_the_lease_id():
    fields = json.loads("{" + GRANT + "}")
    del fields["sandbox_id"]
    assert Grant.model_validate(fields).sandbox_id == "L1"


# ---- a newer fleet's replies on this client


FUTURE = {"placement_score": 0.5, "trace": {"span": "s1"}}
"""Fields a newer controller or worker might add to its results."""


@pytest.fixture
def newer_fleet(tmp_path, monkeypatch):
    """A controller and a worker (Servers on loopback) that answer like a newer fleet: an
    unknown field in every result and one in every reply envelope."""
    original = wire_server.reply_header

    def newer_reply_header(rid, *, result=None, error=None):
        header = original(rid, result=result, error=error)
        return {**header, "server_version": "9.9"}

    monkeypatch.setattr(wire_server, "reply_header", newer_reply_header)
    state = tmp_path / "state"
    state.mkdir()
    ports: dict[str, int] = {}

    def controller(request, payload, peer):
        grant = {"lease_id": "L1", "sandbox_id": "L1", "worker_id": "w1",
                 "worker_address": f"127.0.0.1:{ports['worker']}", "node": "n1",
                 "granted_at": 1000.0, "queued_s": 0.0, "expires_at": 1300.0, "ttl_s": 300.0}
        if request.type == "acquire":
            return {**grant, **FUTURE}
        if request.type == "renew":
            return {**grant, "state": "held", **FUTURE}
        if request.type == "release":
            return {"released": True, "was": "held", **FUTURE}
        return {"role": "controller", **FUTURE}

    def worker(request, payload, peer):
        assert request.type == "exec"
        return ({"exit_code": 3, "timed_out": False, "oom": False, "duration_s": 0.01,
                 **FUTURE}, b"out\n")

    loop = asyncio.new_event_loop()
    servers = [Server(controller, TOKEN, name="newer-controller"),
               Server(worker, TOKEN, name="newer-worker")]
    ports["controller"] = loop.run_until_complete(servers[0].start("127.0.0.1"))[1]
    ports["worker"] = loop.run_until_complete(servers[1].start("127.0.0.1"))[1]
    info = ControllerInfo(address=f"127.0.0.1:{ports['controller']}", token=TOKEN, pid=0)
    (state / CONTROLLER_FILE).write_text(info.model_dump_json())
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield state
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_reply_with_unknown_fields_still_parses_on_the_async_client(newer_fleet, caplog):
    async def go() -> None:
        async with AsyncFleetClient(newer_fleet, retry_s=5) as client:
            lease = await client.acquire("/x.sif", ttl_s=300)
            assert lease.grant.model_extra == FUTURE  # kept, not dropped
            assert lease.sandbox_id == "L1"
            result = await lease.run("exit 3")
            assert (result.output, result.exit_code) == ("out\n", 3)
            await lease.renew()
            await lease.release()

    with caplog.at_level(logging.INFO, logger="sandfleet.wire.messages"):
        asyncio.run(go())
    noted = " ".join(r.getMessage() for r in caplog.records)
    assert "'placement_score'" in noted and "'server_version'" in noted


def test_a_reply_with_unknown_fields_still_parses_on_the_sync_client(newer_fleet):
    with FleetClient(newer_fleet, retry_s=5) as client:
        lease = client.acquire("/x.sif", ttl_s=300)
        result = lease.run("exit 3")  # the sync path: its own socket, recv_frame
        assert (result.output, result.exit_code) == ("out\n", 3)
        assert lease.grant.model_extra == FUTURE
        lease.release()


def test_controller_info_from_a_newer_controller_still_reads(tmp_path):
    info = {"address": "127.0.0.1:1", "token": TOKEN, "pid": 1, "listen_backlog": 512}
    (tmp_path / CONTROLLER_FILE).write_text(json.dumps(info))
    read = read_controller_info(tmp_path)
    assert read is not None and read.address == "127.0.0.1:1"
    assert read.model_extra == {"listen_backlog": 512}


def test_recv_frame_is_the_frames_of_a_blocking_socket():
    left, right = socket.socketpair()
    with left, right:
        left.sendall(encode_frame({"id": "x"}, b"data") + frame("[1]"))
        assert recv_frame(right) == ({"id": "x"}, b"data")
        with pytest.raises(Exception, match="not a JSON object"):
            recv_frame(right)
        left.sendall(PREFIX.pack(1, 0))
        with pytest.raises(Exception, match="header length 1 outside"):
            recv_frame(right)
