"""The local runtime's host side: sandbox records, the helper's and bwrap's command lines,
uid ranges, cgroup v1 limits and small process helpers (``sandfleet.runtime.local``)."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import stat as _stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandfleet.runtime.base import proc_start_time, read_oom_kills, write_json_atomic
from sandfleet.runtime.bwrap import DEFAULT_PATH, BwrapSpec
from sandfleet.runtime.helper import OOM_SCORE_ADJ

log = logging.getLogger(__name__)

HELPER = Path(__file__).with_name("helper.py")
SHM_BYTES = 64 << 20
"""Size of a sandbox's /dev/shm (Docker's default); its pages count against its memory."""
UID_COUNT = 65536
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTAINER_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
                  "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                  "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_MKNOD", "CAP_AUDIT_WRITE",
                  "CAP_SETFCAP")
"""What root inside keeps (Docker's default set); must match helper.CONTAINER_CAPS."""

RESERVE_FILES, RESERVE_BYTES = 8, 64 << 10
"""The disk's reserve: files of real blocks, freed by the host to make the verifier's mount
points on a disk the agent filled."""
MKFS_EXT4 = ["mkfs.ext4", "-q", "-F", "-m", "0", "-i", "32768", "-O", "^has_journal",
             "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"]


SKELETON_MODES = (("upper", 0o755), ("work", 0o700), ("reserve", 0o700))


def _skeleton_ok(folder: Path) -> bool:
    """Whether ``folder`` is a whole skeleton of this version (``disk_skeleton``)."""
    try:
        if any(_stat.S_IMODE(os.lstat(folder / sub).st_mode) != mode or
               not (folder / sub).is_dir() for sub, mode in SKELETON_MODES):
            return False
        reserve = folder / "reserve"
        return sorted(os.listdir(reserve)) == sorted(str(i) for i in range(RESERVE_FILES)) \
            and all(os.lstat(reserve / str(i)).st_size == RESERVE_BYTES
                    for i in range(RESERVE_FILES))
    except OSError:
        return False


def disk_skeleton(folder: Path) -> Path:
    """What a fresh disk holds, as a folder for ``mkfs.ext4 -d``: ``upper`` (the
    overlay's, 0755; the sandbox's root gets it at start), ``work`` (0700) and ``reserve``
    (0700, ``RESERVE_FILES`` files of ``RESERVE_BYTES`` not zero, so mkfs gives them real
    blocks). Made in a folder of its own and renamed into place, so that runtimes of
    several processes on one state folder (the build-time checks of parallel jobs) each
    find it whole: one that is whole is kept, one that is not (another version's, a
    damaged one) is set aside and made again."""
    folder = Path(folder)
    for _ in range(5):
        if _skeleton_ok(folder):
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            for sub, mode in SKELETON_MODES:
                (tmp / sub).mkdir(mode=mode)
                os.chmod(tmp / sub, mode)
            os.chmod(tmp, 0o755)
            for i in range(RESERVE_FILES):
                path = tmp / "reserve" / str(i)
                path.write_bytes(b"\xff" * RESERVE_BYTES)
                os.chmod(path, 0o600)
            os.rename(tmp, folder)
            return folder
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not _skeleton_ok(folder):  # not whole (not another process's): set aside
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            try:
                os.rename(folder, old / "skeleton")
            except FileNotFoundError:
                pass
            shutil.rmtree(old, ignore_errors=True)
    raise OSError(f"{folder}: the disk skeleton could not be made (it changed under each "
                  "of 5 tries)")


def make_disk(path: Path, storage_mb: int, skeleton: Path, timeout: float = 120.0) -> None:
    """A sparse file of ``storage_mb`` holding a fresh ext4 file system with ``skeleton``'s
    folders (``disk_skeleton``): one sandbox's writable layer, used once."""
    with open(path, "wb") as f:
        f.truncate(storage_mb << 20)
    out = subprocess.run([*MKFS_EXT4, "-d", str(skeleton), str(path)], capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False,
                         env={"PATH": DEFAULT_PATH})
    if out.returncode != 0:
        raise OSError(f"mkfs.ext4 {path} failed ({out.returncode}): "
                      f"{(out.stdout + out.stderr).strip()[-800:]}")


def id_map(uid_base: int) -> str:
    return f"0 {uid_base} {UID_COUNT}\n"


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
    monitor: tuple[int, int] | None = None
    """(pid, start time) of bwrap's host-side process, in the sandbox's private mount
    namespace (where the image, the disk and the overlay are mounted)."""
    uid_base: int = 0
    """Host uid (and gid) that uid 0 inside maps to."""
    cgroups: list[str] = field(default_factory=list)
    cpus: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> SandboxRecord | None:
        try:
            data = json.loads(path.read_text())
            data["leader"] = tuple(data["leader"])
            for key in ("init", "monitor"):
                data[key] = tuple(data[key]) if data.get(key) else None
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    def init_pid(self) -> int:
        """pid 1's host pid: for a sandbox that is up (``init`` set, as ``_live`` checks)."""
        assert self.init is not None, f"sandbox {self.sandbox_id} is not up"
        return self.init[0]

    def monitor_pid(self) -> int:
        """bwrap's host-side pid: for a sandbox that is up (``_check_monitor`` checks it)."""
        assert self.monitor is not None, f"sandbox {self.sandbox_id} has no monitor"
        return self.monitor[0]

    def alive(self) -> bool:
        return self.init is not None and proc_start_time(self.init[0]) == self.init[1]


def helper_argv(what: str, *args: str) -> list[str]:
    """The host command running ``helper.py what`` (standard library only, isolated), from
    its compiled form where there is one (a third of its start-up is compiling it)."""
    return [sys.executable, "-I", "-S", str(_compiled.get(HELPER, HELPER)), what, *args]


_compiled: dict[Path, Path] = {}


def compile_helper(folder: Path) -> Path:
    """``helper.py`` compiled into ``folder`` (root's; named by its source and this Python,
    written atomically), used by ``helper_argv`` from now on."""
    import importlib.util
    import py_compile

    source = HELPER.read_bytes()
    tag = hashlib.sha256(source + sys.version.encode()).hexdigest()[:16]
    out = Path(folder) / f"helper-{tag}.pyc"
    if not out.exists():
        py_compile.compile(str(HELPER), cfile=str(out), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    if out.read_bytes()[:4] != importlib.util.MAGIC_NUMBER:
        raise RuntimeError(f"{out}: not compiled by this Python")
    _compiled[HELPER] = out
    return out


def sandbox_bwrap(*, root: str | None, network: bool, hostname: str, info_fd: int,
                  block_fd: int, command: list[str], binds: BwrapSpec | None = None,
                  env: dict[str, str] | None = None, cwd: str = "/",
                  as_pid_1: bool = False) -> list[str]:
    """bwrap for a sealed sandbox (or a verifier): a new user namespace whose map the
    runtime writes (``--userns-block-fd``), a container's capabilities, every namespace
    new but the network unless ``network``."""
    spec = binds or BwrapSpec(root=root)
    spec.root, spec.network, spec.hostname, spec.cwd = root or None, network, hostname, cwd
    spec.env = env if env is not None else {"PATH": DEFAULT_PATH, "HOME": "/root"}
    caps = [arg for cap in CONTAINER_CAPS for arg in ("--cap-add", cap)]
    spec.extra_args = ["--unshare-user", "--uid", "0", "--gid", "0", "--userns-block-fd",
                       str(block_fd), "--info-fd", str(info_fd), "--cap-drop", "ALL", *caps,
                       # as Docker: sysctls read-only, a bounded /dev/shm, no files in /dev
                       # (a tmpfs of half the node's memory otherwise, outside every quota)
                       "--ro-bind", "/proc/sys", "/proc/sys",
                       "--perms", "1777", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
                       "--remount-ro", "/dev"]
    spec.extra_args += ["--as-pid-1"] if as_pid_1 else []
    return spec.argv(command)


def enter_argv(*, init_pid: int, cgroup_procs: Sequence[str], cpus: Sequence[int] | None,
               cwd: str, env: dict[str, str], argv: Sequence[str], user: str = "",
               oom_score_adj: int = OOM_SCORE_ADJ) -> list[str]:
    """The host command that runs ``argv`` inside the sandbox whose pid 1 is ``init_pid``
    (as ``user``, Docker's USER syntax; root for ""), with ``oom_score_adj`` (the agent's
    commands: the OOM killer's first choice; a verifier's: 0, so what the agent left
    running goes first)."""
    return helper_argv("enter", str(init_pid), ",".join(map(str, cpus)) if cpus else "-",
                       cwd, user or "-", str(oom_score_adj), str(len(cgroup_procs)),
                       *cgroup_procs, str(len(env)), *(f"{k}={v}" for k, v in env.items()),
                       *argv)


def pick_cpus(allowed: Iterable[int], n: int, load: Counter) -> list[int]:
    """The ``n`` CPUs of ``allowed`` with the fewest sandboxes on them (lowest first)."""
    ranked = sorted(allowed, key=lambda cpu: (load[cpu], cpu))
    return sorted(ranked[:n])


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


class UidSlots:
    """Host uid ranges for sandboxes: slot ``n`` is ``base + n * 65536``, held by an
    exclusive flock on ``lock_dir/<n>`` (the sandbox leader inherits the fd, so the range
    is free again the moment the sandbox's tree is gone, whoever dies)."""

    def __init__(self, lock_dir: Path, base: int, slots: int):
        self.lock_dir, self.base, self.slots = Path(lock_dir), base, slots
        if base < UID_COUNT or base + slots * UID_COUNT >= 2**32 - 1:
            raise ValueError(f"uid_base {base}: the ranges must lie in [65536, 2^32 - 1)")

    def acquire(self) -> tuple[int, int]:
        """(uid base, fd holding its lock); SandboxStartError-worthy RuntimeError if full."""
        self.lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for slot in range(self.slots):
            fd = os.open(self.lock_dir / str(slot), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return self.base + slot * UID_COUNT, fd
        raise RuntimeError(f"all {self.slots} uid ranges in {self.lock_dir} are in use")


class Cgroups:
    """The cgroup v1 controllers (memory, cpuset, pids, freezer) under
    ``<root>/<controller>/<parent>``; one child cgroup per sandbox."""

    CONTROLLERS = ("memory", "cpuset", "pids", "freezer")
    REQUIRED = ("memory", "pids", "freezer")

    def __init__(self, parent: str = "sandfleet", root: Path = CGROUP_ROOT):
        self.parents: dict[str, Path] = {}
        self.problems: dict[str, str] = {}
        for ctrl in self.CONTROLLERS:
            base, path = root / ctrl, root / ctrl / parent
            if not (base / "cgroup.procs").exists():
                self.problems[ctrl] = f"no cgroup v1 {ctrl} hierarchy at {base}"
                continue
            try:
                path.mkdir(exist_ok=True)
                if ctrl == "cpuset":
                    for name in ("cpuset.cpus", "cpuset.mems"):
                        if not (path / name).read_text().strip():
                            (path / name).write_text((base / name).read_text())
                self.parents[ctrl] = path
            except OSError as e:
                self.problems[ctrl] = f"{path} not writable: {e.strerror or e}"

    def missing(self) -> list[str]:
        return [self.problems[c] for c in self.REQUIRED if c in self.problems]

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
        return read_oom_kills(f"{memory_cgroup}/memory.oom_control")

    @staticmethod
    def freeze(freezer: Path, frozen: bool, timeout: float = 10.0) -> bool:
        """Freeze (or thaw) every process of the cgroup; whether it got there in time."""
        want = "FROZEN" if frozen else "THAWED"
        deadline = time.monotonic() + timeout
        while True:
            (freezer / "freezer.state").write_text(want)
            if _read(str(freezer / "freezer.state")) == want:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    @staticmethod
    def remove(path: Path, timeout: float = 5.0) -> None:
        """Kill what is left in the cgroup, then remove it (retrying while it drains)."""
        deadline = time.monotonic() + timeout
        while path.exists():
            try:
                if (path / "freezer.state").exists():
                    (path / "freezer.state").write_text("THAWED")  # frozen tasks never die
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


def _parent(pid: int) -> int | None:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1]) or None
    return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def remove_unpacked_cache(cache_dir: Path) -> list[str]:
    """Remove root filesystems unpacked by earlier versions (``cache_dir/rootfs``, partial
    ones of a worker killed while unpacking included): images are mounted now, nothing
    uses them. What was removed, one line each."""
    root = Path(cache_dir) / "rootfs"
    if not root.is_dir():
        return []
    trash = root.with_name(f".rootfs-removed-{os.getpid()}")
    try:
        os.rename(root, trash)
    except OSError:
        return []
    subprocess.run(["rm", "-rf", "--one-file-system", str(trash)], timeout=600, check=False,
                   stdin=subprocess.DEVNULL)
    log.info("removed the unpacked image cache %s", root)
    return [f"removed unpacked image cache {root}"]
