"""sandfleet.runtime.apptainer: the exact command lines, and the refusals when a node
cannot run it (no apptainer, too old, no user namespaces, no FUSE, not a SIF). The runtime
against a real Apptainer, as root and as an ordinary user: tests/integration/test_apptainer_real.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandfleet.errors import ImageMissing, SandboxStartError
from sandfleet.runtime.apptainer import (
    WATCHDOG_SH,
    ApptainerRuntime,
    exec_argv,
    list_argv,
    memory_oom_file,
    own_memory_cgroup,
    parse_instance_list,
    start_argv,
    stop_argv,
    watchdog_argv,
)
from sandfleet.runtime.apptainer_setup import (
    fuse_problem,
    holders,
    make_overlay,
    parse_version,
    probe,
    userns_problem,
    wait_released,
)
from sandfleet.runtime.base import SandboxSpec

SPEC = SandboxSpec(image=Path("/img/base.sif"), cpus=4, memory_mb=1024, hostname="box")


def test_start_argv():
    assert start_argv("apptainer", SPEC, "me-k-s1", Path("/st/pid")) == [
        "apptainer", "instance", "start", "--writable-tmpfs", "--containall", "--cleanenv",
        "--no-home", "--no-mount", "tmp", "--pid-file", "/st/pid", "--hostname", "box",
        "--userns", "--net", "--network", "none", "/img/base.sif", "me-k-s1"]
    networked = SandboxSpec(image=Path("/img/base.sif"), network=True, cpus=4, memory_mb=1024)
    assert start_argv("/opt/apptainer", networked, "me-k-s1", Path("/st/pid"),
                      overlay=Path("/st/overlay.img"), start_action=Path("/st/start"),
                      cgroup_limits=True) == [
        "/opt/apptainer", "instance", "start", "--overlay", "/st/overlay.img", "--containall",
        "--cleanenv", "--no-home", "--no-mount", "tmp", "--pid-file", "/st/pid", "--hostname",
        "sandbox", "--userns", "--bind", "/st/start:/.singularity.d/actions/start:ro",
        "--cpus", "4", "--memory", "1024M", "/img/base.sif", "me-k-s1"]
    assert start_argv("apptainer", SPEC, "n", Path("/p"), overlay=Path("/o"), rootless=True,
                      cpus=(2, 3)) == [
        "taskset", "-c", "2,3", "apptainer", "instance", "start", "--overlay", "/o",
        "--containall", "--cleanenv", "--no-home", "--no-mount", "tmp", "--pid-file", "/p",
        "--hostname", "box", "--userns", "--fakeroot", "--net", "--network", "none",
        "/img/base.sif", "n"]


def test_exec_stop_list_watchdog_argv():
    assert exec_argv("apptainer", "me-s1", ["bash", "-c", "ls, -l"], cwd="/app",
                     env={"A": "1,2", "B": "x=y"}) == [
        "apptainer", "--quiet", "exec", "--cleanenv", "--pwd", "/app", "instance://me-s1",
        "env", "A=1,2", "B=x=y", "bash", "-c", "ls, -l"]
    assert exec_argv("apptainer", "me-s1", ["true"], cwd="/", env={}, cpus=(1,)) == [
        "taskset", "-c", "1", "apptainer", "--quiet", "exec", "--cleanenv", "--pwd", "/",
        "instance://me-s1", "true"]
    assert stop_argv("apptainer", "me-s1") == ["apptainer", "instance", "stop", "--force",
                                                "me-s1"]
    assert list_argv("apptainer") == ["apptainer", "instance", "list", "--json"]
    assert watchdog_argv("apptainer", "me-s1", 14400.0, 321) == [
        "sh", "-c", WATCHDOG_SH, "sandfleet-watchdog", "14400", "apptainer", "me-s1", "321"]


def test_parse_instance_list():
    text = """{"instances": [
        {"instance": "me-s1", "pid": 1234, "img": "/img/a.sif", "ip": "",
         "logErrPath": "/x.err", "logOutPath": "/x.out"},
        {"instance": "other-s2", "pid": 99, "img": "/img/b.sif"}]}"""
    assert parse_instance_list(text) == {"me-s1": 1234, "other-s2": 99}
    assert parse_instance_list('{"instances": null}') == {}
    assert parse_instance_list("") == {}


def test_instance_names_are_keyed_by_the_state_folder(tmp_path):
    one = ApptainerRuntime(tmp_path / "w1", owner="me")
    two = ApptainerRuntime(tmp_path / "w2", owner="me")
    assert one._name("s1").startswith("me-") and one._name("s1").endswith("-s1")
    assert one._name("s1") != two._name("s1")
    assert one.prefix == ApptainerRuntime(tmp_path / "w1", owner="me").prefix


def test_concurrent_starts_share_one_start_action(tmp_path):
    """Sandboxes start from several threads of one worker: each gets the start action,
    none fails on another's temporary file (an eval at concurrency 4 lost a start so)."""
    import threading
    for round_ in range(20):
        runtime = ApptainerRuntime(tmp_path / f"w{round_}", owner="me")
        runtime.state_dir.mkdir(parents=True)
        gate, errors, paths = threading.Barrier(4), [], []

        def start(runtime=runtime, gate=gate, errors=errors, paths=paths):
            gate.wait()
            try:
                paths.append(runtime._start_action())
            except OSError as e:
                errors.append(e)
        threads = [threading.Thread(target=start) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(paths) == 4 and paths[0].read_text().startswith("#!")
        assert [p.name for p in runtime.state_dir.iterdir()] == ["start-action.sh"]


def test_parse_version():
    assert parse_version("apptainer version 1.4.5") == (1, 4, 5)
    assert parse_version("apptainer version 1.2.5-1.el8") == (1, 2, 5)
    assert parse_version("apptainer version 1.3.0-rc.1") == (1, 3, 0)
    assert parse_version("singularity-ce version 4") is None


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_refusals_name_what_is_missing(tmp_path, monkeypatch):
    """No apptainer, one too old, one that says no version: a refusal before any sandbox.
    (The scripts stand in for installs this machine does not have: an old Apptainer.)"""
    monkeypatch.delenv("SANDFLEET_APPTAINER", raising=False)
    with pytest.raises(SandboxStartError, match="no nope-apptainer on this node.*install "
                       "Apptainer >= 1.1.0.*tmax-setup-apptainer"):
        probe("nope-apptainer")
    old = script(tmp_path / "old", 'echo "apptainer version 1.0.3"\n')
    with pytest.raises(SandboxStartError, match="Apptainer 1.0.3; sandfleet needs >= 1.1.0"):
        probe(str(old))
    mute = script(tmp_path / "mute", "echo no; exit 3\n")
    with pytest.raises(SandboxStartError, match="gave no version"):
        probe(str(mute))


def test_refusal_reaches_start_and_a_non_sif_is_refused_first(tmp_path, base_sif):
    old = script(tmp_path / "old", 'echo "apptainer version 1.0.3"\n')
    runtime = ApptainerRuntime(tmp_path / "state", owner="me", apptainer=str(old))
    with pytest.raises(SandboxStartError, match="sandbox s1: .*1.0.3"):
        runtime.start("s1", SandboxSpec(image=base_sif))
    not_sif = tmp_path / "image.sif"
    not_sif.write_bytes(b"\x7fELF not an image" * 100)
    with pytest.raises(ImageMissing, match="image.sif"):
        runtime.start("s1", SandboxSpec(image=not_sif))
    with pytest.raises(ImageMissing, match="missing.sif"):
        runtime.start("s1", SandboxSpec(image=tmp_path / "missing.sif"))
    assert not list((tmp_path / "state").rglob("sandbox.json"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is of a worker run as root")
def test_as_root_a_sandbox_is_refused_unless_host_root_is_accepted(tmp_path, base_sif):
    new = script(tmp_path / "new", 'echo "$@" >> "$(dirname "$0")/calls"\n'
                 '[ "$1" = --version ] && echo "apptainer version 1.4.5" && exit 0\nexit 1\n')
    refused = ApptainerRuntime(tmp_path / "state", owner="me", apptainer=str(new))
    with pytest.raises(SandboxStartError, match="host root.*/proc/sys.*apptainer_allow_root"):
        refused.start("s1", SandboxSpec(image=base_sif))
    calls = tmp_path / "calls"
    assert not calls.exists() or "instance" not in calls.read_text()  # nothing was started
    allowed = ApptainerRuntime(tmp_path / "state", owner="me", apptainer=str(new),
                               allow_host_root=True)
    with pytest.raises(SandboxStartError, match="instance start failed"):
        allowed.start("s1", SandboxSpec(image=base_sif))  # it got as far as starting one
    assert "instance start" in calls.read_text()


def test_rootless_needs_user_namespaces_and_fuse(tmp_path):
    off = tmp_path / "max_user_namespaces"
    off.write_text("0\n")
    assert "user namespaces are off" in userns_problem((str(off),))  # names the switch
    on = tmp_path / "on"
    on.write_text("15000\n")
    assert userns_problem((str(on), str(tmp_path / "absent"))) is None
    assert "/fuse (as root: modprobe fuse)" in fuse_problem(False, tmp_path / "fuse")
    node = tmp_path / "fuse-file"
    node.write_text("")
    node.chmod(0o600)
    if os.geteuid() == 0:  # root reads anything: the check is for ordinary users
        assert fuse_problem(False, node) is None
    else:
        node.chmod(0)
        assert "chmod 0666 /dev/fuse" in fuse_problem(False, node)
    assert fuse_problem(True, node) is None  # the wrapper binds a node of its own


def test_memory_oom_file_from_proc_cgroup():
    v1 = "9:name=systemd:/x\n4:memory:/job_1/apptainer-7\n0::/\n"
    assert memory_oom_file(v1) == "/sys/fs/cgroup/memory/job_1/apptainer-7/memory.oom_control"
    assert memory_oom_file("4:memory:/\n0::/\n") is None  # the root: not the instance's
    assert memory_oom_file("0::/user.slice/apptainer-7.scope\n", root="/cg") == \
        "/cg/user.slice/apptainer-7.scope/memory.events"
    assert memory_oom_file("0::/\n") is None
    job = "/cg/memory/job_1/memory.oom_control"
    ours = "/cg/memory/job_1/step_0/memory.oom_control"
    inst = "/cg/memory/job_1/apptainer-7/memory.oom_control"
    assert own_memory_cgroup(inst, ours) == inst
    assert own_memory_cgroup(job, ours) is None  # the job's: every sandbox's OOMs
    assert own_memory_cgroup(ours, ours) is None and own_memory_cgroup(None, ours) is None
    assert own_memory_cgroup("/cg/memory/job_10/memory.oom_control", ours) is not None


def test_the_verifiers_missing_bind_destinations_are_made_as_folders_or_files(tmp_path):
    from sandfleet.runtime.apptainer_verify import MEND_SH, MISSING_DESTINATION, bind_destinations

    host_dir, host_file = tmp_path / "tests", tmp_path / "empty"
    host_dir.mkdir()
    host_file.write_text("")
    entries = [("dir", "/etc/apt", ""), ("file", "/etc/ld.so.conf", ""), ("link", "/bin", "usr/bin")]
    argv = ["apptainer", "exec", "--overlay", "o.img:ro",
            "--bind", "/sq:/etc/apt:image-src=/etc/apt,ro",
            "--bind", "/sq:/etc/ld.so.conf:image-src=/etc/ld.so.conf,ro",
            "--bind", "/sq:/bin:image-src=/usr/bin,ro",
            "--bind", f"{host_file}:/etc/ld.so.preload:ro", "--bind", f"{host_dir}:/tests",
            "image.sif", "sh"]
    dests = bind_destinations(argv, entries)
    assert dests == ["d:/etc/apt", "f:/etc/ld.so.conf", "d:/bin", "f:/etc/ld.so.preload",
                     "d:/tests"]
    # the script over a tree: what is missing is made, what is there (a link too) stays
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "ld.so.conf").write_text("agent's\n")
    (root / "bin").symlink_to("nowhere")
    args = [d[:2] + str(root) + d[2:] for d in dests]
    subprocess.run(["sh", "-c", MEND_SH, "mend", *args], check=True)
    assert (root / "etc/apt").is_dir() and (root / "tests").is_dir()
    assert (root / "etc/ld.so.preload").read_text() == ""
    assert (root / "etc/ld.so.conf").read_text() == "agent's\n"
    assert (root / "bin").is_symlink()
    assert MISSING_DESTINATION.search("FATAL:   container creation failed: mount hook function "
                                      "failure: mount /s->/etc/apt error: while mounting /s: "
                                      "destination /etc/apt doesn't exist in container")


def test_an_overlay_is_released_only_once_no_process_has_it_open(tmp_path):
    """What a container's fuse2fs does after ``instance stop`` returns: it still has the
    image open. ``wait_released`` names it while it does and returns [] once it closed it."""
    image = tmp_path / "overlay.img"
    image.write_bytes(b"x")
    other = tmp_path / "other.img"
    other.write_bytes(b"x")
    holder = subprocess.Popen(["sh", "-c", 'exec 3<"$0"; read line; exec 3<&-; read line',
                               str(image)], stdin=subprocess.PIPE, text=True)
    try:
        while holder.pid not in holders(image):  # (until the shell has opened it)
            assert holder.poll() is None
        assert wait_released(image, 0) == [holder.pid]
        assert holders(other) == []
        holder.stdin.write("close\n")
        holder.stdin.flush()
        assert wait_released(image, 60) == []
        assert holder.poll() is None  # released while the process lives on
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.skipif(not (shutil.which("mkfs.ext3") and shutil.which("debugfs")),
                    reason="needs e2fsprogs")
def test_an_overlay_hides_the_verifier_tools_by_a_whiteout_where_they_are(tmp_path):
    """The whiteout is /upper/.tmax/verifier itself (debugfs's mknod links the name it is
    given into its current folder: a path made an entry named "upper/.tmax/verifier" in
    the image's root, which hid nothing)."""
    make_overlay(tmp_path / "o.img", 16, hide=("/.tmax/verifier",))
    listing = subprocess.run(["debugfs", "-R", "ls -l /upper/.tmax", str(tmp_path / "o.img")],
                             capture_output=True, text=True, check=True).stdout
    entries = {line.split()[-1]: line.split()[1] for line in listing.splitlines()
               if line.strip()}
    assert entries.get("verifier") == "20000"  # a character device (0, 0)
    root = subprocess.run(["debugfs", "-R", "ls /", str(tmp_path / "o.img")],
                          capture_output=True, text=True, check=True).stdout
    assert "upper/.tmax/verifier" not in root


def test_the_pristine_cache_keeps_what_was_used_last_within_its_limit(tmp_path):
    """Oldest first, with their listings; what was used within the hour stays even past
    the limit (a verify may be binding it)."""
    from sandfleet.runtime.apptainer_verify import trim_cache

    now = time.time()
    for name, age_h in (("old", 5), ("mid", 3), ("new", 2), ("busy", 0.1)):
        (tmp_path / f"{name}.sqfs").write_bytes(b"x" * 100)
        (tmp_path / f"{name}.entries-1.json").write_text("[]")
        os.utime(tmp_path / f"{name}.sqfs", (now - age_h * 3600,) * 2)
    assert trim_cache(tmp_path, limit_bytes=250) == [tmp_path / "old.sqfs",
                                                     tmp_path / "mid.sqfs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "busy.entries-1.json", "busy.sqfs", "new.entries-1.json", "new.sqfs"]
    assert trim_cache(tmp_path, limit_bytes=0) == [tmp_path / "new.sqfs"]  # busy stays
    assert trim_cache(tmp_path, limit_bytes=1000) == []
