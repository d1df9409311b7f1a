"""`tmax`: the command line of the recipe (tasks, images, eval, data...)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import click

from tmax import log
from tmax.agent.cli import serve_scripted
from tmax.audit.cli import audit_cmd, repair_cmd
from tmax.data.cli import data_group, gen_cmd
from tmax.eval.cli import eval_cmd, report_cmd
from tmax.images.cli import images_group
from tmax.package_data import CONFIGS, example_tasks
from tmax.tasks.cli import tasks_group
from tmax.train.cli import gc_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="tmax")
def main(verbose: int) -> None:
    """TMax: train terminal agents with RL on Slurm."""
    log.setup(verbose)


main.add_command(tasks_group)
main.add_command(images_group)
main.add_command(serve_scripted)
main.add_command(eval_cmd)
main.add_command(report_cmd)
main.add_command(gen_cmd)
main.add_command(data_group)
main.add_command(audit_cmd)
main.add_command(repair_cmd)
main.add_command(gc_cmd)


@main.command("serve")
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, help="0 picks a free port.")
@click.option("--max-batch", default=16, show_default=True,
              help="Most requests generated together in one batch.")
@click.option("--max-tokens", default=256, show_default=True,
              help="Longest completion (a request's max_tokens may ask for fewer).")
@click.option("--temperature", default=1.0, show_default=True,
              help="Sampling temperature (0 = greedy); requests must match it.")
@click.option("--served-model-name", default=None, help="Model name (default MODEL_DIR).")
@click.option("--device", default=None, help="torch device (default cpu).")
@click.option("--seed", default=None, type=int, help="Sampling seed.")
def serve_cmd(model_dir, host, port, max_batch, max_tokens, temperature, served_model_name,
              device, seed) -> None:
    """Serve MODEL_DIR (a local transformers folder) over vLLM's HTTP subset: chat
    completions with token ids and logprobs, pause/resume, filesystem weight updates
    (see docs/inference.md). Prints the base URL once ready; serves until Ctrl-C."""
    from tmax.inference.hf_server import ModelDirError, run_server

    try:
        run_server(model_dir, host=host, port=port, max_batch=max_batch,
                   max_tokens=max_tokens, temperature=temperature,
                   served_model_name=served_model_name, device=device, seed=seed,
                   ready=lambda url: click.echo(url))
    except ModelDirError as e:
        raise click.ClickException(str(e)) from None


@main.command("demo")
@click.option("--tasks", "tasks_dir", type=click.Path(exists=True, file_okay=False),
              default=lambda: str(example_tasks()),
              show_default="the shipped example tasks", help="Folder of native tasks.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Run folder (default runs/demo-<time>).")
@click.option("--store", default=None, type=click.Path(file_okay=False),
              help="Image store (default $TMAX_IMAGE_STORE or ~/.tmax/images).")
@click.option("--slurm-dir", type=click.Path(file_okay=False),
              default=lambda: os.environ.get("TMAX_LOCAL_SLURM_DIR",
                                             str(Path.home() / ".tmax" / "local-slurm")),
              help="State folder of the local Slurm cluster (used when SLURM_CONF is unset).")
@click.option("--nodes", default=2, show_default=True, help="Virtual nodes to start.")
@click.option("--cpus", default=1, show_default=True, help="CPUs per virtual node and job.")
@click.option("--no-slurm", is_flag=True, help="Build in this process instead of Slurm jobs.")
@click.option("--force", is_flag=True, help="Rebuild the task images even if unchanged.")
@click.option("--train/--no-train", default=True, show_default=True,
              help="After the images: train the tiny model with DPPO against the tasks.")
@click.option("--train-config", type=click.Path(exists=True, dir_okay=False),
              default=str(CONFIGS / "tiny-cpu.yaml"),
              show_default=True, help="Training config for the tiny run.")
def demo_cmd(tasks_dir, out_dir, store, slurm_dir, nodes, cpus, no_slurm, force, train,
             train_config) -> None:
    """The main job on its embedded defaults: build and check every task image in Slurm
    jobs, then train the tiny CPU model with DPPO against them through a local fleet."""
    from tmax.demo import run_demo
    from tmax.images.store import default_cache, default_store

    out = Path(out_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    summary = run_demo(Path(tasks_dir), out, Path(store or default_store()),
                       Path(default_cache()), Path(slurm_dir), nodes=nodes, cpus=cpus,
                       use_slurm=not no_slurm, force=force)
    rows = summary["results"]
    width = max(len(r["task_id"]) for r in rows)
    click.echo(f"{'TASK':{width}}  IMAGE    NOP   ORACLE  NODE  SECONDS  CHECKS")
    for r in rows:
        c = r["checks"] or {}
        verdict = "ok" if c.get("ok") else (c.get("reason") or r["error"] or "-")
        click.echo(f"{r['task_id']:{width}}  {r['status']:7}  {_reward(c.get('nop_reward')):5} "
                   f"{_reward(c.get('oracle_reward')):7} {r['node'] or '-':5} {r['seconds']:7.1f}  "
                   f"{verdict}")
    ok = sum(bool(r["checks"] and r["checks"]["ok"]) for r in rows)
    where = f"Slurm nodes {', '.join(summary['nodes'])}" if summary["nodes"] else "this process"
    click.echo(f"{ok}/{len(rows)} task images built and checked on {where} in "
               f"{summary['seconds']}s; store {summary['store']}; results in "
               f"{out / 'results.json'}")
    if ok != len(rows):
        sys.exit(1)
    if train:
        from tmax.train.config import load_train_config
        from tmax.train.loop import read_metrics
        from tmax.train.loop import train as run_training

        config = load_train_config(train_config, [
            f"out_dir={out / 'train'}", f"tasks.image_store={store or default_store()}",
            f"tasks.paths=[{Path(tasks_dir).resolve()}]"])
        click.echo(f"training {config.name}: {config.steps} DPPO steps on "
                   f"{config.tasks.difficulty or 'all'} tasks (SFT warm start first)")
        from tmax.train.loop import TrainError
        from tmax.train.rollouts import NoUsableGroups, RolloutsFailing

        try:
            run_dir = run_training(config)
        except (TrainError, RolloutsFailing, NoUsableGroups) as e:
            raise click.ClickException(str(e)) from None
        curve = [r["reward_mean"] for r in read_metrics(run_dir)]
        click.echo("mean reward per step: " + " ".join(f"{r:.2f}" for r in curve))
        click.echo(f"training run in {run_dir} (metrics.jsonl, reward.png, checkpoints/)")


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
