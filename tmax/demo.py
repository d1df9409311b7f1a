"""`tmax demo`: the main job on its embedded defaults.

Today it exercises the foundation end to end: it loads the example tasks, brings up a local
Slurm cluster (unless SLURM_CONF points at one), submits one Slurm job per (task, mode) with
submitit, and in each job builds the task's sandbox, runs the reference solution (oracle)
or nothing (nop), then the verifier. It prints the table of rewards and writes
``results.json`` into the run folder. Later stages (images, fleet, training) grow from here.
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

from tmax.tasks import find_tasks, load_task

log = logging.getLogger(__name__)


def check_job(task_path: str, mode: str) -> dict:
    """Runs on a Slurm node: one sandboxed check of one task."""
    from tmax.tasks.check import check_task

    result = check_task(load_task(task_path), mode)  # type: ignore[arg-type]
    return {**result.to_dict(), "node": os.environ.get("SLURMD_NODENAME", "")}


def local_slurm_helper() -> str:
    """Path of bin/tmax-local-slurm: the checkout's own, else the installed one."""
    candidates = [Path(__file__).resolve().parents[1] / "bin" / "tmax-local-slurm",
                  Path(sys.executable).parent / "tmax-local-slurm"]
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
                              capture_output=True, timeout=timeout)

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


def run_on_slurm(jobs: list[tuple[str, str]], folder: Path) -> list[dict]:
    import submitit
    from tqdm import tqdm

    executor = submitit.AutoExecutor(folder=folder / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=15, cpus_per_task=1, slurm_partition="debug",
                               name="tmax-demo")
    submitted = executor.map_array(check_job, [j[0] for j in jobs], [j[1] for j in jobs])
    with tqdm(total=len(submitted), desc="slurm jobs", unit="job") as bar:
        pending = set(range(len(submitted)))
        while pending:
            done = {i for i in pending if submitted[i].done()}
            bar.update(len(done))
            pending -= done
            if pending:
                time.sleep(1.0)
    return [job.result() for job in submitted]


def run_demo(tasks_dir: Path, out_dir: Path, slurm_dir: Path, nodes: int, cpus: int,
             use_slurm: bool) -> dict:
    tasks = [load_task(p) for p in find_tasks(tasks_dir)]
    jobs = [(str(t.root.resolve()), mode) for t in tasks for mode in ("oracle", "nop")]
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if not use_slurm:
        results = [check_job(path, mode) for path, mode in jobs]
    elif os.environ.get("SLURM_CONF"):
        results = run_on_slurm(jobs, out_dir)
    else:
        with LocalCluster(slurm_dir, nodes, cpus) as conf:
            os.environ["SLURM_CONF"] = conf
            try:
                results = run_on_slurm(jobs, out_dir)
            finally:
                os.environ.pop("SLURM_CONF", None)
    summary = {"tasks": len(tasks), "jobs": len(jobs),
               "seconds": round(time.monotonic() - started, 1),
               "nodes": sorted({r["node"] for r in results if r["node"]}),
               "results": results}
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out_dir / "results.json")
    return summary
