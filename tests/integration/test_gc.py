"""`tmax gc` (tmax/train/gc.py, its command line tmax/train/cli.py): runs whose launcher is gone lose their leftover processes
(real ones, started here in their own process groups), their still-queued Slurm jobs (real
jobs of the local cluster, cancelled by id) and their private fleet, and are marked once;
a live launcher, a reused pid, another host and --dry-run leave everything as it is."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from sandfleet.runtime.base import proc_start_time
from tmax.train.cli import gc_cmd
from tmax.train.gc import MARK, Queue, SlurmQueryError, collect_run

HOST = socket.gethostname()


def sleeper(*argv: str) -> subprocess.Popen:
    """A process of this test leading its own process group (as the launcher's children)."""
    proc = subprocess.Popen(list(argv) or ["sleep", "300"], start_new_session=True,
                            stdin=subprocess.DEVNULL)
    wait_for(lambda: proc_start_time(proc.pid) is not None, "the child to start")
    return proc


def wait_for(cond, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def dead_launcher() -> tuple[int, int]:
    """The pid and start time of a process that has ended."""
    proc = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL)
    start = proc_start_time(proc.pid)
    assert start is not None
    proc.kill()
    proc.wait()
    return proc.pid, start


def write_run(run: Path, launcher: tuple[int, int], *, host: str = HOST,
              trainer: list[tuple[int, int | None]] = (), inference: dict | None = None,
              jobs: list[dict] = (), launcher_job: str | None = None) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    inference = inference or {}
    starts = {str(p): s for p, s in [*trainer, *inference.values()]}
    (run / "processes.json").write_text(json.dumps({
        "host": host, "launcher": launcher[0], "launcher_start": launcher[1],
        "launcher_job": launcher_job, "trainer": [p for p, _ in trainer],
        "inference": {k: p for k, (p, _) in inference.items()}, "start_times": starts,
        "jobs": {"trainer": [], "inference": {}}}))
    if jobs:
        (run / "jobs.json").write_text(json.dumps({"jobs": list(jobs)}))
    return run


def gc(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(gc_cmd, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def gc_json(*args: str) -> dict:
    code, out = gc(*args, "-o", "json")
    assert code == 0, out
    return json.loads(out)


def reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def snapshot(root: Path) -> dict[str, tuple[float, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_dead_launchers_processes_are_ended_by_group_and_the_run_is_marked_once(tmp_path):
    pidfile = tmp_path / "grandchild"
    trainer = sleeper()
    server = sleeper("bash", "-c", f"sleep 300 & echo $! > {pidfile}; wait")
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), "the grandchild")
    grandchild = int(pidfile.read_text())
    try:
        run = write_run(tmp_path / "runs" / "r1", dead_launcher(),
                        trainer=[(trainer.pid, proc_start_time(trainer.pid))],
                        inference={"inference-0": (server.pid, proc_start_time(server.pid))})
        code, out = gc(str(tmp_path / "runs"), "--grace", "5")
        assert code == 0, out
        assert f"{run}: collected: launcher pid" in out and "has ended" in out
        assert f"SIGTERM process group {trainer.pid} (trainer-0)" in out
        assert f"SIGTERM process group {server.pid} (inference-0)" in out
        assert trainer.wait(10) == -15 and server.wait(10) == -15
        wait_for(lambda: proc_start_time(grandchild) is None, "the group's grandchild")
        mark = json.loads((run / MARK).read_text())
        assert mark["launcher"]["pid"] and [a["what"] for a in mark["actions"]] == \
            ["SIGTERM", "SIGTERM"]
        before = (run / MARK).read_bytes()
        code, out = gc(str(tmp_path / "runs"))  # the second gc: nothing to do
        assert code == 0 and f"{run}: already: collected already" in out, out
        assert "SIGTERM" not in out and (run / MARK).read_bytes() == before
        # a resume (a new launcher wrote processes.json) makes the run a candidate again
        write_run(run, dead_launcher())
        report, = gc_json(str(run))["runs"]
        assert report["verdict"] == "collected" and report["actions"][-1]["what"] == "mark"
    finally:
        reap(trainer, server)


def test_a_live_launcher_and_another_hosts_launcher_leave_the_run_alone(tmp_path):
    launcher, child = sleeper(), sleeper()
    try:
        kids = [(child.pid, proc_start_time(child.pid))]
        mine = write_run(tmp_path / "runs" / "alive",
                         (launcher.pid, proc_start_time(launcher.pid)), trainer=kids)
        far = write_run(tmp_path / "runs" / "far", dead_launcher(), host="another-login-node",
                        trainer=kids)
        runs = {r["run"]: r for r in gc_json(str(tmp_path / "runs"))["runs"]}
        assert runs[str(mine)]["verdict"] == "alive"
        assert runs[str(mine)]["reason"] == f"left alone: launcher pid {launcher.pid} on " \
            f"{HOST} is running"
        assert runs[str(far)]["verdict"] == "other-host"
        assert "runs on another-login-node, not here" in runs[str(far)]["reason"]
        assert not runs[str(mine)]["actions"] and not runs[str(far)]["actions"]
        assert child.poll() is None and launcher.poll() is None
        assert not (mine / MARK).exists() and not (far / MARK).exists()
    finally:
        reap(launcher, child)


def test_a_reused_pid_is_not_signalled(tmp_path):
    # processes holding pids the run recorded, but not the processes it recorded: one
    # started later than the recorded start time, one with no start time on record
    other, unknown = sleeper(), sleeper()
    try:
        run = write_run(tmp_path / "run", dead_launcher(),
                        trainer=[(other.pid, proc_start_time(other.pid) - 1)],
                        inference={"inference-0": (unknown.pid, None)})
        code, out = gc(str(run))
        assert code == 0, out
        assert f"skip pid {other.pid} (trainer-0): left alone: its start time differs" in out
        assert f"skip pid {unknown.pid} (inference-0): left alone: no start time " \
            "recorded" in out
        assert "SIGTERM" not in out
        assert (run / MARK).exists()  # the recorded processes are gone: nothing left to do
        time.sleep(0.5)
        assert other.poll() is None and unknown.poll() is None
    finally:
        reap(other, unknown)


def test_dry_run_says_what_it_would_do_and_changes_nothing(tmp_path):
    child = sleeper()
    try:
        run = write_run(tmp_path / "run", dead_launcher(),
                        trainer=[(child.pid, proc_start_time(child.pid))])
        before = snapshot(tmp_path)
        code, out = gc(str(run), "--dry-run")
        assert code == 0, out
        assert f"{run}: would-collect: launcher pid" in out
        assert f"would SIGTERM process group {child.pid} (trainer-0): launcher gone" in out
        time.sleep(0.3)
        assert child.poll() is None and snapshot(tmp_path) == before
        assert not (run / MARK).exists()
    finally:
        reap(child)


def test_a_private_fleet_is_taken_down_and_a_joined_one_is_left_alone(tmp_path):
    state = tmp_path / "fleet"
    state.mkdir()
    (state / "fleet.json").write_text(json.dumps({"provider": "local"}))
    pid, start = dead_launcher()  # a controller that died without cleaning up
    (state / "controller.json").write_text(json.dumps({
        "address": "127.0.0.1:1", "token": "x", "pid": pid, "pid_start": start, "host": HOST}))
    run = write_run(tmp_path / "runs" / "own", dead_launcher())
    (run / "fleet.json").write_text(json.dumps({"state_dir": str(state), "private": True}))
    joined = write_run(tmp_path / "runs" / "joined", dead_launcher())
    (joined / "fleet.json").write_text(json.dumps({"state_dir": str(state), "private": False}))
    code, out = gc(str(tmp_path / "runs"), "--dry-run")
    assert code == 0 and f"would fleet down {state}" in out, out
    assert (state / "controller.json").exists()
    code, out = gc(str(tmp_path / "runs"))
    assert code == 0, out
    assert f"fleet down {state}: the run's private fleet, launcher gone" in out
    assert "removed controller.json" in out
    assert f"skip fleet {state}: left alone: a fleet the run joined" in out
    assert not (state / "controller.json").exists()


class FakeQueue(Queue):
    """squeue's answer, for the liveness rules that need no job to exist."""

    def __init__(self, jobs: dict[str, str] | Exception):
        super().__init__()
        self.answer = jobs

    def jobs(self) -> dict[str, str]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_without_processes_json_the_heartbeat_decides_and_a_failed_squeue_marks_nothing(
        tmp_path):
    run = tmp_path / "run"
    beat = run / "handover" / "alive" / "orchestrator"
    beat.parent.mkdir(parents=True)
    beat.touch()
    (run / "jobs.json").write_text(json.dumps({"jobs": [
        {"role": "trainer", "name": "trainer", "job_id": "41", "log": "x"}]}))
    assert collect_run(run, FakeQueue({})).verdict == "alive"
    old = time.time() - 600
    os.utime(beat, (old, old))
    broken = FakeQueue(SlurmQueryError(["squeue"], "exit 1: no controller"))
    report = collect_run(run, broken)
    assert report.verdict == "incomplete" and "no controller" in report.actions[0].error
    assert not (run / MARK).exists()
    report = collect_run(run, FakeQueue({"41": "COMPLETING"}))  # ending already: no scancel
    assert report.verdict == "collected" and "stale after 120 s" in report.reason
    assert [a.what for a in report.actions] == ["mark"]


def test_the_default_root_is_the_train_configs_runs_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = write_run(tmp_path / "runs" / "tiny", dead_launcher())
    code, out = gc()
    assert code == 0 and out.startswith(f"{run}: collected"), out
    code, out = gc(str(tmp_path / "nowhere"))
    assert code == 0 and "nowhere: no such folder" in out


def squeue(env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["squeue", "-h", "--me", "-o", "%i %T"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return dict(line.split() for line in out.splitlines())


def sbatch(env: dict[str, str], out: Path) -> str:
    cp = subprocess.run(["sbatch", "--parsable", "-o", str(out), "--wrap", "sleep 300"],
                        env=env, capture_output=True, text=True, timeout=30, check=True)
    return cp.stdout.strip().split(";")[0]


@pytest.mark.slow
@pytest.mark.slurm
def test_gc_cancels_exactly_the_dead_runs_jobs_by_id(local_slurm, tmp_path):
    env = local_slurm.env
    ours = sbatch(env, tmp_path / "ours.out")
    other = sbatch(env, tmp_path / "other.out")  # this user's too, but in no jobs.json
    try:
        wait_for(lambda: {ours, other} <= set(squeue(env)), "both jobs in squeue", 30)
        run = write_run(tmp_path / "runs" / "dead", dead_launcher(), jobs=[
            {"role": "trainer", "name": "trainer", "job_id": ours, "log": "x"},
            {"role": "inference", "name": "inference-0", "job_id": "999999", "log": "x"}])
        detached = write_run(tmp_path / "runs" / "detached", dead_launcher(),
                             host="compute-node-7", launcher_job=other, jobs=[
                                 {"role": "orchestrator", "name": "orchestrator",
                                  "job_id": other, "log": "x"}])
        t0 = time.monotonic()
        code, out = gc(str(tmp_path / "runs"))
        took = time.monotonic() - t0
        assert code == 0, out
        assert f"{run}: collected" in out
        assert f"  scancel job {ours} (trainer): RUNNING, launcher gone" in out \
            or f"  scancel job {ours} (trainer): PENDING, launcher gone" in out
        assert out.count("scancel") == 1
        assert f"{detached}: alive: left alone: launcher job {other} is" in out
        wait_for(lambda: ours not in squeue(env), f"job {ours} to leave squeue", 30)
        assert other in squeue(env)
        print(f"gc of 2 runs (one squeue, one scancel): {took:.2f} s")
        code, out = gc(str(run))
        assert code == 0 and "already" in out and "scancel" not in out
    finally:
        for job in (ours, other):
            subprocess.run(["scancel", job], env=env, timeout=30, check=False)
