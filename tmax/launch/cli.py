"""``--array N`` for sharded commands (``tmax gen``, ``tmax audit``, ``tmax repair``): the
same command as N Slurm array tasks, each with ``--shard K/N``, submitted through submitit
(``tmax.launch.array``: submitit is the array executor; the one Slurm client,
``sandfleet.slurm``, renders and watches the other jobs); the launching command waits with
a progress bar, then reads the shards' records as one.

An array task runs ``shard(K)``, a module-level function of the sharded command's own
module (``tmax.data.cli.gen_shard`` ...), which runs that command with the launcher's
parameters and ``--shard K/N`` (``run_shard``): never the root ``tmax`` group, so this
module imports no command line above it."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from tmax import log
from tmax.launch.array import ArrayOptions, Outcome, run_array

ARRAY_PARAMS = ("array", "partition", "account", "qos", "cpus_per_job", "mem", "time_min",
                "setup")
"""The options ``array_options`` adds (an array task does not get them again)."""


def array_options(f):
    """--array N and the sbatch options of its tasks."""
    f = click.option("--setup", multiple=True, metavar="LINE",
                     help="With --array: a shell line each task runs first (repeatable), "
                          "e.g. 'source ~/venv/bin/activate'.")(f)
    f = click.option("--time-min", default=240, show_default=True,
                     type=click.IntRange(min=1), help="With --array: walltime per task.")(f)
    f = click.option("--mem", default=None, help="With --array: memory per task, e.g. 16G.")(f)
    f = click.option("--cpus-per-job", default=None, type=click.IntRange(min=1),
                     help="With --array: CPUs per task (default: --jobs + 1).")(f)
    f = click.option("--qos", default=None, help="With --array: --qos of the tasks.")(f)
    f = click.option("--account", default=None, help="With --array: --account.")(f)
    f = click.option("--partition", default=None, help="With --array: --partition.")(f)
    return click.option("--array", "array", default=None, type=click.IntRange(min=1),
                        metavar="N", help="Run as N Slurm array tasks (one shard each, "
                        "through submitit) and wait for them; logs in OUT/slurm/.")(f)


def run_shard(command: click.Command, argv: list[str], k: int, n: int) -> int:
    """Array task k: ``command ARGV --shard k/n --no-progress`` (the command alone, not the
    root ``tmax`` group); its exit code (a click error is raised, so the launcher shows its
    message)."""
    log.setup(0)
    try:
        command.main(args=[*argv, "--shard", f"{k}/{n}", "--no-progress"],
                     prog_name=f"tmax {command.name}", standalone_mode=False)
    except SystemExit as e:
        return int(e.code or 0) if isinstance(e.code, int | None) else 1
    except click.ClickException as e:
        raise RuntimeError(e.format_message()) from None
    return 0


def submit_shards(ctx: click.Context, shard: Callable[[list[str], int, int], int],
                  out_dir: Path, *, progress: bool = True) -> list[Outcome]:
    """Run ``ctx``'s command as ``--array`` N shards, task K calling ``shard(argv, K, N)``
    (the command's module-level ``run_shard`` of itself); echo each failed shard with its
    log. The caller reads the shards' records afterwards."""
    p = ctx.params
    if p.get("shard") is not None:
        raise click.UsageError("--array runs every shard itself: leave out --shard")
    n = p["array"]
    argv = shard_argv(p, ctx.command, (*ARRAY_PARAMS, "shard", "no_progress"))
    options = ArrayOptions(name=f"tmax-{ctx.command.name}", partition=p["partition"],
                           account=p["account"], qos=p["qos"],
                           cpus=p["cpus_per_job"] or p.get("jobs", 1) + 1, mem=p["mem"],
                           time_min=p["time_min"], setup=tuple(p["setup"]))
    from submitit.core.utils import FailedSubmissionError

    try:
        outcomes = run_array(shard, [(argv, k, n) for k in range(n)],
                             Path(out_dir) / "slurm", options, progress=progress)
    except (FailedSubmissionError, OSError, RuntimeError) as e:  # no sbatch, or refused
        raise click.ClickException(f"--array {n}: could not submit the array: {e}") from None
    for o in outcomes:
        if shard_failed(o):
            click.echo(f"shard {o.index}/{n} (job {o.job_id}) "
                       f"{'failed: ' + o.error if o.error else f'exited {o.result}'}; "
                       f"its log: {o.log}", err=True)
    return outcomes


def shard_failed(o: Outcome) -> bool:
    """The task raised, or the command it ran exited non-zero."""
    return o.error is not None or o.result != 0


def failed(outcomes: list[Outcome]) -> int:
    return sum(shard_failed(o) for o in outcomes)


def array_job(outcomes: list[Outcome]) -> str:
    """The array's own job id (its tasks are ``<id>_<k>``)."""
    return outcomes[0].job_id.split("_")[0] if outcomes else "-"


def describe(outcomes: list[Outcome]) -> dict[str, Any]:
    return {"shards": len(outcomes), "failed": failed(outcomes),
            "array_job": array_job(outcomes), "jobs": [o.job_id for o in outcomes]}


def shard_argv(params: dict[str, Any], command: Any, drop: Sequence[str]) -> list[str]:
    """The arguments that call ``command`` (a click command) with ``params`` again, minus
    the parameters named in ``drop``: options first (those not at their default), then the
    positional arguments."""
    options: list[str] = []
    positional: list[str] = []
    for param in command.params:
        name = param.name
        if name in drop or name not in params:
            continue
        value = params[name]
        if isinstance(param.type, click.Path) and value is not None:  # tasks run elsewhere
            value = [os.path.abspath(v) for v in value] if param.multiple or \
                param.nargs == -1 else os.path.abspath(value)
        if isinstance(param, click.Argument):
            positional += [str(v) for v in value] if param.multiple or param.nargs == -1 \
                else [str(value)]
            continue
        default = param.default() if callable(param.default) else param.default
        if not isinstance(param, click.Option) or value == default or value is None:
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            if param.secondary_opts and not value:
                options.append(max(param.secondary_opts, key=len))
            elif value:
                options.append(flag)
        elif param.multiple:
            for v in value:
                options += [flag, str(v)]
        else:
            options += [flag, str(value)]
    return options + positional
