"""`tmax tasks ...`: validate, list, show and convert tasks."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import click
from tqdm import tqdm

from tmax.tasks.check import check_task
from tmax.tasks.model import TaskError
from tmax.tasks.native import LAYOUTS, find_tasks, load_task, validate_task, write_task
from tmax.tasks.readers import detect_format, read_any

output_option = click.option("-o", "--output", type=click.Choice(["text", "json"]),
                             default="text", show_default=True, help="Output format.")


class _Validated(TypedDict):
    """One task of `tmax tasks validate`'s report."""

    task: str
    path: str
    format: str
    problems: list[dict[str, Any]]  # Problem.to_dict()


class _Converted(TypedDict):
    """One task of `tmax tasks convert`'s report (format, to and path when it converted)."""

    task: str
    source: str
    ok: bool
    problems: list[dict[str, Any]]  # Problem.to_dict()
    format: NotRequired[str]
    to: NotRequired[str]
    path: NotRequired[str]


def _find(paths: tuple[str, ...]) -> list[Path]:
    try:
        found = find_tasks(*paths)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    if not found:
        raise click.ClickException(f"no tasks found under: {', '.join(paths)}")
    return found


def load_all(paths: tuple[str, ...]):
    """The tasks under ``paths`` and the errors of those that did not load (for the CLIs)."""
    tasks, errors = [], []
    for path in _find(paths):
        try:
            tasks.append(load_task(path))
        except TaskError as e:
            errors.append(e)
    return tasks, errors


@click.group("tasks")
def tasks_group() -> None:
    """Terminal tasks in the native (Harbor / Terminal-Bench 2.x) layout."""


@tasks_group.command("validate")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--strict", is_flag=True, help="Treat warnings as errors.")
@output_option
def validate_cmd(paths: tuple[str, ...], strict: bool, output: str) -> None:
    """Check task directories (or folders of them); exit 1 on any error."""
    report: list[_Validated] = []
    for path in _find(paths):
        fmt = detect_format(path)
        problems = validate_task(path) if fmt == "native" else _convert_problems(path)
        report.append({"task": path.name, "path": str(path), "format": fmt,
                       "problems": [p.to_dict() for p in problems]})
    bad = [r for r in report if any(p["severity"] == "error" or strict for p in r["problems"])]
    if output == "json":
        click.echo(json.dumps({"tasks": report, "ok": not bad}, indent=2))
    else:
        for r in report:
            status = "FAIL" if r in bad else "ok"
            note = "" if r["format"] == "native" else f" ({r['format']}, convert it first)"
            click.echo(f"{status:4} {r['task']}{note}")
            for p in r["problems"]:
                where = p["file"] + (f" [{p['field']}]" if p["field"] else "")
                fix = f" -> {p['fix']}" if p["fix"] else ""
                click.echo(f"     {p['severity']}: {where}: {p['message']}{fix}")
        click.echo(f"{len(report) - len(bad)}/{len(report)} tasks valid")
    sys.exit(1 if bad else 0)


def _convert_problems(path: Path):
    try:
        draft = read_any(path)
    except TaskError as e:
        return e.problems
    return draft.warnings


@tasks_group.command("ls")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@output_option
def ls_cmd(paths: tuple[str, ...], output: str) -> None:
    """List tasks with domain, difficulty and resources."""
    tasks, errors = load_all(paths)
    rows = [t.summary() for t in tasks]
    if output == "json":
        click.echo(json.dumps({"tasks": rows, "invalid": [e.task for e in errors]}, indent=2))
    else:
        width = max([len(r["id"]) for r in rows] + [4])
        click.echo(f"{'TASK':{width}}  {'DOMAIN':22}  {'DIFFICULTY':10}  ENV")
        for r in rows:
            click.echo(f"{r['id']:{width}}  {r['domain']:22}  {r['difficulty']:10}  "
                       f"{r['environment']}")
        for e in errors:
            click.echo(f"{e.task:{width}}  INVALID (run `tmax tasks validate`)", err=True)
    sys.exit(1 if errors else 0)


@tasks_group.command("show")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@output_option
def show_cmd(path: str, output: str) -> None:
    """Show one task: metadata, files and instruction."""
    try:
        task = load_task(path)
    except TaskError as e:
        raise click.ClickException(str(e)) from None
    files = sorted(str(f.relative_to(task.root)) for f in task.root.rglob("*") if f.is_file())
    if output == "json":
        click.echo(json.dumps({**task.summary(), "config": task.config.model_dump(mode="json"),
                               "files": files, "instruction": task.instruction}, indent=2))
        return
    s = task.summary()
    click.echo(f"{task.task_id}  ({s['domain']}, {s['difficulty']}, {s['environment']})")
    click.echo(f"  path: {task.root}")
    click.echo(f"  resources: {s['cpus']} cpus, {s['memory_mb']} MB, "
               f"network {'on' if s['network'] else 'off'}")
    click.echo(f"  timeouts: agent {s['agent_timeout_sec']:g}s, "
               f"verifier {s['verifier_timeout_sec']:g}s")
    click.echo("  files: " + ", ".join(files))
    click.echo("\n" + task.instruction.rstrip())


@tasks_group.command("convert")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-d", "--dest", required=True, type=click.Path(file_okay=False),
              help="Folder to write the native tasks into.")
@click.option("--force", is_flag=True, help="Replace tasks that already exist in DEST.")
@click.option("--to", "layout", type=click.Choice(LAYOUTS), default="native",
              show_default=True,
              help="native: task.toml with every key as given; harbor: what Harbor reads "
                   "(TMax's own keys kept under [metadata.tmax], TMax's defaults written out).")
@output_option
def convert_cmd(paths: tuple[str, ...], dest: str, force: bool, layout: str,
                output: str) -> None:
    """Convert Terminal-Bench 1 / TMax v1.0 / native / Harbor tasks to the native layout,
    or (--to harbor) to Harbor's.

    Each task is written to a temporary folder, validated, then renamed into place:
    a failure leaves nothing half-written.
    """
    results: list[_Converted] = []
    for path in _find(paths):
        try:
            draft = read_any(path)
            task = write_task(draft, dest, overwrite=force, layout=layout)
        except TaskError as e:
            results.append({"task": path.name, "source": str(path), "ok": False,
                            "problems": [p.to_dict() for p in e.problems]})
        else:
            results.append({"task": task.task_id, "source": str(path), "ok": True,
                            "format": draft.source_format, "to": layout,
                            "path": str(task.root),
                            "problems": [p.to_dict() for p in draft.warnings]})
    failed = [r for r in results if not r["ok"]]
    if output == "json":
        click.echo(json.dumps({"converted": results, "ok": not failed}, indent=2))
    else:
        for r in results:
            head = (f"ok   {r['task']} ({r['format']} -> {r['to']}) {r['path']}" if r["ok"]
                    else f"FAIL {r['task']} ({r['source']})")
            click.echo(head)
            for p in r["problems"]:
                click.echo(f"     {p['severity']}: {p['file']}: {p['message']}"
                           + (f" -> {p['fix']}" if p["fix"] else ""))
    sys.exit(1 if failed else 0)


@tasks_group.command("check")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--mode", "modes", multiple=True, type=click.Choice(["oracle", "nop"]),
              default=("oracle", "nop"), show_default=True,
              help="Run the reference solution (oracle) and/or nothing (nop).")
@click.option("-j", "--jobs", default=2, show_default=True, help="Checks run in parallel.")
@output_option
def check_cmd(paths: tuple[str, ...], modes: tuple[str, ...], jobs: int, output: str) -> None:
    """Run each task's solution and verifier in a throwaway sandbox on this machine.

    A task passes when the oracle scores 1.0 and doing nothing scores below 1.0. The
    sandbox is bubblewrap over this machine's system directories (see tmax.tasks.check):
    a quick check before any image is built.
    """
    tasks, errors = load_all(paths)
    if errors:
        raise click.ClickException("\n".join(str(e) for e in errors))
    jobs_list = [(t, m) for t in tasks for m in modes]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        results = list(tqdm(pool.map(lambda tm: check_task(*tm), jobs_list),
                            total=len(jobs_list), desc="checking", unit="run",
                            disable=output == "json" or None))
    verdicts = summarize_checks(results)
    if output == "json":
        click.echo(json.dumps({"results": [r.to_dict() for r in results],
                               "tasks": verdicts}, indent=2))
    else:
        width = max(len(t) for t in verdicts)
        click.echo(f"{'TASK':{width}}  {'ORACLE':>6}  {'NOP':>6}  VERDICT")
        for task, v in verdicts.items():
            cells = [f"{v[m]:6.2f}" if isinstance(v.get(m), float) else f"{'-':>6}"
                     for m in ("oracle", "nop")]
            click.echo(f"{task:{width}}  {cells[0]}  {cells[1]}  {v['verdict']}")
        for r in results:
            if r.error:
                click.echo(f"{r.task} ({r.mode}): {r.error}", err=True)
    sys.exit(0 if all(v["verdict"] == "ok" for v in verdicts.values()) else 1)


def summarize_checks(results) -> dict[str, dict]:
    """Per task: rewards by mode and a verdict (oracle must reach 1, nop must not)."""
    verdicts: dict[str, dict] = {}
    for r in results:
        verdicts.setdefault(r.task, {})[r.mode] = r.reward
    for v in verdicts.values():
        problems = []
        if "oracle" in v and v["oracle"] != 1.0:
            problems.append("oracle below 1" if v["oracle"] is not None else "oracle: no reward")
        if "nop" in v and (v["nop"] is None or v["nop"] >= 1.0):
            problems.append("passes by doing nothing" if v["nop"] else "nop: no reward")
        v["verdict"] = "; ".join(problems) or "ok"
    return verdicts
