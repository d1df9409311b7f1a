"""The apptainer runtime: one Apptainer instance per sandbox, for clusters.

Each sandbox is ``apptainer instance start --overlay <its ext3 image> --containall
--cleanenv --no-home [--net --network none] <sif> <owner>-<key>-<id>``; commands are
``apptainer exec instance://<name> [env K=V...] ...`` (the working directory as ``--pwd``); ``stop`` is ``apptainer instance stop --force``;
``list_running`` reads ``apptainer instance list --json`` and keeps the names with this
runtime's prefix (``key`` comes from the state folder, so two workers of one user on one
node never reap each other's). Every command line comes from a pure function below.
Which apptainer, and the refusals when the node cannot run it, are in ``apptainer_setup``.

What holds, run as root and as an ordinary user (tested both ways with Apptainer 1.4.5):

- Writes go to the sandbox's own sparse ext3 overlay of ``storage_mb`` (ENOSPC inside at
  the quota; the node's disk gets only what is written), removed at stop; made ahead where
  it can be (``self.overlays``, a ``prepared.PreparedPool``; ``SANDFLEET_PREPARED=0``
  turns it off), one file per sandbox, never used twice. For the shapes of spec leases
  used last, whole instances are started ahead and handed out once (``apptainer_ready``).
- ``--containall``: fresh pid, ipc and mount namespaces, no host home, /tmp or /dev bound,
  a clean environment; ``--no-mount tmp``: /tmp and /var/tmp are the overlay's (the agent's
  files there count in ``storage_mb`` and reach the verifier). The network is a private namespace with only ``lo`` unless
  ``spec.network`` (``--network none`` needs no privileges). The hostname is set.
- As an ordinary user (no setuid starter): ``--userns --fakeroot``, so commands run as
  root inside a user namespace mapping only that user; the image and overlay are mounted
  with squashfuse, fuse2fs and fuse-overlayfs.
- Limits, as root (and as an ordinary user on cgroup v2 with a systemd user session that
  delegates memory and cpu): ``--cpus`` and ``--memory`` through Apptainer's cgroups
  (cgroupfs on v1, systemd on v2); OOM kills are counted from the instance's memory cgroup.
  Otherwise (an ordinary user on cgroup v1, the cluster case) Apptainer applies no cgroup
  limits: the CPUs are pinned instead (the instance and every exec run under ``taskset`` on
  ``spec.cpus`` CPUs of the worker's, the least used first; a process inside may widen its
  own affinity within the worker's), and ``memory_mb`` is enforced by polling: the
  runtime's ``apptainer_memory.MemoryWatcher`` sums the PSS of each instance's processes
  every 0.25 s and past the limit kills every process but its pid 1 (``oom_kills`` counts
  those kills), each command entering with RLIMIT_DATA at 2x ``memory_mb``. What that
  leaves open: ``unenforced()``.
- Max lifetime: a detached watchdog (``sleep; apptainer instance stop --force``) in its
  own session per sandbox, which outlives the worker; if it is killed too, the Slurm job's
  walltime still ends the instance with the job.
- ``instance start`` writes to files under ``state_dir`` (never to pipes, which the
  instance would hold open forever); its pid comes from ``--pid-file`` and, with its start
  time, is recorded in ``sandbox.json`` for liveness checks without calling apptainer.
- A worker killed mid-lease leaves its instances, overlays and watchdogs; the next worker
  with the same state folder, or ``sandfleet gc``, stops them (``reap``). Mounts are all
  inside the instance's own mount namespace and end with it.

The instance's commands all run as one user (root, or fakeroot): ``spec.user`` is not
applied. The verifier: see ``verify``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sandfleet.errors import ImageMissing, SandboxLost, SandboxStartError
from sandfleet.runtime import layers, sif
from sandfleet.runtime.apptainer_memory import MemoryWatcher, cgroup_v2_delegated, data_rlimit_argv
from sandfleet.runtime.apptainer_ready import ReadyInstances
from sandfleet.runtime.apptainer_setup import (
    ROOT_REFUSAL,
    START_ACTION,
    ApptainerInfo,
    find_apptainer,
    make_overlay,
    probe,
    unenforced_limits,
    wait_released,
)
from sandfleet.runtime.apptainer_verify import merge_ahead, verify_in_fresh_container
from sandfleet.runtime.base import (
    NAME_RE,
    OWNER_RE,
    CommandRuntime,
    ExecResult,
    SandboxSpec,
    check_name,
    default_owner,
    kill_group,
    kill_process_group,
    proc_start_time,
    read_oom_kills,
    read_small,
    write_json_atomic,
)
from sandfleet.runtime.prepared import PreparedPool, remove_stale
from sandfleet.verifier.plan import VERIFIER_TOOLS

log = logging.getLogger(__name__)

# /tmp and /var/tmp on the sandbox's overlay, as in a container (``--containall`` alone makes
# them a tmpfs of the instance: outside ``storage_mb``, and gone before the verifier runs)
NO_TMPFS = ("--no-mount", "tmp")
# Stops the instance at the deadline, unless it is no longer the one started (pid gone).
WATCHDOG_SH = ('sleep "$1" && kill -0 "$4" 2>/dev/null && '
               'exec "$2" instance stop --force "$3"')
# An instance started ahead (``apptainer_ready``): waits up to $1 s for the lease's lifetime
# on fd $5, then sleeps it; no line (too old, the pipe closed: the worker ended) stops it.
READY_WATCHDOG_SH = ('if read -r -t "$1" life <&"$5"; then eval "exec $5<&-"; '
                     'sleep "$life"; fi; kill -0 "$4" 2>/dev/null && '
                     'exec "$2" instance stop --force "$3"')


def start_argv(apptainer: str, spec: SandboxSpec, name: str, pid_file: Path, *,
               overlay: Path | None = None, start_action: Path | None = None,
               rootless: bool = False, cgroup_limits: bool = False,
               cpus: Sequence[int] = ()) -> list[str]:
    """``instance start``: writes to ``overlay`` (a tmpfs without), ``start_action`` bound
    over the image's start script, ``--userns --fakeroot`` when ``rootless``, cgroup
    limits with ``cgroup_limits``, pinned to ``cpus`` (by ``taskset``) when given."""
    *below, image = layers.apptainer_args(spec.image)  # a layered image's, then the base
    argv = [*taskset(cpus), apptainer, "instance", "start", *below]
    argv += ["--overlay", str(overlay)] if overlay else ["--writable-tmpfs"]
    argv += ["--containall", "--cleanenv", "--no-home", *NO_TMPFS, "--pid-file", str(pid_file),
             "--hostname", spec.hostname]
    argv += ["--userns", "--fakeroot"] if rootless else ["--userns"]
    if start_action:
        argv += ["--bind", f"{start_action}:/.singularity.d/actions/start:ro"]
    if not spec.network:
        argv += ["--net", "--network", "none"]
    if cgroup_limits:
        argv += ["--cpus", str(spec.cpus), "--memory", f"{spec.memory_mb}M"]
    return argv + [image, name]


def taskset(cpus: Sequence[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []


def exec_argv(apptainer: str, name: str, argv: Sequence[str], *, cwd: str,
              env: dict[str, str], cpus: Sequence[int] = ()) -> list[str]:
    """``apptainer exec`` in the instance, ``env`` set by the image's ``env`` over the
    image's own environment (Apptainer 1.4 drops ``APPTAINERENV_*`` and ``--env`` for
    images without its ``/.singularity.d/env/99-*.sh`` scripts, such as TMax's)."""
    setenv = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return [*taskset(cpus), apptainer, "--quiet", "exec", "--cleanenv", "--pwd", cwd,
            f"instance://{name}", *setenv, *argv]


def stop_argv(apptainer: str, name: str) -> list[str]:
    return [apptainer, "instance", "stop", "--force", name]


def list_argv(apptainer: str) -> list[str]:
    return [apptainer, "instance", "list", "--json"]


def watchdog_argv(apptainer: str, name: str, seconds: float, pid: int,
                  go_fd: int = -1) -> list[str]:
    """The watchdog of instance ``name``; with ``go_fd``, one waiting ``seconds`` at most
    for its lifetime on that pipe (``READY_WATCHDOG_SH``)."""
    if go_fd >= 0:
        return ["bash", "-c", READY_WATCHDOG_SH, "sandfleet-watchdog", str(int(seconds) + 1),
                apptainer, name, str(pid), str(go_fd)]
    return ["sh", "-c", WATCHDOG_SH, "sandfleet-watchdog", f"{seconds:g}", apptainer, name,
            str(pid)]


def parse_instance_list(text: str) -> dict[str, int]:
    """``apptainer instance list --json`` -> {instance name: pid}."""
    data = json.loads(text) if text.strip() else {}
    return {item["instance"]: int(item.get("pid", 0)) for item in data.get("instances") or []}


def memory_oom_file(proc_cgroup: str, root: str = "/sys/fs/cgroup") -> str | None:
    """The file counting the OOM kills of the memory cgroup a process is in, from its
    ``/proc/<pid>/cgroup``: ``memory.oom_control`` on cgroup v1, ``memory.events`` on v2;
    None in the root cgroup."""
    unified = None
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return None if path == "/" else f"{root}/memory{path}/memory.oom_control"
        if hierarchy == "0" and not controllers:
            unified = path
    return None if unified in (None, "/") else f"{root}{unified}/memory.events"


def own_memory_cgroup(instance: str | None, ours: str | None) -> str | None:
    """``instance`` (a ``memory_oom_file``) unless it is not the instance's own: it is
    missing, or it holds us too (the job's cgroup, shared by every sandbox)."""
    if instance is None:
        return None
    if ours is not None and (os.path.dirname(ours) + "/").startswith(
            os.path.dirname(instance) + "/"):
        return None
    return instance


@dataclass
class InstanceRecord:
    """``sandbox.json``: the instance and its watchdog, each as (pid, start time)."""

    sandbox_id: str
    owner: str
    uid: int
    name: str
    spec: dict
    created_at: float
    deadline: float
    instance: tuple[int, int]
    watchdog: tuple[int, int] = (0, 0)
    cpus: tuple[int, ...] = ()
    """The CPUs its commands are pinned to (rootless); () when cgroups limit it."""

    @classmethod
    def load(cls, path: Path) -> InstanceRecord | None:
        try:
            data = json.loads(path.read_text())
            for key in ("instance", "watchdog", "cpus"):
                data[key] = tuple(data.get(key, ()))
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    def alive(self) -> bool:
        return proc_start_time(self.instance[0]) == self.instance[1]


def state_key(state_dir: Path) -> str:
    """8 hex digits naming a state folder in instance names."""
    return hashlib.sha1(str(state_dir).encode()).hexdigest()[:8]


class ApptainerRuntime(CommandRuntime):
    """Apptainer instances on this node (see the module doc)."""

    single_id_userns = True
    """Its user namespace maps one id: apt cannot drop to ``_apt`` (``sandfleet.netproxy``)."""

    def __init__(self, state_dir: Path, owner: str | None = None,
                 apptainer: str = "apptainer", *, cgroup_limits: bool | None = None,
                 start_timeout_s: float = 300.0, call_timeout_s: float = 60.0,
                 data_rlimit: bool = True, allow_host_root: bool = False,
                 prepared: int | None = None, ready: int | None = None,
                 max_sandboxes: int = 256):
        self.state_dir = Path(state_dir).resolve()
        self.owner = check_name("owner", owner or default_owner(), OWNER_RE)
        self.prefix = f"{self.owner}-{state_key(self.state_dir)}-"
        self.apptainer = find_apptainer(apptainer) or apptainer
        self._cgroup_limits = cgroup_limits
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self._env = {k: v for k, v in os.environ.items()
                     if not k.startswith(("APPTAINERENV_", "SINGULARITYENV_"))}
        self._lock = threading.Lock()
        self._action_lock = threading.Lock()  # the start action's file
        self._oom_files: dict[str, str] = {}  # sandbox id -> its OOM counter ("": none)
        self._info: ApptainerInfo | None = None
        self._memory = MemoryWatcher()  # memory_mb without cgroups (apptainer_memory)
        self._data_rlimit = data_rlimit  # and RLIMIT_DATA on each command then
        self.allow_host_root = allow_host_root  # as root: see ROOT_REFUSAL
        self.overlays = PreparedPool(self.state_dir / "prepared", self._make_overlay,
                                     per_size=prepared, what="overlay",
                                     room=lambda: max_sandboxes - len(self._own_dirs()))
        """Overlays made ahead, per ``storage_mb`` (``prepared`` per size; 0: none)."""
        self.ready = ReadyInstances(self, per_shape=ready)
        """Instances started ahead for the shapes leases used last (``apptainer_ready``)."""

    def _make_overlay(self, path: Path, storage_mb: int) -> None:
        make_overlay(path, storage_mb, hide=(VERIFIER_TOOLS,), timeout=self.start_timeout_s)

    def prepare(self, storage_mb: int) -> None:
        """Keep overlays of ``storage_mb`` made ahead from now on (sizes leases use are
        kept anyway, from their first start)."""
        self.overlays.want(storage_mb)

    @property
    def info(self) -> ApptainerInfo:
        """The checked apptainer (probed once; SandboxStartError when unusable)."""
        if self._info is None:
            self._info = probe(self.apptainer, self.call_timeout_s)
            self.apptainer = self._info.path
        return self._info

    @property
    def cgroup_limits(self) -> bool:
        """Whether Apptainer applies ``--cpus``/``--memory`` (default: as root, or on cgroup
        v2 with a delegating systemd user session); without, ``memory_mb`` is watched."""
        if self._cgroup_limits is None:
            self._cgroup_limits = os.geteuid() == 0 or cgroup_v2_delegated() is None
        return self._cgroup_limits

    def unenforced(self) -> list[str]:
        """The spec's limits this runtime does not enforce per sandbox here."""
        return unenforced_limits(self.cgroup_limits)

    def _name(self, sandbox_id: str) -> str:
        return self.prefix + check_name("sandbox id", sandbox_id)

    def _dir(self, sandbox_id: str) -> Path:
        return self.state_dir / "sandboxes" / self._name(sandbox_id)

    def _record(self, sandbox_id: str) -> InstanceRecord | None:
        return self._record_at(self._dir(sandbox_id))

    def _record_at(self, home: Path) -> InstanceRecord | None:
        record = InstanceRecord.load(home / "sandbox.json")
        if record is None or (record.owner, record.uid) != (self.owner, os.getuid()):
            return None
        return record

    def _live(self, sandbox_id: str) -> InstanceRecord:
        record = self._record(sandbox_id)
        if record is None:
            raise SandboxLost(sandbox_id, "no such sandbox on this node")
        if not record.alive():
            why = "max lifetime reached" if time.time() >= record.deadline else \
                "its instance died"
            raise SandboxLost(sandbox_id, why)
        return record

    def _check_alive(self, sandbox_id: str) -> None:
        self._live(sandbox_id)

    def netns_pid(self, sandbox_id: str) -> int:
        """A process in the instance's network namespace: its init (``sandfleet.netproxy``)."""
        return self._live(sandbox_id).instance[0]

    def _host_env(self) -> dict[str, str]:
        return self._env

    def oom_kills(self, sandbox_id: str) -> int | None:
        """With ``cgroup_limits``, from the memory cgroup Apptainer put the instance in
        (found once, through the instance's pid); None without, or when that cgroup is one
        this worker shares with every sandbox (the job's)."""
        if not self.cgroup_limits:
            return self._memory.kills(sandbox_id)
        path = self._oom_files.get(sandbox_id)
        if path is None:
            record = self._record(sandbox_id) if self.cgroup_limits else None
            if record is None or not record.alive():
                return None
            instance, ours = (read_small(f"/proc/{pid}/cgroup")
                              for pid in (record.instance[0], os.getpid()))
            path = self._oom_files[sandbox_id] = own_memory_cgroup(
                memory_oom_file(instance.decode()) if instance else None,
                memory_oom_file(ours.decode()) if ours else None) or ""
        return read_oom_kills(path) if path else None

    def _enter(self, sandbox_id: str, argv: list[str], cwd: str | None,
               env: dict[str, str] | None, *, root: bool = False) -> list[str]:
        # an instance's commands run as its one user (root, or fakeroot): neither ``root``
        # nor the spec's ``user`` changes that
        record = self._live(sandbox_id)
        limit = data_rlimit_argv(record.spec["memory_mb"]) \
            if self._data_rlimit and not self.cgroup_limits else []
        return limit + exec_argv(self.apptainer, record.name, argv,
                                 cwd=cwd or record.spec["workdir"],
                                 env={**record.spec["env"], **(env or {})}, cpus=record.cpus)

    def _call(self, argv: list[str], logfile: Path, timeout: float) -> int:
        """Run an apptainer command with its output in ``logfile``; its exit status."""
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self._env,
                                    start_new_session=True)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_process_group(proc)
                raise

    def _pick_cpus(self, n: int) -> tuple[int, ...]:
        load: Counter = Counter()
        for sid in self._own_dirs():
            record = self._record(sid)
            if record is not None and record.alive():
                load.update(record.cpus)
        allowed = sorted(os.sched_getaffinity(0))
        ranked = sorted(allowed, key=lambda cpu: (load[cpu], cpu))
        return tuple(sorted(ranked[:n]))

    def _start_action(self) -> Path:
        path = self.state_dir / "start-action.sh"
        # a worker starts sandboxes from several threads of one process; its own lock, as
        # verify (holding self._lock) starts the instance again through _launch
        with self._action_lock:
            if not path.exists() or path.read_text() != START_ACTION:
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
                tmp.write_text(START_ACTION)
                tmp.chmod(0o755)
                os.replace(tmp, path)
        return path

    def start(self, sandbox_id: str, spec: SandboxSpec) -> None:
        home = self._dir(sandbox_id)
        try:
            layers.read(spec.image)
        except sif.SifError as e:
            raise ImageMissing(str(spec.image), e.reason) from None
        try:
            info = self.info
        except SandboxStartError as e:
            raise SandboxStartError(sandbox_id, e.reason) from None
        if not info.rootless and not self.allow_host_root:
            raise SandboxStartError(sandbox_id, ROOT_REFUSAL)
        if spec.user:
            log.warning("sandbox %s: its commands run as the instance's user, not as %r (the "
                        "apptainer runtime cannot switch users)", sandbox_id, spec.user)
        with self._lock:
            if home.exists():
                old = self._record(sandbox_id)
                if old is not None and old.alive():
                    raise SandboxStartError(sandbox_id, "already running")
                self._destroy(sandbox_id, old)
            taken = self.ready.take(sandbox_id, spec)  # an instance started ahead, if any
            if not taken:
                home.mkdir(parents=True)
                cpus = () if self.cgroup_limits else self._pick_cpus(spec.cpus)
                # claimed before the (slow) start, so parallel starts spread
                InstanceRecord(sandbox_id, self.owner, os.getuid(), self._name(sandbox_id),
                               spec.to_dict(), time.time(), 0, (0, 0), cpus=cpus
                               ).save(home / "sandbox.json")
        if not taken:
            try:
                if not self.overlays.take(spec.storage_mb, home / "overlay.img"):
                    self._make_overlay(home / "overlay.img", spec.storage_mb)
                self._launch(sandbox_id, spec, info, cpus, time.time() + spec.max_lifetime_s)
            except BaseException as e:
                self._destroy(sandbox_id, None)
                if isinstance(e, (SandboxStartError, KeyboardInterrupt)):
                    raise
                raise SandboxStartError(sandbox_id, f"{type(e).__name__}: {e}") from e
        self.ready.want(spec, info)
        merge_ahead(self.state_dir / "pristine", spec.image)

    def _launch(self, sandbox_id: str, spec: SandboxSpec, info: ApptainerInfo,
                cpus: tuple[int, ...], deadline: float, *, home: Path | None = None,
                watch: bool = True, go_fd: int = -1) -> None:
        """Start the instance over the sandbox's overlay (made already; in ``home``, the
        sandbox's folder unless given), its watchdog set for ``deadline``, and record
        both; its memory watched (``watch``) where no cgroup limits it. With ``go_fd``,
        the watchdog waits for the lifetime on that pipe until ``deadline``."""
        name, home = self._name(sandbox_id), home or self._dir(sandbox_id)
        pid_file, logfile = home / "instance.pid", home / "start.log"
        pid_file.unlink(missing_ok=True)
        argv = start_argv(self.apptainer, spec, name, pid_file, overlay=home / "overlay.img",
                          start_action=self._start_action(), rootless=info.rootless,
                          cgroup_limits=self.cgroup_limits, cpus=cpus)
        code = self._call(argv, logfile, self.start_timeout_s)
        pid = int(pid_file.read_text().strip()) if code == 0 and pid_file.exists() else 0
        start = proc_start_time(pid) if pid else None
        if start is None:
            tail = logfile.read_text(errors="replace")[-1500:].strip()
            raise SandboxStartError(sandbox_id, f"instance start failed ({code}): {tail}")
        InstanceRecord(sandbox_id, self.owner, os.getuid(), name, spec.to_dict(), time.time(),
                       deadline, (pid, start),
                       self._watchdog(name, deadline, pid, home, go_fd), cpus
                       ).save(home / "sandbox.json")
        if watch and not self.cgroup_limits:
            self._memory.watch(sandbox_id, pid, spec.memory_mb)

    def _watchdog(self, name: str, deadline: float, pid: int, home: Path,
                  go_fd: int = -1) -> tuple[int, int]:
        """A detached watchdog stopping instance ``name`` (its init ``pid``) at
        ``deadline`` (see ``watchdog_argv`` for ``go_fd``); its (pid, start time)."""
        with open(home / "watchdog.log", "ab") as out:
            dog = subprocess.Popen(
                watchdog_argv(self.apptainer, name, max(deadline - time.time(), 0.1), pid,
                              go_fd),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self._env, start_new_session=True,
                pass_fds=(go_fd,) if go_fd >= 0 else ())
        return dog.pid, proc_start_time(dog.pid) or 0

    def _end_instance(self, sandbox_id: str, record: InstanceRecord | None) -> None:
        """Stop the instance and its watchdog; its folder (overlay, record) stays."""
        self._oom_files.pop(sandbox_id, None)
        self._memory.forget(sandbox_id)
        home = self._dir(sandbox_id)
        try:  # also when the record says dead: apptainer may still list it
            name = record.name if record is not None else self._name(sandbox_id)
            self._call(stop_argv(self.apptainer, name),
                       home / "stop.log" if home.is_dir() else Path(os.devnull),
                       self.call_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("sandbox %s: instance stop failed: %s", sandbox_id, e)
        if record is not None:
            if record.instance[0] and proc_start_time(record.instance[0]) == \
                    record.instance[1]:
                try:  # stop failed; its init's death ends its whole pid namespace
                    os.kill(record.instance[0], signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if record.watchdog[0] and \
                    proc_start_time(record.watchdog[0], zombie_ok=True) == record.watchdog[1]:
                kill_group(record.watchdog[0])
        self._released(sandbox_id)

    def _released(self, sandbox_id: str) -> None:
        """Wait (bounded) until no process has the sandbox's overlay open: a container
        that ended may still have its fuse2fs writing it back (``wait_released``)."""
        overlay = self._dir(sandbox_id) / "overlay.img"
        if overlay.exists() and (left := wait_released(overlay, self.call_timeout_s)):
            log.warning("sandbox %s: its overlay is still open in processes %s after %.0f s",
                        sandbox_id, left, self.call_timeout_s)

    def verify(self, sandbox_id: str, command: list[str], *, tests: Path, logs: Path,
               timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
               agent_system: bool = False, user: str = "") -> ExecResult:
        """The verifier in a fresh container of the sandbox's SIF over the agent's final
        files, every agent process ended first (``apptainer_verify``). ``user`` is not
        applied: the verifier runs as the instance's one user."""
        if user:
            log.warning("sandbox %s: the verifier runs as the instance's user, not as %r",
                        sandbox_id, user)
        with self._lock:
            return verify_in_fresh_container(self, sandbox_id, list(command), tests=tests,
                                             logs=logs, timeout=timeout, cwd=cwd, env=env,
                                             agent_system=agent_system)

    def stop(self, sandbox_id: str) -> None:
        with self._lock:
            self._destroy(sandbox_id, self._record(sandbox_id))

    def _destroy(self, sandbox_id: str, record: InstanceRecord | None) -> None:
        self._end_instance(sandbox_id, record)
        self._memory.drop(sandbox_id)
        shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)

    def close(self) -> None:
        """End the memory watcher's thread (it also ends by itself once nothing runs) and
        the overlays made ahead (those not taken are removed)."""
        self._memory.close()
        self.ready.close()
        self.overlays.close()

    def _instances(self) -> dict[str, int] | None:
        try:
            out = subprocess.run(list_argv(self.apptainer), capture_output=True, text=True,
                                 env=self._env, timeout=self.call_timeout_s,
                                 stdin=subprocess.DEVNULL, check=False)
            if out.returncode == 0:
                return parse_instance_list(out.stdout)
            log.warning("instance list failed (%d): %s", out.returncode, out.stderr[-500:])
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            log.warning("instance list failed: %s", e)
        return None

    def _own_dirs(self) -> list[str]:
        root = self.state_dir / "sandboxes"
        return sorted(p.name[len(self.prefix):] for p in root.glob(f"{self.prefix}*")) \
            if root.is_dir() else []

    def list_running(self) -> list[str]:
        """From ``apptainer instance list`` (the records, if apptainer cannot answer)."""
        instances = self._instances()
        if instances is None:
            return [sid for sid in self._own_dirs()
                    if (rec := self._record(sid)) is not None and rec.alive()]
        named = {rec.name: sid for sid in self._own_dirs()  # one started ahead keeps its name
                 if (rec := self._record(sid)) is not None}
        waiting = self.prefix + self.ready.prefix  # this runtime's, not handed out yet
        return sorted(named.get(name) or name[len(self.prefix):] for name in instances
                      if name in named or (name.startswith(self.prefix) and not
                                           name.startswith(waiting) and
                                           NAME_RE.fullmatch(name[len(self.prefix):])))

    def reap(self, keep: Iterable[str]) -> list[str]:
        """Stop every instance of this runtime not in ``keep``, dead leftovers included."""
        keep = set(keep)
        remove_stale(self.state_dir / "prepared")  # overlays made ahead by an ended process
        remove_stale(self.state_dir / "ready")  # its instances: in list_running, reaped here
        gone = sorted(set(self.list_running()) | set(self._own_dirs()))
        gone = [sid for sid in gone if sid not in keep]
        for sandbox_id in gone:
            self.stop(sandbox_id)
        return gone
