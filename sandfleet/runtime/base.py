"""What every sandbox runtime offers, and the generic half of it.

A *runtime* starts sandboxes from SIF images on this node and runs things in them. The
``Runtime`` protocol is the whole interface; ``SandboxSpec`` says what to start;
``ExecResult`` is what a command gives back. Policy outcomes (non-zero exit, timeout, OOM)
are results; infrastructure failures (``SandboxLost``, ``ImageMissing``,
``SandboxStartError``) are exceptions from ``sandfleet.errors``.

``CommandRuntime`` does the generic work once, on top of one hook, ``_enter(sandbox_id,
argv, cwd, env) -> host argv``, that each backend fills: ``exec`` (output capture with a
head+tail cap, a timeout that kills the command's process group), ``popen``, and files in
and out as tar streams through the sandbox's own ``tar`` (so paths resolve inside the
sandbox and a symlink cannot point a copy at the host).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import selectors
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from sandfleet.netproxy import HostAllowlist, proxy_env

log = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 1 << 20
"""Default cap on the output an exec keeps (head and tail halves)."""
DRAIN_GRACE_S = 0.2
"""After the command exits, how long to keep reading output held open by its children."""
TIMEOUT_EXIT_CODE = 124
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
OWNER_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")


@dataclass(frozen=True)
class SandboxSpec:
    """What to start: an image and its limits. The same spec runs on every runtime."""

    image: Path
    """The SIF file (a squashfs root filesystem), readable on this node."""
    cpus: int = 2
    """CPUs the sandbox may use (pinned where the runtime can)."""
    memory_mb: int = 2048
    """Memory limit; the kernel OOM-kills inside the sandbox past it."""
    storage_mb: int = 10240
    """Disk quota of the sandbox's writable layer; past it, writes fail with ENOSPC."""
    network: bool = False
    """Share the node's network; False gives a private network namespace with only ``lo``."""
    max_lifetime_s: float = 4 * 3600
    """Hard deadline from start: the sandbox dies then even if every daemon is gone."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment on top of the image's own (/.singularity.d/env)."""
    workdir: str = "/"
    """Working directory of commands that do not give their own."""
    hostname: str = "sandbox"
    user: str = ""
    """Who commands run as, as Docker's USER says it (``name`` or ``uid``, optionally
    ``:group``; looked up in the sandbox's /etc/passwd and /etc/group): what exec and popen
    start, the shell among them. "" is root. File copies and the verifier run as root.
    The local runtime applies it; Apptainer's commands run as the calling user."""
    allowed_hosts: tuple[str, ...] = ()
    """The allowlist network: with hosts (names, ``*.domain``, IPs or CIDR ranges, each
    optionally ``:port``), the sandbox keeps its private network with only ``lo`` and may reach
    these hosts over http(s) through the worker's proxy (``sandfleet.netproxy``), nothing else;
    ``env`` then names the proxy (``http_proxy``...). Empty: ``network`` alone decides."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "image", Path(self.image))
        if self.cpus < 1 or self.memory_mb < 16 or self.storage_mb < 16 \
                or self.max_lifetime_s <= 0:
            raise ValueError(f"bad limits in {self}")
        if not self.workdir.startswith("/"):
            raise ValueError(f"workdir must be absolute: {self.workdir!r}")
        if self.user and not USER_RE.fullmatch(self.user):
            raise ValueError(f"user must be a name or uid, optionally :group, got "
                             f"{self.user!r}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        if self.allowed_hosts:
            if self.network:
                raise ValueError("allowed_hosts with network=True: the allowlist is a private "
                                 "network with a proxy; ask for one or the other")
            HostAllowlist(self.allowed_hosts)  # ValueError naming a bad entry
            object.__setattr__(self, "env", {**self.env, **proxy_env()})

    def to_dict(self) -> dict[str, Any]:
        data = {**asdict(self), "image": str(self.image)}
        if not self.allowed_hosts:  # as on the wire: absent when empty
            del data["allowed_hosts"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SandboxSpec:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown SandboxSpec fields: {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class ExecResult:
    output: str
    """stdout and stderr interleaved, capped (head and tail kept, the cut marked)."""
    exit_code: int
    """The command's exit status; 128+N when killed by signal N; 124 when timed out."""
    timed_out: bool
    oom: bool
    """Something in the sandbox was OOM-killed while the command ran."""
    duration_s: float


@runtime_checkable
class Runtime(Protocol):
    """Sandboxes on this node: lifecycle (start, stop, list, reap) and operations."""

    def start(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """Start a sandbox; returns when commands can run in it."""

    def exec(self, sandbox_id: str, command: str | list[str], *, timeout: float,
             cwd: str | None = None, env: dict[str, str] | None = None,
             stdin: bytes | None = None) -> ExecResult:
        """Run a command to completion (a str runs under ``bash -c``)."""

    def popen(self, sandbox_id: str, argv: Sequence[str], *, cwd: str | None = None,
              env: dict[str, str] | None = None, **popen_kwargs: Any) -> subprocess.Popen:
        """A long-lived process in the sandbox, leading its own process group on the host."""

    def copy_in(self, sandbox_id: str, src: Path, dest: str) -> None:
        """Copy a host file or directory to path ``dest`` in the sandbox."""

    def copy_out(self, sandbox_id: str, src: str, dest: Path) -> None:
        """Copy a sandbox file or directory to host path ``dest``."""

    def verify(self, sandbox_id: str, command: list[str], *, tests: Path, logs: Path,
               timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
               agent_system: bool = False, user: str = "") -> ExecResult:
        """Run a task's verifier as ``user`` (Docker's USER; "" for root): host folder
        ``tests`` is /tests, whatever it leaves in /logs/verifier ends up in host folder
        ``logs``."""

    def stop(self, sandbox_id: str) -> None:
        """Kill the sandbox and remove its state; a no-op when it is already gone."""

    def list_running(self) -> list[str]:
        """Ids of this owner's live sandboxes on this node, read from the node's state."""

    def oom_kills(self, sandbox_id: str) -> int | None:
        """How many processes the kernel OOM-killed in the sandbox so far; None where this
        runtime cannot tell (``ExecResult.oom`` is then always False). Cheap after its first
        call per sandbox (the shell reads it before and after every command)."""

    def reap(self, keep: Iterable[str]) -> list[str]:
        """Stop every sandbox of this owner not in ``keep``; the ids stopped."""


def check_name(kind: str, value: str, pattern: re.Pattern = NAME_RE) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"bad {kind} {value!r}: must match {pattern.pattern}")
    return value


def default_owner() -> str:
    """This user's name, reduced to the characters an owner may hold."""
    import getpass

    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = f"uid{os.getuid()}"
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:64] or f"uid{os.getuid()}"


class OutputBuffer:
    """Bytes kept from a stream: the first and last ``limit // 2``, and a count of the rest."""

    def __init__(self, limit: int = MAX_OUTPUT_BYTES):
        self.half = max(limit // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.cut = 0

    def write(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.half:
                extra = len(self.tail) - self.half
                del self.tail[:extra]
                self.cut += extra

    def text(self) -> str:
        marker = f"\n[... {self.cut} bytes cut ...]\n".encode() if self.cut else b""
        return (bytes(self.head) + marker + bytes(self.tail)).decode("utf-8", "replace")


def cap_output(data: bytes, limit: int = MAX_OUTPUT_BYTES) -> str:
    """``data`` decoded, keeping head and tail within ``limit`` bytes and marking the cut."""
    buf = OutputBuffer(limit)
    buf.write(data)
    return buf.text()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temp file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_small(path: str, dir_fd: int | None = None) -> bytes | None:
    """The first 4 KiB of a /proc or cgroup file (``path`` relative to ``dir_fd`` if given),
    with bare system calls: this runs several times per shell command; None on OSError."""
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_oom_kills(path: str) -> int | None:
    """The ``oom_kill N`` count of a memory cgroup's ``memory.oom_control`` (v1) or
    ``memory.events`` (v2); None if the file or the line is missing."""
    for line in (read_small(path) or b"").splitlines():
        if line.startswith(b"oom_kill "):
            return int(line[9:])
    return None


def proc_start_time(pid: int, *, zombie_ok: bool = False) -> int | None:
    """A process's start time (clock ticks since boot), which with the pid names it for
    good; None if it is gone, or a zombie (dead, not reaped) unless ``zombie_ok``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[1].split()
    return None if rest[0] in ("Z", "X") and not zombie_ok else int(rest[19])


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                rest = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def kill_members(pgid: int) -> None:
    """SIGKILL every live process of group ``pgid`` except its leader."""
    for _ in range(5):  # members may fork while we look
        members = [pid for pid in _group_members(pgid) if pid != pgid]
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_process_group(proc: subprocess.Popen, *, grace_s: float = 2.0) -> int:
    """SIGKILL the process group ``proc`` leads, the leader last; its exit status.

    Use this, not ``os.killpg``, on what ``popen`` returns and on ``_enter`` commands: the
    leader is the host-side ``nsenter`` (or ``apptainer exec``) whose child runs inside the
    sandbox. Killed together, that child can outlive its parent for an instant and is then
    handed to the host's pid 1 as a zombie, and the sandbox's pid namespace cannot be torn
    down until that pid 1 reaps it (never, on some nodes). Killing the members first lets
    the leader reap its child and exit by itself.
    """
    kill_members(proc.pid)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        return proc.wait()


def run_capture(argv: list[str], *, timeout: float, stdin: bytes | None = None,
                env: dict[str, str] | None = None, limit: int = MAX_OUTPUT_BYTES,
                on_timeout: Callable[[], None] | None = None,
                ) -> tuple[str, int, bool, float]:
    """Run ``argv`` in its own process group: (output, exit code, timed out, seconds).

    On timeout the whole group gets SIGKILL, then ``on_timeout()`` runs (to end what left
    the group: a verifier's whole pid namespace). Output is read until the command exits and
    its pipe closes, or ``DRAIN_GRACE_S`` after it exits when a child that left the group
    still holds the pipe. A signal death is reported as 128+N, a timeout as 124.
    """
    started = time.monotonic()
    deadline = started + timeout
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else
                            subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    buf, timed_out, exited_at = OutputBuffer(limit), False, None
    pending = memoryview(stdin or b"")
    with selectors.DefaultSelector() as sel:
        assert proc.stdout is not None
        sel.register(proc.stdout, selectors.EVENT_READ)
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now > exited_at + DRAIN_GRACE_S:
                break
            if exited_at is None and now >= deadline:
                kill_members(proc.pid)  # the leader then reaps its child and exits
                timed_out, deadline = True, float("inf")
                if on_timeout is not None:
                    on_timeout()
            for key, _ in sel.select(min(max(deadline - now, 0), 0.05)):
                if key.fileobj is proc.stdout:
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        buf.write(chunk)
                    else:
                        sel.unregister(key.fileobj)
                else:
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]):]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fileobj)
                        if proc.stdin is not None:  # (registered only then)
                            proc.stdin.close()
    try:
        code = proc.wait(timeout=2.0 if timed_out else max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        timed_out, code = True, kill_process_group(proc)
    for stream in (proc.stdout, proc.stdin):
        if stream is not None and not stream.closed:
            stream.close()
    if timed_out:
        code = TIMEOUT_EXIT_CODE
    elif code < 0:
        code = 128 - code
    return buf.text(), code, timed_out, time.monotonic() - started


def _split_dest(path: str) -> tuple[str, str]:
    path = posixpath.normpath(path)
    parent, name = posixpath.split(path)
    if not path.startswith("/") or name in ("", ".", ".."):
        raise ValueError(f"need an absolute path to a file or directory, not {path!r}")
    return parent, name


def _skip_unsafe(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's ``data`` filter, skipping (not failing on) members it refuses."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError as e:
        log.warning("copy_out: skipped %s (%s)", member.name, e)
        return None


class CommandRuntime:
    """Generic exec, popen and file copies over one backend hook, ``_enter``."""

    max_output_bytes: int = MAX_OUTPUT_BYTES
    copy_timeout_s: float = 600.0

    def _enter(self, sandbox_id: str, argv: list[str], cwd: str | None,
               env: dict[str, str] | None, *, root: bool = False) -> list[str]:
        """The host argv running ``argv`` in the sandbox (as the spec's ``user``, or as root
        with ``root``); SandboxLost when it is gone."""
        raise NotImplementedError

    def _host_env(self) -> dict[str, str]:
        """The environment of the host-side process of ``_enter``'s argv."""
        return {"PATH": os.environ.get("PATH", os.defpath)}

    def _check_alive(self, sandbox_id: str) -> None:
        """Raise SandboxLost unless the sandbox is running."""
        raise NotImplementedError

    def oom_kills(self, sandbox_id: str) -> int | None:
        """OOM kills in the sandbox so far, or None where the runtime cannot tell."""
        return None

    def exec(self, sandbox_id: str, command: str | list[str], *, timeout: float,
             cwd: str | None = None, env: dict[str, str] | None = None,
             stdin: bytes | None = None) -> ExecResult:
        return self._exec(sandbox_id, command, timeout=timeout, cwd=cwd, env=env, stdin=stdin)

    def _exec(self, sandbox_id: str, command: str | list[str], *, timeout: float,
              cwd: str | None = None, env: dict[str, str] | None = None,
              stdin: bytes | None = None, root: bool = False) -> ExecResult:
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        host_argv = self._enter(sandbox_id, argv, cwd, env, root=root)
        before = self.oom_kills(sandbox_id)
        output, code, timed_out, seconds = run_capture(
            host_argv, timeout=timeout, stdin=stdin, env=self._host_env(),
            limit=self.max_output_bytes)
        self._check_alive(sandbox_id)  # died under the command: infrastructure, not a result
        after = self.oom_kills(sandbox_id)
        oom = before is not None and after is not None and after > before
        return ExecResult(output, code, timed_out, oom, seconds)

    def popen(self, sandbox_id: str, argv: Sequence[str], *, cwd: str | None = None,
              env: dict[str, str] | None = None, **popen_kwargs: Any) -> subprocess.Popen:
        return self._popen(sandbox_id, argv, cwd=cwd, env=env, **popen_kwargs)

    def _popen(self, sandbox_id: str, argv: Sequence[str], *, cwd: str | None = None,
               env: dict[str, str] | None = None, root: bool = False,
               **popen_kwargs: Any) -> subprocess.Popen:
        reserved = {"env", "cwd", "start_new_session", "preexec_fn", "process_group", "shell",
                    "executable", "args"} & popen_kwargs.keys()
        if reserved:
            raise TypeError(f"popen: {sorted(reserved)} are set by the runtime")
        host_argv = self._enter(sandbox_id, list(argv), cwd, env, root=root)
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(host_argv, env=self._host_env(), start_new_session=True,
                                **popen_kwargs)

    def _run_files(self, sandbox_id: str, argv: list[str], stdin: IO[bytes] | int,
                   stdout: IO[bytes] | int, what: str) -> None:
        with tempfile.TemporaryFile() as err:
            proc = self._popen(sandbox_id, argv, stdin=stdin, stdout=stdout, stderr=err,
                               root=True)
            try:
                code = proc.wait(timeout=self.copy_timeout_s)
            except subprocess.TimeoutExpired:
                kill_process_group(proc)
                raise TimeoutError(f"{what}: no end after {self.copy_timeout_s:.0f}s") from None
            self._check_alive(sandbox_id)
            if code != 0:
                err.seek(0)
                message = err.read()[-2000:].decode("utf-8", "replace").strip()
                if "No such file" in message or "Cannot stat" in message:
                    raise FileNotFoundError(f"{what}: {message}")
                raise OSError(f"{what} failed ({code}): {message}")

    def copy_in(self, sandbox_id: str, src: Path, dest: str) -> None:
        """Copy ``src`` to path ``dest`` in the sandbox (a directory merges into one there)."""
        src = Path(src)
        if not src.exists():
            raise FileNotFoundError(src)
        parent, name = _split_dest(dest)
        with tempfile.TemporaryFile() as archive:
            with tarfile.open(fileobj=archive, mode="w") as tar:
                tar.add(src, arcname=name)
            archive.seek(0)
            script = 'mkdir -p -- "$1" && exec tar -x --no-same-owner -f - -C "$1"'
            self._run_files(sandbox_id, ["sh", "-c", script, "sh", parent], archive,
                            subprocess.DEVNULL, f"copy_in {src} -> {sandbox_id}:{dest}")

    def verify(self, sandbox_id: str, command: list[str], *, tests: Path, logs: Path,
               timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
               agent_system: bool = False, user: str = "") -> ExecResult:
        """The verifier inside the sandbox itself, where a runtime cannot give it a process
        tree of its own: stale /logs/verifier and /tests removed, ``tests`` copied to
        /tests, ``command`` run, /logs/verifier copied to ``logs``. Not isolated from the
        agent's processes (see the local runtime's ``verify`` for one that is). ``user``
        is not applied: such a runtime's commands run as its instance's one user."""
        clear = self._exec(sandbox_id, "rm -rf /logs/verifier /tests && mkdir -p /logs/verifier",
                           timeout=60, env=env, root=True)
        if clear.exit_code != 0:
            return clear
        self.copy_in(sandbox_id, tests, "/tests")
        result = self._exec(sandbox_id, command, timeout=timeout, cwd=cwd, env=env, root=True)
        if Path(logs).exists():
            shutil.rmtree(logs)
        try:
            self.copy_out(sandbox_id, "/logs/verifier", Path(logs))
        except (FileNotFoundError, OSError) as e:
            log.info("verifier of %s left no /logs/verifier: %s", sandbox_id, e)
            Path(logs).mkdir(parents=True, exist_ok=True)
        return result

    def copy_out(self, sandbox_id: str, src: str, dest: Path) -> None:
        """Copy sandbox path ``src`` to ``dest`` on the host (an existing file is replaced).

        The archive comes from inside the sandbox, so it is untrusted: it is unpacked with
        tarfile's ``data`` filter (no absolute or escaping paths, no links out of ``dest``,
        no device files, no set-id bits); members the filter refuses are skipped.
        """
        dest = Path(dest)
        parent, name = _split_dest(src)
        if dest.is_dir() and not dest.is_symlink():
            raise FileExistsError(f"copy_out: {dest} is an existing directory")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile() as archive, \
                tempfile.TemporaryDirectory(prefix=f".{dest.name}.", dir=dest.parent) as tmp:
            self._run_files(sandbox_id, ["tar", "-c", "-f", "-", "-C", parent, "--", name],
                            subprocess.DEVNULL, archive, f"copy_out {sandbox_id}:{src}")
            archive.seek(0)
            with tarfile.open(fileobj=archive, mode="r") as tar:
                tar.extractall(tmp, filter=_skip_unsafe)
            got = Path(tmp) / name
            if not got.exists() and not got.is_symlink():
                raise FileNotFoundError(f"copy_out {sandbox_id}:{src}: not in the archive")
            os.replace(got, dest)

