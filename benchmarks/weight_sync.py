"""Filesystem weight sync time against model size: the trainer writes a versioned
safetensors folder (``write_weights_folder``), an hf-server loads it through the same
request vLLM takes (``HttpEngine.update_weights_from_path``). One run, sizes interleaved.

    python benchmarks/weight_sync.py [--widths 128,256,512,768] [--layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def measure(model, engine, root: Path, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds to write each version's folder, and for the server to load it."""
    from tmax.train.backends import write_weights_folder

    export, load = [], []
    for version in range(1, repeats + 1):
        t0 = time.monotonic()
        folder = write_weights_folder(model, None, root, version)
        export.append(time.monotonic() - t0)
        t0 = time.monotonic()
        await engine.update_weights_from_path(folder, version)
        load.append(time.monotonic() - t0)
    await engine.aclose()
    return export, load


def main() -> None:
    from tmax.agent.policies.hf import HFPolicy
    from tmax.inference.hf_server import HFServer
    from tmax.inference.http import HttpEngine
    from tmax.models.tiny import (
        build_tiny_model,
        build_tokenizer,
        corpus_texts,
        save_pretrained_dir,
    )
    from tmax.tasks import find_tasks
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="128,256,512,768")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(corpus_texts(find_tasks(REPO / "examples" / "tasks")))
    work = Path(tempfile.mkdtemp(prefix="tmax-weight-sync-"))
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        model = build_tiny_model(tokenizer, n_layers=args.layers, d_model=width,
                                 n_heads=max(1, width // 64), seed=0)
        mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        model_dir = save_pretrained_dir(model, tokenizer, work / f"m{width}")
        server = HFServer(HFPolicy.from_pretrained(model_dir, max_new_tokens=4),
                          model_name="m").start()
        engine = HttpEngine(server.url, "m")
        export, load = asyncio.run(measure(model, engine, work / f"w{width}", args.repeats))
        server.stop()
        rows.append((width, mb, statistics.median(export), statistics.median(load)))
    print(f"{'width':>6} {'MB':>8} {'export s':>9} {'load s':>8} {'total MB/s':>10}")
    for width, mb, e, l in rows:
        print(f"{width:6d} {mb:8.1f} {e:9.3f} {l:8.3f} {mb / (e + l):10.1f}")
    base = rows[0]
    print("time ratio to the smallest:", ", ".join(
        f"{r[1] / base[1]:.0f}x size -> {(r[2] + r[3]) / (base[2] + base[3]):.1f}x time"
        for r in rows[1:]))


if __name__ == "__main__":
    main()
