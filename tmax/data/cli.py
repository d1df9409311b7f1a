"""`tmax gen` (synthetic tasks from a teacher) and `tmax data ...` (dataset tools)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import click

from tmax.launch.cli import array_job, array_options, failed, run_shard, submit_shards
from tmax.package_data import CONFIGS

DEFAULT_CONFIG = CONFIGS / "gen.yaml"


@click.command("gen")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              default=str(DEFAULT_CONFIG), show_default=True, help="Generation config.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Run folder: tasks/, records.jsonl, summary.json, teacher-cache/.")
@click.option("-n", "--num-tasks", type=click.IntRange(min=1), default=10, show_default=True,
              help="Task seeds to run.")
@click.option("--seed", "first_seed", default=0, show_default=True,
              help="First task seed (seeds SEED .. SEED+N-1; each fixes a task's axes).")
@click.option("--jobs", default=2, show_default=True, help="Tasks in progress at once.")
@click.option("--base-url", default=None, help="Teacher endpoint (overrides the config).")
@click.option("--model", default=None, help="Teacher model name (overrides the config).")
@click.option("--store", default=None, type=click.Path(file_okay=False),
              help="Image store (default $TMAX_IMAGE_STORE or ~/.tmax/images).")
@click.option("--builder", type=click.Choice(["auto", "apptainer", "local"]), default="auto",
              show_default=True)
@click.option("--shard", default=None, metavar="K/N|slurm",
              help="Run only the seeds with seed %% N == K (own records file); 'slurm' takes "
                   "K and N from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT.")
@click.option("--id-prefix", default=None, metavar="PREFIX",
              help="Task ids PREFIX-<seed> (overrides generation.id_prefix; give each run "
                   "that shares an image store its own).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@array_options
@click.pass_context
def gen_cmd(ctx, config_path, out_dir, num_tasks, first_seed, jobs, base_url, model, store,
            builder, shard, id_prefix, no_progress, **_array) -> None:
    """Generate native tasks with a teacher LLM: sample the axes of each task seed, ask the
    teacher, build the image and check it (untouched < 1, oracle = 1), send failures back
    for repair, keep or drop each task with its reason. Resumable: a rerun skips seeds
    already kept or dropped and reads paid replies from the cache."""
    from tmax.data.config import GenConfigError, load_gen_config
    from tmax.data.gen import Generator, drop_reasons, format_yield, yield_table
    from tmax.data.stats import run_records
    from tmax.images.build import open_builds
    from tmax.images.store import default_store

    if ctx.params["array"]:
        outcomes = submit_shards(ctx, gen_shard, Path(out_dir), progress=not no_progress)
        wanted = set(range(first_seed, first_seed + num_tasks))
        records = [r for r in run_records(Path(out_dir)) if r["seed"] in wanted]
        click.echo(format_yield(yield_table(records)))
        click.echo(f"{len(outcomes)} array tasks (job {array_job(outcomes)}), "
                   f"{failed(outcomes)} failed; records in {out_dir}/records.shard-*.jsonl, "
                   f"tasks in {Path(out_dir) / 'tasks'}")
        if failed(outcomes) or len(records) < len(wanted):
            click.echo(f"{len(wanted) - len(records)} seeds without a record: run the same "
                       "command to go on", err=True)
            sys.exit(1)
        return
    shard_of = parse_shard(shard)
    try:
        config = load_gen_config(config_path)
    except GenConfigError as e:
        raise click.ClickException(str(e)) from None
    overrides = {k: v for k, v in (("base_url", base_url), ("model", model)) if v}
    if overrides:
        config = config.model_copy(update={"teacher": config.teacher.model_copy(
            update=overrides)})
    if id_prefix is not None:
        try:
            generation = type(config.generation).model_validate(
                {**config.generation.model_dump(), "id_prefix": id_prefix})
        except ValueError:
            raise click.BadParameter(f"{id_prefix!r}: 1-41 lower-case letters, digits and "
                                     "'-', starting with a letter or digit",
                                     param_hint="--id-prefix") from None
        config = config.model_copy(update={"generation": generation})
    builds = open_builds(store or default_store(), builder=builder)
    gen = Generator(config, Path(out_dir), builds, shard=shard_of)
    seeds = range(first_seed, first_seed + num_tasks)
    records = asyncio.run(gen.run(seeds, jobs=jobs, progress=not no_progress))
    click.echo(format_yield(yield_table(records)))
    reasons = drop_reasons(records)
    if reasons:
        click.echo("dropped at: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common()))
    errors = sum(r["outcome"] == "error" for r in records)
    if errors:
        click.echo(f"{errors} tasks not finished (teacher unavailable): rerun to retry them")
    u = gen.teacher.usage
    click.echo(f"teacher: {u.requests} requests, {u.cache_hits} from cache, "
               f"{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens, "
               f"cost {u.cost:.4f}, {u.parse_failures} unparsable replies, "
               f"{u.dropped} dropped; tasks in {Path(out_dir) / 'tasks'}")


def gen_shard(argv: list[str], k: int, n: int) -> int:
    """Array task k of ``tmax gen --array n`` (``tmax.launch.cli.run_shard``)."""
    return run_shard(gen_cmd, argv, k, n)


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """A ``--shard`` value: ``K/N`` or ``slurm`` (K and N of a Slurm array task) -> (K, N);
    ``click.BadParameter`` for anything else."""
    if text is None:
        return None
    if text == "slurm":
        try:
            return (int(os.environ["SLURM_ARRAY_TASK_ID"]),
                    int(os.environ["SLURM_ARRAY_TASK_COUNT"]))
        except (KeyError, ValueError):
            raise click.BadParameter("--shard slurm needs SLURM_ARRAY_TASK_ID and "
                                     "SLURM_ARRAY_TASK_COUNT (run it as an array job)") from None
    k, sep, n = text.partition("/")
    try:
        shard = (int(k), int(n))
    except ValueError:
        shard = (-1, 0)
    if not sep or not 0 <= shard[0] < shard[1]:
        raise click.BadParameter(f"--shard {text!r}: K/N with 0 <= K < N, or 'slurm'")
    return shard


@click.group("data")
def data_group() -> None:
    """Dataset tools: statistics (and decontamination)."""


@data_group.command("yield")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def yield_cmd(run_dir, output) -> None:
    """The yield table of a `tmax gen` run folder (from its records.jsonl)."""
    from tmax.data.gen import format_yield, yield_table
    from tmax.data.stats import run_records

    table = yield_table(run_records(Path(run_dir)))
    click.echo(json.dumps(table, indent=2) if output == "json" else format_yield(table))


@data_group.command("stats")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--eval", "evals", multiple=True, type=click.Path(exists=True),
              help="A `tmax eval` results.jsonl (or its --out folder) for pass@k: once for "
                   "every folder, or once per folder in their order.")
@click.option("--threshold", default=1.0, show_default=True,
              help="An eval trial passes when its reward >= this.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write PNG plots (the folders side by side) into this folder.")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def stats_cmd(dirs, evals, threshold, plot_dir, output) -> None:
    """Counts by axis, balance (exp(entropy) / categories), instruction and verifier lengths
    of one or more task folders, side by side; the yield per stage of `tmax gen` run folders
    (RUN or RUN/tasks); pass@k from `tmax eval` results (--eval); PNG plots (--plot)."""
    from tmax.data.stats import StatsError, dataset_stats, format_stats, write_plots

    if len(evals) not in (0, 1, len(dirs)):
        raise click.BadParameter(f"{len(evals)} given for {len(dirs)} folders: give one for "
                                 "every folder, or one per folder", param_hint="--eval")
    paths = list(evals) * len(dirs) if len(evals) == 1 else list(evals) or [None] * len(dirs)
    try:
        all_stats = [dataset_stats(d, e, threshold=threshold)
                     for d, e in zip(dirs, paths, strict=True)]
    except StatsError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(all_stats, indent=2) if output == "json" else format_stats(all_stats))
    for path in write_plots(all_stats, plot_dir) if plot_dir else []:
        click.echo(f"plot {path}", err=output == "json")


@data_group.command("decontam")
@click.argument("tasks_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--against", "benchmarks", multiple=True, required=True,
              type=click.Path(exists=True, file_okay=False),
              help="A benchmark task folder (repeatable), any supported layout.")
@click.option("--flag-n", default=13, show_default=True,
              help="A task is contaminated when one of its n-grams of this size matches.")
@click.option("--write-clean", "clean_dir", type=click.Path(file_okay=False), default=None,
              help="Copy the tasks that are not contaminated into this folder.")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def decontam_cmd(tasks_dir, benchmarks, flag_n, clean_dir, output) -> None:
    """Word 13- and 8-gram overlap (lower-cased alphanumeric tokens) of each instruction in
    TASKS_DIR against the benchmark folders: a report, and optionally the clean subset."""
    import shutil

    from tmax.data.decontam import NS, build_index, instructions, report

    ns = tuple(sorted({*NS, flag_n}, reverse=True))
    rows = report(instructions(tasks_dir), build_index(*benchmarks, ns=ns), ns, flag_n)
    if clean_dir:
        for row in rows:
            if not row.contaminated:
                shutil.copytree(Path(tasks_dir) / row.task_id, Path(clean_dir) / row.task_id,
                                dirs_exist_ok=True)
    if output == "json":
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    for r in rows:
        parts = [f"n{n} {o.hits}/{o.ngrams}" for n, o in r.overlaps.items()]
        matched = sorted({m for o in r.overlaps.values() for m in o.matches})
        click.echo(f"{'CONTAMINATED' if r.contaminated else 'clean':12} {r.task_id:30} "
                   f"{'  '.join(parts)}  {', '.join(matched[:5])}")
    bad = sum(r.contaminated for r in rows)
    click.echo(f"{bad}/{len(rows)} tasks share a {flag_n}-gram with the benchmarks")
