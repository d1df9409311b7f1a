"""Apptainer instances started ahead, for images leases use: a lease on such an image takes
an instance that is up already (its own fresh overlay, made for no lease) and only what
is the lease's is applied then.

An instance is started ahead for a *shape* (the spec less what is applied at hand-out:
image, its file's identity, storage, memory, network, hostname, lifetime, and the CPUs
where Apptainer's cgroups apply them), named ``<prefix>ready.<pid>-<start>.<n>`` (the
runtime's prefix, then the owning process), in ``state_dir/ready/<pid>-<start>``. At
hand-out, under the runtime's lock: its folder is renamed to the lease's, its watchdog
given the lease's lifetime, its CPUs picked (pinned by
``taskset`` on every command, as for any instance without cgroup limits; its own idle
init keeps the worker's), its memory watched, its record written with the lease's spec.
The instance keeps its name (Apptainer cannot rename one): the record says it, and
``list_running`` maps it back to the lease. Nothing in it was ever a lease's: an instance
started ahead is handed out once, or stopped.

Owners and deadlines: while waiting, an instance's watchdog (detached, in its own session)
waits on a pipe the runtime holds for the lease's lifetime: given one at hand-out, it
sleeps it and then stops the instance, as any sandbox's watchdog; given none, ``max_age_s``
+ 30 s after its start or at once when the pipe closes (``close``, the worker's end, a
crash included), it stops the instance. A runtime's ``reap`` also stops a dead owner's
(they are in ``list_running`` under their own names) and removes its folders. Kept:
``prepared.ReadyPool``'s rules.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from typing import Any

from sandfleet.runtime import layers
from sandfleet.runtime.base import SandboxSpec
from sandfleet.runtime.prepared import Ready, ReadyPool

WAIT_GRACE_S = 30.0
"""A waiting instance's watchdog fires this long after it would be too old to hand out."""


class ReadyInstances(ReadyPool):
    """Instances started ahead for one ``ApptainerRuntime`` (see the module doc)."""

    def __init__(self, runtime: Any, *, per_shape: int | None = None, shapes: int = 4,
                 max_age_s: float = 120.0):
        super().__init__(runtime.state_dir / "ready", runtime.overlays.room,
                         per_shape=per_shape, shapes=shapes, max_age_s=max_age_s)
        self.rt = runtime
        self.prefix = f"ready.{self.tag}."
        """Of the sandbox-id-like names of this pool's instances (after the runtime's)."""

    def shape(self, spec: SandboxSpec) -> str:
        cpus = spec.cpus if self.rt.cgroup_limits else 1
        plain = replace(spec, cpus=cpus, env={}, workdir="/", user="", allowed_hosts=())
        return json.dumps([plain.to_dict(), layers.identity(spec.image)])

    def _start(self, number: int, spec: SandboxSpec, info: Any) -> Ready:
        rt = self.rt
        name = f"{self.prefix}{number}"
        home = self.folder / name
        home.mkdir(parents=True)
        go_r, go_w = os.pipe()
        try:
            if not rt.overlays.take(spec.storage_mb, home / "overlay.img"):
                rt._make_overlay(home / "overlay.img", spec.storage_mb)
            rt._launch(name, spec, info, (), time.time() + self.max_age_s + WAIT_GRACE_S,
                       home=home, watch=False, go_fd=go_r)
            record = rt._record_at(home)
            if record is None:
                raise OSError(f"{home}: no record after the instance started")
            return Ready(name, home, record, time.monotonic(), go_w)
        except BaseException:
            self._end(Ready(name, home, rt._record_at(home), 0, go_w))
            raise
        finally:
            os.close(go_r)

    def _adopt(self, item: Ready, sandbox_id: str, spec: SandboxSpec) -> None:
        """Called with the runtime's lock held and the lease's folder free."""
        rt, old = self.rt, item.record
        home = rt._dir(sandbox_id)
        home.parent.mkdir(parents=True, exist_ok=True)
        os.rename(item.home, home)
        item.home = home
        cpus = () if rt.cgroup_limits else rt._pick_cpus(spec.cpus)
        now = time.time()
        deadline = now + spec.max_lifetime_s
        os.write(item.go, f"{int(spec.max_lifetime_s + 0.999)}\n".encode())  # the watchdog
        os.close(item.go)                                           # sleeps it from now on
        item.go = -1
        record = type(old)(sandbox_id, rt.owner, os.getuid(), old.name, spec.to_dict(), now,
                           deadline, old.instance, old.watchdog, cpus)
        record.save(home / "sandbox.json")
        item.record = record
        if not rt.cgroup_limits:
            rt._memory.watch(sandbox_id, old.instance[0], spec.memory_mb)

    def _end(self, item: Ready, also: str = "") -> None:
        rt = self.rt
        if item.go >= 0:  # its watchdog stops it too, reading no lifetime
            os.close(item.go)
            item.go = -1
        rt._end_instance(item.name, item.record)  # by the record's name: stop, watchdog
        if also:
            rt._memory.forget(also)
            rt._memory.drop(also)
        shutil.rmtree(item.home, ignore_errors=True)
