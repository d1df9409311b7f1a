"""`tmax images ...`: build, list, verify and clean the image store."""

from __future__ import annotations

import json
import os
import sys

import click

from tmax.images.bases import BaseMapError
from tmax.images.build import open_builds
from tmax.images.checks import checks_end_on_sigterm
from tmax.images.installers import MODE_ENV
from tmax.images.store import ImageStore, default_store, own_bytes
from tmax.tasks.cli import load_all, output_option

base_map_option = click.option(
    "--base-map", type=click.Path(exists=True, dir_okay=False), default=None,
    envvar="TMAX_BASE_MAP", show_envvar=True,
    help="Your own map of FROM images to bases (the format of configs/base-images.yaml; a "
         "base is a shipped one or a .def file), tried before the shipped table. Building "
         "and running must use the same map.")

store_option = click.option("--store", default=default_store, show_default="$TMAX_IMAGE_STORE "
                            "or ~/.tmax/images", type=click.Path(file_okay=False),
                            help="Image store folder (on shared scratch for a cluster).")


@click.group("images")
def images_group() -> None:
    """One prebuilt SIF image per task, on shared scratch."""


@images_group.command("build")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@store_option
@click.option("--builder", type=click.Choice(["auto", "apptainer", "local"]), default="auto",
              show_default=True, help="auto: apptainer where it is on PATH, else local.")
@click.option("--mirror", default=None, help="Debian mirror (default: from apt sources).")
@click.option("-j", "--jobs", default=2, show_default=True, help="Parallel builds.")
@click.option("--force", is_flag=True, help="Rebuild even when the inputs did not change.")
@click.option("--no-check", is_flag=True, help="Skip the build-time checks.")
@click.option("--single-file", is_flag=True,
              help="Store each task image as one whole SIF (as before layers): a file a "
                   "cluster's Apptainer runs without sandfleet. Default: a small layer of "
                   "what the task changed over its shared base, and the verifier tools' layer.")
@click.option("--installers", type=click.Choice(["registries", "network"]), default="registries",
              envvar="TMAX_INSTALLERS", show_envvar=True, show_default=True,
              help="Vendor installers that RUN steps download (astral.sh's uv, Go tarballs, "
                   "NodeSource, rustup): 'registries' serves stand-ins fetched from PyPI and "
                   "Debian (for build nodes that reach only those), 'network' lets the RUN "
                   "steps fetch them (see tmax.images.installers).")
@base_map_option
@output_option
def build_cmd(paths, store, builder, mirror, jobs, force, no_check, single_file, installers,
              base_map, output) -> None:
    """Build (or reuse) the image of every task; then check each new image: it starts,
    the untouched environment scores below 1, the reference solution scores 1."""
    os.environ[MODE_ENV] = installers  # (read where the build script is made, and by jobs)

    tasks, errors = load_all(paths)
    if errors:
        raise click.ClickException("\n".join(str(e) for e in errors))
    try:
        builds = open_builds(store, builder=builder, mirror=mirror, check=not no_check,
                             base_map=base_map, layered=not single_file)
    except BaseMapError as e:
        raise click.ClickException(str(e)) from None
    with checks_end_on_sigterm():
        results = builds.build_all(tasks, jobs=jobs, force=force, check=not no_check,
                                   progress=output != "json")
    failed = [r for r in results if r.status == "failed" or
              (r.checks is not None and not r.checks["ok"])]
    if output == "json":
        click.echo(json.dumps({"store": str(store), "results": [r.to_dict() for r in results],
                               "ok": not failed}, indent=2))
    else:
        width = max(len(r.task_id) for r in results)
        for r in results:
            checks = "" if r.checks is None else \
                f"  checks: {'ok' if r.checks['ok'] else 'FAILED: ' + r.checks['reason']}" + \
                (f" ({r.checks['note']})" if r.checks.get("note") else "")
            line = f"{r.status:7} {r.task_id:{width}}  {r.digest[:12]:12} {r.seconds:6.1f}s"
            click.echo(line + checks)
            if r.error:
                click.echo(f"        {r.error}" + (f"\n        log: {r.log}" if r.log else ""))
        click.echo(f"{len(results) - len(failed)}/{len(results)} images ready in {store}")
    sys.exit(1 if failed else 0)


@images_group.command("ls")
@store_option
@output_option
def ls_cmd(store, output) -> None:
    """List the images in the store."""
    manifest = ImageStore(store).read()
    if output == "json":
        click.echo(manifest.model_dump_json(indent=2))
        return
    for name, b in sorted(manifest.bases.items()):
        click.echo(f"base  {name:28} {b.digest[:12]}  {b.size / 2**20:7.1f} MB  {b.builder:9} "
                   f"{b.build_seconds:6.1f}s  {b.built_at}")
    own = own_bytes(manifest)
    for tid, e in sorted(manifest.tasks.items()):
        checks = "-" if e.checks is None else ("FAILED" if not e.checks.ok else
                                               "ok, oracle not checked" if e.checks.note else "ok")
        kind = f"{len(e.layers)} layers" if e.layers else "one SIF"
        click.echo(f"task  {tid:28} {e.digest[:12]}  {own[tid] / 2**20:7.2f} MB  {e.builder:9} "
                   f"{e.build_seconds:6.1f}s  {e.built_at}  base={e.base} {kind} "
                   f"checks={checks}")
    files = {rel: size for e in manifest.tasks.values() for rel, size, _ in e.files()} | \
        {b.sif: b.size for b in manifest.bases.values()}
    click.echo(f"{len(manifest.tasks)} tasks, {len(manifest.bases)} bases: "
               f"{sum(files.values()) / 2**20:.1f} MB in {len(files)} files (MB per task: "
               "its own files, shared layers and bases not counted)")


@images_group.command("verify")
@store_option
@click.option("--quick", is_flag=True, help="Skip hashing file contents.")
@output_option
def verify_cmd(store, quick, output) -> None:
    """Check every image: present, full size, readable SIF, unchanged content."""
    s = ImageStore(store)
    problems = s.verify(deep=not quick)
    manifest = s.read()
    total = len(manifest.tasks) + len(manifest.bases)
    if output == "json":
        click.echo(json.dumps({"images": total, "problems": problems}, indent=2))
    else:
        for p in problems:
            click.echo(f"BAD  {p['image']}: {p['reason']} ({p['path']})")
        click.echo(f"{total - len(problems)}/{total} images ok"
                   + ("; rebuild the bad ones with `tmax images build --force`" if problems else ""))
    sys.exit(1 if problems else 0)


@images_group.command("gc")
@store_option
@click.option("--keep-tasks", type=click.Path(exists=True), default=None,
              help="Also drop the entries of tasks not found under this folder.")
@click.option("--tmp-age-hours", default=6.0, show_default=True,
              help="Remove leftovers in tmp/ older than this.")
@click.option("--dry-run", is_flag=True)
def gc_cmd(store, keep_tasks, tmp_age_hours, dry_run) -> None:
    """Remove unreferenced images, logs and stale build leftovers."""
    keep = None
    if keep_tasks:
        tasks, _ = load_all((keep_tasks,))
        keep = {t.task_id for t in tasks}
    removed = ImageStore(store).gc(tmp_age_hours * 3600, keep, dry_run)
    for path in removed:
        click.echo(("would remove " if dry_run else "removed ") + str(path))
    click.echo(f"{len(removed)} paths {'to remove' if dry_run else 'removed'}")
