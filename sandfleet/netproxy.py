"""The allowlist network: an HTTP proxy the worker runs for each sandbox allowed some hosts.

A sandbox with ``SandboxSpec.allowed_hosts`` keeps its private network namespace with only
``lo``: nothing in it has a route anywhere. The worker (this module, on its asyncio loop)
listens on ``127.0.0.1:PROXY_PORT`` *inside that namespace*, through a socket a short-lived
child creates there (``listen_in_netns``: it joins the sandbox's user namespace where the
worker is not root, then its network namespace, binds, hands the socket back over a unix
socket and exits), and connects upstream from the node's own namespace. The sandbox's
environment names the proxy (``http_proxy``, ``https_proxy`` and their capitals,
``no_proxy`` for loopback: ``proxy_env``), which is how apt, pip, npm, curl and urllib find
it. What it serves:

- ``CONNECT host:port`` (https, and any TLS client behind a proxy): a byte tunnel once the
  host is allowed; the TLS session is the client's own, end to end.
- ``GET http://host/...`` and the other methods with an absolute URI (plain http: apt's
  Debian archives): the request is forwarded with ``Connection: close`` and the reply is
  streamed back (one request per connection).

The host name is checked against the allowlist before anything is resolved or connected
(``HostAllowlist``: exact names, ``*.suffix`` for any name under a domain, IP addresses and
CIDR ranges as literals in the request; a name never matches an IP entry); a refused host
gets ``403`` and is counted (``ProxyStats``). Ports are limited to 80 and 443 unless an
entry names one (``host:port``). The allowlist lives in the worker: nothing in the sandbox
can change it, and a raw socket to any other address finds no route.

Upstream is the node's network, or a parent proxy (``FleetConfig.proxy_upstream``,
``host:port``: a cluster's squid or registry mirror): the same requests are sent on to it
(CONNECT tunnels, absolute-URI requests) after the allowlist has passed them.

For https the sandbox trusts its image's authorities and the node's (``install_ca`` writes
``CA_PATH``; ``proxy_env`` points ``SSL_CERT_FILE``, ``PIP_CERT``... at it), so a node whose
egress inspects TLS with its own authority works as any other. One sandbox's proxy serves at
most ``MAX_CONNECTIONS`` at once (the worker's file descriptors are shared).

The verifier keeps its own policy (offline): the worker closes the proxy (listener and
every open connection) before the tests go in (``ProxyPool.close``) and opens it again after
(``reopen``: a multi-step task's next step). ``ProxiedRuntime`` does the same for callers
without a worker (build-time image checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet.errors import SandboxStartError

log = logging.getLogger(__name__)

PROXY_PORT = 3128
"""Where the proxy listens inside each allowlisted sandbox (its own loopback)."""
REGISTRY_HOSTS: tuple[str, ...] = (
    "deb.debian.org", "security.debian.org", "ftp.debian.org",
    "archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com", "*.archive.ubuntu.com",
    "pypi.org", "files.pythonhosted.org",
    "registry.npmjs.org",
)
"""The package registries: Debian and Ubuntu archives, PyPI, npm (``--agent-network
registries``)."""
CA_PATH = "/etc/sandfleet-ca.crt"
"""The authorities an allowlisted sandbox's TLS clients trust (``install_ca``)."""
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT",
                "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO")
"""What points OpenSSL, Python's ssl and requests, pip, curl, git and Node at CA_PATH."""
IMAGE_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256
"""Open connections one sandbox's proxy serves at once (each holds two of the worker's file
descriptors); one past it is closed as it is accepted."""
_NAME_RE = re.compile(r"(?:\*\.)?[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_](?:[a-z0-9_-]{0,62}))*")
_DEFAULT_PORTS = frozenset({80, 443})


class HostAllowlist:
    """Which ``host:port`` a sandbox may reach. Entries: ``name`` (exactly that name),
    ``*.domain`` (any name under the domain, not the domain itself), an IP address or a
    CIDR range, each optionally ``:port`` (default: 80 and 443). Case and a trailing dot
    do not matter; anything else in an entry is a ValueError naming it."""

    def __init__(self, entries: Iterable[str]):
        self.entries = tuple(entries)
        self._names: dict[str, frozenset[int]] = {}
        self._suffixes: list[tuple[str, frozenset[int]]] = []
        self._nets: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, frozenset[int]]] = []
        for raw in self.entries:
            host, ports = _split_entry(raw)
            try:
                self._nets.append((ipaddress.ip_network(host, strict=False), ports))
                continue
            except ValueError:
                pass
            if not _NAME_RE.fullmatch(host):
                raise ValueError(f"allowed host {raw!r} is not a name, '*.domain', IP address "
                                 "or CIDR range (optionally with :port)")
            if host.startswith("*."):
                self._suffixes.append((host[1:], ports))
            else:
                self._names[host] = self._names.get(host, frozenset()) | ports

    def allows(self, host: str, port: int) -> bool:
        host = host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")
        if not host:
            return False
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            addr = None
        if addr is not None:
            return any(addr in net and port in ports for net, ports in self._nets)
        if port in self._names.get(host, ()):
            return True
        return any(host.endswith(suffix) and port in ports for suffix, ports in self._suffixes)


def _split_entry(raw: str) -> tuple[str, frozenset[int]]:
    entry = str(raw).strip().lower().rstrip(".")
    ports = _DEFAULT_PORTS
    head, sep, tail = entry.rpartition(":")
    if sep and tail.isdigit() and (head.count(":") == 0 or head.endswith("]")):
        port = int(tail)
        if not 0 < port < 65536:
            raise ValueError(f"allowed host {raw!r}: port out of range")
        entry, ports = head, frozenset({port})
    entry = entry.removeprefix("[").removesuffix("]")
    if not entry:
        raise ValueError(f"allowed host {raw!r} is empty")
    return entry, ports


def proxy_env(port: int = PROXY_PORT) -> dict[str, str]:
    """What a sandbox's environment says for its proxy, and the authorities its TLS
    clients trust (``CA_PATH``)."""
    url = f"http://127.0.0.1:{port}"
    env = dict.fromkeys(("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"), url)
    env.update(no_proxy="localhost,127.0.0.1,::1", NO_PROXY="localhost,127.0.0.1,::1")
    return env | dict.fromkeys(CA_VARIABLES, CA_PATH)


def node_ca() -> Path | None:
    """The authorities this node trusts ($SSL_CERT_FILE, else Debian's bundle)."""
    for candidate in (os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


APT_CONF = "/etc/apt/apt.conf.d/00sandfleet-userns"
APT_ARCHIVES = "/var/cache/apt/sandfleet-archives"
APT_SINGLE_ID = f'''// sandfleet: one id in this user namespace; apt cannot drop to _apt or use its files
APT::Sandbox::User "root";
Dir::Cache::Archives "{APT_ARCHIVES}/";
'''


def install_apt_conf(runtime, sandbox_id: str) -> None:
    """Where the runtime's user namespace maps one id (Apptainer's ``single_id_userns``),
    apt's own sandbox user and its archive folder (owned by ``_apt``, an id not mapped)
    cannot be used: ``APT_CONF`` runs apt's downloads as root into a folder of its own, so
    ``apt-get install`` works. Images without apt get nothing; blocking."""
    with tempfile.TemporaryDirectory(prefix="sandfleet-apt-") as tmp:
        conf = Path(tmp) / "conf"
        conf.write_text(APT_SINGLE_ID)
        conf.chmod(0o644)
        (Path(tmp) / "archives" / "partial").mkdir(parents=True)
        with contextlib.suppress(Exception):  # no /etc/apt/apt.conf.d: no apt
            runtime.copy_in(sandbox_id, conf, APT_CONF)
            runtime.copy_in(sandbox_id, Path(tmp) / "archives", APT_ARCHIVES)


def install_ca(runtime, sandbox_id: str, node: Path | None) -> None:
    """``CA_PATH`` in the sandbox: the image's own bundles (an authority a task installed
    still counts) and ``node``'s (this node's network may present its own authority, as a
    proxy that inspects TLS does: the sandbox trusts what the node trusts, as image builds
    do). Copied as the runtime's files are (as root); blocking."""
    with tempfile.TemporaryDirectory(prefix="sandfleet-ca-") as tmp:
        parts = []
        for n, bundle in enumerate(IMAGE_CA_BUNDLES):
            with contextlib.suppress(Exception):  # an image without that bundle
                runtime.copy_out(sandbox_id, bundle, Path(tmp) / f"image-{n}")
                parts.append((Path(tmp) / f"image-{n}").read_bytes())
        if node is not None:
            parts.append(node.read_bytes())
        merged = Path(tmp) / "ca.crt"
        merged.write_bytes(b"\n".join(parts))
        merged.chmod(0o644)
        runtime.copy_in(sandbox_id, merged, CA_PATH)


@dataclass
class ProxyStats:
    """Counts of one sandbox's proxy (logged when it closes)."""

    allowed: int = 0
    refused: int = 0
    failed: int = 0
    """Allowed, but the upstream could not be reached (502)."""
    bytes_up: int = 0
    bytes_down: int = 0
    refused_hosts: dict[str, int] = field(default_factory=dict)


def parse_upstream(value: str) -> tuple[str, int] | None:
    """``FleetConfig.proxy_upstream`` (``host:port`` or ``http://host:port``) -> (host, port)."""
    if not value:
        return None
    text = value.removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"proxy_upstream {value!r}: write it as host:port "
                         "(an HTTP proxy the node reaches)")
    return host.strip("[]"), int(port)


class AllowlistProxy:
    """One sandbox's proxy: serves connections accepted on ``sock`` (already listening)."""

    def __init__(self, allowlist: HostAllowlist, *, upstream: tuple[str, int] | None = None,
                 name: str = ""):
        self.allowlist, self.upstream, self.name = allowlist, upstream, name
        self.stats = ProxyStats()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._server = await asyncio.start_server(self._serve, sock=sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        up_w: asyncio.StreamWriter | None = None
        try:
            if len(self._writers) > MAX_CONNECTIONS:  # the worker's file descriptors are shared
                self.stats.refused += 1
                return  # closed at once, before it can hold anything
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    ConnectionError):
                return
            if len(head) > MAX_HEAD_BYTES:
                return await _reply(writer, 431, "request head too large")
            request = _parse_head(head)
            if request is None:
                return await _reply(writer, 400, "not an HTTP proxy request")
            method, host, port, rest = request
            if not self.allowlist.allows(host, port):
                self.stats.refused += 1
                key = f"{host}:{port}"
                self.stats.refused_hosts[key] = self.stats.refused_hosts.get(key, 0) + 1
                log.info("proxy %s: refused %s %s:%d", self.name, method, host, port)
                return await _reply(writer, 403, f"{host}:{port} is not on this sandbox's "
                                    "allowlist")
            self.stats.allowed += 1
            try:
                up_r, up_w = await self._open(host, port)
                if method == "CONNECT" and self.upstream is not None:
                    up_w.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n"
                               .encode())
                    status = await asyncio.wait_for(up_r.readuntil(b"\r\n\r\n"),
                                                    CONNECT_TIMEOUT_S)
                    if status.split(b" ", 2)[1:2] != [b"200"]:
                        raise OSError(f"parent proxy: {status.splitlines()[0]!r}")
            except (TimeoutError, OSError, asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError, IndexError) as e:
                self.stats.failed += 1
                return await _reply(writer, 502, f"cannot reach {host}:{port}: {e}")
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up_w.write(rest if self.upstream is not None else _origin_form(rest))
            await asyncio.gather(self._pump(reader, up_w, up=True),
                                 self._pump(up_r, writer, up=False))
        except Exception:  # one connection's trouble must never reach the worker
            log.debug("proxy %s: connection failed", self.name, exc_info=True)
        finally:
            self._writers.discard(writer)
            for w in (writer, up_w):
                if w is not None:
                    w.close()

    async def _open(self, host: str, port: int):
        target = self.upstream or (host, port)
        return await asyncio.wait_for(asyncio.open_connection(*target), CONNECT_TIMEOUT_S)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *,
                    up: bool) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                if up:
                    self.stats.bytes_up += len(data)
                else:
                    self.stats.bytes_down += len(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except (ConnectionError, OSError, RuntimeError):
            dst.close()


def _parse_head(head: bytes) -> tuple[str, str, int, bytes] | None:
    """(method, host, port, the head to send upstream, absolute form) or None."""
    try:
        text = head.decode("latin-1")
        line, _, headers = text.partition("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        return None
    if not version.startswith("HTTP/1.") or not method.isalpha():
        return None
    if method == "CONNECT":
        host, port = _host_port(target, 443)
        if host is None:
            return None
        return method, host, port, b""
    if not target.lower().startswith("http://"):
        return None
    authority = target[7:].split("/", 1)[0]
    if "@" in authority:
        return None
    host, port = _host_port(authority, 80)
    if host is None:
        return None
    kept = [h for h in headers.split("\r\n") if h and not h.lower().startswith(
        ("proxy-", "connection:", "keep-alive:", "host:"))]
    # the Host the allowlist checked, never the client's own (a CDN routes by Host)
    out = "\r\n".join([f"{method} {target} HTTP/1.1", f"Host: {authority}", *kept,
                        "Connection: close", "", ""])
    return method, host, port, out.encode("latin-1")


def _host_port(authority: str, default: int) -> tuple[str | None, int]:
    if authority.startswith("["):
        host, _, tail = authority[1:].partition("]")
        port = tail.removeprefix(":")
    else:
        host, _, port = authority.partition(":")
    if not host or (port and not port.isdigit()):
        return None, 0
    value = int(port) if port else default
    return (host, value) if 0 < value < 65536 else (None, 0)


def _origin_form(head: bytes) -> bytes:
    """``GET http://host/path`` -> ``GET /path`` (what an origin server expects)."""
    line, sep, rest = head.partition(b"\r\n")
    method, target, version = line.split(b" ")
    path = target[7:].partition(b"/")[1:]
    return b" ".join([method, b"".join(path) or b"/", version]) + sep + rest


async def _reply(writer: asyncio.StreamWriter, code: int, text: str) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large",
              502: "Bad Gateway"}[code]
    body = f"sandfleet proxy: {text}\n".encode()
    writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: "
                 f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    with contextlib.suppress(Exception):
        await writer.drain()


# ------------------------------------------------------------------- the socket in the sandbox

_CHILD = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
chan, port = int(sys.argv[1]), int(sys.argv[2])
for fd in map(int, sys.argv[3:]):
    if libc.setns(fd, 0) != 0:
        e = ctypes.get_errno()
        sys.exit("setns(%s): %s" % (os.readlink("/proc/self/fd/%d" % fd), os.strerror(e)))
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(128)
socket.send_fds(socket.socket(fileno=chan), [b"ok"], [s.fileno()])
"""


def listen_in_netns(pid: int, port: int = PROXY_PORT, *, timeout: float = 30.0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:``port`` in the network namespace of process
    ``pid`` (a sandbox's). A child joins ``pid``'s user namespace first where it differs
    from ours and we are not root (a rootless Apptainer instance's, which its owner may
    enter), then its network namespace, binds, and passes the socket back (SCM_RIGHTS).
    The namespaces are opened here, so the child joins exactly those even if ``pid`` ends
    meanwhile. OSError naming the step when any of that fails."""
    fds: list[int] = []
    try:
        if os.geteuid() != 0 and os.stat(f"/proc/{pid}/ns/user").st_ino != \
                os.stat("/proc/self/ns/user").st_ino:
            fds.append(os.open(f"/proc/{pid}/ns/user", os.O_RDONLY))
        fds.append(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY))
        if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
            raise OSError(f"process {pid} shares this node's network namespace: no private "
                          "network to put a proxy in")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            proc = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _CHILD, str(theirs.fileno()), str(port),
                 *map(str, fds)], pass_fds=(theirs.fileno(), *fds), capture_output=True,
                timeout=timeout, text=True, env={"PATH": os.defpath})
            if proc.returncode != 0:
                said = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
                raise OSError(f"proxy socket in the sandbox's network (pid {pid}): {said[-1]}")
            ours.setblocking(False)
            _, got, _, _ = socket.recv_fds(ours, 16, 1)
            if not got:
                raise OSError("proxy socket: the helper sent no socket")
            return socket.socket(fileno=got[0])
    finally:
        for fd in fds:
            os.close(fd)


class ProxyPool:
    """The worker's proxies, by lease: ``open`` after the sandbox starts (a runtime that
    can host one has ``netns_pid(sandbox_id)``: a process in the sandbox's network
    namespace), ``close`` before its verifier and at teardown (idempotent)."""

    def __init__(self, upstream: str = "", *, trust_node_ca: bool = True):
        self.upstream = parse_upstream(upstream)
        self.node_ca = node_ca() if trust_node_ca else None
        self.proxies: dict[str, AllowlistProxy] = {}
        self._ca_done: set[str] = set()

    async def open(self, lease_id: str, runtime, allowed_hosts: Iterable[str]) -> None:
        hosts = tuple(allowed_hosts)
        if not hosts or lease_id in self.proxies:
            return
        pid_of = getattr(runtime, "netns_pid", None)
        if pid_of is None:
            raise SandboxStartError(lease_id, f"runtime {type(runtime).__name__} cannot "
                                    "enforce an allowlist network (no netns_pid)")
        loop = asyncio.get_running_loop()
        try:
            sock = await loop.run_in_executor(None, lambda: listen_in_netns(pid_of(lease_id)))
        except OSError as e:
            raise SandboxStartError(lease_id, f"allowlist network: {e}") from None
        if lease_id not in self._ca_done:  # once per sandbox (not again after a verifier)
            try:
                await loop.run_in_executor(None, install_ca, runtime, lease_id, self.node_ca)
                if getattr(runtime, "single_id_userns", False):
                    await loop.run_in_executor(None, install_apt_conf, runtime, lease_id)
            except Exception as e:  # noqa: BLE001 - any failure to copy it fails the start
                sock.close()
                raise SandboxStartError(lease_id, f"allowlist network: {CA_PATH}: {e}") \
                    from None
            self._ca_done.add(lease_id)
        proxy = AllowlistProxy(HostAllowlist(hosts), upstream=self.upstream, name=lease_id)
        await proxy.start(sock)
        self.proxies[lease_id] = proxy

    async def reopen(self, lease_id: str, runtime, allowed_hosts: Iterable[str]) -> None:
        """``open`` again after a verifier (the agent's turn is back: a multi-step task);
        a failure leaves the sandbox offline, logged."""
        try:
            await self.open(lease_id, runtime, allowed_hosts)
        except SandboxStartError as e:
            log.warning("proxy %s not reopened after its verifier: %s", lease_id, e.reason)

    async def close(self, lease_id: str, *, done: bool = False) -> None:
        """``done``: the sandbox is going away (forget it)."""
        if done:
            self._ca_done.discard(lease_id)
        proxy = self.proxies.pop(lease_id, None)
        if proxy is not None:
            await proxy.close()
            s = proxy.stats
            log.info("proxy %s closed: %d allowed, %d refused %s, %d failed, %d B up, %d B down",
                     lease_id, s.allowed, s.refused, s.refused_hosts or "", s.failed,
                     s.bytes_up, s.bytes_down)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    """One event loop in a daemon thread, for proxies of callers that have none."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="netproxy", daemon=True).start()
        return _loop


class ProxiedRuntime:
    """A runtime whose sandboxes with ``allowed_hosts`` get their proxy as a worker gives it
    (open after ``start``, closed for ``verify`` and opened again after, closed at
    ``stop``), for callers without a worker: build-time image checks. Everything else is
    the wrapped runtime's."""

    def __init__(self, runtime, upstream: str = ""):
        self._runtime, self._pool = runtime, ProxyPool(upstream)
        self._hosts: dict[str, tuple[str, ...]] = {}

    def __getattr__(self, name: str):
        return getattr(self._runtime, name)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, _background_loop()).result(120)

    def start(self, sandbox_id: str, spec) -> None:
        self._runtime.start(sandbox_id, spec)
        if spec.allowed_hosts:
            try:
                self._run(self._pool.open(sandbox_id, self._runtime, spec.allowed_hosts))
            except BaseException:
                self._runtime.stop(sandbox_id)
                raise
            self._hosts[sandbox_id] = tuple(spec.allowed_hosts)

    def verify(self, sandbox_id: str, *args, **kwargs):
        self._run(self._pool.close(sandbox_id))
        try:
            return self._runtime.verify(sandbox_id, *args, **kwargs)
        finally:
            if sandbox_id in self._hosts:
                self._run(self._pool.reopen(sandbox_id, self._runtime, self._hosts[sandbox_id]))

    def stop(self, sandbox_id: str) -> None:
        self._hosts.pop(sandbox_id, None)
        self._run(self._pool.close(sandbox_id, done=True))
        self._runtime.stop(sandbox_id)
