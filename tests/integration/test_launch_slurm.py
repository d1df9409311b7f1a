"""`--launcher slurm` for real: the inference server and the trainer as jobs of the local
Slurm cluster (`local_slurm`), the orchestrator in the test's process, real sandboxes; and
the batch scripts a launch of configs/qwen3.5-9b.yaml submits, against golden files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.integration.test_processes import config_for, sft_init  # noqa: F401  (a fixture)
from tmax.train.config import TrainConfigError, load_train_config

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "data" / "golden"


def golden_config():
    return load_train_config(REPO / "configs" / "qwen3.5-9b.yaml", [
        "slurm.python=/opt/tmax/venv/bin/python", "slurm.trainer_nodes=2",
        "slurm.inference.partition=gpu", "slurm.inference.account=rl",
        'slurm.inference.time="12:00:00"',
        'slurm.inference.setup=["module load cuda/12.4", "source /opt/tmax/venv/bin/activate"]',
        "slurm.trainer.partition=gpu", "slurm.trainer.account=rl", "slurm.trainer.qos=high",
        "slurm.trainer.constraint=h100", "slurm.trainer.cpus=12",
        "slurm.trainer.mem=0", 'slurm.trainer.time="24:00:00"',
        "slurm.trainer.extra=[--exclusive]",
        'slurm.trainer.setup=["module load cuda/12.4", "source /opt/tmax/venv/bin/activate"]'])


def test_the_dry_run_scripts_of_the_paper_config_match_the_golden_files(monkeypatch):
    from tmax.train.slurm import slurm_plan

    monkeypatch.setenv("SCRATCH", "/scratch/alice")
    plan = slurm_plan(golden_config())
    assert sorted(plan) == [f"inference-{i}.sbatch" for i in range(6)] + ["trainer.sbatch"]
    for name in ("inference-0.sbatch", "trainer.sbatch"):
        if os.environ.get("TMAX_UPDATE_GOLDEN"):
            (GOLDEN / name).write_text(plan[name])
        assert plan[name] == (GOLDEN / name).read_text(), name
    assert plan["inference-5.sbatch"] == plan["inference-0.sbatch"].replace(
        "inference-0", "inference-5").replace("server 0 on", "server 5 on").replace(
        "/qwen3.5-9b 0\n", "/qwen3.5-9b 5\n").replace(  # staggered: 5 % 4 = 1 step less
        "--time=12:00:00", "--time=11:45:00")


def test_walltimes_parse_in_every_sbatch_form_and_servers_are_staggered():
    from tmax.train.slurm import format_walltime, staggered, walltime_s

    assert [walltime_s(t) for t in ("90", "90:30", "12:00:00", "2-3", "2-3:04",
                                    "2-03:04:05")] == \
        [5400, 5430, 43200, 183600, 183840, 183845]
    assert format_walltime(183845) == "2-03:04:05" and format_walltime(5400) == "01:30:00"
    with pytest.raises(ValueError, match="walltime '1:2:3:4'"):
        walltime_s("1:2:3:4")
    assert [staggered("12:00:00", i, 15, 4) for i in range(6)] == [
        "12:00:00", "11:45:00", "11:30:00", "11:15:00", "12:00:00", "11:45:00"]
    assert staggered("60", 3, 25, 4) == "00:30:00"  # never under half the walltime
    assert staggered(None, 3, 15, 4) is None and staggered("60", 1, 0, 4) == "60"


def test_the_cli_dry_run_prints_the_scripts_and_slurm_needs_distributed(monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/alice")
    cli = [str(REPO / ".venv" / "bin" / "tmax-train")]
    out = subprocess.run([*cli, "--config", str(REPO / "configs" / "qwen3.5-9b.yaml"),
                          "--launcher", "slurm", "--dry-run"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.count("#!/bin/bash") == 7
    assert "# ===== /scratch/alice/tmax/runs/qwen3.5-9b/slurm/trainer.sbatch" in out
    bad = subprocess.run([*cli, "--launcher", "slurm", "--dry-run"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode != 0 and "needs distributed.enabled" in bad.stderr


def test_slurm_options_are_checked_at_load_time():
    with pytest.raises(TrainConfigError, match="quoted string"):
        load_train_config(None, ["slurm.trainer.time=24:00:00"])
    with pytest.raises(TrainConfigError, match="not a multiple of slurm.trainer_nodes"):
        load_train_config(None, ["trainer.backend=deepspeed", "distributed.trainer_ranks=3",
                                 "slurm.trainer_nodes=2"])
    with pytest.raises(TrainConfigError, match="slurm.trainer.nodes"):
        load_train_config(None, ["slurm.trainer.nodes=2"])


def squeue_ids(env: dict[str, str]) -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return set(out.split())


def requeue_wait_s(job: str, env: dict[str, str]) -> float:
    """Seconds the requeued ``job`` waited before it ran again: a requeue resets SubmitTime,
    StartTime is the new run's start (the ended job stays in scontrol for MinJobAge)."""
    from datetime import datetime

    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    assert fields["Restarts"] == "1", fields
    return (datetime.fromisoformat(fields["StartTime"])
            - datetime.fromisoformat(fields["SubmitTime"])).total_seconds()


REQUEUE_WAIT_MAX_S = 60
"""The local cluster holds a requeued job cred_expire + 1 = 11 s (bin/tmax-local-slurm), not
Slurm's default 121 s; more than this means that hold is back."""


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


class CancelInference(threading.Thread):
    """scancel of the inference job once the first step is done; records what it saw."""

    def __init__(self, run_dir: Path, env: dict[str, str]):
        super().__init__(daemon=True)
        self.run_dir, self.env, self.stop = run_dir, env, threading.Event()
        self.cancelled: str | None = None
        self.seen: dict[str, set[str]] = {}  # job id -> states seen in squeue
        self.first_step_s: float | None = None
        self.t0 = time.monotonic()

    def run(self) -> None:
        from tmax.train.slurm import read_jobs

        while not self.stop.wait(0.5):
            out = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self.env, text=True,
                                 capture_output=True, timeout=30, check=False).stdout
            for line in out.splitlines():
                job, state = line.split()
                self.seen.setdefault(job, set()).add(state)
            metrics = self.run_dir / "metrics.jsonl"
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            if steps and self.first_step_s is None:
                self.first_step_s = time.monotonic() - self.t0
            if steps >= 1 and self.cancelled is None:
                jobs = [j for j in read_jobs(self.run_dir) if j["role"] == "inference"]
                if jobs:
                    self.cancelled = jobs[0]["job_id"]
                    subprocess.run(["scancel", self.cancelled], env=self.env, timeout=30,
                                   check=True)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.sandbox
def test_a_run_on_slurm_jobs_survives_a_cancelled_inference_job(
        local_slurm, example_fleet, example_store, sft_init, tmp_path):  # noqa: F811
    from tmax.train.processes import run_processes
    from tmax.train.slurm import read_jobs, run_status, stop_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(sft_init, run_dir / "init")
    config = config_for(run_dir, example_fleet, example_store, "steps=3",
                        "checkpoint_every=2", "slurm.inference.cpus=1",
                        "slurm.trainer.cpus=1", "slurm.poll_s=1")
    watcher = CancelInference(run_dir, local_slurm.env)
    watcher.start()
    try:
        run_processes(config, progress=False, launcher="slurm")
    finally:
        watcher.stop.set()
        watcher.join()
    jobs = read_jobs(run_dir)
    print("jobs:", json.dumps(jobs, indent=1), "\nseen in squeue:", watcher.seen,
          "\nfirst step after", watcher.first_step_s, "s")
    by_name = {j["name"]: j["job_id"] for j in jobs}
    assert set(by_name) == {"inference-0", "inference-1", "trainer"}, jobs
    assert watcher.cancelled == by_name["inference-0"]
    for job_id in by_name.values():  # each was a real job, seen running in squeue
        assert "RUNNING" in watcher.seen.get(job_id, set()), (job_id, watcher.seen)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text()
                .splitlines()]
    infra = [r for r in rollouts if r["infra_failure"]]
    assert all(r["reward"] is None for r in infra)  # masked, never a zero
    assert (run_dir / "final" / "model.safetensors").exists()
    assert json.loads((run_dir / "servers" / "1.json").read_text())["job_id"] == \
        by_name["inference-1"]
    assert "registered" in (run_dir / "logs" / f"slurm-inference-1-{by_name['inference-1']}"
                            ".out").read_text()
    # afterwards: no job of the run in squeue, no process of processes.json alive
    deadline = time.monotonic() + 30
    while set(by_name.values()) & squeue_ids(local_slurm.env):
        assert time.monotonic() < deadline, squeue_ids(local_slurm.env)
        time.sleep(0.5)
    procs = json.loads((run_dir / "processes.json").read_text())
    assert procs["trainer"] == [] and procs["inference"] == {}
    status = run_status(run_dir)
    assert status["step"] == 3 and status["weights"] == 3 and status["done"]
    states = {j["name"]: j["state"] for j in status["jobs"]}
    assert states["trainer"] == "COMPLETED" and states["inference-0"] == "CANCELLED", states
    assert stop_run(run_dir) == [f"{run_dir}: nothing of this run is running"]


class SignalTrainer(threading.Thread):
    """USR2 to the trainer job's ranks (as Slurm sends before the time limit) once the
    first step is done."""

    def __init__(self, run_dir: Path, env: dict[str, str]):
        super().__init__(daemon=True)
        self.run_dir, self.env, self.stop = run_dir, env, threading.Event()
        self.signalled: str | None = None
        self.at_step = 0

    def run(self) -> None:
        from tmax.train.slurm import read_jobs

        while not self.stop.wait(0.3):
            metrics = self.run_dir / "metrics.jsonl"
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            jobs = [j for j in read_jobs(self.run_dir) if j["role"] == "trainer"]
            if steps >= 1 and jobs:
                self.signalled, self.at_step = jobs[0]["job_id"], steps
                subprocess.run(["scancel", "--signal=USR2", self.signalled], env=self.env,
                               timeout=30, check=True)
                return


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.sandbox
def test_tmax_train_status_and_stop_of_a_run_launched_from_the_command_line(
        local_slurm, example_fleet, example_store, sft_init, tmp_path):  # noqa: F811
    from tmax.train.slurm import read_jobs

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(sft_init, run_dir / "init")
    cli = str(REPO / ".venv" / "bin" / "tmax-train")
    args = [f"out_dir={run_dir}", f"fleet.state_dir={example_fleet.state}",
            f"tasks.image_store={example_store.root}", "fleet.concurrency=4",
            f"tasks.paths=[{REPO / 'examples' / 'tasks'}]", "distributed.enabled=true",
            "steps=50", "slurm.inference.cpus=1", "slurm.trainer.cpus=1"]
    t0 = time.monotonic()
    with open(tmp_path / "launcher.err", "wb") as err:
        launcher = subprocess.Popen([cli, "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
                                     "--launcher", "slurm", "-q", *args], env=local_slurm.env,
                                    stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert launcher.poll() is None, (tmp_path / "launcher.err").read_text()
            assert time.monotonic() - t0 < 300, "no first step within 300 s"
            time.sleep(0.5)
        print(f"launch command to first step: {time.monotonic() - t0:.1f} s")
        status = subprocess.run([cli, "status", str(run_dir)], env=local_slurm.env,
                                capture_output=True, text=True, timeout=60, check=True).stdout
        print(status)
        assert f"run {run_dir}: step " in status and "/50, reward " in status
        assert status.count("RUNNING") == 2 and "launcher" in status
        assert "  engine inference-0    v" in status and " serving " in status
        ids = {j["job_id"] for j in read_jobs(run_dir)}
        assert len(ids) == 2 and ids <= squeue_ids(local_slurm.env)
        stop = subprocess.run([cli, "stop", str(run_dir)], env=local_slurm.env,
                              capture_output=True, text=True, timeout=120, check=True).stdout
        print(stop)
        assert f"launcher pid {launcher.pid}: SIGTERM (gone after" in stop
        assert launcher.wait(30) != 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
    deadline = time.monotonic() + 30
    while ids & squeue_ids(local_slurm.env):
        assert time.monotonic() < deadline, squeue_ids(local_slurm.env)
        time.sleep(0.5)
    procs = json.loads((run_dir / "processes.json").read_text())
    assert not pid_alive(procs["launcher"])
    err_text = (tmp_path / "launcher.err").read_text()
    print(err_text[-3000:])
    assert "sbatch:" not in err_text and "squeue:" not in err_text  # no Slurm chatter


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.sandbox
def test_an_inference_job_that_fails_before_registering_stops_the_run_naming_it(
        local_slurm, example_fleet, example_store, sft_init, tmp_path):  # noqa: F811
    from tmax.train.processes import TrainProcessError, run_processes
    from tmax.train.slurm import read_jobs

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(sft_init, run_dir / "init")
    config = config_for(run_dir, example_fleet, example_store, "steps=3",
                        "slurm.inference.cpus=1", "slurm.trainer.cpus=1", "slurm.poll_s=1",
                        'slurm.inference.setup=["echo no GPU here >&2; exit 7"]')
    with pytest.raises(TrainProcessError) as failed:
        run_processes(config, progress=False, launcher="slurm")
    jobs = {j["name"]: j for j in read_jobs(run_dir)}
    inference = jobs["inference-0"]
    message = str(failed.value)
    assert f"inference job {inference['job_id']} ended (FAILED)" in message
    assert inference["log"] in message and "no GPU here" in message
    deadline = time.monotonic() + 30  # the trainer job went with it
    while {j["job_id"] for j in jobs.values()} & squeue_ids(local_slurm.env):
        assert time.monotonic() < deadline, squeue_ids(local_slurm.env)
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.sandbox
def test_a_deepspeed_trainer_job_on_two_nodes_trains_and_survives_a_usr2_requeue(
        local_slurm, example_fleet, example_store, sft_init, tmp_path):  # noqa: F811
    """A trainer job warned by USR2 (as Slurm warns before the time limit) checkpoints,
    requeues itself under the same job id and resumes: its ranks agree first. (One test
    for both backends' requeue: the launcher's path is the same; each backend's
    checkpoint and resume is tested in test_train and test_trainer_backends.)"""
    from tmax.train.processes import run_processes
    from tmax.train.slurm import read_jobs

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(sft_init, run_dir / "init")
    config = config_for(run_dir, example_fleet, example_store, "steps=3",
                        "checkpoint_every=10", "trainer.backend=deepspeed",
                        "distributed.trainer_ranks=2", "slurm.trainer_nodes=2",
                        "slurm.inference.cpus=1", "slurm.trainer.cpus=1", "slurm.poll_s=1")
    warn = SignalTrainer(run_dir, local_slurm.env)
    warn.start()
    try:
        run_processes(config, progress=False, launcher="slurm")
    finally:
        warn.stop.set()
        warn.join()
    trainer, = (j for j in read_jobs(run_dir) if j["role"] == "trainer")
    assert warn.signalled == trainer["job_id"]  # requeued, same id
    out = Path(trainer["log"]).read_text()
    print("\n".join(line for line in out.splitlines() if "Warning" not in line
                    and "return func" not in line)[-3000:])
    assert "2 rank(s) on n[" in out
    assert "requeueing job" in out and "(restart 1)" in out  # the ranks agreed, rank 0 requeued
    assert "resumed from" in out
    waited = requeue_wait_s(trainer["job_id"], local_slurm.env)
    assert waited < REQUEUE_WAIT_MAX_S, f"the requeued job waited {waited:.0f} s to start again"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # none lost, none repeated
    assert (run_dir / "final" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.sandbox
def test_the_jobs_of_a_sigkilled_launcher_end_by_themselves(
        local_slurm, example_fleet, example_store, sft_init, tmp_path):  # noqa: F811
    from tmax.train.slurm import read_jobs

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(sft_init, run_dir / "init")
    cli = str(REPO / ".venv" / "bin" / "tmax-train")
    args = [f"out_dir={run_dir}", f"fleet.state_dir={example_fleet.state}",
            f"tasks.image_store={example_store.root}", "fleet.concurrency=4",
            f"tasks.paths=[{REPO / 'examples' / 'tasks'}]", "distributed.enabled=true",
            "distributed.stale_after_s=10", "steps=50", "slurm.inference.cpus=1",
            "slurm.trainer.cpus=1"]
    launcher = subprocess.Popen([cli, "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
                                 "--launcher", "slurm", "-q", *args], env=local_slurm.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        metrics, t0 = run_dir / "metrics.jsonl", time.monotonic()
        while not (metrics.exists() and metrics.read_text().strip()):
            assert launcher.poll() is None and time.monotonic() - t0 < 300
            time.sleep(0.5)
    finally:
        os.kill(launcher.pid, 9)  # no cleanup: the jobs must notice on their own
        launcher.wait()
    ids = {j["job_id"] for j in read_jobs(run_dir)}
    assert len(ids) == 2
    t0 = time.monotonic()
    while ids & squeue_ids(local_slurm.env):
        assert time.monotonic() - t0 < 90, squeue_ids(local_slurm.env)
        time.sleep(1.0)
    print(f"jobs gone {time.monotonic() - t0:.1f} s after the launcher was killed")
    inference, = (j for j in read_jobs(run_dir) if j["role"] == "inference")
    assert "the orchestrator's heartbeat is older than 10 s" in Path(inference["log"]).read_text()


def test_stop_signals_only_processes_of_this_host_and_their_own_groups(tmp_path):
    from sandfleet.slurm import SlurmClient
    from tmax.train.control import stop_run

    run = tmp_path / "run"
    run.mkdir()
    bystander = subprocess.Popen(["sleep", "60"])  # not a group leader: never signalled
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        (run / "processes.json").write_text(json.dumps(
            {"host": "another-login-node", "launcher": leader.pid, "trainer": [leader.pid],
             "inference": {}}))
        assert stop_run(run, SlurmClient()) == [f"{run}: nothing of this run is running"]
        assert leader.poll() is None
        import socket

        (run / "processes.json").write_text(json.dumps(
            {"host": socket.gethostname(), "launcher": None,
             "trainer": [bystander.pid, leader.pid], "inference": {}}))
        assert stop_run(run, SlurmClient()) == [f"trainer-1 pid {leader.pid}: SIGTERM"]
        assert leader.wait(10) == -15 and bystander.poll() is None
    finally:
        for p in (bystander, leader):
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.sandbox
def test_a_detached_run_is_an_orchestrator_job_and_stop_ends_all_of_it(
        local_slurm, example_fleet, example_store, sft_init, tmp_path):  # noqa: F811
    from tmax.train.slurm import read_jobs

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(sft_init, run_dir / "init")
    cli = str(REPO / ".venv" / "bin" / "tmax-train")
    args = [f"out_dir={run_dir}", f"fleet.state_dir={example_fleet.state}",
            f"tasks.image_store={example_store.root}", "fleet.concurrency=4",
            f"tasks.paths=[{REPO / 'examples' / 'tasks'}]", "distributed.enabled=true",
            "steps=50", "slurm.inference.cpus=1", "slurm.trainer.cpus=1",
            "slurm.orchestrator.cpus=1"]
    t0 = time.monotonic()
    out = subprocess.run([cli, "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
                          "--launcher", "slurm", "--detach", *args], env=local_slurm.env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("orchestrator: job ") and f"tmax-train stop {run_dir}" in out
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() - t0 < 300, read_jobs(run_dir)
        time.sleep(0.5)
    print(f"detached launch to first step: {time.monotonic() - t0:.1f} s")
    jobs = {j["name"]: j["job_id"] for j in read_jobs(run_dir)}
    assert set(jobs) == {"orchestrator", "trainer", "inference-0"}
    status = subprocess.run([cli, "status", str(run_dir)], env=local_slurm.env,
                            capture_output=True, text=True, timeout=60, check=True).stdout
    print(status)
    assert status.count("RUNNING") == 3
    stop = subprocess.run([cli, "stop", str(run_dir)], env=local_slurm.env,
                          capture_output=True, text=True, timeout=120, check=True).stdout
    print(stop)
    # here the job's node is this host, so stop may reach the launcher by pid first
    assert f"orchestrator: scancel {jobs['orchestrator']}" in stop or "launcher pid" in stop
    deadline = time.monotonic() + 60
    while set(jobs.values()) & squeue_ids(local_slurm.env):
        assert time.monotonic() < deadline, squeue_ids(local_slurm.env)
        time.sleep(0.5)
    log = Path(next(j["log"] for j in read_jobs(run_dir) if j["role"] == "orchestrator"))
    assert "tmax orchestrator on" in log.read_text()


def test_detach_dry_run_prints_the_orchestrator_job_first(monkeypatch):
    from tmax.train.slurm import slurm_plan

    monkeypatch.setenv("SCRATCH", "/scratch/alice")
    config = golden_config()
    plan = slurm_plan(config, detach=True)
    assert next(iter(plan)) == "orchestrator.sbatch" and len(plan) == 8
    script = plan["orchestrator.sbatch"]
    assert "#SBATCH --signal=B:TERM@120" in script
    assert script.rstrip().endswith(
        "exec /opt/tmax/venv/bin/python -m tmax.train.cli --config "
        "/scratch/alice/tmax/runs/qwen3.5-9b/config.yaml --launcher slurm -q")
    bad = subprocess.run([str(REPO / ".venv" / "bin" / "tmax-train"), "--detach",
                          "distributed.enabled=true"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.returncode == 2 and "needs --launcher slurm" in bad.stderr
