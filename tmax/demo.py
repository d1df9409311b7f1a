"""`tmax demo`: the main job on its embedded defaults.

Today it runs the foundation end to end: it loads the example tasks, builds the base image
once, brings up a local Slurm cluster (unless SLURM_CONF points at one), and submits one
Slurm job per task with submitit. Each job builds the task's SIF into the shared store
(content-addressed: unchanged tasks are reused) and checks it in real sandboxes of the
local runtime: the untouched environment must score below 1, the reference solution 1.
Later stages (the fleet, rollouts, training) grow from here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tmax.tasks import find_tasks, load_task

log = logging.getLogger(__name__)


def build_job(task_path: str, store: str, cache: str, force: bool) -> dict:
    """Runs on a Slurm node: build (or reuse) and check one task's image."""
    from tmax.images.build import open_builds
    from tmax.images.checks import checks_end_on_sigterm

    builds = open_builds(store, builder="auto", cache_dir=cache)
    with checks_end_on_sigterm():  # (scancel: its check sandboxes end with the job)
        result = builds.build(load_task(task_path), force=force)
    return {**result.to_dict(), "node": os.environ.get("SLURMD_NODENAME", "")}


def local_slurm_helper() -> str:
    """Path of the installed tmax-local-slurm: next to this Python, else on PATH."""
    candidates = [Path(sys.executable).parent / "tmax-local-slurm"]
    found = next((str(c) for c in candidates if c.exists()), shutil.which("tmax-local-slurm"))
    if not found:
        raise RuntimeError("tmax-local-slurm not found: run bin/tmax-setup")
    return found


class LocalCluster:
    """Starts the local cluster if it is not up, and stops it afterwards only if it did."""

    def __init__(self, state_dir: Path, nodes: int, cpus: int):
        self.dir, self.nodes, self.cpus = state_dir, nodes, cpus
        self.helper = local_slurm_helper()
        self.started = False

    def _call(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.helper, *args, "--dir", str(self.dir)], text=True,
                              capture_output=True, timeout=timeout, check=False)

    def __enter__(self) -> str:
        status = self._call("status", "-o", "json", timeout=30)
        was_up = status.returncode == 0 and json.loads(status.stdout or "{}").get("healthy")
        if not was_up:
            up = self._call("up", "--nodes", str(self.nodes), "--cpus", str(self.cpus))
            if up.returncode != 0:
                raise RuntimeError(f"local Slurm cluster did not start:\n{up.stderr}")
            self.started = True
        return str(self.dir / "etc" / "slurm.conf")

    def __exit__(self, *exc) -> None:
        if self.started:
            down = self._call("down")
            if down.returncode != 0:
                log.warning("local Slurm cluster did not stop cleanly: %s", down.stderr)


def run_on_slurm(fn, args: list[list], folder: Path, cpus: int) -> list[dict]:
    """One Slurm job per argument tuple (a submitit job array); results in order."""
    from tmax.launch.array import ArrayOptions, run_array

    outcomes = run_array(fn, list(zip(*args, strict=True)), folder / "submitit",
                         ArrayOptions(name="tmax-demo", partition="debug", cpus=cpus,
                                      time_min=30))
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        raise RuntimeError("; ".join(f"array task {o.index} (job {o.job_id}) failed: "
                                     f"{o.error} (log {o.log})" for o in failed))
    return [o.result for o in outcomes]


def run_demo(tasks_dir: Path, out_dir: Path, store: Path, cache: Path, slurm_dir: Path, *,
             nodes: int, cpus: int, use_slurm: bool, force: bool = False) -> dict:
    from tmax.images.build import open_builds

    tasks = [load_task(p) for p in find_tasks(tasks_dir)]
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    builds = open_builds(store, builder="auto", cache_dir=cache, check=False)
    bases = sorted({builds.plan(t).base for t in tasks})
    for base in bases:  # once, here, before the per-task jobs fan out
        log.warning("base image %s: building if missing (a few minutes the first time)", base)
        builds.ensure_base(base)
    args: list[list[Any]] = [[str(t.root.resolve()) for t in tasks], [str(store)] * len(tasks),
            [str(cache)] * len(tasks), [force] * len(tasks)]
    if not use_slurm:
        results = [build_job(*a) for a in zip(*args)]
    elif os.environ.get("SLURM_CONF"):
        results = run_on_slurm(build_job, args, out_dir, cpus)
    else:
        with LocalCluster(slurm_dir, nodes, cpus) as conf:
            os.environ["SLURM_CONF"] = conf
            try:
                results = run_on_slurm(build_job, args, out_dir, cpus)
            finally:
                os.environ.pop("SLURM_CONF", None)
    summary = {"tasks": len(tasks), "store": str(store),
               "seconds": round(time.monotonic() - started, 1),
               "nodes": sorted({r["node"] for r in results if r["node"]}),
               "results": results}
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out_dir / "results.json")
    return summary
