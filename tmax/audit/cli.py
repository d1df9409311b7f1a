"""`tmax audit` (label every task) and `tmax repair` (keep, repair or drop into a clean set).

Register with ``main.add_command(audit_cmd)`` and ``main.add_command(repair_cmd)``.
"""

from __future__ import annotations

import json
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import click

from tmax.data.cli import parse_shard
from tmax.images.cli import base_map_option, store_option
from tmax.launch.cli import (
    array_job,
    array_options,
    describe,
    failed,
    run_shard,
    submit_shards,
)
from tmax.package_data import CONFIGS

DEFAULT_CONFIG = CONFIGS / "audit.yaml"


def _config(path, base_url, model):
    from tmax.audit.llm import AuditConfigError, load_audit_config

    try:
        config = load_audit_config(path)
    except AuditConfigError as e:
        raise click.ClickException(str(e)) from None
    overrides = {k: v for k, v in (("base_url", base_url), ("model", model)) if v}
    if overrides:
        config = config.model_copy(update={"teacher": config.teacher.model_copy(
            update=overrides)})
    return config


def _tasks(specs, shard):
    from tmax.eval.cli import resolve_tasks

    tasks, invalid = resolve_tasks(specs)
    for s in invalid:
        click.echo(f"not audited (invalid task) {s.task}: {s.reason}", err=True)
    tasks.sort(key=lambda t: t.task_id)
    if shard is not None:
        k, n = shard
        tasks = [t for i, t in enumerate(tasks) if i % n == k]
    if not tasks:
        raise click.ClickException("no task to audit")
    return tasks


def _images(store, base_map):
    from tmax.images.bases import BaseMapError
    from tmax.rollout.run import TaskImages

    try:
        return TaskImages(store, base_map=base_map)
    except BaseMapError as e:
        raise click.ClickException(str(e)) from None
    except (OSError, ValueError) as e:
        raise click.ClickException(f"image store {store}: {e}") from None


async def _open(stack: AsyncExitStack, fleet_dir, tasks, jobs, config, use_teacher, cache):
    """The fleet (a running one, or a private one sized for ``jobs`` sandboxes) and the
    teacher (None unless asked for), both closed by ``stack``."""
    from tmax.fleet import open_fleet
    from tmax.llm import Teacher

    cpus = max(t.config.environment.cpus for t in tasks)
    memory = max(t.config.environment.memory_mb for t in tasks)
    fleet = await stack.enter_async_context(open_fleet(
        fleet_dir, concurrency=jobs, sandbox_cpus=cpus, sandbox_memory_mb=memory))
    teacher = None
    if use_teacher:
        teacher = await stack.enter_async_context(Teacher(config.teacher, cache_dir=cache))
    return fleet, teacher


def _teacher_options(f):
    f = click.option("--model", default=None, help="Teacher model (overrides the config).")(f)
    f = click.option("--base-url", default=None,
                     help="Teacher endpoint (overrides the config; implies --teacher).")(f)
    f = click.option("--teacher", "use_teacher", is_flag=True,
                     help="Use the config's teacher: the LLM auditor labels what the probes "
                          "cannot prove (and repairs weak verifiers and mismatches).")(f)
    f = click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
                     default=str(DEFAULT_CONFIG), show_default=True,
                     help="Audit config: teacher, probe limits, prompts.")(f)
    return f


def _common(f):
    f = click.option("--no-progress", is_flag=True, help="No progress bar.")(f)
    f = click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text",
                     show_default=True, help="Output format.")(f)
    f = click.option("--jobs", default=2, show_default=True, type=click.IntRange(min=1),
                     help="Tasks probed at once.")(f)
    f = click.option("--fleet", "fleet_dir", default=None,
                     type=click.Path(file_okay=False, path_type=Path),
                     help="State dir of a running fleet (`sandfleet up`); default: a "
                          "private local fleet for this run.")(f)
    f = store_option(f)
    f = base_map_option(f)
    return _teacher_options(f)


@click.command("audit")
@click.argument("task_specs", nargs=-1, required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False,
                                                                 path_type=Path),
              help="Audit folder: audit.jsonl (one record per task); rerun to resume.")
@click.option("--shard", default=None, metavar="K/N|slurm",
              help="Audit only the tasks with index %% N == K (sorted by id) into their own "
                   "audit.shard-K-of-N.jsonl; 'slurm' takes K and N from the array task.")
@_common
@array_options
@click.pass_context
def audit_cmd(ctx, task_specs, out_dir, shard, config_path, use_teacher, base_url, model,
              store, base_map, fleet_dir, jobs, output, no_progress, **_array) -> None:
    """Label every task of TASK_SPECS (task folders, folders of them, globs): the
    deterministic probes in real sandboxes of each task's image (nop, oracle, leak scan,
    copy, replay, mutation, paths, exploits: scripted reward hacks) and, with --teacher, the
    LLM auditor for what they cannot prove. Without a teacher a task no probe faults stays unlabelled. Images must be built
    (`tmax images build`)."""
    from sandfleet import run_event_loop
    from tmax.audit.probes import Prober
    from tmax.audit.run import Auditor, format_audit, label_counts
    from tmax.fleet import FleetUnavailable

    if ctx.params["array"]:
        return _audit_array(ctx, task_specs, out_dir, output, no_progress)
    shard_of = parse_shard(shard)
    config = _config(config_path, base_url, model)
    use_teacher = use_teacher or bool(base_url)
    tasks = _tasks(task_specs, shard_of)
    images = _images(store, base_map)
    name = "audit.jsonl" if shard_of is None else \
        f"audit.shard-{shard_of[0]}-of-{shard_of[1]}.jsonl"

    async def go():
        async with AsyncExitStack() as stack:
            fleet, teacher = await _open(stack, fleet_dir, tasks, jobs, config, use_teacher,
                                         out_dir / "teacher-cache")
            auditor = Auditor(Prober(fleet, images, config.probes), out_dir,
                              teacher=teacher, config=config, records_name=name)
            return await auditor.run(tasks, jobs=jobs, progress=not no_progress), teacher

    try:
        records, teacher = run_event_loop(go())
    except FleetUnavailable as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; the audited tasks are in {out_dir / name}; run the same "
                   "command to go on", err=True)
        sys.exit(130)
    if output == "json":
        click.echo(json.dumps({"counts": label_counts(records),
                               "records": [r.to_dict() for r in records]}, indent=2,
                              default=str))
    else:
        click.echo(format_audit(records))
        if teacher is not None:
            u = teacher.usage
            click.echo(f"teacher: {u.requests} requests, {u.cache_hits} from cache, "
                       f"{u.prompt_tokens} + {u.completion_tokens} tokens, cost {u.cost:.4f}")
        click.echo(f"records: {out_dir / name}")
    if any(r.error for r in records):
        click.echo(f"{sum(bool(r.error) for r in records)} tasks not audited (see above); "
                   "run the same command to retry them", err=True)
        sys.exit(1)


def _audit_array(ctx, task_specs, out_dir, output, no_progress) -> None:
    """--array N: the shards as Slurm array tasks, then their records as one audit."""
    from tmax.audit.run import format_audit, label_counts, read_all_records

    tasks = _tasks(task_specs, None)
    outcomes = submit_shards(ctx, audit_shard, out_dir, progress=not no_progress)
    found = read_all_records(out_dir)
    records = [found[t.task_id] for t in tasks if t.task_id in found]
    if output == "json":
        click.echo(json.dumps({"counts": label_counts(records), "array": describe(outcomes),
                               "records": [r.to_dict() for r in records]}, indent=2,
                              default=str))
    else:
        click.echo(format_audit(records))
        click.echo(f"records: {out_dir}/audit.shard-*-of-{len(outcomes)}.jsonl "
                   f"({len(outcomes)} array tasks, job {array_job(outcomes)})")
    missing = len(tasks) - len(records)
    if failed(outcomes) or missing or any(r.error for r in records):
        click.echo(f"{failed(outcomes)} shards failed, {missing} tasks without a record, "
                   f"{sum(bool(r.error) for r in records)} not audited: run the same "
                   "command to retry them", err=True)
        sys.exit(1)


def _repair_array(ctx, task_specs, clean_dir, audit_dir, output, no_progress) -> None:
    """--array N: the shards as Slurm array tasks, then one report over all of them."""
    from tmax.audit.repair import read_repairs
    from tmax.audit.report import format_report, repair_report, write_report
    from tmax.audit.run import read_all_records

    tasks = _tasks(task_specs, None)
    outcomes = submit_shards(ctx, repair_shard, clean_dir, progress=not no_progress)
    audits_found = read_all_records(audit_dir or clean_dir / "audit")
    repairs_found = read_repairs(clean_dir)
    done = [t for t in tasks if t.task_id in audits_found and t.task_id in repairs_found]
    report = repair_report([audits_found[t.task_id] for t in done],
                           [repairs_found[t.task_id] for t in done])
    report["array"] = describe(outcomes)
    write_report(report, clean_dir)
    click.echo(json.dumps(report, indent=2) if output == "json" else format_report(report))
    missing = len(tasks) - len(done)
    if failed(outcomes) or missing or report["unfinished"]:
        click.echo(f"{failed(outcomes)} shards failed, {missing} tasks without a record, "
                   f"{len(report['unfinished'])} not finished: run the same command to go on",
                   err=True)
        sys.exit(1)


@click.command("repair")
@click.argument("task_specs", nargs=-1, required=True)
@click.option("--out", "clean_dir", required=True, type=click.Path(file_okay=False,
                                                                   path_type=Path),
              help="Clean folder: tasks/ (kept and repaired tasks), repair.jsonl, "
                   "report.json, report.txt, labels.png; rerun to resume.")
@click.option("--audit", "audit_dir", default=None,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="A `tmax audit --out` folder; default: audit first, into OUT/audit.")
@click.option("--rounds", default=2, show_default=True, type=click.IntRange(min=1),
              help="Teacher repair attempts per task (each rejection is sent back).")
@click.option("--builder", type=click.Choice(["auto", "apptainer", "local"]), default="auto",
              show_default=True, help="Builder of the repaired tasks' images.")
@click.option("--shard", default=None, metavar="K/N|slurm",
              help="Repair only the tasks with index %% N == K (sorted by id), recorded in "
                   "repair.shard-K-of-N.jsonl; the report is written by a run of all shards "
                   "(--array, or a rerun without --shard).")
@_common
@array_options
@click.pass_context
def repair_cmd(ctx, task_specs, clean_dir, audit_dir, rounds, builder, shard, config_path,
               use_teacher, base_url, model, store, base_map, fleet_dir, jobs, output,
               no_progress, **_array) -> None:
    """Keep, repair or drop each task of TASK_SPECS by its audit label into OUT/tasks:
    unlabelled and clean tasks are kept; answer leaks are moved out of the image into
    tests/ (no LLM); a verifier only the exploit probes forged is hardened without an LLM
    where that is sound (pytest graded from its JUnit report), else left labelled with the
    reason; weak verifiers and instruction/verifier mismatches are rewritten by the teacher
    (--teacher); the rest is dropped. A repair is kept only when the rebuilt task
    passes oracle, fails nop and no probe faults it any more. Writes a report with the label
    counts before and after, and a plot."""
    from sandfleet import run_event_loop
    from tmax.audit.probes import Prober
    from tmax.audit.repair import Repairer
    from tmax.audit.report import format_report, repair_report, write_report
    from tmax.audit.run import Auditor, read_all_records, task_digest
    from tmax.fleet import FleetUnavailable
    from tmax.images.build import open_builds

    if ctx.params["array"]:
        return _repair_array(ctx, task_specs, clean_dir, audit_dir, output, no_progress)
    shard_of = parse_shard(shard)
    suffix = "" if shard_of is None else f".shard-{shard_of[0]}-of-{shard_of[1]}"
    config = _config(config_path, base_url, model)
    use_teacher = use_teacher or bool(base_url)
    tasks = _tasks(task_specs, shard_of)
    images = _images(store, base_map)
    builds = open_builds(store, builder=builder, base_map=base_map)

    async def go():
        async with AsyncExitStack() as stack:
            fleet, teacher = await _open(stack, fleet_dir, tasks, jobs, config, use_teacher,
                                         clean_dir / "teacher-cache")
            prober = Prober(fleet, images, config.probes)
            if audit_dir is None:
                auditor = Auditor(prober, clean_dir / "audit", teacher=teacher, config=config,
                                  records_name=f"audit{suffix}.jsonl")
                audits = await auditor.run(tasks, jobs=jobs, progress=not no_progress)
            else:
                found = read_all_records(audit_dir)
                missing = [t.task_id for t in tasks if t.task_id not in found]
                if missing:
                    raise click.ClickException(
                        f"{audit_dir}: no audit record of {len(missing)} tasks "
                        f"({', '.join(missing[:5])}...); run `tmax audit` on them first")
                audits = [found[t.task_id] for t in tasks]
                stale = [t.task_id for t, a in zip(tasks, audits)
                         if task_digest(t) != a.digest]
                if stale:
                    raise click.ClickException(
                        f"{len(stale)} tasks changed since their audit in {audit_dir} "
                        f"({', '.join(stale[:5])}); run `tmax audit` on them again")
            repairer = Repairer(prober, builds, clean_dir, teacher=teacher, config=config,
                                rounds=rounds, records_name=f"repair{suffix}.jsonl")
            return audits, await repairer.run(list(zip(tasks, audits)), jobs=jobs,
                                              progress=not no_progress)

    try:
        audits, repairs = run_event_loop(go())
    except FleetUnavailable as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; run the same command with --out {clean_dir} to go on",
                   err=True)
        sys.exit(130)
    report = repair_report(audits, repairs)
    if shard_of is None:  # a shard's report would be one part of the whole
        write_report(report, clean_dir)
    click.echo(json.dumps(report, indent=2) if output == "json" else format_report(report))
    if report["unfinished"]:
        click.echo(f"{len(report['unfinished'])} tasks not finished (see above); run the same "
                   "command to try them again", err=True)
        sys.exit(1)


def audit_shard(argv: list[str], k: int, n: int) -> int:
    """Array task k of ``tmax audit --array n`` (``tmax.launch.cli.run_shard``)."""
    return run_shard(audit_cmd, argv, k, n)


def repair_shard(argv: list[str], k: int, n: int) -> int:
    """Array task k of ``tmax repair --array n`` (``tmax.launch.cli.run_shard``)."""
    return run_shard(repair_cmd, argv, k, n)
