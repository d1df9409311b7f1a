"""Lease sandboxes from a fleet: ``FleetClient`` (sync) and ``AsyncFleetClient`` (asyncio).

::

    with FleetClient(state_dir) as fleet, fleet.lease(image, ttl_s=120) as lease:
        lease.run("cd /app && make", timeout=60)       # ExecResult; persistent shell
        lease.put_file(Path("tests"), "/tests")         # directories as tar streams
        lease.get_file("/logs/verifier", Path("out"))

A lease renews itself in the background while held (every third of its ttl); leaving the
``with`` block releases it. Commands and files go straight to the lease's worker; the
controller is only asked to acquire, renew, release, and, when the worker does not answer,
why (so a dead node raises ``NodeLost`` within a few heartbeats, not at the TTL).

Failures: policy outcomes (non-zero exit, ``timed_out``, ``oom``) are ``ExecResult``
fields. Infrastructure failures raise ``sandfleet.errors`` instances rebuilt from the wire
(``SandboxLost``, ``NodeLost``, ``ImageMissing``, ``CapacityTimeout``,
``ControllerUnreachable``...). Using a released lease raises ``LeaseClosed``. Controller
requests are retried with the same request id while the controller is unreachable (a
restarting controller answers a repeated acquire with the lease it already granted).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import select
import socket
import tarfile
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from pydantic import ValidationError

from sandfleet.config import FleetConfig
from sandfleet.discovery import read_controller_info
from sandfleet.errors import (
    ControllerUnreachable,
    InfraError,
    LeaseClosed,
    NodeLost,
    ProtocolError,
    RemoteError,
    UnknownLease,
    error_from_dict,
)
from sandfleet.runtime.base import ExecResult
from sandfleet.wire.frames import (
    MAX_PAYLOAD_BYTES,
    PREAUTH_HEADER_BYTES,
    PREFIX,
    encode_frame,
    recv_frame,
)
from sandfleet.wire.messages import (
    Acquire,
    Exec,
    ExecReply,
    Get,
    Grant,
    Ping,
    Put,
    Release,
    Renew,
    Reply,
    Status,
    Verify,
    VerifyReply,
    new_id,
    parse_result,
)
from sandfleet.wire.transport import Connection, parse_address

log = logging.getLogger(__name__)

EXEC_MARGIN_S = 30.0
"""Beyond a command's own timeout, how long to wait for the worker's reply."""


class AsyncFleetClient:
    """A fleet's client on one asyncio loop; leases and connections belong to that loop."""

    def __init__(self, state_dir: str | os.PathLike, *, client_id: str | None = None,
                 retry_s: float = 30.0):
        self.state_dir = Path(state_dir)
        self.client_id = client_id or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.retry_s = retry_s
        self.config = _fleet_config(self.state_dir)
        self._ctl: Connection | None = None
        self._workers: dict[str, Connection] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._leases: set[AsyncLease] = set()

    # ---- connections

    async def _controller(self) -> Connection:
        info = read_controller_info(self.state_dir)
        if info is None:
            raise ConnectionRefusedError(f"no controller.json in {self.state_dir}")
        async with self._opening.setdefault("controller", asyncio.Lock()):  # open it once
            if self._ctl is not None and (self._ctl.closed
                                          or self._ctl.address != info.address):
                await self._ctl.close()
                self._ctl = None
            if self._ctl is None:
                self._ctl = await Connection.open(info.address, info.token, timeout=5,
                                                  idle_s=self.config.conn_idle_timeout_s)
            return self._ctl

    async def _worker(self, address: str) -> Connection:
        conn = self._workers.get(address)
        if conn is None or conn.closed:
            async with self._opening.setdefault(address, asyncio.Lock()):  # one per worker
                conn = self._workers.get(address)
                if conn is None or conn.closed:
                    if conn is not None:  # lost, or idle long enough for the worker to close
                        await conn.close()
                    info = read_controller_info(self.state_dir)
                    if info is None:
                        raise ControllerUnreachable(str(self.state_dir), "no controller.json")
                    conn = await Connection.open(address, info.token, timeout=5,
                                                 idle_s=self.config.conn_idle_timeout_s)
                    self._workers[address] = conn
        return conn

    async def request(self, message, *, timeout: float = 30.0,
                      retry_s: float | None = None) -> dict:
        """Send ``message`` to the controller, retrying (same id) while it is unreachable."""
        deadline = time.monotonic() + (self.retry_s if retry_s is None else retry_s)
        delay, last = 0.1, None
        while True:
            try:
                conn = await self._controller()
                result, _ = await conn.request(message, timeout=timeout)
                return result
            except (ConnectionError, OSError) as e:
                if isinstance(e, TimeoutError) and self._ctl is not None \
                        and not self._ctl.closed:
                    raise ControllerUnreachable(self._ctl.address,
                                                f"no reply in {timeout:.0f}s") from None
                last = e
                if self._ctl is not None:
                    await self._ctl.close()
                    self._ctl = None
            if time.monotonic() + delay > deadline:
                info = read_controller_info(self.state_dir)
                raise ControllerUnreachable(info.address if info else str(self.state_dir),
                                            f"{type(last).__name__}: {last}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    # ---- leases

    async def acquire(self, image: str | os.PathLike, *, cpus: int = 2, memory_mb: int = 2048,
                      ttl_s: float | None = None, network: bool = False,
                      wait_s: float | None = None, env: dict[str, str] | None = None,
                      workdir: str = "/", max_lifetime_s: float | None = None,
                      storage_mb: int | None = None, user: str = "",
                      allowed_hosts: Sequence[str] = ()) -> AsyncLease:
        """A lease on a fresh sandbox of ``image``, once one is ready (queues when full);
        its commands run as ``user`` (Docker's USER syntax; "" is root). ``allowed_hosts``:
        the allowlist network (``SandboxSpec.allowed_hosts``)."""
        wait = self.config.acquire_wait_s if wait_s is None else wait_s
        message = Acquire(id=new_id("a"), image=os.path.abspath(image), cpus=cpus,  # noqa: ASYNC240 - getcwd only
                          memory_mb=memory_mb, storage_mb=storage_mb, ttl_s=ttl_s,
                          network=network, wait_s=wait,
                          client=self.client_id, env=env or {}, workdir=workdir,
                          max_lifetime_s=max_lifetime_s, user=user,
                          allowed_hosts=tuple(allowed_hosts))
        timeout = wait + self.config.sandbox_start_timeout_s + 30
        result = await self.request(message, timeout=timeout, retry_s=max(self.retry_s, 5))
        lease = AsyncLease(self, parse_result(Grant, result))  # unknown fields kept
        self._leases.add(lease)
        lease.start_renewal()
        return lease

    @contextlib.asynccontextmanager
    async def lease(self, image: str | os.PathLike, **kwargs: Any) -> AsyncIterator[AsyncLease]:
        """``async with client.lease(image) as lease``: released on exit."""
        lease = await self.acquire(image, **kwargs)
        try:
            yield lease
        finally:
            await lease.release(quiet=True)

    async def status(self) -> dict:
        """The controller's ``StatusReply``, as its JSON (``parse_result`` types it)."""
        return await self.request(Status(id=new_id()), retry_s=5)

    async def close(self) -> None:
        for lease in list(self._leases):
            await lease.release(quiet=True)
        for conn in [self._ctl, *self._workers.values()]:
            if conn is not None:
                await conn.close()
        self._ctl, self._workers = None, {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncLease:
    """One held sandbox. ``run``, ``put_file``, ``get_file``; renewed in the background."""

    def __init__(self, client: AsyncFleetClient, grant: Grant):
        self.client, self.grant = client, grant
        self.lease_id, self.sandbox_id = grant.lease_id, grant.sandbox_id
        self.worker_address, self.node = grant.worker_address, grant.node
        self.granted_at, self.queued_s = grant.granted_at, grant.queued_s
        self.ttl_s = grant.ttl_s
        self.expires_at = grant.expires_at
        self.failed: InfraError | None = None
        self.released = False
        self._renewer: asyncio.Task | None = None

    def __repr__(self) -> str:
        return f"<lease {self.lease_id} on {self.node} ({self.worker_address})>"

    # ---- lifecycle

    def start_renewal(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop())

    async def _renew_loop(self) -> None:
        period = max(min(self.ttl_s / 3, 30.0), 0.2)
        while not self.released and self.failed is None:
            await asyncio.sleep(period)
            try:
                await self.renew()
            except InfraError as e:
                if not isinstance(e, ControllerUnreachable):
                    self.failed = e
                    log.warning("lease %s: %s", self.lease_id, e)
                    return
            except RemoteError:
                return  # released elsewhere

    async def renew(self, *, retry_s: float | None = None) -> None:
        """Push the expiry to now + ttl; raises why the lease ended if it did."""
        result = await self.client.request(Renew(id=new_id(), lease_id=self.lease_id),
                                           timeout=10, retry_s=retry_s)
        self.expires_at = parse_result(Grant, result).expires_at

    async def release(self, *, quiet: bool = False) -> None:
        """Release the lease (idempotent); its sandbox is destroyed."""
        if self.released:
            return
        self.released = True
        self.client._leases.discard(self)
        if self._renewer is not None:
            self._renewer.cancel()
        if self.failed is not None and not isinstance(self.failed, ControllerUnreachable):
            return  # the fleet ended it already (node lost, expired...)
        try:
            await self.client.request(Release(id=new_id(), lease_id=self.lease_id),
                                      timeout=10, retry_s=10)
        except (InfraError, RemoteError) as e:
            if not quiet:
                raise
            log.info("release %s: %s (it expires by itself)", self.lease_id, e)

    # ---- operations

    def check_usable(self) -> None:
        """LeaseClosed after release; the recorded failure after one."""
        if self.released:
            raise LeaseClosed(f"lease {self.lease_id} was released")
        if self.failed is not None:
            raise self.failed

    async def _call(self, message, payload: bytes = b"", *, timeout: float) -> tuple[dict, bytes]:
        self.check_usable()
        try:
            conn = await self.client._worker(self.worker_address)
            return await conn.request(message, payload, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - mapped to what the caller should see
            raise await self.explain(e) from None

    async def explain(self, error: Exception) -> Exception:
        """The exception a failed worker call should raise: path errors as they are; an
        infrastructure error, an unknown lease or a broken connection as the controller
        explains it (NodeLost, expired...), waiting for it to find out if need be."""
        if isinstance(error, UnknownLease):
            return await self._why_gone(str(error))
        if isinstance(error, InfraError):
            return await self._why_gone(str(error), fallback=error,
                                        wait_s=2 * self.client.config.heartbeat_s + 1)
        if isinstance(error, (FileNotFoundError, FileExistsError, IsADirectoryError,
                              NotADirectoryError, RemoteError)):
            return error  # an error reply about the request, not the transport
        if isinstance(error, (ConnectionError, OSError)):
            conn = self.client._workers.pop(self.worker_address, None)
            if conn is not None:
                await conn.close()
            return await self._why_gone(f"worker {self.worker_address}: "
                                        f"{type(error).__name__}: {error}")
        return error

    async def _why_gone(self, what: str, *, fallback: InfraError | None = None,
                        wait_s: float | None = None) -> Exception:
        """Why the worker lost the lease: ask the controller until it knows (a dead worker
        is declared lost within ``lost_after_s``); ``fallback`` (default NodeLost) after
        ``wait_s`` either way."""
        if wait_s is None:
            wait_s = self.client.config.lost_after_s * 2 + 2
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await self.renew(retry_s=max(deadline - time.monotonic(), 0.2))
            except (InfraError, RemoteError) as e:
                if not isinstance(e, ControllerUnreachable):
                    if isinstance(e, InfraError):
                        self.failed = e
                    return e
            if time.monotonic() > deadline:
                error = fallback or NodeLost(
                    self.node, f"{what} (the controller still lists the lease)")
                self.failed = error
                return error
            await asyncio.sleep(0.2)

    async def run(self, command: str, timeout: float = 60.0) -> ExecResult:
        """Run ``command`` in the lease's persistent shell (cwd, env, background jobs
        persist); a timeout kills the command's process group and returns timed_out."""
        result, data = await self._call(Exec(id=new_id(), lease_id=self.lease_id,
                                             command=command, timeout=timeout),
                                        timeout=timeout + EXEC_MARGIN_S)
        reply = parse_result(ExecReply, result)
        return ExecResult(data.decode("utf-8", "replace"), reply.exit_code, reply.timed_out,
                          reply.oom, reply.duration_s)

    async def put_file(self, src: str | os.PathLike, dest: str, *,
                       timeout: float = 600.0) -> None:
        """Copy host file or directory ``src`` to absolute path ``dest`` in the sandbox."""
        src = Path(src)
        if not src.exists():
            raise FileNotFoundError(src)
        name = src.name or "data"
        data = await asyncio.to_thread(_tar_of, src, name)
        await self._call(Put(id=new_id(), lease_id=self.lease_id, path=dest, name=name),
                         data, timeout=timeout)

    async def verify(self, tests: str | os.PathLike, command: list[str], *, timeout: float,
                     dest: str | os.PathLike, cwd: str | None = None,
                     env: dict[str, str] | None = None, agent_system: bool = False,
                     user: str = "") -> tuple[ExecResult, Path]:
        """Run a task's verifier beside the sandbox: host folder ``tests`` is its /tests,
        ``command`` runs as ``user`` (Docker's USER as the image names it; "" for root) in a
        process tree the agent cannot reach (on the local runtime; see
        ``sandfleet.runtime.local``), and what it leaves in /logs/verifier lands in host
        folder ``dest`` (which must not exist). The verifier's result and ``dest``."""
        tests = Path(tests)
        if not tests.is_dir():
            raise FileNotFoundError(f"verify: {tests} is not a folder")
        data = await asyncio.to_thread(_tar_of, tests, "tests")
        message = Verify(id=new_id(), lease_id=self.lease_id, name="tests",
                         command=list(command), cwd=cwd, env=env or {}, timeout=timeout,
                         agent_system=agent_system, user=user)
        result, logs = await self._call(message, data, timeout=timeout + 120)
        reply = parse_result(VerifyReply, result)
        out = await asyncio.to_thread(_untar_to, logs, Path(dest))
        return ExecResult(reply.output, reply.exit_code, reply.timed_out, reply.oom,
                          reply.duration_s), out

    async def get_file(self, src: str, dest: str | os.PathLike, *,
                       timeout: float = 600.0) -> Path:
        """Copy sandbox file or directory ``src`` to host path ``dest`` (replaced if a
        file; an existing directory is an error)."""
        _, data = await self._call(Get(id=new_id(), lease_id=self.lease_id, path=src),
                                   timeout=timeout)
        return await asyncio.to_thread(_untar_to, data, Path(dest))


def _tar_of(src: Path, name: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=name)
    if buf.tell() > MAX_PAYLOAD_BYTES:
        raise ValueError(f"{src}: over {MAX_PAYLOAD_BYTES >> 20} MiB as a tar stream")
    return buf.getvalue()


def _untar_to(data: bytes, dest: Path) -> Path:
    if dest.is_dir() and not dest.is_symlink():
        raise FileExistsError(f"get_file: {dest} is an existing directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.", dir=dest.parent) as tmp, \
            tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        if len(tops) != 1:
            raise ValueError(f"get_file: expected one top-level member, got {sorted(tops)}")
        tar.extractall(tmp, members=members, filter="data")
        os.replace(Path(tmp) / tops.pop(), dest)
    return dest


def _fleet_config(state_dir: Path) -> FleetConfig:
    try:
        return FleetConfig.model_validate_json((state_dir / "fleet.json").read_text())
    except (OSError, ValueError):
        return FleetConfig()


# ---- the sync API


class FleetClient:
    """The sync face of ``AsyncFleetClient``: its own event loop on a daemon thread."""

    def __init__(self, state_dir: str | os.PathLike, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="sandfleet-client")
        self._thread.start()
        self.aio = AsyncFleetClient(state_dir, **kwargs)
        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def acquire(self, image: str | os.PathLike, **kwargs: Any) -> Lease:
        return Lease(self, self._run(self.aio.acquire(image, **kwargs)))

    @contextlib.contextmanager
    def lease(self, image: str | os.PathLike, **kwargs: Any) -> Iterator[Lease]:
        """``with fleet.lease(image) as lease``: acquired on enter, released on exit."""
        lease = self.acquire(image, **kwargs)
        try:
            yield lease
        finally:
            lease.release(quiet=True)

    def status(self) -> dict:
        return self._run(self.aio.status())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        for lease in list(self._leases):
            lease._drop()
        with contextlib.suppress(Exception):
            self._run(self.aio.close())
        with contextlib.suppress(Exception):
            self._run(_cancel_others())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _cancel_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Lease:
    """A held sandbox (sync): see ``AsyncLease``."""

    def __init__(self, client: FleetClient, lease: AsyncLease):
        self._client, self.aio = client, lease
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._fleet_token = ""
        self._used = 0.0
        """When the socket's last reply came."""
        client._leases.add(self)

    def __getattr__(self, name: str):
        return getattr(self.aio, name)

    def __repr__(self) -> str:
        return repr(self.aio)

    def run(self, command: str, timeout: float = 60.0) -> ExecResult:
        """As ``AsyncLease.run``; the request goes over this lease's own blocking socket,
        so an exec costs no hop through the client's event loop thread."""
        self.aio.check_usable()
        message = Exec(id=new_id(), lease_id=self.aio.lease_id, command=command,
                       timeout=timeout, token=self._token())
        try:
            with self._lock:
                result, data = self._request(message, timeout + EXEC_MARGIN_S)
        except Exception as e:  # noqa: BLE001 - mapped to what the caller should see
            self._drop()
            raise self._client._run(self.aio.explain(e)) from None
        reply = parse_result(ExecReply, result)
        return ExecResult(data.decode("utf-8", "replace"), reply.exit_code, reply.timed_out,
                          reply.oom, reply.duration_s)

    def _token(self) -> str:
        if not self._fleet_token:
            info = read_controller_info(self._client.aio.state_dir)
            if info is None:
                raise ControllerUnreachable(str(self._client.aio.state_dir),
                                            "no controller.json")
            self._fleet_token = info.token
        return self._fleet_token

    def _request(self, message, timeout: float) -> tuple[dict, bytes]:
        frame, ping = encode_frame(message), ""
        if self._sock is not None and time.monotonic() - self._used > 1.0 \
                and self._stale(self._sock):
            self._drop()  # the worker closed it, or will: reconnect instead
        if self._sock is None:
            self._sock = socket.create_connection(parse_address(self.aio.worker_address),
                                                  timeout=10)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(frame) - PREFIX.size > PREAUTH_HEADER_BYTES:  # too large to authenticate
                ping = new_id("p")
                frame = encode_frame(Ping(id=ping, token=message.token)) + frame
        sock = self._sock
        sock.settimeout(timeout)
        sock.sendall(frame)
        while True:
            try:  # the frames of every connection: sandfleet.wire.frames
                reply, data = recv_frame(sock, decode=Reply.model_validate_json)
            except (ProtocolError, ValidationError) as e:
                raise ConnectionResetError(f"bad frame from the worker: {e}") from None
            if reply.id == message.id:
                break
            if reply.id != ping or not ping:
                raise ConnectionResetError("reply to another request")
        self._used = time.monotonic()
        if not reply.ok:
            raise error_from_dict(reply.error or {})
        return reply.result, data

    def _stale(self, sock: socket.socket) -> bool:
        """Idle for half the worker's idle timeout, or readable while idle: closed by the
        worker (or stray bytes); either way not to be used again."""
        idle = self._client.aio.config.conn_idle_timeout_s
        if idle is not None and time.monotonic() - self._used > idle / 2:
            return True
        try:
            return bool(select.select([sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def put_file(self, src: str | os.PathLike, dest: str, **kwargs: Any) -> None:
        self._client._run(self.aio.put_file(src, dest, **kwargs))

    def get_file(self, src: str, dest: str | os.PathLike, **kwargs: Any) -> Path:
        return self._client._run(self.aio.get_file(src, dest, **kwargs))

    def verify(self, tests: str | os.PathLike, command: list[str],
               **kwargs: Any) -> tuple[ExecResult, Path]:
        return self._client._run(self.aio.verify(tests, command, **kwargs))

    def renew(self) -> None:
        self._client._run(self.aio.renew())

    def release(self, *, quiet: bool = False) -> None:
        self._drop()
        self._client._run(self.aio.release(quiet=quiet))


__all__ = ["AsyncFleetClient", "AsyncLease", "FleetClient", "Lease"]
