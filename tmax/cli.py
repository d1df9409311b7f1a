"""`tmax`: the command line of the recipe (tasks, images, eval, data...)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import click

from tmax.images.cli import images_group
from tmax.tasks.cli import tasks_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="tmax")
def main(verbose: int) -> None:
    """TMax: train terminal agents with RL on Slurm."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


main.add_command(tasks_group)
main.add_command(images_group)


@main.command("demo")
@click.option("--tasks", "tasks_dir", type=click.Path(exists=True, file_okay=False),
              default=str(Path(__file__).resolve().parents[1] / "examples" / "tasks"),
              show_default=True, help="Folder of native tasks.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Run folder (default runs/demo-<time>).")
@click.option("--slurm-dir", type=click.Path(file_okay=False),
              default=lambda: os.environ.get("TMAX_LOCAL_SLURM_DIR",
                                             str(Path.home() / ".tmax" / "local-slurm")),
              help="State folder of the local Slurm cluster (used when SLURM_CONF is unset).")
@click.option("--nodes", default=2, show_default=True, help="Virtual nodes to start.")
@click.option("--cpus", default=1, show_default=True, help="CPUs per virtual node.")
@click.option("--no-slurm", is_flag=True, help="Run the checks in this process instead.")
def demo_cmd(tasks_dir, out_dir, slurm_dir, nodes, cpus, no_slurm) -> None:
    """The main job on its embedded defaults (see tmax.demo)."""
    from tmax.demo import run_demo
    from tmax.tasks.check import CheckResult
    from tmax.tasks.cli import summarize_checks

    out = Path(out_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    summary = run_demo(Path(tasks_dir), out, Path(slurm_dir), nodes, cpus, not no_slurm)
    results = [CheckResult(**{k: v for k, v in r.items() if k != "node"})
               for r in summary["results"]]
    verdicts = summarize_checks(results)
    width = max(len(t) for t in verdicts)
    click.echo(f"{'TASK':{width}}  ORACLE  NOP   VERDICT")
    for task, v in verdicts.items():
        click.echo(f"{task:{width}}  {v['oracle'] if v['oracle'] is not None else '-':<6}  "
                   f"{v['nop'] if v['nop'] is not None else '-':<4}  {v['verdict']}")
    ok = sum(v["verdict"] == "ok" for v in verdicts.values())
    where = f"Slurm nodes {', '.join(summary['nodes'])}" if summary["nodes"] else "this process"
    click.echo(f"{ok}/{len(verdicts)} tasks ok; {summary['jobs']} sandboxed runs on {where} "
               f"in {summary['seconds']}s; results in {out / 'results.json'}")
    sys.exit(0 if ok == len(verdicts) else 1)
