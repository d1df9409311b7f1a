"""sandfleet.runtime without sandboxes: output caps, CPU picking, the entry command line,
users looked up as Docker does, the spec and the errors on the wire, the registry. Real
local sandboxes are test_runtime.py."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from sandfleet.errors import (
    ERRORS,
    CapacityTimeout,
    ImageMissing,
    InfraError,
    SandboxLost,
    SandboxStartError,
)
from sandfleet.runtime import get_runtime
from sandfleet.runtime.base import Runtime, SandboxSpec, cap_output
from sandfleet.runtime.local import HELPER, LocalRuntime, enter_argv, pick_cpus


def test_cap_output_keeps_head_and_tail_and_marks_the_cut():
    assert cap_output(b"short", 100) == "short"
    text = cap_output(b"A" * 60 + b"B" * 100 + b"C" * 40, 100)
    assert text == "A" * 50 + "\n[... 100 bytes cut ...]\n" + "B" * 10 + "C" * 40
    assert cap_output("é".encode() * 10, 100) == "é" * 10


def test_pick_cpus_prefers_the_least_used():
    from collections import Counter

    assert pick_cpus([0, 1, 2, 3], 2, Counter({0: 2, 1: 1})) == [2, 3]
    assert pick_cpus([0, 1, 2, 3], 2, Counter({2: 1, 3: 1})) == [0, 1]
    assert pick_cpus([4, 5], 8, Counter()) == [4, 5]


def test_enter_argv_is_exact():
    from sandfleet.runtime import local
    from sandfleet.runtime.helper import enter_spec

    argv = enter_argv(init_pid=42, cgroup_procs=["/cg/m/cgroup.procs", "/cg/p/cgroup.procs"],
                      cpus=[2, 3], cwd="/app", env={"A": "1", "B": "x=y"}, argv=["ls", "-l"],
                      user="agent:staff")
    helper = local._compiled.get(HELPER, HELPER)
    assert argv == [sys.executable, "-I", "-S", str(helper), "enter", "42", "2,3", "/app",
                    "agent:staff", "500", "2", "/cg/m/cgroup.procs", "/cg/p/cgroup.procs", "2",
                    "A=1", "B=x=y", "ls", "-l"]
    assert enter_spec(argv[5:]) == {
        "init": 42, "cpus": [2, 3], "cwd": "/app", "user": "agent:staff", "oom_score_adj": 500,
        "cgroup_procs": ["/cg/m/cgroup.procs", "/cg/p/cgroup.procs"],
        "env": {"A": "1", "B": "x=y"}, "argv": ["ls", "-l"]}
    root = enter_spec(enter_argv(init_pid=1, cgroup_procs=[], cpus=None, cwd="/", env={},
                                 argv=["--", "x"], oom_score_adj=0)[5:])
    assert (root["argv"], root["user"], root["oom_score_adj"]) == (["--", "x"], "", 0)


def test_a_user_is_looked_up_as_docker_does(tmp_path, monkeypatch):
    """name or uid, optionally :group or :gid; without a group, a user's groups are its
    /etc/group memberships too; an unknown uid runs with gid 0 and home / (Docker's)."""
    from sandfleet.runtime import helper

    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n"
                                "agent:x:1000:1000::/home/agent:/bin/bash\n"
                                "svc:x:999:999::/srv:/usr/sbin/nologin\n")
    (etc / "group").write_text("root:x:0:\nagent:x:1000:\ndocker:x:998:agent,svc\n"
                               "staff:x:50:agent\nsvc:x:999:\n")
    real_open = os.open
    monkeypatch.setattr(helper.os, "open", lambda path, *a: real_open(
        str(tmp_path) + path if str(path).startswith("/etc/") else path, *a))
    assert helper.resolve_user("agent") == (1000, 1000, [1000, 50, 998], "/home/agent")
    assert helper.resolve_user("1000") == (1000, 1000, [1000, 50, 998], "/home/agent")
    assert helper.resolve_user("agent:staff") == (1000, 50, [50], "/home/agent")
    assert helper.resolve_user("svc:4242") == (999, 4242, [4242], "/srv")
    assert helper.resolve_user("svc") == (999, 999, [999, 998], "/srv")
    assert helper.resolve_user("4242") == (4242, 0, [0], "/")
    for bad, what in (("nobody-here", "no user 'nobody-here'"),
                      ("agent:nogroup", "no group 'nogroup'")):
        with pytest.raises(OSError, match=what):
            helper.resolve_user(bad)
    (etc / "group").unlink()
    os.mkfifo(etc / "group")  # what the sandbox put there is not waited on
    assert helper.resolve_user("agent") == (1000, 1000, [1000], "/home/agent")


def test_spec_roundtrip_rejects_unknown_fields():
    spec = SandboxSpec(image=Path("/x.sif"), env={"A": "1"}, network=True)
    assert SandboxSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="colour"):
        SandboxSpec.from_dict({**spec.to_dict(), "colour": "red"})
    with pytest.raises(ValueError):
        SandboxSpec(image=Path("/x.sif"), workdir="relative")


def test_errors_carry_cause_and_data_and_survive_pickle_and_wire():
    errors = [SandboxLost("s1", "gone"), ImageMissing("/i.sif", "truncated"),
              CapacityTimeout(12.5, "no nodes"), SandboxStartError("s2", "bwrap failed"),
              InfraError("plain")]
    for err in errors:
        assert isinstance(err, InfraError)
        for back in (pickle.loads(pickle.dumps(err)), InfraError.from_dict(err.to_dict())):
            assert type(back) is type(err)
            assert (str(back), back.cause, back.to_dict()) == (str(err), err.cause, err.to_dict())
    assert SandboxLost("s1", "gone").sandbox_id == "s1"
    assert ImageMissing("/i.sif", "truncated").image == "/i.sif"
    assert {cls.cause for cls in ERRORS.values()} == {
        "infra", "sandbox_lost", "lease_expired", "sandbox_start", "image_missing", "node_lost",
        "capacity", "controller_unreachable"}
    unknown = InfraError.from_dict({"error": "Evil", "cause": "x", "message": "m"})
    assert type(unknown) is InfraError and unknown.cause == "x"


def test_registry_is_lazy_and_strict(tmp_path):
    code = ("import sys, sandfleet.runtime as r; "
            "print([m for m in sys.modules if m.startswith('sandfleet.runtime.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
    with pytest.raises(ValueError, match="local, apptainer"):
        get_runtime("docker")
    runtime = get_runtime("local", state_dir=tmp_path / "s", cache_dir=tmp_path / "c")
    assert isinstance(runtime, LocalRuntime) and isinstance(runtime, Runtime)


SKELETON_RACE = """
import sys
from pathlib import Path
from sandfleet.runtime.local_host import disk_skeleton
for _ in range(300):
    disk_skeleton(Path(sys.argv[1]))
"""


def test_runtimes_of_several_processes_share_one_disk_skeleton(tmp_path):
    """Parallel build jobs check their images with runtimes on one state folder: each
    process makes the disk skeleton at start. Four at once, 300 times each: none fails (it
    was renamed away under another), and what is left is whole."""
    from sandfleet.runtime.local_host import RESERVE_BYTES, RESERVE_FILES

    folder = tmp_path / "disk-skeleton"
    procs = [subprocess.Popen([sys.executable, "-c", SKELETON_RACE, str(folder)],
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    assert sorted(os.listdir(tmp_path)) == ["disk-skeleton"]  # no temporary folder left
    assert sorted(os.listdir(folder)) == ["reserve", "upper", "work"]
    assert [os.stat(folder / "reserve" / str(i)).st_size for i in range(RESERVE_FILES)] == \
        [RESERVE_BYTES] * RESERVE_FILES


def test_a_whole_skeleton_is_kept_and_a_damaged_one_made_again(tmp_path):
    from sandfleet.runtime.local_host import disk_skeleton

    folder = disk_skeleton(tmp_path / "disk-skeleton")
    inode = os.stat(folder).st_ino
    assert os.stat(disk_skeleton(folder)).st_ino == inode  # whole: kept as it is
    (folder / "reserve" / "0").write_bytes(b"short")
    (folder / "work").chmod(0o755)
    disk_skeleton(folder)
    assert os.stat(folder / "reserve" / "0").st_size > 5
    assert oct(os.stat(folder / "work").st_mode & 0o777) == "0o700"
    assert sorted(os.listdir(tmp_path)) == ["disk-skeleton"]
