"""`sandfleet`: the sandbox fleet's command line."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import click

# What each runtime and provider needs from the machine: (kind, name, why).
REQUIREMENTS = (
    ("runtime local", "bwrap", "bubblewrap sandboxes"),
    ("runtime local", "squashfuse", "mount a SIF's squashfs root without root"),
    ("runtime local", "unsquashfs", "extract a SIF's root into a node-local cache"),
    ("runtime apptainer", "apptainer", "instance start/exec/stop on clusters"),
    ("images", "mksquashfs", "pack image root filesystems"),
    ("images", "siftool", "wrap squashfs as SIF"),
    ("images", "debootstrap", "bootstrap local base images"),
    ("provider slurm", "sbatch", "submit worker jobs"),
    ("provider slurm", "squeue", "poll worker jobs"),
    ("provider slurm", "scancel", "release worker jobs"),
)


def machine_report() -> dict:
    """Which sandbox runtimes and fleet providers this machine can use, and why not."""
    tools = {name: shutil.which(name) for _, name, _ in REQUIREMENTS}
    filesystems = Path("/proc/filesystems").read_text() if Path("/proc/filesystems").exists() \
        else ""
    return {
        "tools": tools,
        "overlayfs": "overlay" in filesystems,
        "fuse": Path("/dev/fuse").exists(),
        "slurm_conf": os.environ.get("SLURM_CONF"),
        "runtimes": {
            "local": bool(tools["bwrap"] and (tools["squashfuse"] or tools["unsquashfs"])),
            "apptainer": bool(tools["apptainer"]),
        },
        "providers": {"local": True,
                      "slurm": all(tools[n] for n in ("sbatch", "squeue", "scancel"))},
    }


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Sandfleet: a Slurm-scaled fleet of sandboxes for agent rollouts."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command("doctor")
@click.option("-o", "--output", type=click.Choice(["text", "json"]), default="text")
def doctor_cmd(output: str) -> None:
    """Report which runtimes and providers this machine supports."""
    report = machine_report()
    if output == "json":
        click.echo(json.dumps(report, indent=2))
        return
    for kind, name, why in REQUIREMENTS:
        path = report["tools"][name]
        click.echo(f"{'ok ' if path else 'no '} {kind:18} {name:12} {path or '-':28} {why}")
    click.echo(f"overlayfs: {'yes' if report['overlayfs'] else 'no'}   "
               f"/dev/fuse: {'yes' if report['fuse'] else 'no'}   "
               f"SLURM_CONF: {report['slurm_conf'] or '-'}")
    usable = [k for k, v in {**report['runtimes']}.items() if v]
    click.echo(f"runtimes usable here: {', '.join(usable) or 'none'}; providers: "
               + ", ".join(k for k, v in report["providers"].items() if v))
