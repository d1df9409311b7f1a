"""The allowlist network (sandfleet.netproxy): host matching, the proxy against a local
upstream, and real sandboxes of the local runtime that reach allowed hosts through it and
nothing else; PyPI and the Ubuntu archive for real (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import socket
import threading
import time
from pathlib import Path

import pytest

from sandfleet.config import FleetConfig
from sandfleet.errors import SandboxStartError
from sandfleet.netproxy import (
    CA_PATH,
    PROXY_PORT,
    REGISTRY_HOSTS,
    AllowlistProxy,
    HostAllowlist,
    ProxyPool,
    listen_in_netns,
    parse_upstream,
)
from sandfleet.runtime.base import SandboxSpec
from sandfleet.wire.messages import Acquire

OWNER = f"netproxy{os.getpid()}"


# ---- the allowlist

def test_names_suffixes_ips_and_ports_match_as_written():
    allow = HostAllowlist(["pypi.org", "*.archive.ubuntu.com", "10.1.0.0/16", "Mirror.Lan:8080",
                           "::1"])
    assert allow.allows("pypi.org", 443) and allow.allows("PYPI.ORG.", 80)
    assert not allow.allows("evil-pypi.org", 443) and not allow.allows("pypi.org.evil", 443)
    assert not allow.allows("sub.pypi.org", 443)  # an exact name is that name only
    assert not allow.allows("pypi.org", 22)  # 80 and 443 unless the entry names a port
    assert allow.allows("us.archive.ubuntu.com", 80)
    assert not allow.allows("archive.ubuntu.com", 80)  # '*.' is what is under the domain
    assert not allow.allows("xarchive.ubuntu.com", 80)
    assert allow.allows("10.1.2.3", 443) and not allow.allows("10.2.0.1", 443)
    assert allow.allows("mirror.lan", 8080) and not allow.allows("mirror.lan", 80)
    assert allow.allows("[::1]", 443)
    assert not allow.allows("", 443)


@pytest.mark.parametrize("entry", ["http://pypi.org", "*.*.org", "pypi.org/simple", "a b",
                                   "pypi.org:0", "", "*"])
def test_a_bad_entry_is_refused_by_name(entry):
    with pytest.raises(ValueError, match="allowed host"):
        HostAllowlist([entry])


def test_specs_and_acquire_carry_hosts_and_refuse_bad_ones():
    spec = SandboxSpec(image=Path("/x.sif"), allowed_hosts=["pypi.org"])
    assert spec.allowed_hosts == ("pypi.org",)
    assert spec.env["https_proxy"] == f"http://127.0.0.1:{PROXY_PORT}"
    assert spec.env["SSL_CERT_FILE"] == spec.env["PIP_CERT"] == CA_PATH
    assert SandboxSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="network=True"):
        SandboxSpec(image=Path("/x.sif"), network=True, allowed_hosts=["pypi.org"])
    with pytest.raises(ValueError, match="allowed host"):
        Acquire(id="a", image="/x.sif", allowed_hosts=["https://pypi.org/"])
    assert "allowed_hosts" not in Acquire(id="a", image="/x.sif").model_dump()
    assert parse_upstream("http://squid.lan:3128/") == ("squid.lan", 3128)
    with pytest.raises(ValueError, match="proxy_upstream"):
        FleetConfig(proxy_upstream="squid.lan")


def test_the_verifier_does_not_take_the_leases_proxy_for_the_images_environment():
    import base64

    from tmax.tasks.environment import parse_probe

    raw = (f"A=1\0https_proxy=http://127.0.0.1:{PROXY_PORT}\0no_proxy=localhost,127.0.0.1,::1\0"
           f"HTTP_PROXY=http://squid.lan:3128\0SSL_CERT_FILE={CA_PATH}\0").encode()
    assert parse_probe(base64.b64encode(raw).decode()) == {
        "A": "1", "HTTP_PROXY": "http://squid.lan:3128"}  # an image's own is kept


# ---- the proxy against a local upstream (on the host)

class Loop:
    """An asyncio loop in a thread (the worker's stands in for it: the proxy's own code)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def loop():
    loop = Loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def upstream(loop):
    """A plain HTTP server on the host (any path: 200 and what it was asked), also an echo
    for tunnels (a first line ``ECHO``)."""
    seen: list[bytes] = []

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n")
        if head.startswith(b"ECHO"):
            writer.write(b"echo:" + head)
            while data := await reader.read(4096):
                writer.write(data)
                await writer.drain()
        else:
            head += await reader.readuntil(b"\r\n\r\n")
            seen.append(head)
            body = b"upstream says hi to " + head.split(b" ")[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    server = loop.run(asyncio.start_server(serve, "0.0.0.0", 0))  # also as this host's name
    port = server.sockets[0].getsockname()[1]
    yield port, seen
    server.close()


def _ask(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        with contextlib.suppress(OSError):  # the proxy may have answered and closed already
            s.shutdown(socket.SHUT_WR)
        out = b""
        while data := s.recv(65536):
            out += data
        return out


def test_an_allowed_name_reaches_the_upstream_and_others_get_403(loop, upstream):
    port, seen = upstream
    proxy = AllowlistProxy(HostAllowlist([f"localhost:{port}"]))
    sock = socket.create_server(("127.0.0.1", 0))
    loop.run(proxy.start(sock))
    at = sock.getsockname()[1]
    try:
        reply = _ask(at, f"GET http://localhost:{port}/pkg?x=1 HTTP/1.1\r\nHost: evil.example\r\n"
                     "Proxy-Connection: keep-alive\r\n\r\n".encode())
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hi to /pkg?x=1")
        assert seen[-1].startswith(b"GET /pkg?x=1 HTTP/1.1\r\n")  # origin form upstream
        # the host the allowlist checked, not the one the client wrote (a CDN routes by it)
        assert f"Host: localhost:{port}".encode() in seen[-1] and b"evil" not in seen[-1]
        assert b"Proxy-Connection" not in seen[-1] and b"Connection: close" in seen[-1]
        n = len(seen)
        for target in (f"127.0.0.1:{port}", f"localhost:{port + 1}", "example.com"):
            reply = _ask(at, f"GET http://{target}/ HTTP/1.1\r\n\r\n".encode())
            assert reply.startswith(b"HTTP/1.1 403"), reply
        reply = _ask(at, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 403") and b"not on this sandbox's allowlist" in reply
        assert len(seen) == n  # nothing refused went upstream
        # a tunnel to an allowed host carries bytes both ways
        reply = _ask(at, f"CONNECT localhost:{port} HTTP/1.1\r\n\r\nECHO\r\nmore".encode())
        assert reply == b"HTTP/1.1 200 Connection established\r\n\r\necho:ECHO\r\nmore"
        assert _ask(at, b"GET /relative HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert proxy.stats.refused == 4 and proxy.stats.allowed == 2
        assert proxy.stats.refused_hosts["example.com:443"] == 1
    finally:
        loop.run(proxy.close())


def test_a_parent_proxy_gets_what_the_allowlist_lets_through(loop, upstream):
    """proxy_upstream: the child proxy forwards allowed requests to a parent (here another
    AllowlistProxy) in absolute form and as CONNECT."""
    port, seen = upstream
    parent = AllowlistProxy(HostAllowlist([f"localhost:{port}"]))
    psock = socket.create_server(("127.0.0.1", 0))
    loop.run(parent.start(psock))
    child = AllowlistProxy(HostAllowlist([f"localhost:{port}"]),
                           upstream=("127.0.0.1", psock.getsockname()[1]))
    csock = socket.create_server(("127.0.0.1", 0))
    loop.run(child.start(csock))
    at = csock.getsockname()[1]
    try:
        reply = _ask(at, f"GET http://localhost:{port}/via HTTP/1.1\r\n\r\n".encode())
        assert reply.endswith(b"hi to /via") and parent.stats.allowed == 1
        assert seen[-1].startswith(b"GET /via HTTP/1.1\r\n")
        reply = _ask(at, f"CONNECT localhost:{port} HTTP/1.1\r\n\r\nECHO\r\n".encode())
        assert reply.endswith(b"echo:ECHO\r\n") and parent.stats.allowed == 2
        assert _ask(at, b"CONNECT example.com:443 HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 403")
        assert parent.stats.refused == 0  # refused by the child, never asked upstream
    finally:
        loop.run(child.close())
        loop.run(parent.close())


def test_a_process_sharing_the_host_network_gets_no_proxy_socket():
    with pytest.raises(OSError, match="shares this node's network namespace"):
        listen_in_netns(os.getpid())


# ---- real sandboxes (local runtime, root)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the local runtime needs root")


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    from sandfleet.runtime.local import LocalRuntime

    root = tmp_path_factory.mktemp("netproxy")
    runtime = LocalRuntime(root / "state", root / "cache", owner=OWNER)
    yield runtime
    assert runtime.reap(keep=()) == []


def _host_address() -> str:
    """An address of this host other than loopback (where the route to the internet goes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        return s.getsockname()[0]


URLOPEN = ("import sys, urllib.request as u\n"
           "try:\n"
           "    print(u.urlopen(sys.argv[1], timeout=20).read().decode())\n"
           "except Exception as e:\n"
           "    print('FAILED', e); sys.exit(3)\n")
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)\n"
           "except OSError as e:\n"
           "    print('FAILED', e); sys.exit(3)\n"
           "print('CONNECTED')\n")


@needs_root
def test_an_allowlisted_sandbox_reaches_allowed_hosts_and_nothing_else(runtime, base_sif, loop,
                                                                        upstream):
    port, _ = upstream
    name = socket.gethostname()  # not "localhost": no_proxy keeps that inside
    hosts = (f"{name}:{port}",)
    pool = ProxyPool()
    runtime.start("allow1", SandboxSpec(image=base_sif, allowed_hosts=hosts))
    try:
        loop.run(pool.open("allow1", runtime, hosts))

        def run(*argv: str, env=None):
            return runtime.exec("allow1", ["python3", "-c", *argv], timeout=60, env=env)

        got = run(URLOPEN, f"http://{name}:{port}/inside")
        assert got.exit_code == 0 and "hi to /inside" in got.output, got.output
        got = run(URLOPEN, f"http://127.0.0.1:{port}/")  # not on the list (and no_proxy)
        assert got.exit_code == 3 and "FAILED" in got.output
        got = run(URLOPEN, "http://example.com/")
        assert got.exit_code == 3 and "403" in got.output, got.output
        got = run(URLOPEN, "https://example.com/")
        assert got.exit_code == 3 and "403" in got.output, got.output
        # the proxy's own environment gone: no route anywhere but the sandbox's loopback
        for address in (_host_address(), "1.1.1.1", "127.0.0.1"):
            got = run(CONNECT, address, str(port))
            assert got.exit_code == 3 and "FAILED" in got.output, (address, got.output)
        stats = pool.proxies["allow1"].stats
        assert stats.allowed == 1 and stats.refused == 2
        # the verifier's policy: the proxy is gone before it runs
        loop.run(pool.close("allow1"))
        got = run(URLOPEN, f"http://{name}:{port}/after")
        assert got.exit_code == 3 and "FAILED" in got.output
    finally:
        loop.run(pool.close("allow1"))
        runtime.stop("allow1")


@needs_root
def test_an_offline_sandbox_gets_no_proxy(runtime, base_sif, loop, upstream):
    port, _ = upstream
    runtime.start("off1", SandboxSpec(image=base_sif))
    try:
        got = runtime.exec("off1", ["python3", "-c", URLOPEN, f"http://localhost:{port}/"],
                           timeout=60, env={"http_proxy": f"http://127.0.0.1:{PROXY_PORT}"})
        assert got.exit_code == 3 and "FAILED" in got.output
    finally:
        runtime.stop("off1")


def test_a_runtime_without_netns_pid_is_a_clear_refusal(loop):
    with pytest.raises(SandboxStartError, match="cannot enforce an allowlist"):
        loop.run(ProxyPool().open("x", object(), ("pypi.org",)))


# ---- the registries for real (this machine reaches PyPI and the Ubuntu archive)

@pytest.fixture(scope="module")
def python_sif(base_store) -> Path:
    """The python-3.12 base (Ubuntu noble with pip and apt)."""
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    ImageBuilds(base_store, LocalBuilder(cache)).ensure_base("python-3.12")
    return base_store.path(base_store.read().bases["python-3.12"].sif)


@needs_root
@pytest.mark.slow
def test_pip_and_apt_install_through_the_registries_allowlist(runtime, python_sif, loop):
    pool = ProxyPool()
    runtime.start("reg1", SandboxSpec(image=python_sif, allowed_hosts=REGISTRY_HOSTS))
    try:
        loop.run(pool.open("reg1", runtime, REGISTRY_HOSTS))
        # this machine's egress presents its own authority for https: the sandbox trusts
        # what the node trusts as well as its image's (CA_PATH), nothing to do here
        got = runtime.exec("reg1", f"grep -c BEGIN {CA_PATH}; echo $PIP_CERT", timeout=30)
        assert int(got.output.split()[0]) > 100 and got.output.split()[1] == CA_PATH
        env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        t0 = time.monotonic()
        got = runtime.exec("reg1", "python3 -m pip install --no-cache-dir "
                           "--break-system-packages six==1.17.0 && python3 -c 'import six'",
                           timeout=300, env=env)
        print(f"pip install six through the proxy: {time.monotonic() - t0:.1f} s")
        assert got.exit_code == 0, got.output[-2000:]
        t0 = time.monotonic()
        got = runtime.exec("reg1", "apt-get update -q && apt-get install -y -q "
                           "--no-install-recommends tree && tree --version", timeout=600)
        print(f"apt-get update + install tree through the proxy: {time.monotonic() - t0:.1f} s")
        assert got.exit_code == 0 and "tree v" in got.output, got.output[-2000:]
        got = runtime.exec("reg1", "python3 -m pip download --no-deps -d /tmp/x --retries 0 "
                           "--index-url https://example.com/simple six", timeout=120, env=env)
        stats = pool.proxies["reg1"].stats
        assert got.exit_code != 0 and stats.refused_hosts.get("example.com:443"), got.output
        assert stats.allowed > 3 and stats.bytes_down > 1 << 20
    finally:
        loop.run(pool.close("reg1"))
        runtime.stop("reg1")


# ---- through a fleet: the wire, the worker's proxy, the verifier offline

VERIFIER_PROBE = """#!/bin/bash
mkdir -p /logs/verifier
if python3 -c 'import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=10)' "$URL"
then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


@pytest.mark.slow
@needs_root
@pytest.mark.sandbox
def test_a_fleet_lease_with_allowed_hosts_and_its_offline_verifier(tmp_path, base_sif, upstream,
                                                                   example_fleet):
    from sandfleet.client import FleetClient

    port, _ = upstream
    name = socket.gethostname()
    url = f"http://{name}:{port}/fleet"
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text(VERIFIER_PROBE)
    fetch = f"python3 -c {shlex.quote(URLOPEN)}"
    with FleetClient(example_fleet.state) as client, \
            client.lease(base_sif, ttl_s=60, allowed_hosts=[f"{name}:{port}"]) as lease:
        got = lease.run(f"{fetch} {url}")
        assert got.exit_code == 0 and "hi to /fleet" in got.output, got.output
        got = lease.run(f"{fetch} https://example.com/")
        assert got.exit_code == 3 and "403" in got.output, got.output
        result, logs = lease.verify(tests, ["bash", "/tests/test.sh"], timeout=60,
                                    dest=tmp_path / "logs", env={
                                        "URL": url, "http_proxy": f"http://127.0.0.1:{PROXY_PORT}"})
        assert (logs / "reward.txt").read_text().strip() == "0", result.output
        got = lease.run(f"{fetch} {url}")  # the agent's turn again
        assert got.exit_code == 0 and "hi to /fleet" in got.output, got.output
        # the controller refuses a bad list before any worker sees it
        with pytest.raises(Exception, match="allowed host"):
            client.lease(base_sif, allowed_hosts=["http://pypi.org/"]).__enter__()


# ---- build-time checks: the reference solution runs as the agent would

SAYS_NOTHING = 'schema_version = "1.4"\n[metadata]\ndifficulty = "easy"\n'
APT_SOLVE = "#!/bin/bash\ncd /app && apt-get update -qq && apt-get download -qq tree\n"
DEB_TEST = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
            "dpkg-deb -f /app/tree_*.deb Package | grep -qx tree && r=1 || r=0\n"
            "echo $r > /logs/verifier/reward.txt\n")


@needs_root
@pytest.mark.slow
def test_a_harbor_task_that_says_nothing_reaches_the_registries(tmp_path, base_store,
                                                                example_fleet):
    """TB 2.0's reference solutions install at agent time: at build-time checks the oracle
    fetches a package from the Debian archive through the proxy (1), the untouched
    environment has none (0); a rollout's agent gets the registries by default (1) and
    nothing with ``agent_network = "offline"`` (0)."""
    from sandfleet.client import AsyncFleetClient
    from tests.conftest import checked_build, passing_checks_log
    from tests.unit.test_tasks import make_task
    from tmax.agent.config import AgentConfig
    from tmax.agent.policies.simple import OraclePolicy
    from tmax.rollout.run import TaskImages, rollout

    files = {"task.toml": SAYS_NOTHING, "solution/solve.sh": APT_SOLVE, "tests/test.sh": DEB_TEST}
    built = checked_build(tmp_path, base_store,
                          lambda tasks: make_task(tasks, "apt-at-agent-time", **files))
    log = passing_checks_log(*built)
    assert "Get:" in log or "tree" in log, log[-2000:]
    store, task, _ = built

    async def go(network: str):
        async with AsyncFleetClient(example_fleet.state) as client:
            return await rollout(task, OraclePolicy(), client, TaskImages(store.root),
                                 AgentConfig(agent_network=network))

    for network, reward in (("registries", 1.0), ("offline", 0.0)):
        traj = asyncio.run(go(network))
        assert (traj.reward, traj.infra_failure) == (reward, None), traj.verifier_output


def test_one_sandbox_cannot_hold_more_than_its_share_of_connections(loop, monkeypatch):
    from sandfleet import netproxy

    monkeypatch.setattr(netproxy, "MAX_CONNECTIONS", 3)
    proxy = AllowlistProxy(HostAllowlist(["pypi.org"]))
    sock = socket.create_server(("127.0.0.1", 0))
    loop.run(proxy.start(sock))
    held = [socket.create_connection(sock.getsockname(), timeout=10) for _ in range(3)]
    try:
        for _ in range(50):  # the proxy has accepted the three
            if len(proxy._writers) == 3:
                break
            time.sleep(0.05)
        with contextlib.suppress(ConnectionResetError):  # closed as it is accepted
            assert _ask(sock.getsockname()[1], b"GET http://pypi.org/ HTTP/1.1\r\n\r\n") == b""
        assert proxy.stats.refused == 1
    finally:
        for s in held:
            s.close()
        loop.run(proxy.close())
