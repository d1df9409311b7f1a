"""bin/tmax-local-slurm against real Slurm daemons.

The first group uses the session cluster (3 nodes x 2 CPUs, fixture `local_slurm`); the
second starts its own 1-node clusters in other directories to check ownership and teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import local_slurm_cmd

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def slurm(*argv: str, env: dict[str, str], timeout: float = 30) -> str:
    cp = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert cp.returncode == 0, f"{argv} -> {cp.returncode}: {cp.stderr}"
    return cp.stdout


def sbatch(env: dict[str, str], *args: str) -> str:
    return slurm("sbatch", "--parsable", *args, env=env).strip().split(";")[0]


def job_field(job_id: str, key: str, env: dict[str, str]) -> str:
    out = slurm("scontrol", "-o", "show", "job", job_id, env=env)
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields[key]


def wait_state(job_id: str, want: set[str], env: dict[str, str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = job_field(job_id, "JobState", env)
        if state in want:
            return state
        assert time.monotonic() < deadline, f"job {job_id} still {state}, wanted {want}"
        time.sleep(0.3)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def wait_dead(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ---------------------------------------------------------------- session cluster


def test_sinfo_lists_the_three_virtual_nodes(local_slurm):
    out = slurm("sinfo", "-h", "-N", "-o", "%N %c %T", env=local_slurm.env)
    rows = sorted(line.split() for line in out.splitlines())
    assert [r[0] for r in rows] == ["n1", "n2", "n3"]
    assert all(r[1] == "2" for r in rows), rows
    status = json.loads(
        local_slurm_cmd("status", "--dir", str(local_slurm.dir), "-o", "json").stdout
    )
    assert status["healthy"] and len(status["daemons"]) == 5
    env_line = local_slurm_cmd("env", "--dir", str(local_slurm.dir)).stdout.strip()
    assert env_line == f"export SLURM_CONF={local_slurm.conf}"


def test_batch_job_writes_a_file_and_completes(local_slurm, tmp_path):
    target = tmp_path / "hello.txt"
    job = sbatch(
        local_slurm.env,
        "-o",
        str(tmp_path / "out"),
        "--wrap",
        f"echo hello $SLURM_JOB_ID > {target}",
    )
    assert wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, local_slurm.env) == "COMPLETED"
    assert target.read_text() == f"hello {job}\n"


def test_scancel_ends_a_running_job(local_slurm, tmp_path):
    pidfile = tmp_path / "pid"
    job = sbatch(
        local_slurm.env,
        "-o",
        str(tmp_path / "out"),
        "--wrap",
        f"echo $$ > {pidfile}; exec sleep 300",
    )
    deadline = time.monotonic() + 30
    while slurm("squeue", "-h", "-j", job, "-o", "%T", env=local_slurm.env).strip() != "RUNNING":
        assert time.monotonic() < deadline, "job never RUNNING in squeue"
        time.sleep(0.3)
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline, "job never wrote its pid"
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    assert alive(pid)
    slurm("scancel", job, env=local_slurm.env)
    assert wait_state(job, {"CANCELLED"}, local_slurm.env, timeout=30) == "CANCELLED"
    assert wait_dead(pid), f"sleep (pid {pid}) survived scancel"


def test_two_node_job_runs_on_two_distinct_nodes(local_slurm, tmp_path):
    out = tmp_path / "out"
    job = sbatch(
        local_slurm.env,
        "-N",
        "2",
        "-o",
        str(out),
        "--wrap",
        "srun -N 2 -n 2 bash -c 'echo $SLURMD_NODENAME'",
    )
    assert wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, local_slurm.env) == "COMPLETED"
    names = out.read_text().split()
    assert len(names) == 2 and len(set(names)) == 2, names
    assert set(names) <= {"n1", "n2", "n3"}
    nodelist = job_field(job, "NodeList", local_slurm.env)
    expanded = slurm("scontrol", "show", "hostnames", nodelist, env=local_slurm.env).split()
    assert sorted(expanded) == sorted(names)


def test_submitit_runs_a_function(local_slurm, tmp_path):
    submitit = pytest.importorskip("submitit")

    def where(x: int) -> tuple[int, str | None, str | None]:
        import os

        return x * 2, os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURMD_NODENAME")

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5, slurm_partition="debug", cpus_per_task=1)
    job = executor.submit(where, 21)
    value, job_id, node = job.result()
    assert value == 42
    assert job_id == job.job_id
    assert node in {"n1", "n2", "n3"}


# ---------------------------------------------------------------- own small clusters


@pytest.fixture
def small_dir():
    """A short folder: slurmd's sockets live under it, and a unix socket's path has at most
    107 bytes (pytest's tmp_path under pytest-xdist, .../popen-gwN/test_<long name>0/, can
    be longer)."""
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="tls-", dir="/tmp"))
    root = top / "cluster"
    yield root
    local_slurm_cmd("down", "--dir", str(root))
    shutil.rmtree(top, ignore_errors=True)


def daemon_pids(root: Path) -> dict[str, int]:
    status = json.loads(local_slurm_cmd("status", "--dir", str(root), "-o", "json").stdout)
    return {d["name"]: d["pid"] for d in status["daemons"]}


def test_up_twice_is_a_no_op(small_dir):
    first = local_slurm_cmd("up", "--dir", str(small_dir), "--nodes", "1")
    assert first.returncode == 0, first.stderr
    pids = daemon_pids(small_dir)
    assert set(pids) == {"munged", "slurmctld", "slurmd-n1"}
    again = local_slurm_cmd("up", "--dir", str(small_dir), "--nodes", "1")
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stderr
    assert again.stdout.strip() == f"export SLURM_CONF={small_dir / 'etc' / 'slurm.conf'}"
    assert daemon_pids(small_dir) == pids
    other = local_slurm_cmd("up", "--dir", str(small_dir), "--nodes", "2")
    assert other.returncode == 2 and "down" in other.stderr


def test_down_after_slurmd_died(small_dir):
    up = local_slurm_cmd("up", "--dir", str(small_dir), "--nodes", "1")
    assert up.returncode == 0, up.stderr
    pids = daemon_pids(small_dir)
    os.kill(pids["slurmd-n1"], signal.SIGKILL)
    assert wait_dead(pids["slurmd-n1"])

    partly = local_slurm_cmd("up", "--dir", str(small_dir))
    assert partly.returncode == 3, partly.stderr
    assert "partly dead" in partly.stderr and "down" in partly.stderr

    down = local_slurm_cmd("down", "--dir", str(small_dir))
    assert down.returncode == 0, down.stderr
    assert f"slurmd-n1 (pid {pids['slurmd-n1']}): already dead" in down.stdout
    for name in ("munged", "slurmctld"):
        assert f"{name} (pid {pids[name]}): stopped" in down.stdout
        assert not alive(pids[name])
    assert not (small_dir / "cluster.json").exists()
    assert (small_dir / "log" / "slurmctld.log").exists()


@pytest.fixture
def foreign_sleep():
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_up_refuses_a_dir_held_by_a_foreign_pid_file(tmp_path, foreign_sleep):
    root = tmp_path / "taken"
    (root / "run").mkdir(parents=True)
    (root / "run" / "slurmctld.pid").write_text(f"{foreign_sleep.pid}\n")
    up = local_slurm_cmd("up", "--dir", str(root), "--nodes", "1")
    assert up.returncode == 2, up.stderr
    assert str(foreign_sleep.pid) in up.stderr and str(root) in up.stderr
    assert not (root / "cluster.json").exists() and not (root / "munge").exists()
    assert foreign_sleep.poll() is None, "up must not touch a process it did not start"


def test_up_refuses_a_recorded_pid_with_another_start_time(tmp_path, foreign_sleep):
    root = tmp_path / "reused"
    (root / "run").mkdir(parents=True)
    stat = Path(f"/proc/{foreign_sleep.pid}/stat").read_text()
    start = int(stat[stat.rindex(")") + 2 :].split()[19])
    (root / "run" / "munged.pid").write_text(f"{foreign_sleep.pid}\n")
    record = {
        "dir": str(root),
        "uid": os.geteuid(),
        "host": os.uname().nodename,
        "conf": str(root / "etc" / "slurm.conf"),
        "nodes": 1,
        "cpus": 2,
        "memory_mb": 2048,
        "daemons": [
            {
                "name": "munged",
                "pid": foreign_sleep.pid,
                "start_time": start - 1,
                "argv": ["munged"],
            }
        ],
    }
    (root / "cluster.json").write_text(json.dumps(record))
    up = local_slurm_cmd("up", "--dir", str(root), "--nodes", "1")
    assert up.returncode == 2, up.stderr
    assert str(foreign_sleep.pid) in up.stderr and str(root) in up.stderr
    down = local_slurm_cmd("down", "--dir", str(root))
    assert down.returncode == 0 and "already dead" in down.stdout
    assert foreign_sleep.poll() is None, "down must not signal a pid whose start time differs"
