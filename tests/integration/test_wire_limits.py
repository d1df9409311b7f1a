"""Wire limits before authentication: a frame's token is checked as soon
as its header is complete, before any payload byte is kept; payloads are bounded by request
type; silent and idle connections are closed; each peer IP holds only so many connections;
rejections are logged once per peer per interval; clients reopen pooled connections a
server closed without their caller noticing.

The first tests run a ``Server`` in the test's own event loop, so they can look at its
connections (``buffered``: the bytes of an incomplete frame it holds). The last ones run a
real fleet (controller and worker processes) and measure their memory under the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from pathlib import Path
from typing import Self

import pytest

from sandfleet.client import FleetClient
from sandfleet.wire.frames import MAX_PAYLOAD_BYTES, PREAUTH_HEADER_BYTES, PREFIX, read_frame
from sandfleet.wire.messages import Exec, Ping, Put, new_id
from sandfleet.wire.server import Server, WireLimits
from sandfleet.wire.transport import Connection
from tests.fleet_harness import Fleet

TOKEN = "the-fleets-token"
LOOPBACK = "127.0.0.1"


def echo(request, payload: bytes, peer):
    """A handler that says what it got (``exec`` of ``sleep N`` takes N seconds)."""
    if request.type == "exec" and request.command.startswith("sleep "):
        return _after(float(request.command.split()[1]), {"slept": True})
    return {"type": request.type, "payload_bytes": len(payload)}


async def _after(delay: float, result: dict) -> dict:
    await asyncio.sleep(delay)
    return result


@contextlib.asynccontextmanager
async def serving(**limits):
    server = Server(echo, TOKEN, name="test-server", limits=WireLimits(**limits))
    _, port = await server.start(LOOPBACK, 0)
    try:
        yield server, port
    finally:
        await server.close()


def _header(token: str, kind: str = "put", **fields) -> bytes:
    from pydantic_core import to_json

    base = {"type": kind, "v": 1, "id": new_id(), "token": token}
    if kind == "put":
        base |= {"lease_id": "L1", "path": "/p", "name": "n"}
    return to_json(base | fields)


async def _until(predicate, what: str, timeout: float = 10.0) -> None:
    """Wait (generously: this asserts what happens, not how fast) for ``predicate``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _ended(reader: asyncio.StreamReader, timeout: float = 10.0) -> bool:
    """True once the server has closed the connection (EOF or reset)."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    except (ConnectionError, OSError):
        pass
    return True


async def _probe(port: int, server: Server, *, token: str = "wrong-token",
                 announce: int = MAX_PAYLOAD_BYTES, stream: int = 64 << 20,
                 kind: str = "put") -> dict:
    """A frame announcing ``announce`` payload bytes, then up to ``stream`` of them
    written while the server's connections are watched; what happened."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    raw = _header(token, kind)
    writer.write(PREFIX.pack(len(raw), announce) + raw)
    reply = asyncio.create_task(read_frame(reader))  # taken as soon as it comes
    sent, peak, chunk = 0, 0, b"\0" * (1 << 20)
    try:
        while sent < stream:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 3)  # stalls once the server reads no more
            sent += len(chunk)
            await asyncio.sleep(0)  # the server's turn
            peak = max([peak, *(conn.buffered for conn in server._conns)])
    except (ConnectionError, OSError, TimeoutError):
        pass
    try:
        frame = await asyncio.wait_for(reply, 10)
    except (ConnectionError, OSError):
        frame = None
    header = frame[0] if frame else None
    ended = await _ended(reader)
    writer.transport.abort()
    return {"reply": header, "sent": sent, "peak_buffered": peak, "ended": ended}


@pytest.fixture
def counted(monkeypatch):
    """Bytes the servers' transports handed to their connections, in all."""
    from sandfleet.wire import server

    total = [0]
    original = server._Served.data_received

    def data_received(self, data: bytes) -> None:
        total[0] += len(data)
        original(self, data)

    monkeypatch.setattr(server._Served, "data_received", data_received)
    return total


# ---- a server in this process


def test_wrong_token_with_a_huge_payload_is_refused_before_the_payload_is_read(counted):
    async def go():
        async with serving() as (server, port):
            seen = await _probe(port, server)
            assert seen["reply"] is not None, seen
            assert seen["reply"]["error"]["error"] == "Unauthorized", seen
            assert seen["ended"], seen
            assert seen["peak_buffered"] <= PREAUTH_HEADER_BYTES, seen
            assert counted[0] < 4 << 20, f"the server read {counted[0]} bytes"
            await _until(lambda: server.peer_connections(LOOPBACK) == (0, 0),
                         "the refused connection to be gone")
            conn = await Connection.open(f"{LOOPBACK}:{port}", TOKEN)  # others unaffected
            assert (await conn.request(Ping(id=new_id())))[0]["type"] == "ping"
            await conn.close()

    asyncio.run(go())


def test_payloads_are_bounded_by_request_type_and_headers_before_authentication(counted):
    async def go():
        async with serving() as (server, port):
            # authenticated, but a ping carries no payload: refused before it is read
            seen = await _probe(port, server, token=TOKEN, kind="ping", announce=8 << 20,
                                stream=8 << 20)
            assert seen["reply"]["error"]["error"] == "BadRequest", seen
            assert "payload" in seen["reply"]["error"]["message"]
            assert seen["peak_buffered"] <= PREAUTH_HEADER_BYTES and seen["ended"], seen
            assert counted[0] < 4 << 20
            # a put over MAX_PAYLOAD_BYTES breaks the framing: closed at its prefix
            seen = await _probe(port, server, token=TOKEN, announce=MAX_PAYLOAD_BYTES + 1,
                                stream=1 << 20)
            assert seen["reply"] is None and seen["ended"], seen
            # a first header past the pre-auth bound is not read to its end
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(PREFIX.pack(PREAUTH_HEADER_BYTES + 1, 0) + b"{" * 4096)
            assert await _ended(reader)
            writer.transport.abort()
            # well-behaved: a put with its payload; a first request larger than the
            # pre-auth bound (the client authenticates with a ping before it)
            conn = await Connection.open(f"{LOOPBACK}:{port}", TOKEN)
            big = Exec(id=new_id(), lease_id="L1", command="echo " + "x" * 200_000,
                       timeout=5)
            assert (await conn.request(big))[0]["type"] == "exec"
            put = Put(id=new_id(), lease_id="L1", path="/p", name="n")
            assert (await conn.request(put, b"y" * (3 << 20)))[0]["payload_bytes"] == 3 << 20
            await conn.close()

    asyncio.run(go())


@pytest.mark.slow
def test_silent_and_idle_connections_are_closed_after_their_timeouts():
    async def go():
        async with serving(auth_timeout_s=0.3, idle_timeout_s=0.8) as (server, port):
            silent = [await asyncio.open_connection(LOOPBACK, port) for _ in range(20)]
            slow_reader, slow = await asyncio.open_connection(LOOPBACK, port)
            slow.write(PREFIX.pack(100, 0) + b'{"to')  # a header that never completes
            good = await Connection.open(f"{LOOPBACK}:{port}", TOKEN, idle_s=None)
            assert (await good.request(Ping(id=new_id())))[0]["type"] == "ping"
            busy = await Connection.open(f"{LOOPBACK}:{port}", TOKEN, idle_s=None)
            # started now (a bare coroutine would first run at its await, after the loop
            # below: busy would then be a connection that never sent anything)
            long = asyncio.ensure_future(busy.request(Exec(
                id=new_id(), lease_id="L", command="sleep 1.6", timeout=5)))
            for reader, writer in [*silent, (slow_reader, slow)]:
                assert await _ended(reader)
                writer.transport.abort()
            assert (await long)[0] == {"slept": True}  # running is not idle
            await _until(lambda: good._closed is not None, "the idle connection to close")
            await _until(lambda: busy._closed is not None, "the other one, once idle")
            await _until(lambda: server.peer_connections(LOOPBACK) == (0, 0), "all gone")

    asyncio.run(go())


def test_a_pooled_connection_counts_as_closed_before_the_server_may_close_it():
    async def go():
        async with serving(idle_timeout_s=0.6) as (_, port):
            conn = await Connection.open(f"{LOOPBACK}:{port}", TOKEN, idle_s=0.6)
            await conn.request(Ping(id=new_id()))
            assert not conn.closed
            await _until(lambda: conn.closed, "half the idle timeout to pass")
            assert conn._closed is None  # the server has not closed it yet
            await conn.close()

    asyncio.run(go())


def test_the_per_peer_caps_refuse_the_next_connection_and_log_once(caplog):
    async def go():
        async with serving(per_peer=4, unauthenticated_per_peer=2,
                           auth_timeout_s=30) as (server, port):
            address = f"{LOOPBACK}:{port}"

            async def refused() -> None:
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                assert await _ended(reader)
                writer.transport.abort()

            silent = [await asyncio.open_connection(LOOPBACK, port) for _ in range(2)]
            await _until(lambda: server.peer_connections(LOOPBACK) == (2, 2), "2 accepted")
            for _ in range(5):  # the 3rd unauthenticated one, and the next: refused
                await refused()
            assert server.peer_connections(LOOPBACK) == (2, 2)
            for _, writer in silent:
                writer.transport.abort()
            await _until(lambda: server.peer_connections(LOOPBACK) == (0, 0), "room again")
            good = []
            for _ in range(3):
                good.append(await Connection.open(address, TOKEN))
                await good[-1].request(Ping(id=new_id()))
            quiet = await asyncio.open_connection(LOOPBACK, port)
            await _until(lambda: server.peer_connections(LOOPBACK) == (4, 1), "4 open")
            for _ in range(3):  # the 5th connection: refused
                await refused()
            extra = await Connection.open(address, TOKEN)
            with pytest.raises(ConnectionError):
                await extra.request(Ping(id=new_id()), timeout=10)
            await good.pop().close()
            await _until(lambda: server.peer_connections(LOOPBACK) == (3, 1), "room again")
            again = await Connection.open(address, TOKEN)
            assert (await again.request(Ping(id=new_id())))[0]["type"] == "ping"
            quiet[1].transport.abort()
            for conn in [*good, extra, again]:
                await conn.close()

    with caplog.at_level(logging.WARNING, logger="sandfleet.wire"):
        asyncio.run(go())
    rejected = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 1, [r.getMessage() for r in rejected]  # 9 refusals, one line
    assert LOOPBACK in rejected[0].getMessage()


# ---- a real fleet: controller and worker processes


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    cache = tmp_path_factory.mktemp("wire-cache")
    root = tmp_path_factory.mktemp("wire-fleet")
    with Fleet(root, cache, min_nodes=1, conn_auth_timeout_s=1.0,
               conn_idle_timeout_s=1.5).running() as fleet:
        yield fleet


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def blocking_probe(address: tuple[str, int], stream: int = 256 << 20,
                   keep: list[socket.socket] | None = None) -> int:
    """A wrong-token put announcing MAX_PAYLOAD_BYTES, then up to ``stream`` bytes of it;
    how many the server took before it closed the connection. The socket is left open in
    ``keep`` when given (closed otherwise)."""
    raw = _header("wrong-token")
    sent, chunk = 0, b"\0" * (1 << 20)
    sock = socket.create_connection(address, timeout=5)
    try:
        sock.sendall(PREFIX.pack(len(raw), MAX_PAYLOAD_BYTES) + raw)
        while sent < stream:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:  # refused: reset, or the server stopped reading
        pass
    if keep is None:
        sock.close()
    else:
        keep.append(sock)
    return sent


class Abuse:
    """Silent connections (reopened as the server closes them) and wrong-token probes,
    kept up in threads until ``stop()``."""

    def __init__(self, addresses: list[tuple[str, int]], silent: int):
        self.addresses, self.silent = addresses, silent
        self._stop = threading.Event()
        self.probes = 0
        self.closed_by_server = 0
        """Silent connections the server closed (and this reopened)."""
        self._threads = [threading.Thread(target=self._silent, args=(a,), daemon=True)
                         for a in addresses]
        self._threads += [threading.Thread(target=self._probes, args=(a,), daemon=True)
                          for a in addresses]

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _silent(self, address) -> None:
        socks: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                kept = [s for s in socks if not _closed_by_peer(s)]
                for sock in set(socks) - set(kept):
                    sock.close()
                self.closed_by_server += len(socks) - len(kept)
                socks = kept
                while len(socks) < self.silent:
                    socks.append(socket.create_connection(address, timeout=5))
                self._stop.wait(0.05)
        finally:
            for sock in socks:
                sock.close()

    def _probes(self, address) -> None:
        while not self._stop.is_set():
            blocking_probe(address, stream=64 << 20)
            self.probes += 1


def _closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed (or reset) it; never waits (a socket with a timeout would)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.sandbox
def test_pre_auth_probes_do_not_grow_the_controller_or_the_worker(fleet):
    info = fleet.info()
    worker_pid = fleet.worker_pids()[0]
    worker = _address(fleet.status()["nodes"][0]["address"])
    before = {"controller": _rss_mib(info.pid), "worker": _rss_mib(worker_pid)}
    held: list[socket.socket] = []  # the probes stay open while the servers are measured
    try:
        taken = [blocking_probe(address, keep=held)
                 for address in (_address(info.address), worker) for _ in range(2)]
        after = {"controller": _rss_mib(info.pid), "worker": _rss_mib(worker_pid)}
    finally:
        for sock in held:
            sock.close()
    for role, rss in before.items():
        assert after[role] - rss < 32, (before, after, taken)
    assert max(taken) < 64 << 20, taken  # the rest of the payload was never read


@pytest.mark.slow
@pytest.mark.sandbox
def test_idle_pooled_connections_closed_by_the_fleet_are_reopened_transparently(
        fleet, base_sif, tmp_path):
    src = tmp_path / "f.txt"
    src.write_text("data\n")
    with FleetClient(fleet.state) as client, client.lease(base_sif) as lease:
        long = "x" * 100_000  # a first request past the pre-auth header bound
        assert lease.run(f"echo {long} | wc -c").output == "100001\n"
        lease.put_file(src, "/tmp/f.txt")  # opens the client's pooled worker connection
        old_sock, old_conn = lease._sock, client.aio._workers[lease.worker_address]
        time.sleep(3)  # past the fleet's 1.5 s idle timeout
        assert _closed_by_peer(old_sock) and old_conn._closed is not None  # by the worker
        assert lease.run("cat /tmp/f.txt").output == "data\n"
        assert lease._sock is not old_sock
        lease.put_file(src, "/tmp/g.txt")
        assert lease.run("cat /tmp/g.txt").output == "data\n"
        lease.renew()  # the controller closed its connection too
        with client.lease(base_sif) as second:  # and the controller's to the worker
            assert second.run("echo second").output == "second\n"
        time.sleep(3)
        assert lease.run("echo still").output == "still\n"
        assert client.status()["leases"]["held"] == 1


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_well_behaved_client_works_while_abuse_connections_are_open(fleet, base_sif):
    info = fleet.info()
    worker = _address(fleet.status()["nodes"][0]["address"])
    pids = {"controller": info.pid, "worker": fleet.worker_pids()[0]}
    with FleetClient(fleet.state) as client, client.lease(base_sif) as lease:
        lease.run("true")
        before = {role: _rss_mib(pid) for role, pid in pids.items()}
        with Abuse([_address(info.address), worker], silent=100) as abuse:
            time.sleep(0.5)
            i, deadline = 0, time.monotonic() + 60
            while i < 30 or abuse.closed_by_server < 100:  # past the auth deadline (1 s)
                assert lease.run(f"echo {i}").output == f"{i}\n"
                i += 1
                assert time.monotonic() < deadline, "the fleet closed no silent connection"
            with client.lease(base_sif) as other:
                assert other.run("echo other").output == "other\n"
            lease.renew()
        after = {role: _rss_mib(pid) for role, pid in pids.items()}
        assert abuse.probes >= 2
        assert lease.run("echo after").output == "after\n"
    for role, rss in before.items():
        assert after[role] - rss < 64, (before, after)
