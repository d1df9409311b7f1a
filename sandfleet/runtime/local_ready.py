"""Local sandboxes started ahead, for images leases use: a lease on such an image takes one
that is up already (its own disk, uid range, cgroups and namespaces, made for no lease),
and only what is the lease's is applied then.

What is started ahead is what does not depend on the lease: for a *shape* (the spec less
what is applied at hand-out: image, its file's identity, storage, memory, network,
hostname, lifetime), the whole sandbox of ``LocalRuntime._launch``, but its pid 1 waits on
a pipe for its lifetime before its clock starts (``INIT_SH``). At hand-out, under the
runtime's lock: its folder and cgroups are renamed to the lease's sandbox id, its CPUs
picked and written to its cpuset, its lifetime written to the pipe (pid 1's deadline
counts from then), its record written with the lease's spec and environment. Nothing in
it was ever a lease's: a sandbox started ahead is handed out once, or ended.

Owners and deadlines: the runtime holds each waiting sandbox's pipe. Closing it (``close``,
a sandbox older than ``max_age_s``) ends the sandbox by itself, and so does the runtime's
death, a crash included: the kernel closes the pipe, pid 1 reads no lifetime and exits,
the tree and its namespaces (its mounts, loop devices) go with it. The folders
(``state_dir/ready/<pid>-<start>``) and cgroups (``<owner>~<pid>-<start>-<n>.<scope>``) of
a process that is gone are removed by the next runtime's ``reap``. The host's own deadline
(``timeout``) of a sandbox started ahead is its lifetime plus ``max_age_s`` plus 5 s from
its start: at most ``max_age_s`` later than a lease's; pid 1's holds to the second.

Kept: ``per_shape`` per shape for the ``shapes`` shapes used last, never more than the node's
room for sandboxes (``LocalRuntime.disks``'s bound, which counts them). Off with
``SANDFLEET_PREPARED=0``, and where CPUs cannot be set at hand-out (no cpuset cgroup).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sandfleet.runtime import sif
from sandfleet.runtime.base import SandboxSpec, kill_group, proc_start_time
from sandfleet.runtime.local_host import Cgroups, SandboxRecord, pick_cpus
from sandfleet.runtime.prepared import per_size_default, remove_stale

log = logging.getLogger(__name__)


def shape(spec: SandboxSpec) -> str:
    """The part of ``spec`` a sandbox started ahead is made for, with the image file's
    identity (a file replaced at the same path is another shape)."""
    st = os.stat(spec.image)
    plain = replace(spec, cpus=1, env={}, workdir="/", user="", allowed_hosts=())
    return json.dumps([plain.to_dict(), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size])


@dataclass
class Ready:
    name: str
    """``~ready-<n>``: a record name no sandbox id can be (``check_name`` refuses ``~``)."""
    home: Path
    record: SandboxRecord
    go: int
    """Write end of pid 1's lifetime pipe; closing it ends the sandbox."""
    made_at: float


class ReadySandboxes:
    """Sandboxes started ahead for one ``LocalRuntime`` (see the module doc)."""

    def __init__(self, runtime: Any, *, per_shape: int | None = None, shapes: int = 4,
                 max_age_s: float = 120.0):
        self.rt = runtime
        self.per_shape = per_size_default() if per_shape is None else per_shape
        if "cpuset" not in runtime.cgroups.parents:
            self.per_shape = 0  # CPUs are pinned by taskset at launch then: not movable
        self.shapes, self.max_age_s = shapes, max_age_s
        tag = f"{os.getpid()}-{proc_start_time(os.getpid())}"
        self.root = runtime.state_dir / "ready"
        self.folder = self.root / tag
        self.cgroup_tag = f"{runtime.owner}~{tag}"
        self._ready: dict[str, deque[Ready]] = {}
        self._wanted: OrderedDict[str, tuple[SandboxSpec, sif.Partition]] = OrderedDict()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._count = 0
        self.taken = self.missed = 0

    # ---- what the runtime calls

    def want(self, spec: SandboxSpec, part: sif.Partition) -> None:
        """Keep sandboxes of ``spec``'s shape ready (the ``shapes`` used last)."""
        if self.per_shape <= 0:
            return
        key = shape(spec)
        with self._cond:
            if self._closed:
                return
            self._wanted[key] = (spec, part)
            self._wanted.move_to_end(key)
            while len(self._wanted) > self.shapes:
                old, _ = self._wanted.popitem(last=False)
                for item in self._ready.pop(old, deque()):
                    self._end_later(item)
            if self._thread is None:
                self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ready-sandboxes")
                self._thread.start()
            self._cond.notify_all()

    def take(self, sandbox_id: str, spec: SandboxSpec) -> bool:
        """Make a ready sandbox of ``spec``'s shape the lease's ``sandbox_id`` (called with
        the runtime's lock held, its folder free); False when there is none or it failed
        (it is ended then, and the caller starts one as without)."""
        if self.per_shape <= 0:
            return False
        key = shape(spec)
        with self._cond:
            queue = self._ready.get(key)
            item = None
            while queue:
                item = queue.popleft()
                if time.monotonic() - item.made_at < self.max_age_s and item.record.alive():
                    break
                self._end_later(item)
                item = None
            self._cond.notify_all()
            if item is None:
                self.missed += 1
                return False
        try:
            self._adopt(item, sandbox_id, spec)
        except Exception as e:  # noqa: BLE001 - never fail a start for the pool's sake
            log.warning("ready sandbox %s not handed to %s: %s", item.name, sandbox_id, e)
            self._end(item, also=sandbox_id)
            return False
        self.taken += 1
        return True

    def ready(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._ready.values())

    def close(self) -> None:
        """End every sandbox still waiting, and the maker."""
        with self._cond:
            self._closed = True
            items = [item for queue in self._ready.values() for item in queue]
            self._ready.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=60)
        for item in items:
            self._end(item)
        shutil.rmtree(self.folder, ignore_errors=True)

    def reap_stale(self) -> list[str]:
        """Remove the folders and cgroups of sandboxes started ahead by processes that are
        gone (their sandboxes ended with them); what was removed."""
        gone = remove_stale(self.root)
        prefix, suffix = f"{self.rt.owner}~", f".{self.rt._scope}"
        for parent in self.rt.cgroups.parents.values():
            for path in parent.glob(f"{prefix}*{suffix}"):
                pid, _, rest = path.name[len(prefix):].partition("-")
                start = rest.partition("-")[0]
                if not (pid.isdigit() and start.isdigit()
                        and proc_start_time(int(pid)) == int(start)):
                    Cgroups.remove(path)
                    gone.append(str(path))
        return gone

    # ---- hand-out and ending

    def _adopt(self, item: Ready, sandbox_id: str, spec: SandboxSpec) -> None:
        rt = self.rt
        home = rt._dir(sandbox_id)
        home.parent.mkdir(parents=True, exist_ok=True)
        os.rename(item.home, home)
        item.home = home
        cgroups = []
        for path in map(Path, item.record.cgroups):
            new = path.with_name(rt._cgroup_name(sandbox_id))
            os.rename(path, new)
            cgroups.append(str(new))
        item.record.cgroups = cgroups
        cpus = pick_cpus(sorted(os.sched_getaffinity(0)), spec.cpus, rt._cpu_load())
        cpuset = rt.cgroups.parents["cpuset"] / rt._cgroup_name(sandbox_id)
        (cpuset / "cpuset.cpus").write_text(",".join(map(str, cpus)))
        now = time.time()
        record = SandboxRecord(sandbox_id, rt.owner, os.getuid(), spec.to_dict(), now,
                               now + spec.max_lifetime_s, item.record.leader,
                               item.record.init, item.record.monitor,
                               uid_base=item.record.uid_base, cgroups=cgroups, cpus=cpus,
                               env={**item.record.env, **spec.env})
        os.write(item.go, f"{int(spec.max_lifetime_s + 0.999)}\n".encode())
        os.close(item.go)
        item.go = -1
        record.save(home / "sandbox.json")
        rt._records.pop(item.name, None)
        rt._records[sandbox_id] = record
        child = rt._children.pop(item.name, None)
        if child is not None:
            rt._children[sandbox_id] = child
        item.record = record

    def _end_later(self, item: Ready) -> None:
        threading.Thread(target=self._end, args=(item,), daemon=True).start()

    def _end(self, item: Ready, also: str = "") -> None:
        """End a sandbox started ahead: its pipe closed (pid 1 exits), its tree killed if
        it lingers, its cgroups and folder removed (under the lease's name too, ``also``,
        when a hand-out failed halfway)."""
        rt = self.rt
        if item.go >= 0:
            os.close(item.go)
            item.go = -1
        init, leader = item.record.init, item.record.leader
        if init is not None and proc_start_time(init[0]) == init[1]:
            try:
                os.kill(init[0], 9)
            except ProcessLookupError:
                pass
        child = rt._children.pop(item.name, None) or (
            rt._children.pop(also, None) if also else None)
        try:
            if child is not None:
                child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill_group(leader[0])
        rt._records.pop(item.name, None)
        if also:
            rt._records.pop(also, None)
        paths = [Path(p) for p in item.record.cgroups]
        if also:
            paths += rt.cgroups.paths(rt._cgroup_name(also)).values()
        for path in paths:
            Cgroups.remove(path)
        shutil.rmtree(item.home, ignore_errors=True)

    # ---- the maker

    def _next(self) -> tuple[str, SandboxSpec, sif.Partition] | None:
        """A shape short of sandboxes, the one used last first (lock held)."""
        if self.rt.disks.room() <= 0:
            return None
        for key in reversed(self._wanted):
            if len(self._ready.get(key, ())) < self.per_shape:
                return key, *self._wanted[key]
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                for queue in self._ready.values():
                    while queue and now - queue[0].made_at > self.max_age_s:
                        self._end_later(queue.popleft())
                job = None if self._closed else self._next()
                while job is None and not self._closed:
                    self._cond.wait(timeout=min(self.max_age_s / 2, 30.0))
                    job = self._next()
                if self._closed or job is None:
                    return
                self._count += 1
                name = f"~ready-{self._count}"
            key, spec, part = job
            try:
                item = self._start(name, spec, part)
            except Exception as e:  # noqa: BLE001 - a failed start must not end the maker
                log.warning("sandbox ahead for %s not started: %s", spec.image, e)
                with self._cond:
                    self._cond.wait(timeout=5.0)
                continue
            with self._cond:
                if self._closed or key not in self._wanted:
                    self._end_later(item)
                    continue
                self._ready.setdefault(key, deque()).append(item)

    def _start(self, name: str, spec: SandboxSpec, part: sif.Partition) -> Ready:
        """One sandbox of ``spec``'s shape, its pid 1 waiting for its lifetime."""
        rt = self.rt
        home = self.folder / name[1:]
        for sub in ("raw", "disk"):
            (home / sub).mkdir(parents=True)
        uid_base, slot = rt.uids.acquire()
        go_r, go_w = os.pipe()
        record = None
        try:
            if not rt.disks.take(spec.storage_mb, home / "disk.img"):
                rt._make_disk(home / "disk.img", spec.storage_mb)
            cgroups = rt.cgroups.create(f"{self.cgroup_tag}-{name[len('~ready-'):]}"
                                        f".{rt._scope}", memory_mb=spec.memory_mb,
                                        cpus=sorted(os.sched_getaffinity(0)),
                                        pids_max=rt.pids_max)
            now = time.time()
            record = SandboxRecord(name, rt.owner, os.getuid(), spec.to_dict(), now,
                                   now + spec.max_lifetime_s + self.max_age_s, (0, 0),
                                   uid_base=uid_base, cgroups=[str(p) for p in cgroups])
            rt._launch(record, spec, part, home, slot, go_fd=go_r, ready_s=self.max_age_s)
            return Ready(name, home, record, go_w, time.monotonic())
        except BaseException:
            item = Ready(name, home, record or SandboxRecord(
                name, rt.owner, os.getuid(), {}, 0, 0, (0, 0)), go_w, 0)
            self._end(item)
            raise
        finally:
            os.close(go_r)
            os.close(slot)
