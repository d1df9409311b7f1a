"""The local runtime: sealed bubblewrap sandboxes over a SIF's squashfs, for machines
without Apptainer. Runs as root (it mounts loop devices and writes cgroups); elsewhere it
refuses to start and says why.

Root filesystem. Nothing is unpacked: each sandbox mounts its image's squashfs partition
read-only through a loop device, *idmapped* to the sandbox's uid range, as the lower layer
of an overlay whose upper layer is a fresh ext4 file system of ``spec.storage_mb`` in a
sparse file (the disk quota: past it, writes fail with ENOSPC inside). All of it happens in
a private mount namespace (``helper.py seal``), so nothing reaches the host's mount table
and it all goes, loop devices included, with the sandbox's last process.

Process tree of one sandbox (host view)::

    timeout -s KILL <lifetime+5>           own session: the host-side hard deadline; holds
      python3 helper.py seal -> bwrap      the uid-range lock; private mount namespace
        bash (pid 1 inside): ignores every signal, sleeps until <lifetime>, exits

Commands enter with ``helper.py enter`` (network namespace, then user namespace, then
mount, pid, ipc, uts, cgroup; root of the namespace; capabilities dropped to a container's
set; then the command's user, as ``docker exec -u`` would) after
joining the sandbox's cgroups; inside, the command gets exactly the given environment.
``sandbox.json`` records the pids and their start times, so ``list_running``/``reap``/
``stop`` work from a fresh instance and never touch a reused pid or another owner's sandbox.

Enforced (threat model: an untrusted agent as root inside, a semi-trusted image):

- Root inside is not host root: uids and gids 0-65535 inside map to a range of 65536 host
  uids of the sandbox's own (``uid_base`` + slot * 65536; a slot is held by a lock on
  ``uid_lock_dir`` for the sandbox's life, so no two live sandboxes on a node share ids).
  Files it writes on the upper layer are owned by those host uids.
- Capabilities: a container's set (chown, dac_override, fowner, fsetid, kill, setgid,
  setuid, setpcap, net_bind_service, net_raw, sys_chroot, mknod, audit_write, setfcap) in
  the sandbox's own user namespace, bounding set included. No sys_admin: no mounts (of
  cgroups or anything else), no new namespaces with caps; no sys_module, sys_rawio,
  sys_ptrace, net_admin, sys_resource, sys_time. /proc/sys and /proc/sysrq-trigger are
  read-only (and owned by host root, which the sandbox is not); /sys is absent.
- Filesystem: only the overlay root plus a fresh /dev and /proc; nothing of the host. The
  image and the cache are never written. Mounted ``nodev``. Where the image's /etc/hosts
  does not name localhost, the sandbox's layer gets Docker's lines (localhost, the
  sandbox's hostname) before the image's (``helper.localhost``); with the network, the
  node's /etc/resolv.conf where the image's is empty (``helper.resolver``).
- Fresh pid, mount, ipc, uts, cgroup and (unless ``spec.network``) net namespaces; a new
  session (no terminal injection); a clean environment: the image's
  /.singularity.d/env/{10-docker2singularity,90-environment}.sh sourced, then
  ``spec.env``, then the call's ``env``.
- Max lifetime, twice: pid 1 inside ends at the deadline (signals from inside cannot stop
  it: pid 1 of a namespace ignores them), and the host ``timeout`` kills the tree 5 s
  later. Both hold if every daemon dies.
- cgroup v1 (``cgroup_parent`` under /sys/fs/cgroup/<controller>; required): memory
  (``memory.limit_in_bytes`` and ``memsw`` where present; OOM kills counted from
  ``memory.oom_control``, reported as ``ExecResult.oom``), CPU pinning to ``spec.cpus``
  CPUs of the worker's affinity, least-used first (``cpuset``), ``pids.max``, and a
  freezer (the agent is frozen while the verifier's view is built).
- The verifier (``verify``) runs in a fresh process tree the agent cannot see, signal or
  trace (its own pid, mount, ipc and user namespaces; the sandbox's network), over the
  agent's final files but with the image's own system directories and tool configuration
  (``PRISTINE``) and the image's own copy of the folders its PATH names outside them (a
  venv in /opt: ``path_roots``), and writes its reward into a host folder only it has
  mounted. Its command runs as ``verify``'s ``user`` (Docker's USER, as the image's own
  /etc/passwd and /etc/group name it, never the agent's copy), entered as the agent's
  commands are, so a set-user-ID program of the image works in it as in Docker.

Not enforced: no CPU time quota (pinning bounds parallelism only), no seccomp filter, no
per-task network policy (``spec.network`` shares the host's network). Pids are checked by
start time, but a pid can be reused between that check and ``setns`` (microseconds).
"""

from __future__ import annotations

import array
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import select
import shutil
import signal
import stat as _stat
import subprocess
import sys
import tempfile
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
    ExecResult,
    SandboxSpec,
    check_name,
    default_owner,
    kill_group,
    proc_start_time,
    read_oom_kills,
    run_capture,
    write_json_atomic,
)
from sandfleet.runtime.bwrap import DEFAULT_PATH, BwrapSpec
from sandfleet.runtime.helper import (
    OOM_SCORE_ADJ,
    VERIFIER_TOOLS,
    db_lines,
    resolve_user,
    user_ids,
)

log = logging.getLogger(__name__)

TOOLS = ("timeout", "mount", "mkfs.ext4", "bwrap", "nsenter", "setpriv")
HELPER = Path(__file__).with_name("helper.py")
HOST_GRACE_S = 5
SHM_BYTES = 64 << 20
"""Size of a sandbox's /dev/shm (Docker's default); its pages count against its memory."""
UID_COUNT = 65536
IMAGE_ENV_FILES = ("/.singularity.d/env/10-docker2singularity.sh",
                   "/.singularity.d/env/90-environment.sh")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTAINER_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
                  "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                  "CAP_NET_RAW", "CAP_SYS_CHROOT", "CAP_MKNOD", "CAP_AUDIT_WRITE",
                  "CAP_SETFCAP")
"""What root inside keeps (Docker's default set); must match helper.CONTAINER_CAPS."""
PRISTINE = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""Top-level entries the verifier gets from the image as built, not from the agent."""
PRISTINE_ETC = ("alternatives", "ld.so.preload", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
                "python3", "perl", "bash.bashrc", "environment", "profile", "profile.d")
PRISTINE_ETC_PREFIXES = ("python3.", "ld-musl-")
"""Entries of /etc that decide which program or library runs (the loader's cache and
preload list, the alternatives' links, interpreters' site customisation): the image's."""
OVERLAY_SAFE = re.compile(r"[A-Za-z0-9._/+@-]+")
"""PATH folders the verifier gets the image's copy of must read as one overlay option
(no ',', ':' or spaces); any other stays the agent's, behind the image's on its PATH."""
VERIFIER_ENV = {"UV_NO_CONFIG": "1", "PIP_CONFIG_FILE": os.devnull}
"""The verifier's defaults (a task's verifier env may override): uv and pip read none of
the agent-writable configuration files (uv.toml, pip.conf, ~/.config/...), which could
point them at packages of the agent's even offline (``find-links``)."""
PATH_KEEP = ("tmp", "dev", "proc", "sys", "run", "logs", "tests")
"""Top-level folders whose PATH entries the verifier takes from the agent's tree (scratch
space, kernel file systems, the verifier's own mounts): see ``path_roots``."""

# Pid 1 inside: writes the image's environment (its env files sourced in a subshell, as
# NUL-separated entries and one more NUL) to fd $3, drops the host's log file and bwrap's
# fds, turns deaf to signals, reaps orphans (bash does), ends at the deadline.
INIT_SH = ('(for f in ' + " ".join(IMAGE_ENV_FILES) + '; do if [ -r "$f" ]; then . "$f"; '
           'fi; done; unset PWD OLDPWD SHLVL _; env -0; printf "\\0") >&"$3" 2>/dev/null; '
           'exec </dev/null >/dev/null 2>&1; eval "exec $2<&- $3>&-"; '
           'trap "" HUP INT QUIT TERM USR1 USR2 PIPE ALRM TSTP TTIN TTOU; end=$1; '
           'while ((SECONDS < end)); do sleep $((end - SECONDS)) & wait $!; done')
# Host side of the verifier: join the cgroups given before "--", exec the rest (nsenter).
JOIN_SH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
# The verifier's host side, in a private copy of the sandbox's mount namespace: a tmpfs of
# $2 at $1 (charged to the sandbox's memory cgroup, so what the verifier writes is bounded
# and the agent, which cannot see it, cannot fill it) with a root folder "top" holding a
# copy of the tests folder $4 as tests/, an empty logs folder and an empty file "empty",
# all owned by $3, the logs folder writable by all (as Harbor makes /logs/verifier); then
# the rest (bwrap, as the sandbox's uid); then what it left in logs copied (links as links)
# to the host folder $5.
# With $6 (not "-"), the image's verifier tools $6 are at $v/tools, under an overlay whose
# upper layer is on that tmpfs (writable for the verifier, e.g. a tool's cache; the image
# is never written); with $8 (not "-"), that overlay copies metadata only and its files
# are owned by host ids $8 (the verifier's user: they are its tools, as its own cache
# would be; links are not followed).
VERIFIER_SH = ('v=$1 t=$4 l=$5; mount -t tmpfs -o "size=$2,mode=0755" tmpfs "$v" && '
               'mkdir "$v/top" && cp -a -- "$t" "$v/top/tests" && mkdir "$v/logs" '
               '"$v/top/dev" "$v/top/proc" && : > "$v/empty" && chown -R -- "$3" "$v" '
               '&& chmod 0777 "$v/logs" || exit 125; if [ "$6" != - ]; then meta=; '
               'if [ "$8" != - ]; then meta=,metacopy=on; fi; '
               'mkdir "$v/tools" "$v/.up" "$v/.work" && '
               'chown -- "$3" "$v/.up" && mount -t overlay overlay -o '
               '"lowerdir=$6,upperdir=$v/.up,workdir=$v/.work$meta" "$v/tools" || exit 125; '
               'if [ "$8" != - ]; then chown -R -h -P -- "$8" "$v/tools" || exit 125; fi; fi; '
               'if [ "$7" != - ]; then set -f; i=0; IFS=:; for low in $7; do '
               'mkdir "$v/r$i" "$v/.u$i" "$v/.w$i" && chown -- "$3" "$v/.u$i" && '
               'mount -t overlay overlay -o "lowerdir=$low,upperdir=$v/.u$i,workdir=$v/.w$i" '
               '"$v/r$i" || exit 125; i=$((i + 1)); done; unset IFS; set +f; fi; '
               'shift 8; "$@"; code=$?; cp -a -- "$v/logs/." "$l/" || exit 125; exit $code')
"""The verifier's own mounts, made in the sandbox's mount namespace before it starts: a
tmpfs ($1, size $2, owner $3) holding a copy of the tests ($4) and its logs (copied to $5 at
the end); the image's verifier tools ($6, or -; owned by $8 unless -) and each of the
image's PATH folders (the colon-separated $7, or -) under a writable overlay whose changes
stay on that tmpfs; the verifier's root folder "top", into which bwrap binds the agent's
top-level entries (``_verifier_view``). The rest is bwrap holding the verifier's
namespaces (``VERIFIER_HOLD``) until the runtime kills its pid 1."""
VERIFIER_START = ["/bin/sh", "-c", ('cd "$0" 2>/dev/null || { echo "sandfleet verify: cannot '
                                    'enter $0: started in /" >&2; cd /; }; exec "$@"')]
"""The verifier's command starts in its working directory ($0), or in / where the agent
made that unusable (removed it, or put a link or a file there): what it left is graded,
never an error it could choose (Docker's exec would fail). Nothing is made on the host's
side for it (a link there would lead outside the sandbox)."""
VERIFIER_HOLD = ["/bin/sh", "-c", "kill -STOP $$"]
"""What bwrap runs in the verifier's namespaces (its own init as pid 1 above it): a process
that stops itself, so the namespaces stay until the runtime ends them. The verifier's
command is entered into them (``helper.py enter``), not run by bwrap, whose
no_new_privs it would inherit: a set-user-ID program of the image must work for a
verifier that runs as the image's user, as under Docker."""
TOP_LEVEL_MAX = 512
"""An agent root with more top-level entries than this is bound whole as the verifier's /
(one mount, not one per entry on bwrap's command line, which the kernel bounds), its
/tests then a mount point that cannot be moved; the agent then stays frozen while the
verifier runs (its live root is the verifier's)."""
LOADER_ETC = ("ld.so.preload", "ld.so.cache")
"""Files in /etc glibc's dynamic loader reads on its own: where the image has none, the
verifier gets an empty one, so one the agent writes while it runs is never read. (Not
musl's ld-musl-<arch>.path: an empty one there means no library path at all; one the
agent made before the verifier started is set aside, as ``PRISTINE_ETC_PREFIXES`` says.)"""
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10
VERIFIER_SPACE_MB = 256
"""Room on the verifier's tmpfs beyond its tests (for /logs/verifier, and what it writes
in /tests)."""


class RuntimeUnavailable(RuntimeError):
    """This machine cannot give the local runtime's guarantees; the message says which
    feature is missing and what to do."""


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


def init_argv(*, lifetime_s: float, seal: dict, network: bool, hostname: str, info_fd: int,
              block_fd: int, env_fd: int) -> list[str]:
    """The host command that builds one sandbox and runs its pid 1 (see module doc)."""
    seconds = math.ceil(lifetime_s)
    bwrap = sandbox_bwrap(root=seal["root"], network=network, hostname=hostname,
                          info_fd=info_fd, block_fd=block_fd,
                          command=["bash", "-c", INIT_SH, "sandfleet-init", str(seconds),
                                   str(block_fd), str(env_fd)], as_pid_1=True)
    return (["timeout", "-s", "KILL", str(seconds + HOST_GRACE_S)]
            + helper_argv("seal", json.dumps({**seal, "argv": bwrap})))


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


def host_problems(cgroups: Cgroups) -> list[str]:
    """What this machine lacks for the local runtime's guarantees (empty: nothing)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("the local runtime needs root on the node (it mounts images and "
                        "disk quotas through loop devices and writes cgroup limits); as an "
                        "ordinary user use `runtime: apptainer`")
    if not Path("/proc/self/uid_map").exists():
        problems.append("the kernel has no user namespaces (CONFIG_USER_NS)")
    elif _read("/proc/sys/user/max_user_namespaces") in ("", "0"):
        problems.append("user namespaces are disabled (sysctl user.max_user_namespaces=0)")
    if not Path("/dev/loop-control").exists():
        problems.append("no loop devices (/dev/loop-control missing: modprobe loop)")
    filesystems = _read("/proc/filesystems")
    for fs in ("squashfs", "overlay"):
        if fs not in filesystems:
            problems.append(f"the kernel has no {fs} file system (modprobe {fs})")
    missing = [t for t in TOOLS if shutil.which(t, path=DEFAULT_PATH) is None]
    if missing:
        problems.append(f"missing tools: {', '.join(missing)} (bin/tmax-setup installs them)")
    problems += [f"{p} (memory, pids and freezer limits are required)" for p in cgroups.missing()]
    return problems


class LocalRuntime(CommandRuntime):
    """Sealed bubblewrap sandboxes over SIF images, on this machine (see the module doc)."""

    def __init__(self, state_dir: Path, cache_dir: Path | None = None,
                 owner: str | None = None, *, cgroup_parent: str = "sandfleet",
                 pids_max: int = 4096, start_timeout_s: float = 60.0,
                 uid_base: int = 1 << 31, uid_slots: int = 4096,
                 uid_lock_dir: Path = Path("/run/sandfleet/uid-slots"),
                 mount_dir: Path = Path("/run/sandfleet/mnt")):
        self.state_dir = Path(state_dir).resolve()
        self.cache_dir = Path(cache_dir).resolve() if cache_dir is not None else None
        self.owner = check_name("owner", owner or default_owner(), OWNER_RE)
        if any(c in str(self.state_dir) for c in ",:\\\n"):  # they go into mount options
            raise ValueError(f"{self.state_dir}: ',', ':' and '\\' cannot appear in "
                             "overlay paths")
        self.pids_max, self.start_timeout_s = pids_max, start_timeout_s
        self.cgroups = Cgroups(cgroup_parent)
        problems = host_problems(self.cgroups)
        if problems:
            raise RuntimeUnavailable("local runtime unavailable on this machine: "
                                     + "; ".join(problems))
        self.uids = UidSlots(uid_lock_dir, uid_base, uid_slots)
        self.mnt = Path(mount_dir)
        """Mount points inside each sandbox's private mount namespace (``root``: the
        overlay, ``image``: the image alone, ``verifier``: the verifier's folders); on the
        host they stay empty directories."""
        for sub in ("root", "image", "verifier"):
            (self.mnt / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.mnt, 0o755)
        compile_helper(self.mnt.parent)
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

    def oom_kills(self, sandbox_id: str) -> int | None:
        """From the sandbox's memory cgroup (None without one). Read before and after every
        shell command: the file's path is worked out once."""
        path = self._oom_files.get(sandbox_id)
        if path is None:
            record = self._record(sandbox_id)
            memory = [p for p in (record.cgroups if record else [])
                      if Path(p).parent == self.cgroups.parents.get("memory")]
            if not memory:
                return None
            path = self._oom_files[sandbox_id] = memory[0]
        return Cgroups.oom_kills(path)

    def _procs_files(self, record: SandboxRecord, *, freezer: bool = True) -> list[str]:
        return [str(Path(p) / "cgroup.procs") for p in record.cgroups
                if freezer or Path(p).parent != self.cgroups.parents.get("freezer")]

    def _cpus(self, record: SandboxRecord) -> list[int] | None:
        return None if "cpuset" in self.cgroups.parents or not record.cpus else record.cpus

    def _enter(self, sandbox_id: str, argv: list[str], cwd: str | None,
               env: dict[str, str] | None, *, root: bool = False) -> list[str]:
        record = self._live(sandbox_id)
        return enter_argv(init_pid=record.init_pid(), cgroup_procs=self._procs_files(record),
                          cpus=self._cpus(record), cwd=cwd or record.spec["workdir"],
                          env={**record.env, **(env or {})}, argv=argv,
                          user="" if root else record.spec.get("user", ""))

    def _host_env(self) -> dict[str, str]:
        return {"PATH": DEFAULT_PATH}

    # ---- images

    @staticmethod
    def partition(image: Path) -> sif.Partition:
        """The image's squashfs partition; ImageMissing when it cannot be used."""
        try:
            return sif.read_partition(image)
        except sif.SifError as e:
            raise ImageMissing(str(image), e.reason) from None
        except OSError as e:
            raise ImageMissing(str(image), e.strerror or str(e)) from None

    # ---- lifecycle

    def start(self, sandbox_id: str, spec: SandboxSpec) -> None:
        check_name("sandbox id", sandbox_id)
        part = self.partition(spec.image)
        try:
            uid_base, slot = self.uids.acquire()
        except RuntimeError as e:
            raise SandboxStartError(sandbox_id, str(e)) from None
        try:
            self._start(sandbox_id, spec, part, uid_base, slot)
        finally:
            os.close(slot)  # the leader keeps its own copy for the sandbox's life

    def _start(self, sandbox_id: str, spec: SandboxSpec, part: sif.Partition,
               uid_base: int, slot: int) -> None:
        home = self._dir(sandbox_id)
        with self._lock:
            if home.exists():
                old = self._record(sandbox_id)
                if old is not None and old.alive():
                    raise SandboxStartError(sandbox_id, "already running")
                self._destroy(sandbox_id, old)
            for sub in ("raw", "disk"):
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
                                   now + spec.max_lifetime_s, (0, 0), uid_base=uid_base,
                                   cgroups=[str(p) for p in cgroups], cpus=cpus)
            try:
                self._launch(record, spec, part, home, slot)
                record.env = {**record.env, **spec.env}
                record.save(home / "sandbox.json")
            except BaseException as e:
                if isinstance(e, (SandboxStartError, KeyboardInterrupt)):
                    self._destroy(sandbox_id, record)
                    raise
                error = self._start_error(sandbox_id, home, f"{type(e).__name__}: {e}")
                self._destroy(sandbox_id, record)
                raise error from e

    def _launch(self, record: SandboxRecord, spec: SandboxSpec, part: sif.Partition,
                home: Path, slot: int) -> None:
        """Start the process tree; returns once pid 1 runs inside (record updated)."""
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        env_r, env_w = os.pipe()
        seal = {"home": str(home), "image": str(Path(spec.image).resolve()),
                "offset": part.offset, "size": part.size, "uid_base": record.uid_base,
                "uid_count": UID_COUNT, "storage_mb": spec.storage_mb,
                "cgroup_procs": self._procs_files(record), "root": str(self.mnt / "root"),
                "image_dir": str(self.mnt / "image"), "close_fds": [slot],
                "hostname": spec.hostname, "network": spec.network}
        argv = init_argv(lifetime_s=spec.max_lifetime_s, seal=seal, network=spec.network,
                         hostname=spec.hostname, info_fd=info_w, block_fd=block_r,
                         env_fd=env_w)
        if self._cpus(record):
            argv = ["taskset", "-c", ",".join(map(str, record.cpus))] + argv
        try:
            with open(home / "init.log", "wb") as logfile:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfile,
                                        stderr=subprocess.STDOUT,
                                        pass_fds=(info_w, block_r, env_w, slot),
                                        env={"PATH": DEFAULT_PATH}, start_new_session=True)
            self._children[record.sandbox_id] = proc
            record.leader = (proc.pid, proc_start_time(proc.pid) or 0)
            record.save(home / "sandbox.json")  # from here on, stop() can find the tree
            os.close(info_w)
            os.close(block_r)
            os.close(env_w)
            info_w = block_r = env_w = -1
            deadline = time.monotonic() + self.start_timeout_s
            child = self._userns_ready(info_r, block_w, record.uid_base, deadline)
            if child is None:
                proc.poll()
                raise self._start_error(record.sandbox_id, home, "bwrap gave no sandbox pid")
            while (comm := _read(f"/proc/{child}/comm")) == "bwrap":  # not yet exec'd
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            start = proc_start_time(child)
            monitor = _parent(child)
            if comm in ("bwrap", "") or start is None or monitor is None:
                raise self._start_error(record.sandbox_id, home, "pid 1 did not start")
            image_env = self._read_env(env_r, deadline)
            if image_env is None:
                raise self._start_error(record.sandbox_id, home, "no image environment")
            # The OOM killer must pick an agent process, not pid 1 (whose death would turn the
            # agent's own memory use into a lost sandbox): pid 1 is exempt where the host
            # lets us (cap_sys_resource), and commands enter with a raised score either way.
            try:
                Path(f"/proc/{child}/oom_score_adj").write_text("-1000")
            except PermissionError:
                pass
            record.init = (child, start)
            record.monitor = (monitor, proc_start_time(monitor) or 0)
            record.env = {"PATH": DEFAULT_PATH, "HOME": "/root", **image_env}
            self._records[record.sandbox_id] = record
        finally:
            for fd in (info_r, info_w, block_r, block_w, env_r, env_w):
                if fd >= 0:
                    os.close(fd)

    def _userns_ready(self, info_r: int, block_w: int, uid_base: int,
                      deadline: float) -> int | None:
        """Read bwrap's child pid, write its user namespace's maps, let it go on; the pid."""
        info = self._read_info(info_r, deadline)
        if info is None:
            return None
        child = info["child-pid"]
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{child}/{name}").write_text(id_map(uid_base))
        os.write(block_w, b"1")
        return child

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

    @staticmethod
    def _read_env(fd: int, deadline: float) -> dict[str, str] | None:
        """The image environment pid 1 writes (see INIT_SH), or None if it did not."""
        data = b""
        while not (data == b"\0" or data.endswith(b"\0\0")):
            ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                return None
            data += chunk
        pairs = (item.partition("=") for item in data.decode("utf-8", "replace").split("\0")
                 if "=" in item)
        return {key: value for key, _, value in pairs}

    def _cpu_load(self) -> Counter:
        load: Counter = Counter()
        for path in (self.state_dir / "sandboxes").glob("*/sandbox.json"):
            record = SandboxRecord.load(path)
            if record is not None and record.alive():
                load.update(record.cpus)
        return load

    # ---- the verifier

    def verify(self, sandbox_id: str, command: list[str], *, tests: Path, logs: Path,
               timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
               agent_system: bool = False, user: str = "") -> ExecResult:
        """Run ``command`` (the task's verifier) beside the sandbox, in a process tree of
        its own that no agent process can see, signal or trace: new pid, mount, ipc, uts
        and user namespaces, the sandbox's network. Its root is a folder of its own holding
        the agent's final file system's top-level entries (its folders bound, so what either
        writes there the other sees) and, as a plain folder, a copy of host folder ``tests``
        as /tests (one a test.sh can move away and back); the image's own ``PRISTINE``
        directories and ``PRISTINE_ETC`` entries are bound over the agent's (unless
        ``agent_system``), and a fresh folder covers /logs/verifier. Its root, its tests and
        logs are on a tmpfs of the verifier's own (bounded, in the sandbox's memory cgroup);
        what it leaves in /logs/verifier is copied to host folder ``logs`` at the end: the
        only place it writes that the caller reads. The agent is frozen while that view is
        built and thawed once the verifier's command runs (a server it left running can
        answer); its files and folders that the verifier's mounts cover are immutable until
        the verifier ends (``_Immutable``). An agent root of more than ``TOP_LEVEL_MAX``
        entries is bound whole instead, the tests over its /tests, and the agent, whose
        live root that is, stays frozen until the verifier ends; so it does where its
        files cannot be made immutable. Unless ``agent_system``, the folders that
        ``env``'s PATH names outside ``PRISTINE`` (a venv's, /root/.local: ``path_roots``)
        are the image's too, where the image has them.

        ``command`` runs as ``user`` (Docker's USER; "" for root) as the image's own
        /etc/passwd and /etc/group name it, not the agent's copies (which the agent may
        have rewritten, to choose who grades it), with that user's home as HOME unless
        ``env`` sets one: as ``docker exec -u`` (or Harbor's verifier as the image's USER)
        runs it; a non-root user gets no capabilities, and the verifier tools' overlay
        is its own. A user the image does not name exits 126 with why, as Docker's exec
        fails."""
        record = self._live(sandbox_id)
        self._check_monitor(record)
        try:
            ids = self._image_user(record, user) if user else None
        except OSError as e:
            return ExecResult(f"sandfleet verify: {e}\n", 126, False, False, 0.0)
        logs = Path(logs)
        logs.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="verify-", dir=self._dir(sandbox_id)) as tmp:
            staged = Path(tmp) / "tests"
            shutil.copytree(tests, staged, symlinks=True)
            size_mb = (_tree_bytes(staged) >> 20) + VERIFIER_SPACE_MB
            return self._run_verifier(record, staged, logs, size_mb, command, timeout=timeout,
                                      cwd=cwd, env=env, agent_system=agent_system, ids=ids,
                                      setup_log=Path(tmp) / "setup.log")

    def _image_user(self, record: SandboxRecord, user: str) -> tuple[int, int, list[int], str]:
        """``user``'s uid, gid, groups and home as the image's /etc/passwd and /etc/group
        name them (read through the sandbox's mount namespace, no link followed); an
        OSError for a name the image has not, or an id outside the sandbox's range."""
        image = str(self.mnt / "image")
        fix = _ViewFixer(f"/proc/{record.monitor_pid()}/root", record.uid_base, "")
        texts = [fix.read(f"{image}/etc/{name}", 1 << 20) if fix.is_dir(f"{image}/etc")
                 else "" for name in ("passwd", "group")]
        uid, gid, groups, home = resolve_user(user, (db_lines(texts[0]), db_lines(texts[1])),
                                              where="image")
        if not all(0 <= i < UID_COUNT for i in (uid, gid, *groups)):
            raise OSError(f"user {user!r} has ids outside the sandbox's 0-{UID_COUNT - 1}")
        return uid, gid, groups, home

    def _run_verifier(self, record: SandboxRecord, tests: Path, logs: Path, size_mb: int,
                      command: list[str], *, timeout: float, cwd: str | None,
                      env: dict[str, str] | None, agent_system: bool,
                      ids: tuple[int, int, list[int], str] | None,
                      setup_log: Path) -> ExecResult:
        """bwrap builds the verifier's namespaces and holds them (``VERIFIER_HOLD``); the
        command is entered into them as ``ids`` (None: root) and, once it has ended, the
        hold's pid 1 is killed, which ends whatever the command left there; then
        ``VERIFIER_SH`` copies the logs out."""
        freezer = Path(self.cgroups.paths(self._cgroup_name(record.sandbox_id))["freezer"])
        if not Cgroups.freeze(freezer, True):  # it cannot be kept from racing: end it
            log.warning("sandbox %s: agent would not freeze; killing its processes",
                        record.sandbox_id)
            for pid in _read(str(freezer / "cgroup.procs")).split():
                if int(pid) != record.init_pid():
                    _kill(int(pid))
        guards = _Immutable(f"/proc/{record.monitor_pid()}/root")
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        fds = {info_r, info_w, block_r, block_w}
        host: subprocess.Popen | None = None
        hold = -1  # a pidfd of the hold's pid 1

        def close(fd: int) -> None:  # once: another thread may get the number next
            if fd in fds:
                fds.discard(fd)
                os.close(fd)

        try:
            spec, guarded = self._verifier_view(record, agent_system,
                                                path=(env or {}).get("PATH"), cwd=cwd)
            # the thawed agent cannot remove (and so detach) the verifier's mount points in
            # its tree; where they cannot be held so, or its live root is the verifier's
            # (more than TOP_LEVEL_MAX names at /), it stays frozen until the verifier ends
            frozen = spec.root == str(self.mnt / "root") or not guards.hold(
                f"{self.mnt / 'root'}{path}" for path in guarded)
            uid = ids[0] if ids else 0
            env = {"PATH": DEFAULT_PATH, "HOME": ids[3] if ids else "/root",
                   "PYTHONNOUSERSITE": "1", **VERIFIER_ENV, **(env or {})}
            for key, value in spec.env.items():  # the tools' settings, on top
                env[key] = value.replace("$PATH", env.get(key, "")) if key == "PATH" else value
            if not agent_system:  # the agent's folders on PATH can no longer shadow the image's
                env["PATH"] = trusted_first(env["PATH"], [f"/{n}" for n in PRISTINE] +
                                            [d for _, d in spec.ro_binds + spec.binds])
            bwrap = sandbox_bwrap(root=spec.root, network=True,
                                  hostname=record.spec["hostname"], info_fd=info_w,
                                  block_fd=block_r, command=VERIFIER_HOLD, binds=spec,
                                  cwd="/", env={"PATH": DEFAULT_PATH})
            base = record.uid_base
            tools = "-"
            if any(dest == VERIFIER_TOOLS for _, dest in spec.binds):
                tools = f"{self.mnt / 'image'}{VERIFIER_TOOLS}"
            overlays = [f"{self.mnt / 'image'}{dest}" for src, dest in spec.binds
                        if Path(src).parent == self.mnt / "verifier"
                        and Path(src).name[:1] == "r"]
            argv = (["sh", "-c", JOIN_SH, "sh", *self._procs_files(record, freezer=False),
                     "--", "nsenter", f"--mount=/proc/{record.monitor_pid()}/ns/mnt",
                     f"--net=/proc/{record.init_pid()}/ns/net", "--",
                     "unshare", "-m", "--propagation", "private", "--",
                     "sh", "-c", VERIFIER_SH, "sh", str(self.mnt / "verifier"), f"{size_mb}m",
                     f"{base}:{base}", str(tests), str(logs), tools,
                     ":".join(overlays) or "-",
                     f"{base + uid}:{base + ids[1]}" if ids and uid else "-",
                     "setpriv", f"--reuid={base}", f"--regid={base}", "--clear-groups", "--"]
                    + bwrap)
            with open(setup_log, "wb") as out:
                host = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, env=self._host_env(),
                                        start_new_session=True, pass_fds=(info_w, block_r))
            close(info_w)
            close(block_r)
            deadline = time.monotonic() + self.start_timeout_s
            child = self._userns_ready(info_r, block_w, base, deadline)
            try:
                hold = os.pidfd_open(child) if child else -1
            except ProcessLookupError:
                child = None
            while child and not _command_started(child) \
                    and host.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)  # its mounts are in place once the hold runs
            started = child is not None and _command_started(child)
            if not frozen or not started:
                Cgroups.freeze(freezer, False)
            if child is None or not started:
                kill_group(host.pid)  # its host side may still be making mounts
                host.wait()
                tail = setup_log.read_text(errors="replace")[-1500:]
                raise SandboxStartError(record.sandbox_id, f"verifier did not start: {tail}")
            who = user_ids(uid, ids[1], ids[2]) if ids else ""
            if uid and not agent_system:  # the image's set-user-ID programs work, as in Docker
                self._allow_setuid(child, [dest for src, dest in spec.ro_binds
                                           if dest.lstrip("/") in PRISTINE])
            # the OOM killer's choice is what the agent left running (its oom_score_adj),
            # and at the deadline all of the verifier ends, what left its group too
            output, code, timed_out, seconds = run_capture(
                enter_argv(init_pid=child, cgroup_procs=self._procs_files(record, freezer=False),
                           cpus=self._cpus(record), cwd="/", env=env, user=who,
                           argv=[*VERIFIER_START, cwd or record.spec["workdir"], *command],
                           oom_score_adj=0),
                timeout=timeout, env=self._host_env(), limit=self.max_output_bytes,
                on_timeout=lambda: _pidfd_kill(hold))
            _pidfd_kill(hold)  # the verifier's processes end with its pid 1
            try:
                copied = host.wait(timeout=self.copy_timeout_s)  # its logs copied out
            except subprocess.TimeoutExpired:
                copied = -1
            if copied == 125:
                tail = setup_log.read_text(errors="replace")[-1500:]
                output += f"\nsandfleet verify: its logs were not all copied: {tail}"
        finally:
            if host is not None and host.poll() is None:
                _pidfd_kill(hold)
                kill_group(host.pid)
                host.wait()
            if hold >= 0:
                os.close(hold)
            guards.release()
            Cgroups.freeze(freezer, False)  # (again, if it failed before: idempotent)
            for fd in sorted(fds):  # (a copy: close() changes the set)
                close(fd)
        self._check_alive(record.sandbox_id)
        return ExecResult(output, code, timed_out, False, seconds)

    def _allow_setuid(self, pid: int, paths: list[str]) -> None:
        """Clear nosuid on mount points ``paths`` (the image's own folders) of the
        verifier's mount namespace (pid 1 ``pid``); where the kernel refuses, the verifier
        runs without (logged)."""
        if not paths:
            return
        out = subprocess.run(helper_argv("suid", str(pid), *paths), capture_output=True,
                             text=True, env=self._host_env(), timeout=60, check=False)
        if out.returncode != 0:
            log.warning("verifier: set-user-ID programs will not work: %s", out.stderr.strip())

    def _check_monitor(self, record: SandboxRecord) -> None:
        if record.monitor is None or proc_start_time(record.monitor[0]) != record.monitor[1]:
            raise SandboxLost(record.sandbox_id, "its mount namespace is gone")

    def _verifier_view(self, record: SandboxRecord, agent_system: bool, *,
                       path: str | None = None,
                       cwd: str | None = None) -> tuple[BwrapSpec, list[str]]:
        """The verifier's mounts (see ``verify``): the agent's root, with the image's own
        ``PRISTINE`` directories and ``PRISTINE_ETC`` entries bound over it read-only, as
        is the image's copy of each folder ``path_roots`` picks from ``path`` (the
        verifier's PATH) and from the PATH of the image's verifier tools, where every
        component of that folder is a real directory in the image (one reached through a
        link of the image is left out: bwrap would follow that link on the host), and the
        verifier's logs at /logs/verifier; its root is ``VERIFIER_SH``'s folder "top" (the
        tests in it; bwrap binds the agent's top-level folders and files there and makes
        its links anew), or the agent's root with the tests bound at /tests where that has
        more than ``TOP_LEVEL_MAX`` entries. Second: the paths below the top level that
        ``_Immutable`` holds while the verifier runs (each mount point in the agent's
        folders and the folders above it).

        With the agent frozen, the host first makes every mount point a real directory (or
        file) of the agent's tree, setting aside whatever the agent put there instead (a
        link, a file, a /etc/ld.so.preload the image has not, a /conftest.py): an entry is
        renamed to ``.tmax-set-aside-<name>-<random>`` in its folder, which follows no link
        (an image's directory is never set aside: overlayfs cannot rename one, and a real
        directory needs nothing but the mount over it). The host works through the
        sandbox's mount namespace (the monitor's /proc root) on paths whose every component
        but the last it controls: a nested mount point (/opt/venv) is made one component at
        a time, top down (/opt, then /opt/venv)."""
        self._check_monitor(record)
        ns = f"/proc/{record.monitor_pid()}/root"
        root, image = str(self.mnt / "root"), str(self.mnt / "image")
        fix = _ViewFixer(ns, record.uid_base, f"{self._dir(record.sandbox_id)}/disk/reserve")
        spec = BwrapSpec(root=root, env={})
        has_tools = fix.is_dir(f"{image}{VERIFIER_TOOLS}")  # the image's, never the agent's
        tools_env = _tools_env(fix.read(f"{image}{VERIFIER_TOOLS}/env")) if has_tools else {}
        if not agent_system:
            image_top = set(fix.names(image))
            for name in fix.names(root):  # files and links the image has not at / go
                if name not in image_top and not fix.is_dir(f"{root}/{name}"):
                    fix.set_aside(f"{root}/{name}")
            for name in PRISTINE:
                if fix.like(f"{image}/{name}", f"{root}/{name}") == "bind":
                    spec.ro_binds.append((f"{image}/{name}", f"/{name}"))
            if not fix.is_dir(f"{root}/etc"):  # the agent replaced /etc: the image's whole
                fix.like(f"{image}/etc", f"{root}/etc")
                spec.ro_binds.append((f"{image}/etc", "/etc"))
            elif fix.like(f"{image}/etc", f"{root}/etc") == "bind":
                image_etc = set(fix.names(f"{image}/etc"))
                for name in fix.names(f"{root}/etc"):
                    if _pristine_etc(name) and name not in image_etc:
                        fix.set_aside(f"{root}/etc/{name}")
                for name in sorted(image_etc):
                    if _pristine_etc(name) and \
                            fix.like(f"{image}/etc/{name}", f"{root}/etc/{name}") == "bind":
                        spec.ro_binds.append((f"{image}/etc/{name}", f"/etc/{name}"))
                for name in LOADER_ETC:  # none in the image: an empty one, held (below)
                    if name not in image_etc:
                        fix.empty_file(f"{root}/etc/{name}")
                        spec.ro_binds.append((str(self.mnt / "verifier" / "empty"),
                                              f"/etc/{name}"))
            keep = [record.spec["workdir"]] + ([cwd] if cwd else [])
            roots = 0
            for found in path_roots(f"{path or ''}:{tools_env.get('PATH', '')}", keep=keep):
                steps = list(_prefixes(found))
                # every component in the image is checked before the next is looked at
                if OVERLAY_SAFE.fullmatch(found) and \
                        all(fix.is_dir(f"{image}{step}") for step in steps):
                    for step in steps:  # top down: only the last component is the agent's
                        fix.real_dir(f"{root}{step}")
                    # the image's copy, writable: a pip install into the venv, cargo's lock
                    # in ~/.cargo, go's module cache work; what is written stays the
                    # verifier's (VERIFIER_SH)
                    spec.binds.append((str(self.mnt / "verifier" / f"r{roots}"), found))
                    roots += 1
        for sub in ("dev", "proc", "tests", "logs", "logs/verifier"):  # the verifier's
            fix.real_dir(f"{root}/{sub}")                             # mounts cover them
        top = self.mnt / "verifier" / "top"
        names = fix.names(root)
        if len(names) <= TOP_LEVEL_MAX:  # its own /, the agent's entries in it
            spec.root = str(top)
            covered = {dest for _, dest in spec.ro_binds}  # (the image's own)
            for name in names:
                if name in ("tests", "dev", "proc") or f"/{name}" in covered:
                    continue
                kind = fix.kind(f"{root}/{name}")
                if kind == "link":  # as it is (it resolves in the verifier's root)
                    spec.symlinks.append((fix.link(f"{root}/{name}"), f"/{name}"))
                elif kind in ("dir", "file"):  # (its mounts with it)
                    spec.root_binds.append((f"{root}/{name}", f"/{name}"))
        else:
            spec.binds.append((str(top / "tests"), "/tests"))
        spec.binds.append((str(self.mnt / "verifier" / "logs"), "/logs/verifier"))
        if has_tools:
            spec.binds.append((str(self.mnt / "verifier" / "tools"), VERIFIER_TOOLS))
            spec.env = tools_env
        guarded: list[str] = []  # below the top level: the agent's own entries
        for _, dest in spec.ro_binds + spec.binds if spec.root == str(top) else []:
            parts = dest.strip("/").split("/")
            if dest != VERIFIER_TOOLS:  # (a mount point in the agent's namespace already)
                guarded += [p for p in ("/" + "/".join(parts[:k])
                                        for k in range(2, len(parts) + 1)) if p not in guarded]
        return spec, guarded

    def stop(self, sandbox_id: str) -> None:
        check_name("sandbox id", sandbox_id)
        with self._lock:
            self._destroy(sandbox_id, self._record(sandbox_id))

    def _destroy(self, sandbox_id: str, record: SandboxRecord | None) -> None:
        """Kill the tree, remove cgroups and state. Safe on half-started and dead ones."""
        self._records.pop(sandbox_id, None)
        self._oom_files.pop(sandbox_id, None)
        home = self._dir(sandbox_id)
        paths = self.cgroups.paths(self._cgroup_name(sandbox_id))
        if "freezer" in paths and paths["freezer"].exists():
            try:  # a frozen process does not die of SIGKILL until thawed
                Cgroups.freeze(paths["freezer"], False, timeout=1)
            except OSError:
                pass
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
        for path in paths.values():
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
        """Stop every sandbox of this owner not in ``keep``, dead leftovers included (their
        disk files with them), and sandboxes whose state dir is gone but whose cgroups
        (named by owner, id and state dir) are still there."""
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


class _ViewFixer:
    """Makes an agent's tree safe to mount over, as host root, without following links:
    paths are sandbox paths under ``ns`` (a /proc/<pid>/root), and only their last
    component is ever the agent's."""

    def __init__(self, ns: str, uid: int, reserve: str):
        self.ns, self.uid, self.reserve = ns, uid, reserve

    def _make(self, make) -> None:
        """``make()``, freeing the disk's reserve (blocks and inodes held outside the
        agent's layer since the start) while it fails for lack of space: an agent that
        filled its disk still gets graded."""
        while True:
            try:
                return make()
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                left = self.names(self.reserve)
                if not left:
                    raise
                os.unlink(f"{self.ns}{self.reserve}/{left[0]}")

    def _lstat(self, path: str) -> os.stat_result | None:
        try:
            return os.lstat(f"{self.ns}{path}")
        except FileNotFoundError:
            return None

    def names(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(f"{self.ns}{path}")) if self.is_dir(path) else []
        except OSError:
            return []

    def read(self, path: str, limit: int = 65536) -> str:
        """A regular file's text (not through a link), "" if there is none."""
        try:
            fd = os.open(f"{self.ns}{path}", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return ""
        try:
            return os.read(fd, limit).decode("utf-8", "replace") \
                if _stat.S_ISREG(os.fstat(fd).st_mode) else ""
        finally:
            os.close(fd)

    def is_dir(self, path: str) -> bool:
        st = self._lstat(path)
        return st is not None and _stat.S_ISDIR(st.st_mode)

    def kind(self, path: str) -> str:
        """"dir", "file" (regular), "link", "other" or "" (none), not through a link."""
        st = self._lstat(path)
        if st is None:
            return ""
        return ("dir" if _stat.S_ISDIR(st.st_mode) else "file" if _stat.S_ISREG(st.st_mode)
                else "link" if _stat.S_ISLNK(st.st_mode) else "other")

    def link(self, path: str) -> str:
        return os.readlink(f"{self.ns}{path}")

    def set_aside(self, path: str) -> None:
        if self._lstat(path) is not None:
            parent, name = os.path.split(path)
            os.rename(f"{self.ns}{path}",
                      f"{self.ns}{parent}/.tmax-set-aside-{name}-{os.urandom(4).hex()}")

    def real_dir(self, path: str) -> None:
        if not self.is_dir(path):
            self.set_aside(path)
            self._make(lambda: os.mkdir(f"{self.ns}{path}", 0o755))
            os.lchown(f"{self.ns}{path}", self.uid, self.uid)

    def empty_file(self, path: str) -> None:
        """An empty regular file at ``path`` (whatever is there set aside)."""
        self.set_aside(path)
        self._make(lambda: os.close(os.open(f"{self.ns}{path}", os.O_CREAT | os.O_EXCL
                                            | os.O_WRONLY | os.O_NOFOLLOW, 0o644)))
        os.lchown(f"{self.ns}{path}", self.uid, self.uid)

    def like(self, image_path: str, path: str) -> str:
        """Make ``path`` a mount point for ``image_path`` (a directory or a file: "bind"),
        or the same link (then nothing needs mounting: "link"); set it aside when the
        image has no such entry ("absent")."""
        st = self._lstat(image_path)
        mine = self._lstat(path)
        if st is None:
            self.set_aside(path)
            return "absent"
        if _stat.S_ISLNK(st.st_mode):
            target = os.readlink(f"{self.ns}{image_path}")
            if mine is None or not _stat.S_ISLNK(mine.st_mode) or \
                    os.readlink(f"{self.ns}{path}") != target:
                self.set_aside(path)
                self._make(lambda: os.symlink(target, f"{self.ns}{path}"))
                os.lchown(f"{self.ns}{path}", self.uid, self.uid)
            return "link"
        if _stat.S_ISDIR(st.st_mode):
            self.real_dir(path)
        elif mine is None or not _stat.S_ISREG(mine.st_mode):
            self.empty_file(path)
        return "bind"


class _Immutable:
    """Entries of the agent's tree made immutable (``FS_IMMUTABLE_FL``) while the verifier
    runs, through descriptors held until ``release``: the agent's processes (no
    CAP_LINUX_IMMUTABLE) can then neither remove nor rename them, and so cannot detach the
    verifier's mounts on them (Linux detaches a mount in every namespace once its mount
    point is removed in any, since 3.18), nor add entries to those folders."""

    def __init__(self, ns: str):
        self.ns = ns
        self.held: list[tuple[int, int]] = []

    def hold(self, paths: Iterable[str]) -> bool:
        """Each of ``paths`` (sandbox paths under ``ns``, the agent frozen: no link
        followed at the last component, the others made real folders), in order; False
        when one cannot be held (a file system without the flag, a full disk)."""
        for path in paths:
            fd = -1
            try:
                fd = os.open(f"{self.ns}{path}",
                             os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                mode = os.fstat(fd).st_mode
                if not (_stat.S_ISDIR(mode) or _stat.S_ISREG(mode)):
                    raise OSError(errno.EINVAL, "neither a folder nor a file")
                flags = array.array("i", [0])
                try:
                    fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
                except OSError as e:  # only in the image's (squashfs) layer: copied up by
                    if e.errno != errno.ENOTTY:  # setting its times as they are, its
                        raise                    # flags are then the writable layer's
                    st = os.fstat(fd)
                    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
                    fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
                old = flags[0]
                flags[0] = old | FS_IMMUTABLE_FL
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
            except OSError as e:
                if fd >= 0:
                    os.close(fd)
                log.warning("verifier: cannot hold %s in the agent's tree (%s)", path, e)
                return False
            self.held.append((fd, old))
        return True

    def release(self) -> None:
        """Their flags as they were, the descriptors closed."""
        while self.held:
            fd, old = self.held.pop()
            try:
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, array.array("i", [old]), True)
            except OSError as e:  # (its sandbox may be gone)
                log.debug("verifier: could not restore flags: %s", e)
            finally:
                os.close(fd)


def trusted_first(path: str, trusted: Iterable[str]) -> str:
    """``path`` with its entries in the ``trusted`` folders (the verifier's mounts of the
    image's own folders) first, in their order, then the others (the agent's: a top-level
    /go/bin, a folder the image has not, the workdir's), in theirs: a program the agent
    plants there runs only where the image has none of that name, never instead of the
    image's (e.g. an agent's /go/bin/go over the image's /usr/local/go/bin/go)."""
    folders = [t for t in trusted if t.startswith("/")]
    entries = path.split(":")

    def is_trusted(entry: str) -> bool:
        parts = [p for p in entry.split("/") if p not in ("", ".")]
        norm = "/" + "/".join(parts)
        return entry.startswith("/") and ".." not in parts and \
            any(_within(norm, f) for f in folders)

    return ":".join([e for e in entries if is_trusted(e)] +
                    [e for e in entries if not is_trusted(e)])


def path_roots(path: str | None, keep: Iterable[str] = ()) -> list[str]:
    """The folders of a PATH value that the verifier gets from the image (lexically; the
    view also needs them to be real directories there): for each absolute entry, its
    parent when its last component is ``bin`` or ``sbin`` (/opt/venv/bin: /opt/venv, the
    venv's libraries with its programs), else the entry itself. Left out: relative
    entries and entries with a ``..``; a root at the top level (/app, /opt, /root: that
    would hide the agent's work); one in a ``PRISTINE`` folder (bound whole already; with
    a merged /usr, /bin is the image's link to usr/bin); one under ``PATH_KEEP``; the
    verifier tools' folder, what is in it and what holds it; one of ``keep`` (the workdir,
    the verifier's cwd) or a folder holding one. Sorted, without duplicates, the
    outermost of nested roots only."""
    kept = [os.path.normpath(k) for k in keep if k and k.startswith("/")]
    roots = set()
    for entry in (path or "").split(":"):
        parts = [p for p in entry.split("/") if p not in ("", ".")]
        if not entry.startswith("/") or ".." in parts:
            continue
        if parts and parts[-1] in ("bin", "sbin"):
            parts.pop()
        if len(parts) < 2 or parts[0] in PRISTINE or parts[0] in PATH_KEEP:
            continue
        found = "/" + "/".join(parts)
        if _within(found, VERIFIER_TOOLS) or _within(VERIFIER_TOOLS, found) or \
                any(_within(k, found) for k in kept):
            continue
        roots.add(found)
    return [r for r in sorted(roots) if not any(o != r and _within(r, o) for o in roots)]


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _prefixes(path: str) -> Iterable[str]:
    """/a, /a/b, /a/b/c for /a/b/c."""
    parts = path.strip("/").split("/")
    return ("/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1))


def _tools_env(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of an image's verifier-tools env file (``$PATH`` in a PATH value
    stands for the verifier's PATH); other lines are ignored."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.isidentifier():
            env[key] = value
    return env


def _pristine_etc(name: str) -> bool:
    return name in PRISTINE_ETC or name.startswith(PRISTINE_ETC_PREFIXES)


def _pidfd_kill(fd: int) -> None:
    """SIGKILL to the process of pidfd ``fd`` (-1: none), if it is still there."""
    if fd >= 0:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _command_started(bwrap_child: int) -> bool:
    """Whether bwrap (its process in the new namespaces given) has set everything up and
    started the command: its own init's child runs something that is not bwrap."""
    for pid in [bwrap_child] + _read(f"/proc/{bwrap_child}/task/{bwrap_child}/children").split():
        comm = _read(f"/proc/{pid}/comm")
        if comm and comm != "bwrap":
            return True
    return False


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


def _tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size if _stat.S_ISREG(st.st_mode) else 0
    return total
