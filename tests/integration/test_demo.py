"""The main job (`tmax demo`) end to end on the real local Slurm cluster."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.unit.test_tasks import EXAMPLES, make_task
from tmax.demo import run_demo

pytestmark = [pytest.mark.slurm, pytest.mark.sandbox, pytest.mark.slow]


def test_demo_builds_and_checks_images_in_slurm_jobs(local_slurm, image_store, tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(EXAMPLES / "hello-world-file", tasks / "hello-world-file")
    make_task(tasks, "lazy", **{"tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                                "echo 1 > /logs/verifier/reward.txt\n",
                                # its own input, so its image is not hello-world-file's
                                "environment/Dockerfile": "FROM python:3.11-slim\n"
                                "WORKDIR /app\nRUN echo lazy > /app/marker\n"})
    out = tmp_path / "run"
    summary = run_demo(tasks, out, image_store.root, Path.home() / ".cache" / "tmax",
                       tmp_path / "unused", nodes=2, cpus=1, use_slurm=True)
    assert set(summary["nodes"]) <= {"n1", "n2", "n3"} and summary["nodes"]
    by_task = {r["task_id"]: r for r in summary["results"]}
    assert by_task["hello-world-file"]["status"] == "built", by_task["hello-world-file"]
    assert by_task["hello-world-file"]["checks"]["ok"] is True
    assert by_task["lazy"]["checks"]["reason"] == "the untouched environment already scores 1.0"
    assert set(image_store.read().tasks) == {"hello-world-file", "lazy"}
    assert json.loads((out / "results.json").read_text())["tasks"] == 2
    # a second run reuses the images
    again = run_demo(tasks, tmp_path / "run2", image_store.root, Path.home() / ".cache" / "tmax",
                     tmp_path / "unused", nodes=2, cpus=1, use_slurm=False)
    assert {r["status"] for r in again["results"]} == {"cached"}
    assert {r["task_id"]: r["checks"]["ok"] for r in again["results"]} == \
        {"hello-world-file": True, "lazy": False}
