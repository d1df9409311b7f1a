"""`tmax eval` (run a policy on tasks through a fleet) and `tmax report` (tables and plots).

Register with ``main.add_command(eval_cmd)`` and ``main.add_command(report_cmd)``.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from pathlib import Path

import click

from tmax.images.cli import base_map_option, store_option


def resolve_tasks(specs: tuple[str, ...]):
    """The tasks of each ``--tasks`` value (a task dir, a folder of tasks, or a glob), and
    the folders that do not load as tasks (``Skipped``, kind ``invalid_task``, id the
    folder's name)."""
    from tmax.eval.runner import Skipped
    from tmax.tasks.model import TaskError
    from tmax.tasks.native import find_tasks, load_task

    paths: dict[Path, None] = {}
    for spec in specs:
        matches = [spec] if Path(spec).exists() else sorted(glob.glob(spec, recursive=True))
        if not matches:
            raise click.ClickException(f"--tasks {spec}: no such folder, and no path matches "
                                       "it as a glob")
        found = find_tasks(*matches)
        if not found:
            raise click.ClickException(f"--tasks {spec}: no task folders there (a task "
                                       "folder holds instruction.md and task.toml)")
        paths.update((p.resolve(), None) for p in found)
    tasks, invalid = [], []
    for path in paths:
        try:
            tasks.append(load_task(path))
        except TaskError as e:
            invalid.append(Skipped(path.name, "invalid_task", str(e), str(path)))
    ids = [t.task_id for t in tasks]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise click.ClickException(f"several task folders share the ids {', '.join(dupes)}")
    return tasks, invalid


def _policy(spec: str, submit_marker: str):
    from tmax.agent.policies.choose import PolicySpecError, make_policy

    options = {"submit_marker": submit_marker} if spec in ("oracle", "nop") else {}
    try:
        return make_policy(spec, **options)
    except PolicySpecError as e:
        raise click.BadParameter(str(e), param_hint="--policy") from None
    except (OSError, ValueError) as e:  # a scripted policy's file, a model path
        raise click.BadParameter(f"{spec}: {e}", param_hint="--policy") from None


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


@click.command("eval")
@click.option("--tasks", "task_specs", multiple=True, required=True,
              help="A task folder, a folder of tasks, or a glob of them (repeatable).")
@click.option("--policy", "policy_spec", required=True,
              help="oracle | nop | scripted:FILE | openai:MODEL@URL | hf:PATH | vllm:PATH "
                   "(a vLLM server TMax starts for the model folder and stops at the end)")
@click.option("--trials", default=1, show_default=True, type=click.IntRange(min=1),
              help="Episodes per task.")
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(min=1),
              help="Episodes at once.")
@click.option("--fleet", "fleet_dir", default=None, type=click.Path(file_okay=False,
                                                                   path_type=Path),
              help="State dir of a running fleet (`sandfleet up`); default: start a private "
                   "local fleet for this run.")
@store_option
@click.option("--agent-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Agent config (YAML); default configs/agent.yaml.")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False,
                                                                path_type=Path),
              help="Run folder (default runs/eval-<time>); an existing one resumes.")
@click.option("--max-infra-retries", default=3, show_default=True,
              type=click.IntRange(min=0), help="Re-runs of an infra-failed episode.")
@click.option("--max-internal-errors", default=3, show_default=True,
              type=click.IntRange(min=1),
              help="Stop after this many episodes end in TMax's own error (a bug; never "
                   "re-run; the tracebacks are in OUT/results.jsonl).")
@click.option("--step-limit", type=click.IntRange(min=1), default=None,
              help="Override the agent config's step_limit.")
@click.option("--command-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Override the agent config's command_timeout_s (seconds).")
@click.option("--agent-network", type=click.Choice(["offline", "registries"]), default=None,
              help="The agent's network for Harbor tasks that say nothing about it (Harbor "
                   "runs them online): the package registries only (Debian/Ubuntu archives, "
                   "PyPI, npm) through the fleet's proxy, or none. Default: the agent "
                   "config's agent_network (registries).")
@click.option("--threshold", default=1.0, show_default=True,
              help="A trial passes when its reward is at least this.")
@click.option("--strict", is_flag=True,
              help="Refuse to run when any task is invalid or has no usable image "
                   "(default: skip those tasks and list them with their reasons).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@base_map_option
def eval_cmd(task_specs, policy_spec, trials, concurrency, fleet_dir, store, agent_config,
             out_dir, max_infra_retries, max_internal_errors, step_limit, command_timeout,
             agent_network, threshold, strict, no_progress, base_map) -> None:
    """Run a policy on tasks through a sandbox fleet; write every episode to
    OUT/results.jsonl, the statistics to OUT/summary.json, and print them. Infra-failed
    episodes are re-run; running again with the same --out resumes. Tasks that are invalid,
    whose FROM image has no local base, whose image is not built or failed its build-time
    checks are skipped and listed with their reasons (--strict refuses instead); episodes
    whose verifier could not grade are counted apart, not scored."""
    from tmax.agent.config import AgentConfigError, load_agent_config
    from tmax.eval.runner import (
        EvalError,
        eval_meta,
        open_results,
        preflight,
        read_skipped,
        run_eval,
        skipped_text,
    )
    from tmax.eval.summary import format_tables, summarize
    from tmax.fleet import FleetUnavailable, open_fleet
    from tmax.inference.base import EngineStartError
    from tmax.rollout.run import TaskImages

    tasks, invalid = resolve_tasks(task_specs)
    overrides = {k: v for k, v in (("step_limit", step_limit),
                                   ("command_timeout_s", command_timeout),
                                   ("agent_network", agent_network)) if v is not None}
    try:
        config = load_agent_config(agent_config, **overrides)
    except AgentConfigError as e:
        raise click.ClickException(str(e)) from None
    policy = _policy(policy_spec, config.submit_marker)
    out = out_dir or Path(f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    results = out / "results.jsonl"
    from tmax.images.bases import BaseMapError

    try:
        images = TaskImages(store, base_map=base_map)
    except BaseMapError as e:  # the base table or the --base-map file
        raise click.ClickException(str(e)) from None
    except (OSError, ValueError) as e:  # the store's folder
        raise click.ClickException(f"image store {store}: {e}") from None
    runnable, unusable = preflight(tasks, images, policy)
    skipped = [*invalid, *unusable]
    listing = skipped_text(skipped, store)
    if skipped and strict:
        raise click.ClickException(f"{len(skipped)} of {len(tasks) + len(invalid)} tasks "
                                   "cannot run (--strict: nothing was run):\n" + listing)
    if not runnable:
        raise click.ClickException("no task can run; all were skipped:\n" + listing)
    if skipped:
        click.echo(f"skipping {len(skipped)} of {len(tasks) + len(invalid)} tasks:\n"
                   + listing, err=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        open_results(results, eval_meta(tasks, policy, config, trials, invalid))
    except EvalError as e:
        raise click.ClickException(str(e)) from None
    _write_json(out / "agent_config.json", config.model_dump(mode="json"))

    async def go():
        cpus = max(t.config.environment.cpus for t in runnable)
        memory = max(t.config.environment.memory_mb for t in runnable)
        start, stop = getattr(policy, "start", None), getattr(policy, "aclose", None)
        try:
            if start is not None:  # a server the policy owns (vllm:PATH)
                await start()
            async with open_fleet(fleet_dir, concurrency=concurrency, sandbox_cpus=cpus,
                                  sandbox_memory_mb=memory) as fleet:
                return await run_eval(tasks, policy, fleet, images, config, trials=trials,
                                      concurrency=concurrency, results_path=results,
                                      max_infra_retries=max_infra_retries,
                                      max_internal_errors=max_internal_errors,
                                      progress=not no_progress, skipped=invalid,
                                      strict=strict)
        finally:
            if stop is not None:
                await stop()

    from sandfleet import run_event_loop

    try:
        records = run_event_loop(go())
    except (EvalError, FleetUnavailable, EngineStartError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; the finished episodes are in {results}; run the same "
                   f"command with --out {out} to resume", err=True)
        sys.exit(130)
    summary = summarize(records, threshold=threshold, skipped=read_skipped(results))
    _write_json(out / "summary.json", summary)
    click.echo(format_tables(summary))
    click.echo(f"\nresults {results}\nsummary {out / 'summary.json'}\n"
               f"plots: tmax report {results}")
    if summary["unscored"]:
        click.echo(f"{len(summary['unscored'])} episodes failed on infrastructure every "
                   f"time; run the same command with --out {out} to try them again", err=True)
        sys.exit(1)


@click.command("report")
@click.argument("results", type=click.Path(exists=True, path_type=Path))
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False,
                                                                path_type=Path),
              help="Folder for the PNGs (default: next to RESULTS).")
@click.option("--threshold", default=1.0, show_default=True,
              help="A trial passes when its reward is at least this.")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="Output format.")
def report_cmd(results: Path, out_dir: Path | None, threshold: float, output: str) -> None:
    """Print the tables of an evaluation's RESULTS (results.jsonl, or its run folder) and
    write its plots (reward by domain, pass@k, phase times) as PNGs."""
    from tmax.eval.report import write_plots
    from tmax.eval.runner import read_skipped
    from tmax.eval.summary import format_tables, summarize
    from tmax.rollout.trajectory import read_jsonl

    if results.is_dir():
        results = results / "results.jsonl"
        if not results.is_file():
            raise click.ClickException(f"no results.jsonl in {results.parent}")
    try:
        records = list(read_jsonl(results))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise click.ClickException(f"{results}: not a results file ({e})") from None
    if not records:
        raise click.ClickException(f"{results}: no records")
    summary = summarize(records, threshold=threshold, skipped=read_skipped(results))
    plots = write_plots(summary, records, out_dir or results.parent)
    if output == "json":
        click.echo(json.dumps({"summary": summary, "plots": [str(p) for p in plots]},
                              indent=2))
        return
    click.echo(format_tables(summary))
    click.echo("\nplots: " + ", ".join(str(p) for p in plots))


__all__ = ["eval_cmd", "report_cmd", "resolve_tasks"]
