"""A training run as separate processes (hf-server, trainer, orchestrator), for real: real
sandboxes, a real inference server process, a real trainer process, and faults injected
by killing them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

from tests.unit.test_tasks import EXAMPLES
from tmax.train.config import TrainConfigError, load_train_config

REPO = Path(__file__).resolve().parents[2]


def config_for(run_dir: Path, fleet, store, *extra: str):
    return load_train_config(REPO / "configs" / "tiny-cpu.yaml", [
        f"out_dir={run_dir}", f"fleet.state_dir={fleet.state}",
        f"tasks.image_store={store.root}", "fleet.concurrency=4", f"tasks.paths=[{EXAMPLES}]",
        "distributed.enabled=true", "distributed.server_start_timeout_s=300", *extra])


@pytest.fixture(scope="module")
def sft_init(tmp_path_factory, example_store):
    """The tiny model after its SFT warm start, made once (as each run would make it)."""
    from tmax.train.loop import load_training_tasks, prepare_model, run_agent_config

    root = tmp_path_factory.mktemp("sft")
    config = load_train_config(REPO / "configs" / "tiny-cpu.yaml", [
        f"out_dir={root}", f"tasks.paths=[{EXAMPLES}]"])
    prepare_model(config, load_training_tasks(config), root,
                  run_agent_config(config), False)
    return root / "init"


def test_more_than_one_rank_needs_the_deepspeed_backend():
    with pytest.raises(TrainConfigError, match="needs trainer.backend = deepspeed"):
        load_train_config(None, ["distributed.trainer_ranks=2"])
    config = load_train_config(None, ["distributed.enabled=true"])
    assert (config.distributed.inference_servers, config.distributed.trainer_ranks) == (1, 1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Faults(threading.Thread):
    """Kills the inference server once the first step is done, and the trainer once the
    step-2 checkpoint exists (while later steps are under way)."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir, self.killed, self.stop = run_dir, {}, threading.Event()

    def steps(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def processes(self) -> dict:
        try:
            return json.loads((self.run_dir / "processes.json").read_text())
        except (OSError, ValueError):
            return {}

    def run(self) -> None:
        while not self.stop.wait(0.2):
            procs = self.processes()
            if "inference" not in self.killed and self.steps() >= 1 and procs.get("inference"):
                (_, pid), = procs["inference"].items()
                os.killpg(pid, signal.SIGKILL)
                self.killed["inference"] = pid
            if "inference" in self.killed and "trainer" not in self.killed and \
                    (self.run_dir / "checkpoints" / "step-2").is_dir() and procs.get("trainer"):
                pid, = procs["trainer"]
                os.killpg(pid, signal.SIGKILL)
                self.killed["trainer"] = pid
                return


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_run_of_separate_processes_survives_a_dead_server_and_a_dead_trainer(
        example_fleet, example_store, sft_init, tmp_path):
    from tmax.train.processes import run_processes

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(sft_init, run_dir / "init")
    config = config_for(run_dir, example_fleet, example_store, "steps=5", "checkpoint_every=2",
                        "tracking.tensorboard=true")
    faults = Faults(run_dir)
    faults.start()
    try:
        run_processes(config, progress=False)
    finally:
        faults.stop.set()
        faults.join()
    assert set(faults.killed) == {"inference", "trainer"}, faults.killed
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # none lost, none repeated
    for r in rows:  # the staleness bound (async_steps=1) held for every batch
        assert r["policy_version_min"] >= r["step"] - 1 - config.rollout.async_steps
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "resumed from" in trainer_log and "(step 2)" in trainer_log
    assert (run_dir / "logs" / "inference-1.log").exists()  # the replacement
    from tmax.train.handover import Handover

    engines = {e["name"]: e for e in Handover(run_dir).engines()}  # what status shows
    assert set(engines) == {"inference-0", "inference-1"}, engines
    assert engines["inference-0"]["live"] is False and engines["inference-1"]["live"] is True
    assert engines["inference-1"]["version"] == 5 and engines["inference-1"]["served"] > 0
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text()
                .splitlines()]
    infra = [r for r in rollouts if r["infra_failure"]]
    assert infra and all(r["infra_failure"]["cause"] == "policy_unavailable" and
                         r["reward"] is None for r in infra)
    assert (run_dir / "final" / "model.safetensors").exists()
    # the trainer's rank 0 logged every step to TensorBoard too (both of its launches)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {e.step for e in events.Scalars("reward_mean")} == {1, 2, 3, 4, 5}
    launch = json.loads((run_dir / "run.json").read_text())["launches"][0]
    assert launch["launcher"] == "local" and launch["git"]["commit"]
    procs = json.loads((run_dir / "processes.json").read_text())
    assert procs["trainer"] == [] and procs["inference"] == {}
    assert not any(alive(pid) for pid in faults.killed.values())
