"""The local runtime: bubblewrap sandboxes over a SIF's root filesystem, for machines
without Apptainer (run as root; the cgroup limits need a writable cgroup v1 tree).

Root filesystem. Each image is *extracted once* (``sif.extract``, unsquashfs) into
``cache_dir/rootfs/<key>``, key = sha256 of (realpath, size, mtime_ns), under a file
lock, and shared read-only by every sandbox of that image as the lower layer of a
per-sandbox overlay (upper and work dirs in ``state_dir/sandboxes/<owner>-<id>/``).
Extracting rather than squashfuse-mounting: no FUSE daemon per image whose death would
break every sandbox on it, no mount to clean up after a crash, and native file speed; the
cost is disk (the image's unpacked size, once per node) and one unsquashfs per image.

Process tree of one sandbox (host view)::

    timeout -s KILL <lifetime+5>              own session: the host-side hard deadline
      unshare -m --propagation private        private mount namespace
        sh: join cgroups; mount -t overlay -o nodev ... merged; exec
          bwrap --bind merged / --unshare-all --unshare-user --as-pid-1 --die-with-parent
            bash (pid 1 inside): ignores every signal, sleeps until <lifetime>, exits

The overlay exists only in that private mount namespace, so nothing reaches the host's
mount table and it vanishes with the sandbox's last process. When pid 1 exits (deadline,
``stop``) the kernel kills everything in the sandbox's pid namespace. Commands enter with
``nsenter -t <pid 1> -U -m -p -n -i -u -C -r`` (after joining the sandbox's cgroups), so
every process of a sandbox lives in its namespaces and dies with it; inside, ``sh`` sets
the working directory and ``env -i`` the environment. ``sandbox.json`` records the pids
and their start times, so ``list_running``/``reap``/``stop`` work from a fresh instance
and never touch a reused pid or another owner's sandbox.

Enforced (threat model: an untrusted agent as root inside, a semi-trusted image):

- Filesystem: only the overlay root plus a fresh /dev and /proc; nothing of the host.
  Writes (anywhere, /tmp included) land in the sandbox's upper dir, never in the image or
  the cache. The overlay is mounted ``nodev``.
- User namespace with uids and gids 0-65535 mapped to themselves: root inside has
  capabilities only over the sandbox's namespaces (no mknod, no host mounts, no module
  loading); useradd/su/chown inside work as in a container. Since the same uids own the
  upper dir's files on the host, keep ``state_dir`` out of other users' reach.
- Fresh pid, mount, ipc, uts, cgroup and (unless ``spec.network``) net namespaces; a new
  session (no terminal injection); a clean environment: the image's
  /.singularity.d/env/{10-docker2singularity,90-environment}.sh sourced, then
  ``spec.env``, then the call's ``env``.
- Max lifetime, twice: pid 1 inside ends at the deadline (signals from inside cannot stop
  it: pid 1 of a namespace ignores them), and the host ``timeout`` kills the tree 5 s
  later. Both hold if every daemon dies.
- With a writable cgroup v1 tree (``cgroup_parent`` under /sys/fs/cgroup/<controller>):
  memory (``memory.limit_in_bytes`` and ``memsw`` where present; OOM kills counted from
  ``memory.oom_control``, reported as ``ExecResult.oom``), CPU pinning to ``spec.cpus``
  CPUs of the worker's affinity, least-used first (``cpuset``), and ``pids.max``.

Not enforced: without writable cgroups, memory and pids are unlimited, CPU pinning is
``taskset`` (the sandbox may widen its own affinity) and ``oom`` is always False. No CPU
time quota (pinning bounds parallelism only), no disk quota on the upper dir, no seccomp
filter. Pids are checked by start time, but a pid can be reused between that check and
``nsenter`` (microseconds). Whatever ``spec.network`` shares is the host's network.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandfleet.errors import ImageMissing, SandboxLost, SandboxStartError
from sandfleet.runtime import sif
from sandfleet.runtime.base import (
    OWNER_RE,
    CommandRuntime,
    SandboxSpec,
    check_name,
    default_owner,
    kill_group,
    proc_start_time,
    read_small,
    write_json_atomic,
)
from sandfleet.runtime.bwrap import DEFAULT_PATH, BwrapSpec

log = logging.getLogger(__name__)

TOOLS = ("timeout", "unshare", "mount", "bwrap", "nsenter", "taskset")
HOST_GRACE_S = 5
ID_MAP = "0 0 65536\n"
IMAGE_ENV_FILES = ("/.singularity.d/env/10-docker2singularity.sh",
                   "/.singularity.d/env/90-environment.sh")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# Host side, in the private mount namespace: join the cgroups given before "--", mount
# the overlay, exec the rest (bwrap).
SETUP_SH = """set -e
while [ "$1" != -- ]; do echo $$ > "$1"; shift; done; shift
mount -t overlay overlay -o "nodev,lowerdir=$1,upperdir=$2,workdir=$3" "$4"
shift 4
exec "$@"
"""
# Pid 1 inside: drops the host's log file and bwrap's fd, turns deaf to signals, reaps
# orphans (bash does), ends at the deadline.
INIT_SH = ('exec </dev/null >/dev/null 2>&1; eval "exec $2<&-"; '
           'trap "" HUP INT QUIT TERM USR1 USR2 PIPE ALRM TSTP TTIN TTOU; end=$1; '
           'while ((SECONDS < end)); do sleep $((end - SECONDS)) & wait $!; done')
# Host side of every command: join the cgroups given before "--", exec the rest (nsenter).
JOIN_SH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
# Inside, first thing of every command: working directory, then a clean environment.
ENTER_SH = 'cd -- "$1" || exit 126; shift; exec /usr/bin/env -i "$@"'
ENV_PROBE_SH = ('for f in "$@"; do if [ -r "$f" ]; then . "$f"; fi; done; '
                'unset PWD OLDPWD SHLVL _; exec env -0')


@dataclass
class SandboxRecord:
    """``sandbox.json``: what a fresh runtime instance needs to find and end a sandbox."""

    sandbox_id: str
    owner: str
    uid: int
    spec: dict
    created_at: float
    deadline: float
    leader: tuple[int, int]
    """(pid, start time) of the host-side ``timeout``, leader of the tree's process group."""
    init: tuple[int, int] | None = None
    """(pid, start time) of pid 1 inside; None until the sandbox is up."""
    cgroups: list[str] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> SandboxRecord | None:
        try:
            data = json.loads(path.read_text())
            data["leader"] = tuple(data["leader"])
            data["init"] = tuple(data["init"]) if data.get("init") else None
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    def alive(self) -> bool:
        return self.init is not None and proc_start_time(self.init[0]) == self.init[1]


def init_argv(*, lifetime_s: float, lower: Path, upper: Path, work: Path, merged: Path,
              cgroup_procs: Sequence[str], taskset: str | None, network: bool,
              hostname: str, info_fd: int, block_fd: int) -> list[str]:
    """The host command that builds one sandbox and runs its pid 1 (see module doc)."""
    bwrap = BwrapSpec(root=str(merged), network=network, hostname=hostname,
                      env={"PATH": DEFAULT_PATH, "HOME": "/root"},
                      extra_args=["--unshare-user", "--uid", "0", "--gid", "0",
                                  "--userns-block-fd", str(block_fd), "--info-fd",
                                  str(info_fd), "--as-pid-1"])
    seconds = math.ceil(lifetime_s)
    return (["timeout", "-s", "KILL", str(seconds + HOST_GRACE_S),
             "unshare", "-m", "--propagation", "private", "--",
             "sh", "-c", SETUP_SH, "sh", *cgroup_procs, "--",
             str(lower), str(upper), str(work), str(merged)]
            + (["taskset", "-c", taskset] if taskset else [])
            + bwrap.argv(["bash", "-c", INIT_SH, "sandfleet-init", str(seconds),
                           str(block_fd)]))


def enter_argv(*, init_pid: int, cgroup_procs: Sequence[str], taskset: str | None,
               cwd: str, env: dict[str, str], argv: Sequence[str]) -> list[str]:
    """The host command that runs ``argv`` inside the sandbox whose pid 1 is ``init_pid``."""
    return (["sh", "-c", JOIN_SH, "sh", *cgroup_procs, "--"]
            + (["taskset", "-c", taskset] if taskset else [])
            + ["nsenter", "-t", str(init_pid), "-U", "-m", "-p", "-n", "-i", "-u", "-C",
               "-r", "-w", "--", "/bin/sh", "-c", ENTER_SH, "sh", cwd, "--"]
            + [f"{k}={v}" for k, v in env.items()] + list(argv))


def pick_cpus(allowed: Iterable[int], n: int, load: Counter) -> list[int]:
    """The ``n`` CPUs of ``allowed`` with the fewest sandboxes on them (lowest first)."""
    ranked = sorted(allowed, key=lambda cpu: (load[cpu], cpu))
    return sorted(ranked[:n])


def image_key(path: Path) -> str:
    st = path.stat()
    ident = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _wait_gone(pid: int, start: int, timeout: float) -> bool:
    """Wait until process (pid, start) is dead (a zombie counts); whether it is."""
    deadline = time.monotonic() + timeout
    while proc_start_time(pid) == start:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Cgroups:
    """The cgroup v1 controllers (memory, cpuset, pids) this process can write under
    ``<root>/<controller>/<parent>``; one child cgroup per sandbox."""

    CONTROLLERS = ("memory", "cpuset", "pids")

    def __init__(self, parent: str = "sandfleet", root: Path = CGROUP_ROOT):
        self.parents: dict[str, Path] = {}
        for ctrl in self.CONTROLLERS:
            base, path = root / ctrl, root / ctrl / parent
            if not (base / "cgroup.procs").exists():
                continue
            try:
                path.mkdir(exist_ok=True)
                if ctrl == "cpuset":
                    for name in ("cpuset.cpus", "cpuset.mems"):
                        if not (path / name).read_text().strip():
                            (path / name).write_text((base / name).read_text())
                self.parents[ctrl] = path
            except OSError as e:
                log.info("cgroup %s not usable (%s): not enforced", path, e)

    def paths(self, name: str) -> dict[str, Path]:
        return {ctrl: parent / name for ctrl, parent in self.parents.items()}

    def create(self, name: str, *, memory_mb: int, cpus: list[int], pids_max: int
               ) -> list[Path]:
        made = []
        for ctrl, path in self.paths(name).items():
            path.mkdir(exist_ok=True)
            made.append(path)
            if ctrl == "memory":
                limit = str(memory_mb << 20)
                (path / "memory.limit_in_bytes").write_text(limit)
                try:
                    (path / "memory.memsw.limit_in_bytes").write_text(limit)
                except OSError:
                    pass  # no swap accounting: the memory limit alone holds
            elif ctrl == "cpuset":
                (path / "cpuset.mems").write_text(
                    (self.parents[ctrl] / "cpuset.mems").read_text())
                (path / "cpuset.cpus").write_text(",".join(map(str, cpus)))
            elif ctrl == "pids":
                (path / "pids.max").write_text(str(pids_max))
        return made

    @staticmethod
    def oom_kills(memory_cgroup: str | Path) -> int | None:
        text = read_small(f"{memory_cgroup}/memory.oom_control")
        for line in (text or b"").splitlines():
            if line.startswith(b"oom_kill "):
                return int(line[9:])
        return None

    @staticmethod
    def remove(path: Path, timeout: float = 5.0) -> None:
        """Kill what is left in the cgroup, then remove it (retrying while it drains)."""
        deadline = time.monotonic() + timeout
        while path.exists():
            try:
                for pid in (path / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                path.rmdir()
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    log.warning("cgroup %s not removed: %s", path, e)
                    return
                time.sleep(0.02)


class LocalRuntime(CommandRuntime):
    """Bubblewrap sandboxes over SIF images, on this machine (see the module doc)."""

    def __init__(self, state_dir: Path, cache_dir: Path, owner: str | None = None, *,
                 cgroup_parent: str = "sandfleet", pids_max: int = 4096,
                 start_timeout_s: float = 60.0, cache_max_gb: float | None = None):
        self.state_dir = Path(state_dir).resolve()
        self.cache_dir = Path(cache_dir).resolve()
        self.owner = check_name("owner", owner or default_owner(), OWNER_RE)
        for path in (self.state_dir, self.cache_dir):
            if any(c in str(path) for c in ",:\\\n"):  # they go into overlay mount options
                raise ValueError(f"{path}: ',', ':' and '\\' cannot appear in overlay paths")
        self.pids_max, self.start_timeout_s = pids_max, start_timeout_s
        self.cache_max_bytes = None if cache_max_gb is None else int(cache_max_gb * 2**30)
        self.cgroups = Cgroups(cgroup_parent)
        self._scope = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:8]
        self._records: dict[str, SandboxRecord] = {}
        self._oom_files: dict[str, str] = {}  # sandbox id -> its memory cgroup
        self._children: dict[str, subprocess.Popen] = {}  # leaders we started, to reap
        self._lock = threading.Lock()

    # ---- paths and records

    def _dir(self, sandbox_id: str) -> Path:
        return self.state_dir / "sandboxes" / f"{self.owner}-{sandbox_id}"

    def _cgroup_name(self, sandbox_id: str) -> str:
        return f"{self.owner}-{sandbox_id}.{self._scope}"

    def _record(self, sandbox_id: str) -> SandboxRecord | None:
        record = self._records.get(sandbox_id)
        if record is None:
            record = SandboxRecord.load(self._dir(sandbox_id) / "sandbox.json")
            if record is not None and (record.owner, record.uid) != (self.owner, os.getuid()):
                return None
        return record

    def _live(self, sandbox_id: str) -> SandboxRecord:
        check_name("sandbox id", sandbox_id)
        record = self._record(sandbox_id)
        if record is None or record.init is None:
            raise SandboxLost(sandbox_id, "no such sandbox on this node")
        if not record.alive():
            why = "max lifetime reached" if time.time() >= record.deadline else \
                "its processes died"
            raise SandboxLost(sandbox_id, why)
        return record

    def _check_alive(self, sandbox_id: str) -> None:
        self._live(sandbox_id)

    def _oom_kills(self, sandbox_id: str) -> int | None:
        """Read before and after every shell command: the file's path is worked out once."""
        path = self._oom_files.get(sandbox_id)
        if path is None:
            record = self._record(sandbox_id)
            memory = [p for p in (record.cgroups if record else [])
                      if Path(p).parent == self.cgroups.parents.get("memory")]
            if not memory:
                return None
            path = self._oom_files[sandbox_id] = memory[0]
        return Cgroups.oom_kills(path)

    def _procs_files(self, record: SandboxRecord) -> list[str]:
        return [str(Path(p) / "cgroup.procs") for p in record.cgroups]

    def _taskset(self, record: SandboxRecord) -> str | None:
        if "cpuset" in self.cgroups.parents or not record.cpus:
            return None
        return ",".join(map(str, record.cpus))

    def _enter(self, sandbox_id: str, argv: list[str], cwd: str | None,
               env: dict[str, str] | None) -> list[str]:
        record = self._live(sandbox_id)
        return enter_argv(init_pid=record.init[0], cgroup_procs=self._procs_files(record),
                          taskset=self._taskset(record), cwd=cwd or record.spec["workdir"],
                          env={**record.env, **(env or {})}, argv=argv)

    def _host_env(self) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH}

    # ---- images

    def rootfs(self, image: Path) -> Path:
        """The image's root filesystem in the node cache, extracted on first use."""
        try:
            sif.read_partition(image)
            key = image_key(image)
        except sif.SifError as e:
            raise ImageMissing(str(image), e.reason) from None
        except OSError as e:
            raise ImageMissing(str(image), e.strerror or str(e)) from None
        dest = self.cache_dir / "rootfs" / key
        if dest.is_dir():
            _touch(dest)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.parent / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not dest.is_dir():
                log.info("extracting %s into %s", image, dest)
                try:
                    sif.extract(image, dest)
                except sif.SifError as e:
                    raise ImageMissing(str(image), e.reason) from None
                except (RuntimeError, subprocess.SubprocessError) as e:
                    raise ImageMissing(str(image), f"cannot unpack: {e}") from None
                (dest.parent / f"{key}.size").write_text(str(_tree_size(dest)))
        if self.cache_max_bytes is not None:
            self.evict(self.cache_max_bytes, keep=key)
        return dest

    def _pin(self, image: Path) -> tuple[Path, int]:
        """The image's root and an fd holding a shared lock on it (for the sandbox leader)."""
        for _ in range(3):
            lower = self.rootfs(image)
            fd = os.open(lower.parent / f"{lower.name}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if lower.is_dir():  # not evicted between rootfs() and the lock
                return lower, fd
            os.close(fd)
        raise ImageMissing(str(image), "its unpacked root kept being evicted; raise "
                           "cache_max_gb")

    def evict(self, max_bytes: int, keep: str | None = None) -> list[str]:
        """Remove least recently used roots not in use until the cache fits ``max_bytes``;
        returns the keys removed."""
        root = self.cache_dir / "rootfs"
        entries = []
        for d in root.iterdir() if root.is_dir() else ():
            if d.is_dir() and not d.name.startswith("."):
                size_file = root / f"{d.name}.size"
                try:
                    size = int(size_file.read_text())
                except (OSError, ValueError):
                    size = _tree_size(d)
                entries.append((d.stat().st_mtime, d.name, size))
        total = sum(e[2] for e in entries)
        removed = []
        for _, key, size in sorted(entries):
            if total <= max_bytes:
                break
            if key == keep:
                continue
            with open(root / f"{key}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a sandbox (or an extraction) uses it
                trash = root / f".evicted-{key}-{os.getpid()}"
                try:
                    os.rename(root / key, trash)
                except FileNotFoundError:
                    continue
                (root / f"{key}.size").unlink(missing_ok=True)
            shutil.rmtree(trash, ignore_errors=True)
            total -= size
            removed.append(key)
            log.info("evicted unpacked image %s (%d MB) from %s", key, size >> 20, root)
        return removed

    # ---- lifecycle

    def start(self, sandbox_id: str, spec: SandboxSpec) -> None:
        check_name("sandbox id", sandbox_id)
        missing = [t for t in TOOLS if shutil.which(t, path=DEFAULT_PATH) is None]
        if missing:
            raise SandboxStartError(sandbox_id, f"missing tools: {', '.join(missing)}")
        lower, pin = self._pin(spec.image)
        try:
            self._start(sandbox_id, spec, lower, pin)
        finally:
            os.close(pin)  # the leader keeps its own copy for the sandbox's life

    def _start(self, sandbox_id: str, spec: SandboxSpec, lower: Path, pin: int) -> None:
        home = self._dir(sandbox_id)
        with self._lock:
            if home.exists():
                old = self._record(sandbox_id)
                if old is not None and old.alive():
                    raise SandboxStartError(sandbox_id, "already running")
                self._destroy(sandbox_id, old)
            for sub in ("upper", "work", "merged"):
                (home / sub).mkdir(parents=True)
            cpus = pick_cpus(sorted(os.sched_getaffinity(0)), spec.cpus, self._cpu_load())
            try:
                cgroups = self.cgroups.create(self._cgroup_name(sandbox_id),
                                              memory_mb=spec.memory_mb, cpus=cpus,
                                              pids_max=self.pids_max)
            except OSError as e:
                self._destroy(sandbox_id, None)
                raise SandboxStartError(sandbox_id, f"cgroup setup: {e}") from None
            now = time.time()
            record = SandboxRecord(sandbox_id, self.owner, os.getuid(), spec.to_dict(), now,
                                   now + spec.max_lifetime_s, (0, 0),
                                   cgroups=[str(p) for p in cgroups], cpus=cpus)
            try:
                self._launch(record, spec, lower, home, pin)
                record.env = {"PATH": DEFAULT_PATH, "HOME": "/root",
                              **self._image_env(sandbox_id), **spec.env}
                record.save(home / "sandbox.json")
            except BaseException as e:
                if isinstance(e, (SandboxStartError, KeyboardInterrupt)):
                    self._destroy(sandbox_id, record)
                    raise
                error = self._start_error(sandbox_id, home, f"{type(e).__name__}: {e}")
                self._destroy(sandbox_id, record)
                raise error from e

    def _launch(self, record: SandboxRecord, spec: SandboxSpec, lower: Path,
                home: Path, pin: int) -> None:
        """Start the process tree; returns once pid 1 runs inside (record updated)."""
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        argv = init_argv(lifetime_s=spec.max_lifetime_s, lower=lower, upper=home / "upper",
                         work=home / "work", merged=home / "merged",
                         cgroup_procs=self._procs_files(record), taskset=self._taskset(record),
                         network=spec.network, hostname=spec.hostname, info_fd=info_w,
                         block_fd=block_r)
        try:
            with open(home / "init.log", "wb") as logfile:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfile,
                                        stderr=subprocess.STDOUT, pass_fds=(info_w, block_r, pin),
                                        env={"PATH": DEFAULT_PATH}, start_new_session=True)
            self._children[record.sandbox_id] = proc
            record.leader = (proc.pid, proc_start_time(proc.pid) or 0)
            record.save(home / "sandbox.json")  # from here on, stop() can find the tree
            os.close(info_w)
            os.close(block_r)
            info_w = block_r = -1
            deadline = time.monotonic() + self.start_timeout_s
            info = self._read_info(info_r, deadline)
            if info is None:
                proc.poll()
                raise self._start_error(record.sandbox_id, home, "bwrap gave no sandbox pid")
            child = info["child-pid"]
            for name in ("uid_map", "gid_map"):
                Path(f"/proc/{child}/{name}").write_text(ID_MAP)
            os.write(block_w, b"1")
            while (comm := _read(f"/proc/{child}/comm")) == "bwrap":  # not yet exec'd
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            start = proc_start_time(child)
            if comm in ("bwrap", "") or start is None:
                raise self._start_error(record.sandbox_id, home, "pid 1 did not start")
            record.init = (child, start)
            self._records[record.sandbox_id] = record
        finally:
            for fd in (info_r, info_w, block_r, block_w):
                if fd >= 0:
                    os.close(fd)

    @staticmethod
    def _read_info(fd: int, deadline: float) -> dict | None:
        """bwrap's --info-fd JSON, or None if it closed or the deadline passed first."""
        data = b""
        while True:
            try:
                return json.loads(data)
            except ValueError:
                pass
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                return None
            data += chunk

    @staticmethod
    def _start_error(sandbox_id: str, home: Path, what: str) -> SandboxStartError:
        try:
            tail = (home / "init.log").read_text(errors="replace")[-1500:].strip()
        except OSError:
            tail = ""
        return SandboxStartError(sandbox_id, f"{what}: {tail or 'no output'}")

    def _image_env(self, sandbox_id: str) -> dict[str, str]:
        result = self.exec(sandbox_id, ["bash", "-c", ENV_PROBE_SH, "sh", *IMAGE_ENV_FILES],
                           timeout=30, env={})
        if result.exit_code != 0:
            raise SandboxStartError(sandbox_id, f"image environment: {result.output[-500:]}")
        pairs = (item.partition("=") for item in result.output.split("\0") if "=" in item)
        return {key: value for key, _, value in pairs}

    def _cpu_load(self) -> Counter:
        load: Counter = Counter()
        for path in (self.state_dir / "sandboxes").glob("*/sandbox.json"):
            record = SandboxRecord.load(path)
            if record is not None and record.alive():
                load.update(record.cpus)
        return load

    def stop(self, sandbox_id: str) -> None:
        check_name("sandbox id", sandbox_id)
        with self._lock:
            self._destroy(sandbox_id, self._record(sandbox_id))

    def _destroy(self, sandbox_id: str, record: SandboxRecord | None) -> None:
        """Kill the tree, remove cgroups and state. Safe on half-started and dead ones."""
        self._records.pop(sandbox_id, None)
        self._oom_files.pop(sandbox_id, None)
        home = self._dir(sandbox_id)
        if record is not None:
            # Pid 1 inside first: the kernel kills the rest, bwrap reaps it and exits, then
            # timeout does. Killing the host side first would orphan pid 1 to the host's
            # pid 1, and the namespace would wait for that one to reap it.
            init, leader = record.init, record.leader
            if init is not None and proc_start_time(init[0]) == init[1]:
                os.kill(init[0], signal.SIGKILL)
                if not _wait_gone(*init, timeout=5):
                    log.warning("sandbox %s: pid 1 outlives SIGKILL", sandbox_id)
            if leader[0] and not _wait_gone(*leader, timeout=1 if init else 0):
                kill_group(leader[0])
        child = self._children.pop(sandbox_id, None)
        if child is not None:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("sandbox %s: leader %d still running", sandbox_id, child.pid)
        for path in self.cgroups.paths(self._cgroup_name(sandbox_id)).values():
            Cgroups.remove(path)
        if home.exists():
            shutil.rmtree(home, ignore_errors=True)
            if home.exists():
                log.warning("sandbox %s: state dir %s not fully removed", sandbox_id, home)

    def _own_records(self) -> dict[str, SandboxRecord | None]:
        """Every sandbox dir of this owner here: id -> record (None if unreadable)."""
        prefix, found = f"{self.owner}-", {}
        root = self.state_dir / "sandboxes"
        for home in sorted(root.iterdir()) if root.is_dir() else []:
            if home.name.startswith(prefix):
                sandbox_id = home.name[len(prefix):]
                record = SandboxRecord.load(home / "sandbox.json")
                if record is None or (record.owner, record.uid) == (self.owner, os.getuid()):
                    found[sandbox_id] = record
        return found

    def list_running(self) -> list[str]:
        return [sid for sid, rec in self._own_records().items() if rec and rec.alive()]

    def reap(self, keep: Iterable[str]) -> list[str]:
        """Stop every sandbox of this owner not in ``keep``, dead leftovers included, and
        sandboxes whose state dir is gone but whose cgroups (named by owner, id and
        state dir) are still there."""
        keep = set(keep)
        gone = {sid for sid in self._own_records() if sid not in keep}
        prefix, suffix = f"{self.owner}-", f".{self._scope}"
        for parent in self.cgroups.parents.values():
            gone |= {path.name[len(prefix):-len(suffix)]
                     for path in parent.glob(f"{prefix}*{suffix}")
                     if path.name[len(prefix):-len(suffix)] not in keep}
        for sandbox_id in sorted(gone):
            self.stop(sandbox_id)
        return sorted(gone)


def _touch(path: Path) -> None:
    """Mark a cached root as used now (eviction removes the least recently used first)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _tree_size(path: Path) -> int:
    """Bytes used by the files under ``path`` (hard links counted once)."""
    seen, total = set(), 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + dirnames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
