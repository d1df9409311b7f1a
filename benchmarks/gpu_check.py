"""The GPU path end to end, on one machine with no internet: a small random-initialised model
built here (no hub), served by vLLM with the FP32 LM head (or hf-server with --cpu), three
DPPO steps on the DeepSpeed backend, a filesystem weight sync after each, and the
trainer-vs-engine log-prob gap before and after each sync.

    benchmarks/gpu_check.sh              # on a GPU node: vLLM + DeepSpeed (bf16, ZeRO-3)
    python benchmarks/gpu_check.py --cpu # here: hf-server + DeepSpeed on CPU (gloo, fp32)

Rollouts are synthetic (no sandboxes): a completion's reward is the share of its token ids
divisible by 10 (an arbitrary rule a policy can learn), centred per prompt. What
is measured is what the GPU path must get right: token ids and log-probs from the engine,
the trainer's log-probs of the same tokens (the gap), the DPPO step, the versioned weights
folder the engine loads, and the version it reports afterwards.
The NCCL weight transfer is not exercised here (its request payloads are checked in
tests/test_inference.py; the trainer-side broadcast is not written yet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS = [f"Write the numbers from {i} to {i + 9}, separated by spaces." for i in range(8)]


def build_model(work: Path, layers: int, width: int) -> Path:
    from tmax.models.tiny import (
        build_tiny_model,
        build_tokenizer,
        corpus_texts,
        save_pretrained_dir,
    )
    from tmax.tasks import find_tasks

    texts = corpus_texts(find_tasks(REPO / "examples" / "tasks")) + PROMPTS
    tokenizer = build_tokenizer(texts, 2048)
    model = build_tiny_model(tokenizer, n_layers=layers, d_model=width, n_heads=max(1, width // 64),
                             max_positions=2048, seed=0)
    return save_pretrained_dir(model, tokenizer, work / "model")


def server_argv(args, model_dir: Path, port: int) -> tuple[list[str], dict[str, str]]:
    if args.cpu:
        from tmax.inference.process import hf_server_command

        return hf_server_command(model_dir, port=port, max_batch=64, max_tokens=args.tokens,
                                 temperature=1.0, served_model_name="check", seed=0), {}
    from tmax.inference.vllm import VLLMConfig, vllm_env, vllm_serve_command

    config = VLLMConfig(model=str(model_dir), served_model_name="check", port=port,
                        host="127.0.0.1", dtype="bfloat16", fp32_head=True,
                        gpu_memory_utilization=0.3, max_model_len=2048, enforce_eager=True,
                        weight_transfer="folder")
    return vllm_serve_command(config), vllm_env(config)


def trainer_logprobs(backend, samples) -> list[list[float]]:
    """The trainer's log-probs of each sample's completion tokens (mask 1)."""
    from tmax.train.trainer import sequence_logprobs

    out = []
    model = backend.model
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.tokens], device=device)
            # the deepspeed backend's head module computes in float32 itself (ZeRO-3
            # gathers its weight there): no second upcast outside it
            logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=1.0,
                                        fp32_head=False)
            out.append([float(x) for x, m in zip(logp[0].tolist(), s.mask[1:]) if m])
    return out


def gap(backend, samples) -> float:
    """Mean |trainer log-prob - engine log-prob| over every completion token."""
    ours = trainer_logprobs(backend, samples)
    diffs = [abs(a - b) for s, mine in zip(samples, ours)
             for a, b in zip(mine, [x for x, m in zip(s.old_logp[1:], s.mask[1:]) if m])]
    return sum(diffs) / max(1, len(diffs))


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
    from tmax.models.tiny import load_pretrained_dir
    from tmax.train.backends import make_trainer
    from tmax.train.config import load_train_config

    work = Path(args.work or tempfile.mkdtemp(prefix="tmax-gpu-check-"))
    t_start = time.monotonic()
    model_dir = build_model(work, args.layers, args.width)
    port = free_port()
    argv, env = server_argv(args, model_dir, port)
    server = ServerProcess(argv, url=f"http://127.0.0.1:{port}", log_path=work / "server.log",
                           env=env, name="vllm" if not args.cpu else "hf-server",
                           start_timeout_s=600)
    report: dict = {"engine": server.name, "work": str(work), "steps": []}
    config = load_train_config(None, [
        "trainer.backend=deepspeed", "trainer.zero_stage=3", "optim.lr=1e-4",
        "optim.micro_batch_size=8", "rollout.temperature=1.0", "model.fp32_lm_head=true"])
    model, tokenizer = load_pretrained_dir(model_dir)
    if torch.cuda.is_available():
        model = model.cuda()
    backend = make_trainer(config, model, pad_id=tokenizer.pad_token_id or 0, max_len=2048)
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
        await engine.aclose()
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
    from sandfleet import run_event_loop

    report = run_event_loop(run(args))
    print(json.dumps({k: v for k, v in report.items() if k != "steps"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    worst = max(r["gap_after_sync"] for r in report["steps"])
    versions = [r["engine_version"] for r in report["steps"]]
    ok = versions == list(range(1, args.steps + 1)) and worst < args.max_gap
    print(f"{'OK' if ok else 'FAILED'}: engine versions {versions}, worst gap after sync "
          f"{worst:.2e} (limit {args.max_gap:g})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
