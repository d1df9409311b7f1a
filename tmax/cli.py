"""`tmax`: the command line of the recipe (tasks, images, eval, data...)."""

from __future__ import annotations

import logging

import click

from tmax.tasks.cli import tasks_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="tmax")
def main(verbose: int) -> None:
    """TMax: train terminal agents with RL on Slurm."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


main.add_command(tasks_group)
