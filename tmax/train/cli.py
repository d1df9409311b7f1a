"""`tmax-train`: the trainer's command line."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import asdict
from pathlib import Path

import click

from tmax.train.gc import default_roots, format_report
from tmax.train.gc import gc as collect


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


def env_report(output: str) -> None:
    """What the trainer would run on here: torch build, GPUs, vLLM and DeepSpeed."""
    report = accelerator_report()
    if output == "json":
        click.echo(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        click.echo(f"{key:15} {value if value not in (None, []) else '-'}")


@click.command(context_settings={"help_option_names": ["-h", "--help"],
                                 "ignore_unknown_options": True})
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              default=None, help="Training config (YAML), e.g. configs/tiny-cpu.yaml, or a "
              "shipped config's name (tiny-cpu, qwen3.5-9b); default: the embedded tiny CPU "
              "defaults.")
@click.option("--dry-run", is_flag=True, help="Print the resolved config (and with "
              "distributed.enabled each server's and the trainer's command line and the "
              "DeepSpeed config) and exit.")
@click.option("--launcher", type=click.Choice(["local", "slurm"]), default="local",
              show_default=True, help="With distributed.enabled: where the inference "
              "servers and the trainer run (local processes, or Slurm jobs from the "
              "slurm/ templates; the orchestrator runs here either way).")
@click.option("--detach", is_flag=True, help="With --launcher slurm: submit the launcher "
              "itself as a CPU job (slurm.orchestrator) and return; follow it with "
              "`tmax-train status RUN_DIR`, end it with `tmax-train stop RUN_DIR`.")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              help="For `tmax-train env`.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.argument("overrides", nargs=-1)
def main(config_path: str | None, dry_run: bool, launcher: str, detach: bool, output: str,
         quiet: bool, overrides: tuple[str, ...]) -> None:
    """Train a terminal agent with DPPO: tmax-train --config FILE [--launcher slurm]
    [key=value ...]

    Overrides use dotted keys (rollout.group_size=4 optim.lr=1e-5). The resolved config is
    saved as RUN_DIR/config.yaml; a run dir with checkpoints resumes from the latest (the
    same command again). `tmax-train env` reports the torch build, GPUs, vLLM and
    DeepSpeed; `tmax-train status RUN_DIR` each job's state, the step, reward and the
    engines' weights version; `tmax-train stop RUN_DIR` cancels the run's jobs by id and
    stops its processes.
    """
    import asyncio
    import logging

    from tmax import log

    if overrides[:1] == ("env",):
        env_report(output)
        return
    if overrides[:1] in (("status",), ("stop",)):
        if len(overrides) != 2:
            raise click.UsageError(f"usage: tmax-train {overrides[0]} RUN_DIR")
        from tmax.train.slurm import run_status, stop_run

        if overrides[0] == "status":
            report = run_status(overrides[1])
            click.echo(json.dumps(report, indent=1) if output == "json"
                       else format_status(report))
        else:
            for line in stop_run(overrides[1]):
                click.echo(line)
        return
    from tmax.train.config import TrainConfigError, load_train_config

    try:
        config = load_train_config(config_path, list(overrides))
    except TrainConfigError as e:
        raise click.ClickException(str(e)) from None
    if launcher == "slurm" and not config.distributed.enabled:
        raise click.ClickException("--launcher slurm runs the inference servers and the "
                                   "trainer as separate jobs: it needs distributed.enabled"
                                   "=true (in the config, or as an override)")
    if detach and launcher != "slurm":
        raise click.UsageError("--detach submits the launcher as a Slurm job: it needs "
                               "--launcher slurm")
    if dry_run and launcher == "slurm":
        from tmax.train.slurm import slurm_plan

        for name, script in slurm_plan(config, detach=detach).items():
            click.echo(f"# ===== {config.run_dir / 'slurm' / name}")
            click.echo(script, nl=not script.endswith("\n"))
        return
    if dry_run:
        import yaml

        from tmax.train.processes import launch_plan

        click.echo(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        if config.distributed.enabled:
            click.echo("# --- the launch (distributed.enabled): every command as it runs\n"
                       + yaml.safe_dump({"launch": launch_plan(config)}, sort_keys=False,
                                        width=1000))
        return
    log.setup(default=logging.INFO)
    if detach:
        from tmax.train.slurm import SlurmError
        from tmax.train.slurm import detach as submit_orchestrator

        try:
            job_id = submit_orchestrator(config)
        except SlurmError as e:
            raise click.ClickException(str(e)) from None
        run = config.run_dir.absolute()
        click.echo(f"orchestrator: job {job_id} (log {run}/logs/slurm-orchestrator-"
                   f"{job_id}.out)\n  tmax-train status {run}\n  tmax-train stop {run}")
        return
    from tmax.inference.base import EngineError
    from tmax.train.handover import HandoverError
    from tmax.train.loop import TrainError, read_metrics, train
    from tmax.train.processes import TrainProcessError, run_processes
    from tmax.train.rollouts import InternalErrors, NoUsableGroups, RolloutsFailing
    from tmax.train.slurm import SlurmError

    try:
        if config.distributed.enabled:
            run_dir = run_processes(config, progress=not quiet, launcher=launcher)
        else:
            run_dir = train(config, progress=not quiet)
    except (TrainError, RolloutsFailing, NoUsableGroups, InternalErrors, TrainProcessError,
            HandoverError, EngineError, SlurmError) as e:
        raise click.ClickException(str(e)) from None
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise click.ClickException(f"stopped; the run's jobs and processes are stopped too. "
                                   f"Resume: the same command on {config.run_dir}") from None
    rows = read_metrics(run_dir)
    curve = " ".join(f"{r['reward_mean']:.2f}" for r in rows)
    click.echo(f"reward per step: {curve}")
    click.echo(f"run folder {run_dir}: metrics.jsonl, rollouts.jsonl, reward.png, checkpoints/")


def format_status(report: dict) -> str:
    """``tmax-train status`` as text."""
    lines = [f"run {report['run_dir']}: step {report['step']}/{report['steps']}"
             + (f", reward {report['reward']:.2f}" if report.get("reward") is not None else "")
             + (f", weights v{report['weights']}" if report.get("weights") is not None
                else "") + (" (done)" if report.get("done") else "")]
    for job in report["jobs"]:
        lines.append(f"  {job['name']:14} job {job['job_id']:>8}  {job['state']:12} "
                     f"{job['log']}")
    for engine in report.get("engines", []):
        lines.append(f"  engine {engine['name']:14} v{engine['version']:<6} "
                     f"{'serving' if engine['live'] else 'lost':8} {engine['served']} turns")
    for name, proc in report["processes"].items():
        lines.append(f"  {name:14} pid {proc['pid']:>8}  "
                     f"{'alive' if proc['alive'] else 'gone'}")
    fleet = report.get("fleet")
    if fleet:
        kind = "private" if fleet["private"] else "joined"
        if not fleet["up"]:
            lines.append(f"  fleet ({kind})   down  {fleet['state_dir']}")
        else:
            leases = fleet.get("leases", {})
            lines.append(f"  fleet ({kind})   {fleet.get('nodes', 0)} nodes, "
                         f"{leases.get('held', 0)} leases held, {leases.get('queued', 0)} "
                         f"queued, worker jobs {' '.join(fleet.get('jobs', [])) or '-'}  "
                         f"{fleet['state_dir']}")
    return "\n".join(lines)


if __name__ == "__main__":  # the orchestrator job (tmax-train --detach) runs this module
    main()


@click.command("gc")
@click.argument("roots", nargs=-1, type=click.Path(file_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="Say what would be done; change nothing.")
@click.option("--grace", "grace_s", default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL of a leftover process group.")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def gc_cmd(roots: tuple[Path, ...], dry_run: bool, grace_s: float, output: str) -> None:
    """Collect runs whose launcher is gone, under RUNS_ROOT... (default: the runs root of
    the train config, ./runs): scancel their still-queued jobs by id, end their leftover
    local processes (recorded pid and start time only), stop their private fleet, and mark
    them (RUN/gc.json). Only this user's runs, jobs and processes. Safe from cron."""
    chosen = list(roots) or default_roots()
    notes = [f"{r}: no such folder" for r in chosen if not r.is_dir()]
    reports = collect([r for r in chosen if r.is_dir()], dry_run=dry_run, grace_s=grace_s)
    if output == "json":
        click.echo(json.dumps({"dry_run": dry_run, "roots": [str(r) for r in chosen],
                               "notes": notes, "runs": [asdict(r) for r in reports]},
                              indent=1))
    else:
        for line in notes:
            click.echo(line)
        for report in reports:
            click.echo(format_report(report, dry_run))
        if not reports:
            click.echo(f"no run folders under {', '.join(map(str, chosen))}")
    if any(r.verdict == "incomplete" for r in reports):
        raise SystemExit(1)
