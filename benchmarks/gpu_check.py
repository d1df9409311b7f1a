"""The GPU training path end to end on one GPU, with no network and no vLLM: a small
random-initialised model built here (no hub), served by ``tmax serve`` (hf-server) on the
GPU, three DPPO steps on the DeepSpeed backend (ZeRO-3, bf16, NCCL, the model built under
``zero.Init``, the chunked FP32 LM head, activation checkpointing), a weight sync after
each step, and the trainer-vs-engine log-prob gap before and after each sync.

    benchmarks/gpu_check.sh              # on a GPU machine (see there for the wheels)
    python benchmarks/gpu_check.py --cpu # here: the same on CPU (gloo, fp32)

Rollouts are synthetic (no sandboxes): a completion's reward is the share of its token ids
divisible by 10 (an arbitrary rule a policy can learn), centred per prompt. What is
measured is what the GPU path must get right: token ids and log-probs from the engine,
the trainer's log-probs of the same tokens through its chunked head (the gap), the DPPO
step, the weights the engine loads and the version it reports afterwards, and the NCCL
sender's ZeRO-3 gather (``tmax.train.weight_sync.checkpoint_tensors``: every tensor it
would broadcast equals the exported weights). vLLM's NCCL broadcast itself needs vLLM on
both ends and is checked against vLLM's classes in tests/integration/test_nccl_sync.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS = [f"Write the numbers from {i} to {i + 9}, separated by spaces." for i in range(8)]


def build_model(work: Path, layers: int, width: int, dtype: torch.dtype) -> Path:
    from tmax.models.tiny import (
        build_tiny_model,
        build_tokenizer,
        corpus_texts,
        save_pretrained_dir,
    )
    from tmax.tasks import find_tasks

    texts = corpus_texts(find_tasks(REPO / "examples" / "tasks")) + PROMPTS
    tokenizer = build_tokenizer(texts, 2048)
    model = build_tiny_model(tokenizer, n_layers=layers, d_model=width,
                             n_heads=max(1, width // 64), max_positions=2048, seed=0)
    return save_pretrained_dir(model.to(dtype), tokenizer, work / "model")


def server_argv(args, model_dir: Path, port: int) -> list[str]:
    from tmax.inference.process import hf_server_command

    argv = hf_server_command(model_dir, port=port, max_batch=64, max_tokens=args.tokens,
                             temperature=1.0, served_model_name="check", seed=0)
    return argv if args.cpu else [*argv, "--device", "cuda"]


def trainer_config(args):
    from tmax.train.config import load_train_config

    gpu = not args.cpu
    return load_train_config(None, [
        "trainer.backend=deepspeed", "trainer.zero_stage=3",
        f"trainer.device={'cuda' if gpu else 'cpu'}",
        f"trainer.precision={'bf16' if gpu else 'fp32'}",
        f"trainer.dist_backend={'nccl' if gpu else 'gloo'}",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        "trainer.activation_checkpointing=true", f"trainer.head_chunk={args.head_chunk}",
        "trainer.param_persistence_threshold=0", "optim.lr=1e-4",
        "optim.micro_batch_size=8", "rollout.temperature=1.0", "model.fp32_lm_head=true"])


def trainer_logprobs(backend, samples) -> list[list[float]]:
    """The trainer's log-probs of each sample's completion tokens (mask 1), through the
    trainer's own scoring head (chunked, float32)."""
    from tmax.train.head import score_tokens

    out = []
    model = backend.model
    model.eval()
    device = backend.device
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens], device=device)
            logp, _ = score_tokens(model, ids, torch.ones_like(ids), temperature=1.0)
            out.append([float(x) for x, m in zip(logp[0].tolist(), s.mask[1:]) if m])
    return out


def gap(backend, samples) -> float:
    """Mean |trainer log-prob - engine log-prob| over every completion token."""
    ours = trainer_logprobs(backend, samples)
    diffs = [abs(a - b) for s, mine in zip(samples, ours)
             for a, b in zip(mine, [x for x, m in zip(s.old_logp[1:], s.mask[1:]) if m])]
    return sum(diffs) / max(1, len(diffs))


def sender_matches_export(backend) -> bool:
    """The NCCL sender's gather (ZeRO-3, a layer at a time, every rank) yields exactly
    the exported weights under the same names."""
    from tmax.train.weight_sync import checkpoint_layout, checkpoint_tensors

    ds = backend._ds
    sent = dict(checkpoint_tensors(backend.model, rank=backend.rank, gathered=lambda ps: (
        ds.zero.GatheredParameters(ps, modifier_rank=None))))
    exported = backend.export_weights()
    layout = {n: (d, s) for n, d, s in checkpoint_layout(backend.model)}
    return backend.rank != 0 or (
        set(sent) == set(layout) and set(sent) <= set(exported)
        and all(torch.equal(t.cpu(), exported[n].cpu()) for n, t in sent.items()))


def gpu_processes() -> list[str]:
    """nvidia-smi's ``pid, used memory`` of each process on the GPU (none without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


async def sample(engine, group: int) -> tuple[list, float, int]:
    from tmax.train.trainer import Sample

    t0 = time.monotonic()
    chats = [[{"role": "user", "content": p}] for p in PROMPTS for _ in range(group)]
    done = await asyncio.gather(*(engine.complete(c) for c in chats))
    seconds = time.monotonic() - t0
    samples, tokens = [], 0
    for i in range(0, len(done), group):
        rewards = []
        for c in done[i:i + group]:
            ids = c.completion_ids
            rewards.append(sum(1 for t in ids if t % 10 == 0) / max(1, len(ids)))
        mean = sum(rewards) / len(rewards)
        for c, r in zip(done[i:i + group], rewards):
            n = len(c.prompt_ids)
            samples.append(Sample(c.prompt_ids + c.completion_ids, [0.0] * n + c.logprobs,
                                  [0] * n + [1] * len(c.completion_ids), r - mean))
            tokens += len(c.completion_ids)
    return samples, tokens / seconds, tokens


async def run(args) -> dict:
    from tmax.inference.http import HttpEngine
    from tmax.inference.process import ServerProcess, free_port
    from tmax.train.backends.choose import make_trainer
    from tmax.train.model_load import load_trainer_model

    work = Path(args.work or tempfile.mkdtemp(prefix="tmax-gpu-check-"))
    t_start = time.monotonic()
    config = trainer_config(args)
    model_dir = build_model(work, args.layers, args.width, getattr(torch, config.model.dtype))
    port = free_port()
    server = ServerProcess(server_argv(args, model_dir, port), url=f"http://127.0.0.1:{port}",
                           log_path=work / "server.log", name="hf-server", start_timeout_s=600)
    model, tokenizer = load_trainer_model(config, model_dir)  # under zero.Init
    backend = make_trainer(config, model, pad_id=tokenizer.pad_token_id or 0, max_len=2048)
    report: dict = {"engine": "hf-server", "device": str(backend.device),
                    "precision": "bf16" if config.model.dtype == "bfloat16" else "fp32",
                    "dist_backend": torch.distributed.get_backend(), "work": str(work),
                    "steps": []}
    async with server:
        engine = HttpEngine(server.url, "check", temperature=1.0, max_tokens=args.tokens,
                            max_retries=1)
        await engine.refresh_version()
        report["startup_seconds"] = time.monotonic() - t_start
        for _ in range(args.steps):
            samples, tok_s, tokens = await sample(engine, args.group)
            before = gap(backend, samples)
            t0 = time.monotonic()
            metrics = backend.step(samples)
            train_s = time.monotonic() - t0
            shift = gap(backend, samples)  # what a sync that never reached the engine leaves
            t0 = time.monotonic()
            folder = backend.export_to_path(work / "weights", backend.step_count)
            await engine.update_weights_from_path(folder, backend.step_count)
            sync_s = time.monotonic() - t0
            again, _, _ = await sample(engine, 1)
            after = gap(backend, again)
            row = {"step": backend.step_count, "engine_version": engine.version,
                   "gap_before_step": before, "gap_after_sync": after,
                   "gap_without_sync": shift,
                   "generation_tokens_per_s": tok_s, "completion_tokens": tokens,
                   "train_seconds": train_s,
                   "trainer_tokens_per_s": metrics.get("tokens", 0) / max(train_s, 1e-9),
                   "sync_seconds": sync_s, "loss": metrics.get("loss")}
            report["steps"].append(row)
            print(json.dumps(row), flush=True)
        report["gpu_processes"] = gpu_processes()  # the trainer and the server, both up
        await engine.aclose()
    report["nccl_sender_gather_matches_export"] = sender_matches_export(backend)
    if torch.cuda.is_available() and backend.device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(backend.device)
        report["trainer_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report["trainer_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    import deepspeed
    import transformers
    report["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__,
                          "cuda": torch.version.cuda, "deepspeed": deepspeed.__version__,
                          "transformers": transformers.__version__}
    report["total_seconds"] = time.monotonic() - t_start
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="hf-server and DeepSpeed on CPU")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--tokens", type=int, default=48, help="max tokens per completion")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--head-chunk", type=int, default=64,
                   help="positions per chunk of the LM head (small: several chunks)")
    p.add_argument("--work", help="folder for the model, weights and logs (default: a temp)")
    p.add_argument("--out", help="write the report as JSON here")
    p.add_argument("--max-gap", type=float, default=None, help="worst mean |trainer - "
                   "engine| log-prob gap after a sync that passes (default 1e-3 on CPU, "
                   "0.05 with bf16 on a GPU)")
    args = p.parse_args()
    if args.max_gap is None:
        args.max_gap = 1e-3 if args.cpu else 0.05
    if args.cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    elif not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no GPU (run with --cpu for the CPU variant)")
    from sandfleet import run_event_loop

    report = run_event_loop(run(args))
    print(json.dumps({k: v for k, v in report.items() if k != "steps"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    worst = max(r["gap_after_sync"] for r in report["steps"])
    versions = [r["engine_version"] for r in report["steps"]]
    ok = versions == list(range(1, args.steps + 1)) and worst < args.max_gap \
        and report["nccl_sender_gather_matches_export"]
    last = report["steps"][-1]
    print(f"{'OK' if ok else 'FAILED'}: engine versions {versions}, worst log-prob gap after "
          f"sync {worst:.2e} (limit {args.max_gap:g}), generation "
          f"{last['generation_tokens_per_s']:.0f} tokens/s, trainer "
          f"{last['trainer_tokens_per_s']:.0f} tokens/s, sender gather "
          f"{'ok' if report['nccl_sender_gather_matches_export'] else 'WRONG'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
