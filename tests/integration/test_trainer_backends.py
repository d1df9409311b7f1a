"""Trainer backends: the DeepSpeed config builder, the torch backend's weight export, and
the deepspeed backend (ZeRO-3, for real, on CPU with gloo) against the torch one at 1 and 2
ranks: same loss and gradients, dropped rollouts out of the global denominator, same
weights after a step, checkpoint/resume, the FP32 head inside the partitioned head.

The deepspeed runs happen in spawned processes (one per rank), once per world size for the
whole module; each test checks one part of what they recorded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.conftest import REPO
from tmax.inference.base import MARKER as WEIGHTS_MARKER
from tmax.train.backends import TrainerBackend, weights_dir
from tmax.train.backends.choose import make_trainer
from tmax.train.backends.config import TrainerSection, build_deepspeed_config
from tmax.train.config import AlgoSection, OptimSection, TrainConfigError, load_train_config
from tmax.train.trainer import Sample, Trainer, samples_of

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="deepspeed is not installed: pip install -e '.[deepspeed]' "
    "(bin/tmax-setup installs it with the dev extra)")
VOCAB = 64
OPTIM = OptimSection(lr=1e-2, micro_batch_size=2)
TOL = 1e-5


def tiny(seed: int = 0) -> torch.nn.Module:
    """A one-layer Llama with tied embeddings (the tiny model's shape, smaller)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def batch(seed: int) -> list[Sample]:
    """Five sequences of 6..12 tokens (several lengths, three micro-batches of 2)."""
    rng = random.Random(seed)
    out = []
    for _ in range(5):
        n = rng.randint(6, 12)
        mask = [0] * 3 + [1] * (n - 3)
        out.append(Sample([rng.randrange(VOCAB) for _ in range(n)],
                          [(-rng.random() * 3) * m for m in mask], mask,
                          rng.choice([-0.5, 0.25, 0.5])))
    return out


def shard(samples: list[Any], rank: int, world: int) -> list[Any]:
    return samples[rank::world]


def trainer_kwargs() -> dict[str, Any]:
    return {"algo": AlgoSection(), "optim": OPTIM, "total_steps": 10, "temperature": 1.0,
            "fp32_head": True, "pad_id": 0, "max_len": 64}


class Traj:
    def __init__(self, samples: list[Sample]):
        self._samples = samples

    def sequences(self):
        return [(s.tokens, s.old_logp, s.mask) for s in self._samples]


def group(samples: list[Sample], advantages: list[float | None]) -> Any:
    return SimpleNamespace(trajectories=[Traj([s]) for s in samples],
                           advantages=SimpleNamespace(advantages=advantages))


def groups_of_rank(rank: int, world: int) -> list[Any]:
    """A step's groups with one infra-failed rollout (advantage None); on 2 ranks, rank 1
    holds only that one."""
    s = batch(7)
    everything = [group(s[:2], [0.5, -0.5]), group(s[2:3], [None])]
    if world == 1:
        return everything
    return [everything[rank]]


def valid_samples() -> list[Sample]:
    """What the torch backend trains on: the step's samples, the dropped rollout gone."""
    return samples_of(groups_of_rank(0, 1), 64)


# ---- config

def test_deepspeed_config_is_built_exactly():
    optim = OptimSection(lr=2e-6, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=0.5,
                         micro_batch_size=4)
    assert build_deepspeed_config(TrainerSection(backend="deepspeed"), optim, bf16=True) == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-6, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100_000,
                              "stage3_gather_16bit_weights_on_model_save": False},
        "bf16": {"enabled": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    section = TrainerSection(backend="deepspeed", zero_stage=2, deepspeed={
        "zero_optimization": {"overlap_comm": True}, "bf16": {"enabled": True},
        "steps_per_print": 10})
    built = build_deepspeed_config(section, optim, bf16=False)
    assert built["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert built["bf16"] == {"enabled": True}  # the override wins
    assert built["steps_per_print"] == 10
    assert section.deepspeed == {"zero_optimization": {"overlap_comm": True},
                                 "bf16": {"enabled": True}, "steps_per_print": 10}


def test_precision_auto_is_bf16_on_gpu_only():
    from tmax.train.backends.config import uses_bf16

    auto, fp32, bf16 = (TrainerSection(precision=p) for p in ("auto", "fp32", "bf16"))
    assert [uses_bf16(t, cuda=c) for t in (auto, fp32, bf16) for c in (True, False)] == \
        [True, False, False, False, True, True]


def test_trainer_section_loads_strictly_and_defaults_to_torch():
    assert load_train_config(None).trainer == TrainerSection()
    config = load_train_config(None, ["trainer.backend=deepspeed", "trainer.zero_stage=3",
                                      "trainer.deepspeed={zero_optimization: {x: 1}}"])
    assert config.trainer.backend == "deepspeed"
    assert config.trainer.deepspeed == {"zero_optimization": {"x": 1}}
    with pytest.raises(TrainConfigError, match="trainer.zero"):
        load_train_config(None, ["trainer.zero=3"])
    with pytest.raises(TrainConfigError, match="trainer.backend"):
        load_train_config(None, ["trainer.backend=fsdp"])


# ---- the torch backend

def test_make_trainer_builds_the_torch_backend_by_default():
    config = load_train_config(None, ["optim.lr=0.01", "optim.micro_batch_size=2"])
    trainer = make_trainer(config, tiny(), pad_id=0, max_len=64)
    assert isinstance(trainer, Trainer) and isinstance(trainer, TrainerBackend)
    assert (trainer.rank, trainer.world_size) == (0, 1)
    reference = Trainer(tiny(), **{**trainer_kwargs(), "total_steps": config.steps})
    m1, m2 = trainer.step(batch(1)), reference.step(batch(1))
    assert m1["loss"] == m2["loss"]
    for (k, v), (k2, v2) in zip(trainer.export_weights().items(),
                                reference.export_weights().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)


def test_export_to_path_writes_a_complete_versioned_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(tiny(), **trainer_kwargs())
    trainer.step(batch(1))
    path = trainer.export_to_path(tmp_path / "weights", 3)
    assert path == weights_dir(tmp_path / "weights", 3) == tmp_path / "weights" / "v00000003"
    assert json.loads((path / WEIGHTS_MARKER).read_text()) == {"version": 3}
    assert list(path.glob("*.safetensors")) and (path / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v00000003"]
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for key, value in trainer.export_weights().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    trainer.step(batch(2))
    again = trainer.export_to_path(tmp_path / "weights", 3)  # replaced whole
    assert torch.equal(AutoModelForCausalLM.from_pretrained(again).state_dict()[
        "model.norm.weight"], trainer.export_weights()["model.norm.weight"])


def test_missing_deepspeed_names_what_to_install(monkeypatch):
    from tmax.train.backends import deepspeed as backend

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(backend.DeepSpeedUnavailable, match=r"pip install -e '\.\[deepspeed\]'"):
        backend.import_deepspeed()
    config = load_train_config(None, ["trainer.backend=deepspeed"])
    with pytest.raises(ImportError, match="trainer.backend=torch"):
        make_trainer(config, tiny(), pad_id=0, max_len=64)


def test_deepspeed_is_imported_only_when_the_backend_is_built():
    code = ("import sys, tmax.train.loop, tmax.train.backends, tmax.train.backends.deepspeed,"
            " tmax.train.trainer; sys.exit('deepspeed' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr or "deepspeed imported at module import"


# ---- the deepspeed backend, in spawned ranks

def make_ds(seed: int = 0, **section: Any) -> Any:
    from tmax.train.backends.deepspeed import DeepSpeedTrainer

    # persistence 0: every parameter is partitioned, however small (as in a real model)
    cfg = TrainerSection(backend="deepspeed", param_persistence_threshold=0, **section)
    return DeepSpeedTrainer(tiny(seed), trainer=cfg, **trainer_kwargs())


def scenario_step(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer = make_ds()
    trainer.forward_backward(shard(batch(1), rank, world))
    grads = trainer.full_gradients()
    metrics = trainer.optimizer_step()
    weights = trainer.export_weights()
    path = trainer.export_to_path(out / "weights", 1)
    return {"grads": grads, "metrics": metrics, "weights": weights, "path": str(path)}


def scenario_dropped(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer = make_ds()
    samples = samples_of(groups_of_rank(rank, world), 64)
    trainer.forward_backward(samples)
    return {"n_local": len(samples), "grads": trainer.full_gradients(),
            "metrics": trainer.optimizer_step()}


def scenario_resume(rank: int, world: int, out: Path) -> dict[str, Any]:
    trainer = make_ds()
    trainer.step(shard(batch(1), rank, world))
    trainer.save(out / "ckpt", {"note": "after step 1"})
    rand_after_save = torch.rand(3)
    trainer.step(shard(batch(2), rank, world))
    uninterrupted = trainer.export_weights()
    resumed = make_ds(seed=99)  # another init: everything must come from the checkpoint
    extra = resumed.load(out / "ckpt")
    rand_after_load = torch.rand(3)
    step_after_load = resumed.step_count
    metrics = resumed.step(shard(batch(2), rank, world))
    return {"uninterrupted": uninterrupted, "resumed": resumed.export_weights(),
            "extra": extra, "rand": (rand_after_save, rand_after_load),
            "step_after_load": step_after_load, "lr": metrics["lr"],
            "tmp_left": (out / ".ckpt.tmp").exists()}


def scenario_head(rank: int, world: int, out: Path) -> dict[str, Any]:
    seen: list[tuple[Any, ...]] = []
    results = {}
    for precision in ("fp32", "bf16"):
        trainer = make_ds(precision=precision)
        head = trainer.model.get_output_embeddings()
        hook = head.register_forward_hook(lambda m, args, output, p=precision: seen.append(
            (p, output.dtype, m.weight.dtype, m.weight.numel())))
        trainer.step(shard(batch(1), rank, world))
        hook.remove()
        results[precision] = {"numel_outside": head.weight.numel(),
                              "full_numel": head.weight.ds_numel}
    return {"seen": seen, **results}


def scenario_stages(rank: int, world: int, out: Path) -> dict[str, Any]:
    weights = {}
    for stage in (1, 2):
        trainer = make_ds(zero_stage=stage)
        trainer.step(shard(batch(1), rank, world))
        weights[stage] = trainer.export_weights()
    return weights


SCENARIOS = {"step": scenario_step, "dropped": scenario_dropped, "resume": scenario_resume,
             "head": scenario_head, "stages": scenario_stages}


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    results = {}
    for name, scenario in SCENARIOS.items():
        results[name] = scenario(rank, world, Path(out) / name)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    import torch.distributed as dist

    if dist.is_initialized():  # (gloo's threads left at exit: "terminate called", SIGABRT)
        dist.barrier()
        dist.destroy_process_group()


def run_ranks(world: int, out: Path, timeout: float = 400) -> list[dict[str, Any]]:
    """Every scenario on ``world`` spawned ranks; their results, by rank."""
    import torch.multiprocessing as mp

    from tmax.train.backends.deepspeed import free_port

    for name in SCENARIOS:
        (out / name).mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), str(out)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} deepspeed ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


_RUNS: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    def get(world: int) -> list[dict[str, Any]]:
        if world not in _RUNS:
            _RUNS[world] = run_ranks(world, tmp_path_factory.mktemp(f"ds-{world}"))
        return _RUNS[world]
    return get


def torch_reference(samples: list[Sample]) -> tuple[dict, dict, dict]:
    trainer = Trainer(tiny(), **trainer_kwargs())
    trainer.forward_backward(samples)
    grads = trainer.full_gradients()
    metrics = trainer.optimizer_step()
    return grads, metrics, {k: v.clone() for k, v in trainer.export_weights().items()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> None:
    assert set(a) == set(b)
    for key in a:
        diff = (a[key].float() - b[key].float()).abs().max().item()
        assert diff <= tol, f"{key}: max |diff| {diff:.3g} > {tol}"


WORLDS = [pytest.param(1, id="1-rank"), pytest.param(2, id="2-ranks")]


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_same_batch_same_loss_and_gradients_as_torch(ds_runs, world):
    grads, metrics, _ = torch_reference(batch(1))
    runs = ds_runs(world)
    for run in runs:  # every rank reports the step's global metrics
        m = run["step"]["metrics"]
        assert m["loss"] == pytest.approx(metrics["loss"], abs=TOL)
        assert m["response_tokens"] == metrics["response_tokens"]
        assert (m["tokens"], m["sequences"]) == (metrics["tokens"], metrics["sequences"])
        assert m["grad_norm"] == pytest.approx(metrics["grad_norm"], abs=TOL)
        for key in ("kept_fraction", "ratio_mean", "entropy", "logprob_abs_gap"):
            assert m[key] == pytest.approx(metrics[key], abs=TOL), key
        assert_close(run["step"]["grads"], grads, TOL)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_weights_after_one_step_agree_with_torch(ds_runs, world):
    _, _, weights = torch_reference(batch(1))
    runs = ds_runs(world)
    assert_close(runs[0]["step"]["weights"], weights, 1e-5)
    assert all(run["step"]["weights"] == {} for run in runs[1:])  # rank 0 only


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_zero_stages_1_and_2_make_the_same_update(ds_runs, world):
    _, _, weights = torch_reference(batch(1))
    for stage, exported in ds_runs(world)[0]["stages"].items():
        assert set(exported) == set(weights), stage
        assert_close(exported, weights, 1e-5)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_dropped_rollout_is_in_no_ranks_denominator(ds_runs, world):
    grads, metrics, _ = torch_reference(valid_samples())
    runs = ds_runs(world)
    if world == 2:
        assert [run["dropped"]["n_local"] for run in runs] == [2, 0]  # rank 1: only the drop
    for run in runs:
        m = run["dropped"]["metrics"]
        assert m["response_tokens"] == metrics["response_tokens"]
        assert m["loss"] == pytest.approx(metrics["loss"], abs=TOL)
        assert_close(run["dropped"]["grads"], grads, TOL)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_save_load_step_equals_the_uninterrupted_run(ds_runs, world):
    runs = ds_runs(world)
    r = runs[0]["resume"]
    assert r["extra"] == {"note": "after step 1"} and r["step_after_load"] == 1
    assert torch.equal(*r["rand"])  # the RNG state came back
    assert not r["tmp_left"]
    assert_close(r["resumed"], r["uninterrupted"], 0.0)
    reference = Trainer(tiny(), **trainer_kwargs())
    reference.step(batch(1))
    m = reference.step(batch(2))
    assert r["lr"] == m["lr"]
    assert_close(r["uninterrupted"], reference.export_weights(), 1e-5)


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_fp32_head_runs_inside_the_partitioned_head(ds_runs, world):
    for run in ds_runs(world):
        h = run["head"]
        full = VOCAB * 16
        for precision, weight_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            calls = [s for s in h["seen"] if s[0] == precision]
            assert len(calls) == {1: 3, 2: 2}[world]  # one per micro-batch (filler too)
            # inside its forward the head's weight is gathered whole, in the model dtype,
            # and the logits come out in float32; outside it is a partition
            assert all(c[1:] == (torch.float32, weight_dtype, full) for c in calls), calls
            assert h[precision]["full_numel"] == full
            assert h[precision]["numel_outside"] == 0


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_deepspeed_export_to_path_is_the_exported_weights(ds_runs, world):
    from transformers import AutoModelForCausalLM

    runs = ds_runs(world)
    path = Path(runs[0]["step"]["path"])
    assert path.name == "v00000001"
    assert json.loads((path / WEIGHTS_MARKER).read_text()) == {"version": 1}
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert_close({k: loaded[k] for k in runs[0]["step"]["weights"]},
                 runs[0]["step"]["weights"], 0.0)


# ---- the training loop on the deepspeed backend

@needs_deepspeed
@pytest.mark.slow
def test_a_run_trains_and_resumes_on_the_deepspeed_backend(example_fleet, example_store,
                                                            tmp_path):
    """The loop with trainer.backend=deepspeed (ZeRO-3, one rank, in a child process):
    two steps against real sandboxes, the engine synced from export_weights, DeepSpeed
    checkpoints; then a third step resumed from the last checkpoint."""
    from tests.conftest import EXAMPLES
    from tmax.models.tiny import load_pretrained_dir
    from tmax.train.loop import read_metrics

    run = tmp_path / "run"
    overrides = [f"out_dir={run}", f"fleet.state_dir={example_fleet.state}",
                 f"tasks.image_store={example_store.root}", "fleet.concurrency=4",
                 f"tasks.paths=[{EXAMPLES}]", "checkpoint_every=1", "rollout.group_size=4",
                 "rollout.groups_per_step=1", "trainer.backend=deepspeed",
                 "trainer.param_persistence_threshold=0"]
    code = ("import sys; from tmax.train.config import load_train_config; "
            "from tmax.train.loop import train; "
            "train(load_train_config(sys.argv[1], sys.argv[2:]), progress=False)")

    def train(steps: int) -> None:
        result = subprocess.run(
            [sys.executable, "-c", code, str(REPO / "configs" / "tiny-cpu.yaml"),
             *overrides, f"steps={steps}"], cwd=REPO, capture_output=True, text=True,
            timeout=900, check=False, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert result.returncode == 0, result.stderr[-4000:]

    train(2)
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    ckpt = run / "checkpoints" / "step-2"
    assert (ckpt / "ds").is_dir() and (ckpt / "rng-rank0.pt").is_file()
    init, _ = load_pretrained_dir(run / "init")
    final, _ = load_pretrained_dir(run / "final")
    moved = [k for k, v in final.state_dict().items()
             if not torch.equal(v, init.state_dict()[k])]
    assert moved, "the final weights are the initial ones"
    train(3)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # warmup over 3 steps: a schedule started afresh would be back at 2/3 of the rate
    assert rows[0]["lr"] == pytest.approx(5e-4 * 2 / 3)
    assert rows[-1]["lr"] == pytest.approx(5e-4)
