"""Writable layers made ahead (sandfleet/runtime/prepared.py): the pool's
own rules with a plain file maker, then on the real runtimes: a disk handed to a second
lease holds nothing of the first and is another file system, and nothing made ahead
outlives the runtime's close or its process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sandfleet.runtime.prepared import (
    ENV_VAR,
    READY_ENV_VAR,
    PreparedPool,
    per_size_default,
    ready_default,
    remove_stale,
)
from tests.seal_helpers import HOST_PATH, REPO, host_read

SIZE = 64


def until(predicate, timeout: float) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def counting_maker(made: list[Path]):
    def make(path: Path, size_mb: int) -> None:
        path.write_text(f"{size_mb} {len(made)}")
        made.append(path)
    return make


def test_take_hands_each_file_out_once_and_an_empty_pool_says_so(tmp_path):
    made: list[Path] = []
    gate = threading.Event()  # (the first file waits: the maker thread is quick)
    count = counting_maker(made)

    def make(path: Path, size_mb: int) -> None:
        gate.wait(30)
        count(path, size_mb)

    pool = PreparedPool(tmp_path / "prepared", make, per_size=2)
    try:
        assert not pool.take(SIZE, tmp_path / "a")  # nothing yet: the caller makes its own
        gate.set()
        assert until(lambda: pool.ready() == {SIZE: 2}, 10)
        taken = []
        for name in ("b", "c", "d", "e"):
            assert until(lambda: pool.ready().get(SIZE), 10)
            assert pool.take(SIZE, tmp_path / name)
            taken.append((tmp_path / name).read_text())
        assert len(set(taken)) == 4, taken  # four different files
        assert all(text.startswith(f"{SIZE} ") for text in taken)
        assert pool.ready().get(128) is None  # a size nobody asked for is not made
    finally:
        pool.close()
    assert not pool.folder.exists()
    assert (pool.taken, pool.missed) == (4, 1)


def test_room_bounds_what_is_kept_ready(tmp_path):
    room = [1]
    made: list[Path] = []
    pool = PreparedPool(tmp_path / "prepared", counting_maker(made), per_size=3,
                        room=lambda: room[0])
    try:
        pool.want(SIZE)
        pool.want(2 * SIZE)
        assert until(lambda: sum(pool.ready().values()) == 1, 10)
        time.sleep(0.3)
        assert sum(pool.ready().values()) == 1 and len(made) == 1
        room[0] = 6
        pool.want(SIZE)  # wakes the maker
        assert until(lambda: pool.ready() == {SIZE: 3, 2 * SIZE: 3}, 10)
    finally:
        pool.close()


def test_files_past_their_age_are_made_again_and_never_handed_out(tmp_path):
    made: list[Path] = []
    pool = PreparedPool(tmp_path / "prepared", counting_maker(made), per_size=1,
                        max_age_s=0.3)
    try:
        pool.want(SIZE)
        assert until(lambda: len(made) >= 3, 10)  # each replaced once too old
        assert len(list(pool.folder.iterdir())) <= 2  # the old ones removed
    finally:
        pool.close()


def test_a_failing_maker_leaves_nothing_and_takes_find_none(tmp_path):
    def broken(path: Path, size_mb: int) -> None:
        path.write_text("half")
        raise OSError("disk full")

    pool = PreparedPool(tmp_path / "prepared", broken, per_size=2)
    try:
        pool.want(SIZE)
        time.sleep(0.3)
        assert not pool.take(SIZE, tmp_path / "x") and not (tmp_path / "x").exists()
        assert list(pool.folder.iterdir()) == []
    finally:
        pool.close()


def test_a_pool_whose_folder_was_removed_stops_making_files(tmp_path):
    """A runtime whose state folder its owner removed without closing it (a test's
    tmp_path, a scratch folder cleaned): its maker ends instead of trying for ever."""
    made: list[Path] = []
    pool = PreparedPool(tmp_path / "prepared", counting_maker(made), per_size=1)
    try:
        pool.want(SIZE)
        assert until(lambda: pool.ready() == {SIZE: 1}, 10)
        thread = pool._thread
        shutil.rmtree(tmp_path / "prepared")
        assert not pool.take(SIZE, tmp_path / "x")  # its file went with the folder
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert len(made) == 1 and not (tmp_path / "prepared").exists()
        assert not pool.take(SIZE, tmp_path / "y") and not (tmp_path / "prepared").exists()
    finally:
        pool.close()


def test_the_environment_turns_pools_off_and_a_bad_value_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv(READY_ENV_VAR, raising=False)
    monkeypatch.setenv(ENV_VAR, "0")
    pool = PreparedPool(tmp_path / "prepared", counting_maker([]))
    pool.want(SIZE)
    assert not pool.enabled and not pool.take(SIZE, tmp_path / "x")
    assert not (tmp_path / "prepared").exists()
    monkeypatch.setenv(ENV_VAR, "many")
    with pytest.raises(ValueError, match=f"{ENV_VAR}='many'"):
        per_size_default()
    monkeypatch.setenv(ENV_VAR, "3")
    assert per_size_default() == 3
    assert (ready_default(), ready_default(1)) == (0, 1)  # a runtime alone, a worker
    monkeypatch.setenv(READY_ENV_VAR, "2")
    assert ready_default(1) == 2
    monkeypatch.setenv(ENV_VAR, "0")  # off: sandboxes ahead too
    assert ready_default(1) == 0


def test_a_killed_owners_files_are_removed_and_a_live_ones_kept(tmp_path):
    root = tmp_path / "prepared"
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from sandfleet.runtime.prepared import PreparedPool
        pool = PreparedPool(Path({str(root)!r}), lambda p, s: p.write_text("x"), per_size=2)
        pool.want(64)
        while pool.ready().get(64, 0) < 2:
            time.sleep(0.01)
        print(pool.folder, flush=True)
        time.sleep(600)
    """)
    owners = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               text=True, cwd=REPO) for _ in range(2)]
    try:
        folders = [Path(p.stdout.readline().strip()) for p in owners]  # type: ignore[union-attr]
        assert all(len(list(f.iterdir())) == 2 for f in folders)
        owners[0].send_signal(signal.SIGKILL)
        owners[0].wait()
        assert remove_stale(root) == [str(folders[0])]
        assert not folders[0].exists() and folders[1].exists()
    finally:
        for p in owners:
            p.kill()
            p.wait()


# ---- the real runtimes

def fs_uuid(disk: Path) -> bytes:
    """The ext2/3/4 file system's UUID, from its superblock (1024 bytes in, at 0x68)."""
    with open(disk, "rb") as f:
        f.seek(1024 + 0x68)
        return f.read(16)


def layer_file(runtime, sandbox_id: str) -> Path:
    name = "disk.img" if hasattr(runtime, "disks") else "overlay.img"
    return runtime._dir(sandbox_id) / name


def pool_of(runtime) -> PreparedPool:
    return runtime.disks if hasattr(runtime, "disks") else runtime.overlays


def lingering(root: Path) -> list[str]:
    """Mounts and loop devices of files under ``root``."""
    found = [line for line in host_read("/proc/self/mountinfo").splitlines()
             if str(root) in line]
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, timeout=30,
                         env={"PATH": HOST_PATH}, check=True).stdout
    return found + [line for line in out.splitlines() if str(root) in line]


def local_runtime(root: Path, per_size: int = 2, ready: int = 0):
    from sandfleet.runtime.local import LocalRuntime

    return LocalRuntime(root / "state", root / "cache", owner="prep", uid_base=5 << 28,
                        uid_slots=8, uid_lock_dir=root / "slots", prepared=per_size,
                        ready=ready)


def apptainer_runtime(root: Path, per_size: int = 2, ready: int = 0):
    from sandfleet.runtime.apptainer import ApptainerRuntime
    from tests.seal_helpers import ensure_apptainer

    ensure_apptainer()
    return ApptainerRuntime(root / "state", owner="prep", allow_host_root=True,
                            prepared=per_size, ready=ready)


RUNTIMES = {"local": local_runtime, "apptainer": apptainer_runtime}


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the real runtimes' pool tests run as root (the local runtime's need)")


@pytest.mark.sandbox
@pytest.mark.parametrize("kind", [
    "local", pytest.param("apptainer", marks=pytest.mark.slow)])
def test_a_prepared_layer_holds_nothing_of_the_lease_before(kind, tmp_path, base_sif):
    needs_root()
    from sandfleet.runtime.base import SandboxSpec

    runtime = RUNTIMES[kind](tmp_path)
    spec = SandboxSpec(image=base_sif, storage_mb=SIZE)
    try:
        runtime.start("one", spec)  # the first start asks for the size: none ready yet
        first = fs_uuid(layer_file(runtime, "one"))
        out = runtime.exec("one", "echo secret > /root/left && mkdir -p /opt/mine && "
                           "echo 1 > /opt/mine/f && sync && cat /root/left", timeout=60)
        assert out.output == "secret\n", out
        runtime.stop("one")
        assert not layer_file(runtime, "one").exists()  # a disk is never reused
        pool = pool_of(runtime)
        assert until(lambda: pool.ready().get(SIZE), 60)
        taken = pool.taken
        runtime.start("two", spec)
        assert pool.taken == taken + 1  # this lease got a disk made ahead
        assert fs_uuid(layer_file(runtime, "two")) != first  # another file system
        listing = runtime.exec("two", "ls -A /root /opt", timeout=60).output
        assert "left" not in listing and "mine" not in listing, listing
        out = runtime.exec("two", "cat /root/left /opt/mine/f", timeout=60)
        assert out.exit_code != 0 and "secret" not in out.output, out  # neither is there
        assert runtime.exec("two", "echo ok > /root/new && cat /root/new",
                            timeout=60).output == "ok\n"  # and the layer is writable
    finally:
        runtime.reap(())
        runtime.close()


@pytest.mark.sandbox
@pytest.mark.parametrize("kind", [
    "local", pytest.param("apptainer", marks=pytest.mark.slow)])
def test_close_leaves_no_prepared_layer_or_mount_behind(kind, tmp_path, base_sif):
    needs_root()
    from sandfleet.runtime.base import SandboxSpec

    runtime = RUNTIMES[kind](tmp_path)
    pool = pool_of(runtime)
    runtime.prepare(SIZE)
    runtime.prepare(2 * SIZE)
    assert until(lambda: pool.ready() == {SIZE: 2, 2 * SIZE: 2}, 60)
    runtime.start("s", SandboxSpec(image=base_sif, storage_mb=SIZE))
    assert pool.taken == 1
    runtime.stop("s")
    inits = []
    if kind == "local":  # and a sandbox started ahead, ended by close
        runtime.ready.per_shape = 1
        runtime.ready.want(SandboxSpec(image=base_sif, storage_mb=SIZE),
                           runtime.partition(base_sif))
        assert until(lambda: runtime.ready.ready() == 1, 60)
        inits = [item.record.init for q in runtime.ready._ready.values() for item in q]
        assert ready_cgroups(runtime)
    runtime.close()
    assert not pool.folder.exists()
    assert not any(alive(init) for init in inits)
    if kind == "local":
        assert not ready_cgroups(runtime) and not runtime.ready.folder.exists()
    assert not list((tmp_path / "state" / "prepared").iterdir())
    assert until(lambda: not lingering(tmp_path), 10), lingering(tmp_path)
    assert not list((tmp_path / "state" / "sandboxes").iterdir())


def ready_cgroups(runtime) -> list[Path]:
    return [p for parent in runtime.cgroups.parents.values()
            for p in parent.glob(f"{runtime.owner}~*")]


def alive(pid_start: tuple[int, int] | None) -> bool:
    from sandfleet.runtime.base import proc_start_time

    return pid_start is not None and proc_start_time(pid_start[0]) == pid_start[1]


@pytest.mark.sandbox
def test_a_crashed_runtimes_disks_and_sandboxes_ahead_go(tmp_path, base_sif):
    """A worker killed with its pools full: its sandboxes started ahead end by themselves
    (their lifetime pipe closes), and the next runtime on its state folder (a requeued
    worker, ``sandfleet gc``) removes the disks, folders and cgroups at its first reap."""
    needs_root()
    script = textwrap.dedent(f"""
        import json, sys, time
        from pathlib import Path
        from sandfleet.runtime.base import SandboxSpec
        from tests.integration.test_prepared import local_runtime
        rt = local_runtime(Path({str(tmp_path)!r}), ready=1)
        rt.start("s", SandboxSpec(image=Path({str(base_sif)!r}), storage_mb=64))
        rt.stop("s")
        while rt.disks.ready().get(64, 0) < 2 or rt.ready.ready() < 1:
            time.sleep(0.05)
        item = next(iter(rt.ready._ready.values()))[0]
        print(json.dumps([str(rt.disks.folder), str(rt.ready.folder), item.record.init]),
              flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        disks, ready, init = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert len(list(Path(disks).glob("64m-*"))) == 2 and alive(tuple(init))
    finally:
        proc.kill()
        proc.wait()
    assert until(lambda: not alive(tuple(init)), 10)  # ended with its owner
    runtime = local_runtime(tmp_path)
    assert ready_cgroups(runtime)  # left by the dead process, until a reap
    runtime.reap(())
    assert not Path(disks).exists() and not Path(ready).exists()
    assert not ready_cgroups(runtime)
    assert until(lambda: not lingering(tmp_path), 10), lingering(tmp_path)


@pytest.mark.sandbox
@pytest.mark.parametrize("kind", [
    "local", pytest.param("apptainer", marks=pytest.mark.slow)])
def test_a_sandbox_started_ahead_gets_the_leases_lifetime_cpus_and_environment(
        kind, tmp_path, base_sif):
    needs_root()
    from sandfleet.errors import SandboxLost
    from sandfleet.runtime.base import SandboxSpec

    runtime = RUNTIMES[kind](tmp_path, ready=1)
    spec = SandboxSpec(image=base_sif, storage_mb=SIZE, memory_mb=300, max_lifetime_s=4,
                       env={"WHO": "one"}, cpus=1)  # (Apptainer's --cpus: in the shape)
    try:
        runtime.start("one", spec)  # the shape's first lease: none ahead yet
        assert (runtime.ready.taken, runtime.ready.missed) == (0, 1)
        runtime.exec("one", "echo mine > /root/left", timeout=60)
        runtime.stop("one")
        assert until(lambda: runtime.ready.ready() == 1, 60)
        time.sleep(2.5)  # a deadline counted from its start would be 1.5 s away at most
        started = time.monotonic()
        runtime.start("two", SandboxSpec(image=base_sif, storage_mb=SIZE, memory_mb=300,
                                         max_lifetime_s=4, cpus=1, env={"WHO": "two"},
                                         workdir="/tmp"))
        assert runtime.ready.taken == 1
        out = runtime.exec("two", 'echo "$WHO $(pwd)"; ls /root', timeout=60).output
        assert out.startswith("two /tmp\n") and "left" not in out, out
        if kind == "local":
            record = runtime._records["two"]
            name = runtime._cgroup_name("two")
            cpuset = runtime.cgroups.parents["cpuset"] / name / "cpuset.cpus"
            assert cpuset.read_text().strip() == ",".join(map(str, record.cpus))
            assert len(record.cpus) == 1
            memory = runtime.cgroups.parents["memory"] / name / "memory.limit_in_bytes"
            assert int(memory.read_text()) == 300 << 20
        assert runtime.list_running() == ["two"]  # a waiting one is no sandbox
        time.sleep(max(0.0, started + 3 - time.monotonic()))
        assert runtime.exec("two", "true", timeout=30).exit_code == 0  # 3 s on: alive
        assert until(lambda: "two" not in runtime.list_running(), 10)  # then its end
        with pytest.raises(SandboxLost):
            runtime.exec("two", "true", timeout=30)
    finally:
        runtime.reap(())
        runtime.close()
    if kind == "local":
        assert not ready_cgroups(runtime)
    else:
        assert not runtime._instances()  # the waiting one stopped by close


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_crashed_runtimes_waiting_instances_are_stopped_by_their_watchdogs(
        tmp_path, base_sif):
    """Apptainer: an instance started ahead whose runtime is SIGKILLed is stopped at once
    by its own watchdog (its lifetime pipe closed), and the next reap removes its folder."""
    needs_root()
    script = textwrap.dedent(f"""
        import json, time
        from pathlib import Path
        from sandfleet.runtime.base import SandboxSpec
        from tests.integration.test_prepared import apptainer_runtime
        rt = apptainer_runtime(Path({str(tmp_path)!r}), ready=1)
        rt.start("s", SandboxSpec(image=Path({str(base_sif)!r}), storage_mb=64))
        rt.stop("s")
        while rt.ready.ready() < 1:
            time.sleep(0.05)
        item = rt.ready.items()[0]
        print(json.dumps([str(rt.ready.folder), item.record.instance]), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        folder, instance = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert alive(tuple(instance))
    finally:
        proc.kill()
        proc.wait()
    assert until(lambda: not alive(tuple(instance)), 60)  # its watchdog read no lifetime
    runtime = apptainer_runtime(tmp_path)
    runtime.reap(())
    assert not Path(folder).exists() and runtime.list_running() == []


@pytest.mark.sandbox
def test_close_right_after_a_start_leaves_no_sandbox_started_ahead(tmp_path, base_sif):
    """Closed while its maker starts a sandbox ahead (right after the shape's first lease),
    the pool ends that one too before close returns."""
    needs_root()
    from sandfleet.runtime.base import SandboxSpec

    runtime = local_runtime(tmp_path, ready=1)
    runtime.start("s", SandboxSpec(image=base_sif, storage_mb=SIZE))
    busy = runtime.ready._busy or until(lambda: runtime.ready._busy, 0.5)
    runtime.close()
    assert not ready_cgroups(runtime) and not runtime.ready.folder.exists(), busy
    runtime.stop("s")
    assert until(lambda: not lingering(tmp_path), 10), lingering(tmp_path)
