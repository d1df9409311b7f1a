"""Task checks in real bubblewrap sandboxes: examples, converted tasks, verifier errors."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.unit.test_tasks import DATA, EXAMPLES, make_task, run_cli
from tmax.tasks import find_tasks, load_task, read_any, write_task
from tmax.tasks.check import check_task
from tmax.tasks.reward import VerifierError, read_reward

pytestmark = pytest.mark.sandbox

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap missing: run bin/tmax-setup")


@needs_bwrap
@pytest.mark.parametrize("task_dir", find_tasks(EXAMPLES), ids=lambda p: p.name)
def test_example_oracle_scores_one_and_nop_zero(task_dir):
    task = load_task(task_dir)
    oracle, nop = check_task(task, "oracle"), check_task(task, "nop")
    assert oracle.reward == 1.0, oracle.log
    assert nop.reward == 0.0, nop.log


@needs_bwrap
@pytest.mark.parametrize("src", ["tb1/hello-file", "tb1/word-count", "tmax-v1/config-port"])
def test_converted_tasks_run_and_grade(tmp_path, src):
    task = write_task(read_any(DATA / src), tmp_path)
    assert check_task(task, "oracle").reward == 1.0
    assert check_task(task, "nop").reward == 0.0


@needs_bwrap
def test_sandbox_hides_host_and_has_no_network(tmp_path):
    probe = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
             "ok=1\n[ -e /work ] && ok=0\n[ -e /root/.bashrc ] && ok=0\n"
             "python3 -c 'import socket, sys; "
             "sys.exit([n for _, n in socket.if_nameindex()] != [\"lo\"])' || ok=0\n"
             "echo $ok > /logs/verifier/reward.txt\n")
    task = load_task(make_task(tmp_path, **{"tests/test.sh": probe}))
    assert check_task(task, "nop").reward == 1.0


@needs_bwrap
def test_verifier_that_writes_no_reward_is_an_error_not_zero(tmp_path):
    task = load_task(make_task(tmp_path, **{
        "tests/test.sh": "#!/bin/bash\n# forgets to write /logs/verifier/reward.txt\nexit 0\n"}))
    result = check_task(task, "oracle")
    assert result.reward is None
    assert "wrote no reward" in result.error


@needs_bwrap
def test_stale_reward_from_the_agent_is_removed(tmp_path):
    task = load_task(make_task(tmp_path, **{
        "solution/solve.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                             "echo 1 > /logs/verifier/reward.txt\n",
        "tests/test.sh": "#!/bin/bash\n# only writes a reward when the answer is right\n"
                         "grep -qx 42 /app/answer.txt && echo 1 > /logs/verifier/reward.txt\n"}))
    result = check_task(task, "oracle")
    assert result.reward is None and "wrote no reward" in result.error


@needs_bwrap
def test_cli_check_flags_a_task_passed_by_doing_nothing(tmp_path):
    make_task(tmp_path, "good")
    make_task(tmp_path, "lazy", **{"tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                                   "echo 1 > /logs/verifier/reward.txt\n"})
    res = run_cli("tasks", "check", tmp_path, "-o", "json")
    assert res.exit_code == 1
    verdicts = json.loads(res.output)["tasks"]
    assert verdicts["good"] == {"oracle": 1.0, "nop": 0.0, "verdict": "ok"}
    assert verdicts["lazy"]["verdict"] == "passes by doing nothing"


@pytest.mark.parametrize("files, expected", [
    ({"reward.txt": "0.75\n"}, 0.75),
    ({"reward.json": '{"reward": 0.5, "checks": 4}'}, 0.5),
    ({"reward.txt": "1", "reward.json": '{"reward": 0}'}, 1.0),
    # Harbor's multi-reward form: named rewards and no total -> their mean, (1 + 0) / 2
    ({"reward.json": '{"correctness": 1, "performance": 0}'}, 0.5),
    ({"reward.json": '{"score": 1}'}, 1.0),
])
def test_read_reward(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert read_reward(tmp_path, "t") == expected


@pytest.mark.parametrize("files, words", [
    ({}, "wrote no reward"),
    ({"reward.txt": "yes"}, "not a number"),
    ({"reward.txt": "1.5"}, "outside [0, 1]"),
    ({"reward.txt": "nan"}, "outside [0, 1]"),
    ({"reward.json": "{"}, "not JSON"),
    ({"reward.json": '{"score": "high"}'}, "'reward' key"),
    ({"reward.json": '{"reward": "1", "x": 1}'}, "'reward' key"),
    ({"reward.json": '{}'}, "flat dict"),
    ({"reward.json": '{"a": 1, "b": 3}'}, "outside [0, 1]"),
])
def test_read_reward_errors(tmp_path, files, words):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(VerifierError, match="t: verifier") as exc:
        read_reward(tmp_path, "t")
    assert words in exc.value.reason
