"""The main job (`tmax demo`) end to end on the real local Slurm cluster."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.test_tasks import EXAMPLES, make_task
from tmax.demo import run_demo

pytestmark = [pytest.mark.slurm, pytest.mark.sandbox]


def test_demo_runs_checks_as_slurm_jobs(local_slurm, tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(EXAMPLES / "hello-world-file", tasks / "hello-world-file")
    make_task(tasks, "lazy", **{"tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                                "echo 1 > /logs/verifier/reward.txt\n"})
    out = tmp_path / "run"
    summary = run_demo(tasks, out, tmp_path / "unused", nodes=2, cpus=1, use_slurm=True)
    assert summary["jobs"] == 4
    assert set(summary["nodes"]) <= {"n1", "n2", "n3"} and summary["nodes"]
    rewards = {(r["task"], r["mode"]): r["reward"] for r in summary["results"]}
    assert rewards == {("hello-world-file", "oracle"): 1.0, ("hello-world-file", "nop"): 0.0,
                       ("lazy", "oracle"): 1.0, ("lazy", "nop"): 1.0}
    assert json.loads((out / "results.json").read_text())["jobs"] == 4
    assert list(out.glob("submitit/*_log.out")), "submitit wrote job logs"
