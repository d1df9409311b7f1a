"""The local runtime's own mechanics under the seal: its loop devices, mounts,
cgroups and uid slots gone after a stop or an owner's SIGKILL, its refusal to start without
root, cgroups or bubblewrap, and the host-side helpers that shape a sandbox's /etc and the
verifier's PATH. The attacks from inside, on both runtimes, are in tests/test_seal_*.py.
"""

# ruff: noqa: F811  (the fixtures imported from tests.seal_helpers are parameters here)
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.seal_helpers import (  # noqa: F401  (fixtures)
    OWNER,
    REPO,
    dirs,
    host_read,
    make,
    run,
    runtime,
    wait_until,
)


def loop_lines(*needles: str) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    return [line for line in out.splitlines() if any(n in line for n in needles)]


def slot_free(lock_dir: Path, slot: int) -> bool:
    fd = os.open(lock_dir / str(slot), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


# ---- a full disk


@pytest.mark.sandbox
def test_a_full_disk_can_be_freed_again(runtime, make):
    """A policy outcome: the sandbox is up, full, and can free its space again. (Local
    only: on Apptainer as root, ``rm`` of the file that filled the ext3 overlay sometimes
    fails with ENOSPC and the file stays, 3 times in 4 tries here: not a strict expected
    failure, so not parametrized; see docs/sandbox.md, Disk quota.)"""
    sid = make(storage_mb=64)
    run(runtime, sid, "dd if=/dev/zero of=/var/fill bs=1M count=1024 status=none")
    assert run(runtime, sid, "rm /var/fill && echo 12 > /var/small && cat /var/small"
               ).output == "12\n"


# ---- nothing outlives a sandbox


@pytest.fixture
def private_sif(tmp_path, base_sif) -> Path:
    """The base image under a path of this test's own, so its loop devices are findable."""
    path = tmp_path / "image.sif"
    shutil.copyfile(base_sif, path)  # a copy: mount reuses a loop device of the same inode
    return path


SLOT_BASE = 3 << 30
"""uid_base of the lifecycle tests' runtimes: ranges no default-configured runtime uses."""


def lifecycle_runtime(root: Path, owner: str = OWNER):
    from sandfleet.runtime.local import LocalRuntime

    return LocalRuntime(root / "state", root / "cache", owner=owner, uid_base=SLOT_BASE,
                        uid_slots=8, uid_lock_dir=root / "slots")


def leftovers(runtime, root: Path, sandbox_id: str, sif: Path, slot: int) -> list[str]:
    home = runtime._dir(sandbox_id)
    found = [f"loop device: {line}" for line in loop_lines(str(home), str(sif))]
    found += [f"mount: {line}" for line in host_read("/proc/self/mountinfo").splitlines()
              if str(root) in line]
    found += [f"cgroup {p}" for p in runtime.cgroups.paths(runtime._cgroup_name(sandbox_id))
              .values() if p.exists()]
    if home.exists():
        found.append(f"state dir {home}")
    if not slot_free(root / "slots", slot):
        found.append(f"uid slot {slot} still locked")
    return found


@pytest.mark.sandbox
def test_stop_leaves_no_loop_device_mount_cgroup_slot_or_state(tmp_path, private_sif):
    from sandfleet.runtime.base import SandboxSpec

    rt = lifecycle_runtime(tmp_path)
    rt.start("life", SandboxSpec(image=private_sif, storage_mb=64))
    try:
        record = rt._live("life")
        slot = (record.uid_base - SLOT_BASE) >> 16
        assert loop_lines(str(private_sif)) and loop_lines(str(rt._dir("life")))  # seen
        assert not slot_free(tmp_path / "slots", slot)
        assert run(rt, "life", "echo x > /tmp/x && cat /tmp/x").output == "x\n"
    finally:
        rt.stop("life")
    assert wait_until(lambda: not leftovers(rt, tmp_path, "life", private_sif, slot), 10,
                      "the sandbox's resources to go") is True
    assert rt.list_running() == []


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_sandbox_whose_owner_is_sigkilled_dies_at_max_lifetime_and_reap_clears_it(
        tmp_path, private_sif):
    script = (
        "import sys; from pathlib import Path\n"
        "from tests.integration.test_seal_local import lifecycle_runtime\n"
        "from sandfleet.runtime.base import SandboxSpec\n"
        f"rt = lifecycle_runtime(Path({str(tmp_path)!r}), {OWNER!r})\n"
        f"rt.start('orphan', SandboxSpec(image=Path({str(private_sif)!r}), storage_mb=64,"
        " max_lifetime_s=3))\n"
        "r = rt._live('orphan'); print(r.init[0], r.init[1], r.uid_base, flush=True)\n"
        "import time; time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             text=True, cwd=REPO)
    try:
        started = time.monotonic()
        pid, start, uid_base = map(int, owner.stdout.readline().split())
    finally:
        owner.kill()  # SIGKILL: no cleanup of any kind on the Python side
        owner.wait()
    from sandfleet.runtime.base import proc_start_time

    rt = lifecycle_runtime(tmp_path)
    slot = (uid_base - SLOT_BASE) >> 16
    try:
        assert "orphan" in rt.list_running()
        assert run(rt, "orphan", "echo alive").output == "alive\n"
        wait_until(lambda: proc_start_time(pid) != start, 15, "max lifetime")
        # pid 1 counts in bash's whole SECONDS: a 3 s lifetime lasts more than 2 s
        assert time.monotonic() - started > 2.0
        # the tree is gone: its mounts and loop devices went with its mount namespace and
        # its uid range is free; only the state dir and cgroups wait for the reap
        wait_until(lambda: not loop_lines(str(rt._dir("orphan")), str(private_sif)), 10,
                   "the loop devices to detach")
        wait_until(lambda: slot_free(tmp_path / "slots", slot), 10, "the uid slot")
        assert rt.reap(keep=()) == ["orphan"]
        assert leftovers(rt, tmp_path, "orphan", private_sif, slot) == []
    finally:
        rt.reap(keep=())


# ---- refusal


def test_host_problems_names_what_is_missing(tmp_path, monkeypatch):
    from sandfleet.runtime import local

    assert local.host_problems(local.Cgroups()) == []  # this machine has it all
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    problems = local.host_problems(local.Cgroups())
    assert len(problems) == 1 and "needs root" in problems[0], problems
    monkeypatch.undo()
    for ctrl in ("memory", "cpuset"):  # pids and freezer missing
        (tmp_path / ctrl).mkdir()
        (tmp_path / ctrl / "cgroup.procs").write_text("")
        if ctrl == "cpuset":
            for name in ("cpuset.cpus", "cpuset.mems"):
                (tmp_path / ctrl / name).write_text("0\n")
    problems = local.host_problems(local.Cgroups(root=tmp_path))
    required = "(memory, pids and freezer limits are required)"
    assert [p for p in problems if "cgroup" in p] == [
        f"no cgroup v1 pids hierarchy at {tmp_path / 'pids'} {required}",
        f"no cgroup v1 freezer hierarchy at {tmp_path / 'freezer'} {required}"]
    monkeypatch.setattr(local.shutil, "which", lambda name, path=None:
                        None if name == "bwrap" else f"/usr/bin/{name}")
    assert any("missing tools: bwrap" in p for p in local.host_problems(local.Cgroups()))


def test_the_local_runtime_refuses_to_start_without_its_guarantees(tmp_path, monkeypatch):
    from sandfleet.runtime import local

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(local.RuntimeUnavailable, match="needs root on the node"):
        local.LocalRuntime(tmp_path / "s", tmp_path / "c", owner=OWNER)
    monkeypatch.undo()
    empty = tmp_path / "no-cgroups"
    empty.mkdir()

    class NoCgroups(local.Cgroups):
        def __init__(self, parent: str = "sandfleet", root: Path = empty):
            super().__init__(parent, root=empty)

    monkeypatch.setattr(local, "Cgroups", NoCgroups)
    with pytest.raises(local.RuntimeUnavailable) as err:
        local.LocalRuntime(tmp_path / "s", tmp_path / "c", owner=OWNER)
    for ctrl in ("memory", "pids", "freezer"):
        assert f"no cgroup v1 {ctrl} hierarchy at {empty / ctrl}" in str(err.value)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.json"))


# ---- the host-side helpers


def test_an_images_own_hosts_file_is_kept_and_a_link_is_not_followed(tmp_path):
    from sandfleet.runtime.helper import localhost

    lower, upper = tmp_path / "lower", tmp_path / "upper"
    (lower / "etc").mkdir(parents=True)
    upper.mkdir()
    (lower / "etc" / "hosts").write_text("127.0.0.1 localhost\n10.0.0.9 db\n")
    localhost(str(lower), str(upper), os.getuid(), "box")
    assert not (upper / "etc").exists()  # the image's names localhost: kept as it is
    (lower / "etc" / "hosts").write_text("10.0.0.9 db\n")
    localhost(str(lower), str(upper), os.getuid(), "box")
    assert (upper / "etc" / "hosts").read_text() == (
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tbox\n"
        "10.0.0.9 db\n")
    secret = tmp_path / "host-secret"
    secret.write_text("127.0.0.1 not-for-the-sandbox\n")
    (lower / "etc" / "hosts").unlink()
    (lower / "etc" / "hosts").symlink_to(secret)
    (upper / "etc" / "hosts").unlink()
    (upper / "etc").rmdir()
    localhost(str(lower), str(upper), os.getuid(), "box")
    assert "not-for-the-sandbox" not in (upper / "etc" / "hosts").read_text()


def test_a_networked_sandbox_gets_the_nodes_resolver_where_the_image_has_none(tmp_path):
    from sandfleet.runtime.helper import resolver

    lower, upper, host = tmp_path / "lower", tmp_path / "upper", tmp_path / "resolv.conf"
    (lower / "etc").mkdir(parents=True)
    upper.mkdir()
    host.write_text("nameserver 10.1.2.3\n")
    (lower / "etc" / "resolv.conf").write_text("nameserver 9.9.9.9\n")
    resolver(str(lower), str(upper), os.getuid(), str(host))
    assert not (upper / "etc").exists()  # the image's own: kept
    (lower / "etc" / "resolv.conf").write_text("")
    resolver(str(lower), str(upper), os.getuid(), str(host))
    assert (upper / "etc" / "resolv.conf").read_text() == "nameserver 10.1.2.3\n"


def test_trusted_first_puts_the_agents_path_folders_behind_the_images():
    from sandfleet.runtime.local import trusted_first

    path = "/go/bin:/usr/local/go/bin:/app:/opt/venv/bin:/usr/bin:/bin:rel:/opt/venv/../x/bin"
    assert trusted_first(path, ["/usr", "/bin", "/opt/venv", "/tests"]) == (
        "/usr/local/go/bin:/opt/venv/bin:/usr/bin:/bin:/go/bin:/app:rel:/opt/venv/../x/bin")
    assert trusted_first("/a:/b", []) == "/a:/b"


def test_path_roots_pick_the_folders_of_tools_outside_the_system_and_the_work():
    from sandfleet.runtime.local import path_roots

    image_path = ("/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    assert path_roots(image_path) == ["/opt/venv"]
    path = ("/root/.local/bin:/root/.cargo/bin:/opt/conda/bin:/opt/conda/condabin:"
            "/opt/venv//bin/:/opt/venv/lib/x/bin:/usr/lib/jvm/bin:/app/bin:/app:/opt/bin:"
            "bin:./x:/opt/x/../y/bin::/tmp/a/bin:/logs/x/bin:/tests/x:/run/x/bin:"
            "/.tmax/verifier/bin:/srv/work/bin:/srv/proj/.venv/bin:/home/u/work/tools/bin")
    assert path_roots(path, keep=["/srv/work", "/home/u/work/tools/sub/"]) == [
        "/opt/conda", "/opt/venv", "/root/.cargo", "/root/.local", "/srv/proj/.venv"]
    assert path_roots(None) == path_roots("") == []
