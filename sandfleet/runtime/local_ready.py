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

Kept (``prepared.ReadyPool``): ``per_shape`` per shape for the ``shapes`` shapes used
last, never more than the node's room for sandboxes (``LocalRuntime.disks``'s bound, which
counts them). Off with ``SANDFLEET_PREPARED=0``, and where CPUs cannot be set at hand-out
(no cpuset cgroup).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandfleet.runtime import layers
from sandfleet.runtime.base import SandboxSpec, kill_group, proc_start_time
from sandfleet.runtime.local_host import Cgroups, SandboxRecord, pick_cpus
from sandfleet.runtime.prepared import Ready, ReadyPool, remove_stale


def shape(spec: SandboxSpec) -> str:
    """The part of ``spec`` a sandbox started ahead is made for, with the image file's
    identity (a file replaced at the same path is another shape)."""
    plain = replace(spec, cpus=1, env={}, workdir="/", user="", allowed_hosts=())
    return json.dumps([plain.to_dict(), layers.identity(spec.image)])


class ReadySandboxes(ReadyPool):
    """Sandboxes started ahead for one ``LocalRuntime`` (see the module doc). Their record
    names are ``~ready-<n>``, which no sandbox id can be (``check_name`` refuses ``~``)."""

    def __init__(self, runtime: Any, *, per_shape: int | None = None, shapes: int = 4,
                 max_age_s: float = 120.0):
        super().__init__(runtime.state_dir / "ready", runtime.disks.room,
                         per_shape=per_shape, shapes=shapes, max_age_s=max_age_s)
        if "cpuset" not in runtime.cgroups.parents:
            self.per_shape = 0  # CPUs are pinned by taskset at launch then: not movable
        self.rt = runtime
        self.cgroup_tag = f"{runtime.owner}~{self.tag}"

    def shape(self, spec: SandboxSpec) -> str:
        return shape(spec)

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

    def _adopt(self, item: Ready, sandbox_id: str, spec: SandboxSpec) -> None:
        """Called with the runtime's lock held and the lease's folder free."""
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

    def _end(self, item: Ready, also: str = "") -> None:
        """Its pipe closed (pid 1 exits), its tree killed if it lingers, its cgroups and
        folder removed (under the lease's name too, ``also``)."""
        rt = self.rt
        if item.go >= 0:
            os.close(item.go)
            item.go = -1
        init, leader = item.record.init, item.record.leader
        if init is not None and proc_start_time(init[0]) == init[1]:
            try:
                os.kill(init[0], signal.SIGKILL)
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

    def _start(self, number: int, spec: SandboxSpec, part: list[layers.Layer]) -> Ready:
        """One sandbox of ``spec``'s shape, its pid 1 waiting for its lifetime."""
        rt = self.rt
        name, home = f"~ready-{number}", self.folder / f"ready-{number}"
        for sub in ("raw", "disk"):
            (home / sub).mkdir(parents=True)
        uid_base, slot = rt.uids.acquire()
        go_r, go_w = os.pipe()
        cgroup = f"{self.cgroup_tag}-{number}.{rt._scope}"
        record = SandboxRecord(name, rt.owner, os.getuid(), {}, 0, 0, (0, 0), cgroups=[
            str(p) for p in rt.cgroups.paths(cgroup).values()])  # what to remove on error
        try:
            if not rt.disks.take(spec.storage_mb, home / "disk.img"):
                rt._make_disk(home / "disk.img", spec.storage_mb)
            cgroups = rt.cgroups.create(cgroup, memory_mb=spec.memory_mb,
                                        cpus=sorted(os.sched_getaffinity(0)),
                                        pids_max=rt.pids_max)
            now = time.time()
            record = SandboxRecord(name, rt.owner, os.getuid(), spec.to_dict(), now,
                                   now + spec.max_lifetime_s + self.max_age_s, (0, 0),
                                   uid_base=uid_base, cgroups=[str(p) for p in cgroups])
            rt._launch(record, spec, part, home, slot, go_fd=go_r, ready_s=self.max_age_s)
            return Ready(name, home, record, time.monotonic(), go_w)
        except BaseException:
            self._end(Ready(name, home, record, 0, go_w))
            raise
        finally:
            os.close(go_r)
            os.close(slot)
