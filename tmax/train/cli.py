"""`tmax-train`: the trainer's command line."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import click


def accelerator_report() -> dict:
    """Torch build and devices, and whether the GPU extras are installed (not imported)."""
    import torch  # heavy: imported only when asked

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cuda_build": torch.version.cuda,
        "threads": torch.get_num_threads(),
        "transformers": version("transformers"),
        "vllm": version("vllm") if importlib.util.find_spec("vllm") else None,
        "deepspeed": version("deepspeed") if importlib.util.find_spec("deepspeed") else None,
    }


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """TMax trainer: DPPO with infrastructure-failure masking."""


@main.command("env")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def env_cmd(output: str) -> None:
    """What the trainer would run on here: torch build, GPUs, vLLM and DeepSpeed."""
    report = accelerator_report()
    if output == "json":
        click.echo(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        click.echo(f"{key:15} {value if value not in (None, []) else '-'}")
