"""`tmax gen` (synthetic tasks from a teacher) and `tmax data ...` (dataset tools)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gen.yaml"


@click.command("gen")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              default=str(DEFAULT_CONFIG), show_default=True, help="Generation config.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Run folder: tasks/, records.jsonl, summary.json, teacher-cache/.")
@click.option("-n", "--num-tasks", default=10, show_default=True, help="Task seeds to run.")
@click.option("--seed", "first_seed", default=0, show_default=True,
              help="First task seed (seeds SEED .. SEED+N-1; each fixes a task's axes).")
@click.option("--jobs", default=2, show_default=True, help="Tasks in progress at once.")
@click.option("--base-url", default=None, help="Teacher endpoint (overrides the config).")
@click.option("--model", default=None, help="Teacher model name (overrides the config).")
@click.option("--store", default=None, type=click.Path(file_okay=False),
              help="Image store (default $TMAX_IMAGE_STORE or ~/.tmax/images).")
@click.option("--builder", type=click.Choice(["auto", "apptainer", "local"]), default="auto",
              show_default=True)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def gen_cmd(config_path, out_dir, num_tasks, first_seed, jobs, base_url, model, store, builder,
            no_progress) -> None:
    """Generate native tasks with a teacher LLM: sample the axes of each task seed, ask the
    teacher, build the image and check it (untouched < 1, oracle = 1), send failures back
    for repair, keep or drop each task with its reason. Resumable: a rerun skips seeds
    already kept or dropped and reads paid replies from the cache."""
    from tmax.data.config import GenConfigError, load_gen_config
    from tmax.data.gen import Generator, drop_reasons, format_yield, yield_table
    from tmax.images import open_builds
    from tmax.images.store import default_store

    try:
        config = load_gen_config(config_path)
    except GenConfigError as e:
        raise click.ClickException(str(e)) from None
    overrides = {k: v for k, v in (("base_url", base_url), ("model", model)) if v}
    if overrides:
        config = config.model_copy(update={"teacher": config.teacher.model_copy(
            update=overrides)})
    builds = open_builds(store or default_store(), builder=builder)
    gen = Generator(config, Path(out_dir), builds)
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


@click.group("data")
def data_group() -> None:
    """Dataset tools: statistics (and decontamination)."""


@data_group.command("yield")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def yield_cmd(run_dir, output) -> None:
    """The yield table of a `tmax gen` run folder (from its records.jsonl)."""
    from tmax.data.gen import RECORDS, format_yield, yield_table

    path = Path(run_dir) / RECORDS
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.is_file() else []
    latest = {r["seed"]: r for r in records}
    table = yield_table(list(latest.values()))
    click.echo(json.dumps(table, indent=2) if output == "json" else format_yield(table))
