"""The local runtime: sealed bubblewrap sandboxes over a SIF's squashfs, for machines
without Apptainer. Runs as root (it mounts loop devices and writes cgroups); elsewhere it
refuses to start and says why.

Root filesystem. Nothing is unpacked: each sandbox mounts its image's squashfs partition
read-only through a loop device, *idmapped* to the sandbox's uid range, as the lower layer
of an overlay whose upper layer is a fresh ext4 file system of ``spec.storage_mb`` in a
sparse file (the disk quota: past it, writes fail with ENOSPC inside). All of it happens in
a private mount namespace (``helper.py seal``), so nothing reaches the host's mount table
and it all goes, loop devices included, with the sandbox's last process. The disk is
formatted ahead where it can be (``self.disks``, a ``prepared.PreparedPool`` keeping
``prepared`` disks per size ready; ``SANDFLEET_PREPARED=0`` turns it off): one file per
sandbox, moved into its folder, deleted with it, never used twice. For the shapes of
spec leases used last, whole sandboxes are started ahead and handed out once, the lease's
id, CPUs, lifetime and environment applied then (``local_ready``; ``ready``).

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
  agent's final files, with the view ``sandfleet.verifier.plan`` plans (the image's own
  system folders, tool configuration, PATH folders, installer stand-in and Python import
  order) applied by ``sandfleet.runtime.verify_local``, and writes its reward into a host
  folder only it has mounted. Its command runs as ``verify``'s ``user`` (Docker's USER, as
  the image's own /etc/passwd and /etc/group name it, never the agent's copy), entered as
  the agent's commands are, so a set-user-ID program of the image works in it as in Docker.

Not enforced: no CPU time quota (pinning bounds parallelism only), no seccomp filter, no
per-task network policy (``spec.network`` shares the host's network). Pids are checked by
start time, but a pid can be reused between that check and ``setns`` (microseconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import marshal
import math
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from sandfleet.errors import ImageMissing, SandboxLost, SandboxStartError
from sandfleet.runtime import layers, sif
from sandfleet.runtime.base import (
    OWNER_RE,
    CommandRuntime,
    SandboxSpec,
    check_name,
    default_owner,
    kill_group,
    proc_start_time,
)
from sandfleet.runtime.bwrap import DEFAULT_PATH
from sandfleet.runtime.local_host import (  # noqa: F401 (the runtime's API, as before)
    CGROUP_ROOT,
    CONTAINER_CAPS,
    HELPER,
    SHM_BYTES,
    UID_COUNT,
    Cgroups,
    SandboxRecord,
    UidSlots,
    _compiled,
    _parent,
    _read,
    _wait_gone,
    compile_helper,
    disk_skeleton,
    enter_argv,
    helper_argv,
    id_map,
    make_disk,
    pick_cpus,
    remove_unpacked_cache,
    sandbox_bwrap,
)
from sandfleet.runtime.local_ready import ReadySandboxes
from sandfleet.runtime.prepared import PreparedPool, remove_stale
from sandfleet.runtime.verify_local import LocalVerifier
from sandfleet.verifier.plan import path_roots, trusted_first  # noqa: F401

log = logging.getLogger(__name__)

TOOLS = ("timeout", "mount", "mkfs.ext4", "bwrap", "nsenter", "setpriv")
HOST_GRACE_S = 5
IMAGE_ENV_FILES = ("/.singularity.d/env/10-docker2singularity.sh",
                   "/.singularity.d/env/90-environment.sh")

# Pid 1 inside: writes the image's environment (its env files sourced in a subshell, as
# NUL-separated entries and one more NUL) to fd $3, drops the host's log file and bwrap's
# fds, turns deaf to signals, reaps orphans (bash does), ends at the deadline: $1 seconds
# from now, or (a sandbox started ahead, ``local_ready``) as many seconds as the line
# read from fd $4 says from when it comes; the pipe closed without one: at once. (SECONDS
# ticks at the wall clock's whole seconds, not from the shell's start: one second more, so
# pid 1 never ends before the record's deadline.)
INIT_SH = ('(for f in ' + " ".join(IMAGE_ENV_FILES) + '; do if [ -r "$f" ]; then . "$f"; '
           'fi; done; unset PWD OLDPWD SHLVL _; env -0; printf "\\0") >&"$3" 2>/dev/null; '
           'exec </dev/null >/dev/null 2>&1; eval "exec $2<&- $3>&-"; '
           'trap "" HUP INT QUIT TERM USR1 USR2 PIPE ALRM TSTP TTIN TTOU; end=$1; '
           'if [ "$4" != - ]; then read -r end <&"$4" || exit 0; eval "exec $4<&-"; '
           'end=$((SECONDS + end)); fi; end=$((end + 1)); '
           'while ((SECONDS < end)); do sleep $((end - SECONDS)) & wait $!; done')


class RuntimeUnavailable(RuntimeError):
    """This machine cannot give the local runtime's guarantees; the message says which
    feature is missing and what to do."""


def init_argv(*, lifetime_s: float, seal: dict, network: bool, hostname: str, info_fd: int,
              block_fd: int, env_fd: int, go_fd: int = -1, ready_s: float = 0) -> list[str]:
    """The host command that builds one sandbox and runs its pid 1 (see module doc); with
    ``go_fd``, pid 1 waits for its lifetime on that pipe (see INIT_SH) and the host's
    deadline gives it ``ready_s`` more (the longest it may wait)."""
    seconds = math.ceil(lifetime_s)
    bwrap = sandbox_bwrap(root=seal["root"], network=network, hostname=hostname,
                          info_fd=info_fd, block_fd=block_fd,
                          command=["bash", "-c", INIT_SH, "sandfleet-init", str(seconds),
                                   str(block_fd), str(env_fd),
                                   str(go_fd) if go_fd >= 0 else "-"], as_pid_1=True)
    return (["timeout", "-s", "KILL", str(seconds + math.ceil(ready_s) + HOST_GRACE_S)]
            + helper_argv("seal", marshal.dumps({**seal, "argv": bwrap}).hex()))



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



class LocalRuntime(LocalVerifier, CommandRuntime):
    """Sealed bubblewrap sandboxes over SIF images, on this machine (see the module doc)."""

    def __init__(self, state_dir: Path, cache_dir: Path | None = None,
                 owner: str | None = None, *, cgroup_parent: str = "sandfleet",
                 pids_max: int = 4096, start_timeout_s: float = 60.0,
                 uid_base: int = 1 << 31, uid_slots: int = 4096,
                 uid_lock_dir: Path = Path("/run/sandfleet/uid-slots"),
                 mount_dir: Path = Path("/run/sandfleet/mnt"), prepared: int | None = None,
                 ready: int | None = None, max_sandboxes: int | None = None):
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
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.skeleton = disk_skeleton(self.state_dir / "disk-skeleton")
        quota = min(max_sandboxes or uid_slots, uid_slots)  # ready disks never outnumber it
        self.disks = PreparedPool(self.state_dir / "prepared", self._make_disk,
                                  per_size=prepared, what="disk",
                                  room=lambda: quota - len(self._records))
        """Disks made ahead, per ``storage_mb`` (``prepared`` per size; 0: none)."""
        self.ready = ReadySandboxes(self, per_shape=ready)
        """Sandboxes started ahead for the shapes leases used last (``local_ready``)."""

    def _make_disk(self, path: Path, storage_mb: int) -> None:
        make_disk(path, storage_mb, self.skeleton, timeout=self.start_timeout_s)

    def prepare(self, storage_mb: int) -> None:
        """Keep disks of ``storage_mb`` made ahead from now on (sizes leases use are kept
        anyway, from their first start)."""
        self.disks.want(storage_mb)

    def close(self) -> None:
        """End the sandboxes started ahead and remove the disks made ahead (sandboxes
        handed out keep running)."""
        self.ready.close()
        self.disks.close()

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

    def netns_pid(self, sandbox_id: str) -> int:
        """A process in the sandbox's network namespace: pid 1 (``sandfleet.netproxy``)."""
        return self._live(sandbox_id).init_pid()

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
    def partition(image: Path) -> list[layers.Layer]:
        """The image's squashfs layers (a SIF's partition, or a layered image's files);
        ImageMissing when one cannot be used."""
        try:
            return layers.read(image)
        except sif.SifError as e:
            raise ImageMissing(str(image), e.reason) from None
        except OSError as e:
            raise ImageMissing(str(image), e.strerror or str(e)) from None

    # ---- lifecycle

    def start(self, sandbox_id: str, spec: SandboxSpec) -> None:
        check_name("sandbox id", sandbox_id)
        part = self.partition(spec.image)
        with self._lock:
            self._free_home(sandbox_id)
            taken = self.ready.take(sandbox_id, spec)  # one started ahead, if any
        if not taken:
            try:
                uid_base, slot = self.uids.acquire()
            except RuntimeError as e:
                raise SandboxStartError(sandbox_id, str(e)) from None
            try:
                self._start(sandbox_id, spec, part, uid_base, slot)
            finally:
                os.close(slot)  # the leader keeps its own copy for the sandbox's life
        self.ready.want(spec, part)

    def _free_home(self, sandbox_id: str) -> None:
        """Remove what a dead sandbox of this id left; SandboxStartError if it runs."""
        if self._dir(sandbox_id).exists():
            old = self._record(sandbox_id)
            if old is not None and old.alive():
                raise SandboxStartError(sandbox_id, "already running")
            self._destroy(sandbox_id, old)

    def _start(self, sandbox_id: str, spec: SandboxSpec, part: list[layers.Layer],
               uid_base: int, slot: int) -> None:
        home = self._dir(sandbox_id)
        with self._lock:
            self._free_home(sandbox_id)
            for sub in ("raw", "disk"):
                (home / sub).mkdir(parents=True)
            disk = home / "disk.img"  # this sandbox's alone, removed with its folder
            prepared = self.disks.take(spec.storage_mb, disk)
            if not prepared:
                try:
                    self._make_disk(disk, spec.storage_mb)
                except (OSError, subprocess.TimeoutExpired) as e:
                    self._destroy(sandbox_id, None)
                    raise SandboxStartError(sandbox_id, f"disk: {e}") from None
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

    def _launch(self, record: SandboxRecord, spec: SandboxSpec, part: list[layers.Layer],
                home: Path, slot: int, go_fd: int = -1, ready_s: float = 0) -> None:
        """Start the process tree; returns once pid 1 runs inside (record updated). With
        ``go_fd`` (``local_ready``): pid 1 waits for its lifetime on that pipe."""
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        env_r, env_w = os.pipe()
        seal = {"home": str(home), "layers": [(str(la.path), la.offset, la.size)
                                               for la in part],
                "uid_base": record.uid_base,
                "uid_count": UID_COUNT, "storage_mb": spec.storage_mb,
                "cgroup_procs": self._procs_files(record), "root": str(self.mnt / "root"),
                "image_dir": str(self.mnt / "image"), "close_fds": [slot],
                "hostname": spec.hostname, "network": spec.network}
        argv = init_argv(lifetime_s=spec.max_lifetime_s, seal=seal, network=spec.network,
                         hostname=spec.hostname, info_fd=info_w, block_fd=block_r,
                         env_fd=env_w, go_fd=go_fd, ready_s=ready_s)
        if self._cpus(record):
            argv = ["taskset", "-c", ",".join(map(str, record.cpus))] + argv
        try:
            with open(home / "init.log", "wb") as logfile:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logfile,
                                        stderr=subprocess.STDOUT,
                                        pass_fds=(info_w, block_r, env_w, slot,
                                                  *([go_fd] if go_fd >= 0 else [])),
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
        remove_stale(self.state_dir / "prepared")  # disks made ahead by an ended process
        self.ready.reap_stale()  # and its sandboxes started ahead (ended with it)
        gone = {sid for sid in self._own_records() if sid not in keep}
        prefix, suffix = f"{self.owner}-", f".{self._scope}"
        for parent in self.cgroups.parents.values():
            gone |= {path.name[len(prefix):-len(suffix)]
                     for path in parent.glob(f"{prefix}*{suffix}")
                     if path.name[len(prefix):-len(suffix)] not in keep}
        for sandbox_id in sorted(gone):
            self.stop(sandbox_id)
        return sorted(gone)
