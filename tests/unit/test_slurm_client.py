"""sandfleet.slurm, the one Slurm client: the renderer's exact lines and refusals, and the
calls and the poller against fake sbatch/squeue/scontrol/sacct/scancel on PATH (each logs
its argv and answers what the test wrote for it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sandfleet.slurm import (
    Poller,
    SlurmClient,
    SlurmError,
    SubmitError,
    render_template,
    sbatch_lines,
    template_text,
)

TOOLS = ("sbatch", "squeue", "scontrol", "sacct", "scancel")
FAKE = """#!/bin/sh
name=$(basename "$0")
echo "$name $*" >> "$FAKE_DIR/calls"
[ -f "$FAKE_DIR/$name.out" ] && cat "$FAKE_DIR/$name.out"
[ -f "$FAKE_DIR/$name.err" ] && cat "$FAKE_DIR/$name.err" >&2
exit "$(cat "$FAKE_DIR/$name.rc" 2>/dev/null || echo 0)"
"""


class Fake:
    def __init__(self, root: Path):
        self.root = root
        for tool in TOOLS:
            path = root / tool
            path.write_text(FAKE)
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
        self.env = {"PATH": f"{root}{os.pathsep}{os.environ['PATH']}", "FAKE_DIR": str(root)}

    def answer(self, tool: str, out: str = "", err: str = "", rc: int = 0) -> None:
        (self.root / f"{tool}.out").write_text(out)
        (self.root / f"{tool}.err").write_text(err)
        (self.root / f"{tool}.rc").write_text(str(rc))

    def calls(self, tool: str | None = None) -> list[str]:
        path = self.root / "calls"
        lines = path.read_text().splitlines() if path.exists() else []
        return [c for c in lines if tool is None or c.split()[0] == tool]


@pytest.fixture
def fake(tmp_path):
    return Fake(tmp_path)


def test_sbatch_lines_are_exact_and_in_one_order():
    assert sbatch_lines(["--constraint=cpu"], ("requeue",), time="1:00:00", job_name="j",
                        nodes=2, ntasks_per_node=4, partition=None, signal="USR2@300") == [
        "#SBATCH --job-name=j", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
        "#SBATCH --time=1:00:00", "#SBATCH --signal=USR2@300", "#SBATCH --requeue",
        "#SBATCH --constraint=cpu"]


@pytest.mark.parametrize("value", ["/scratch/my runs/x-%j.out", "a\n#SBATCH --uid=0", "a\tb",
                                   "", "  "])
def test_a_value_with_a_space_or_newline_is_refused(value):
    with pytest.raises(ValueError, match="bad sbatch value for output"):
        sbatch_lines(output=value)


def test_unknown_options_and_bad_extras_are_refused_with_the_valid_list():
    with pytest.raises(ValueError, match="unknown sbatch options.*valid: job_name"):
        sbatch_lines(walltime=10)
    with pytest.raises(ValueError, match="unknown sbatch options"):
        sbatch_lines(flags=("exclusive",))
    with pytest.raises(ValueError, match="--key=value"):
        sbatch_lines(["--x=1\n#SBATCH --uid=0"])
    with pytest.raises(ValueError, match="--key=value"):
        sbatch_lines(["uid=0"])


def test_render_template_fills_every_placeholder_or_names_the_missing_one():
    assert render_template("a {{x}} {{y}} {{x}}", {"x": "1", "y": "2"}) == "a 1 2 1"
    with pytest.raises(ValueError, match=r"\{\{y\}\} has no value; given: x"):
        render_template("{{x}} {{y}}", {"x": "1"})


@pytest.mark.parametrize("package, name", [
    ("sandfleet", "sandfleet-worker.sbatch"), ("tmax.train", "tmax-trainer.sbatch"),
    ("tmax.train", "tmax-inference.sbatch"), ("tmax.train", "tmax-orchestrator.sbatch")])
def test_the_templates_are_package_data(package, name):
    text = template_text(package, name)
    assert text.startswith("#!/bin/bash") and "{{sbatch_options}}" in text


def test_submit_returns_the_id_and_a_refusal_carries_its_stderr(fake, tmp_path):
    client = SlurmClient(10, fake.env)
    fake.answer("sbatch", "4242;cluster\n")
    assert client.submit(tmp_path / "job.sbatch") == "4242"
    assert fake.calls("sbatch") == [f"sbatch --parsable {tmp_path / 'job.sbatch'}"]
    fake.answer("sbatch", "", "sbatch: error: Invalid partition name specified\n", 1)
    with pytest.raises(SubmitError) as e:
        client.submit(tmp_path / "job.sbatch")
    assert e.value.returncode == 1 and "Invalid partition" in e.value.stderr
    assert str(e.value).startswith(f"sbatch {tmp_path / 'job.sbatch'} failed (1): sbatch: error")


def test_states_ask_squeue_once_for_all_then_scontrol_then_one_sacct(fake):
    client = SlurmClient(10, fake.env)
    fake.answer("squeue", "11|RUNNING|me|n1|a\n12|PENDING|me||b\n")
    fake.answer("scontrol", "")  # forgot 13 and 14 (MinJobAge)
    fake.answer("sacct", "13|COMPLETED\n14|CANCELLED by 1000\n")
    assert client.states(["11", "12", "13", "14", "11"]) == {
        "11": "RUNNING", "12": "PENDING", "13": "COMPLETED", "14": "CANCELLED"}
    assert fake.calls("squeue") == ["squeue -h -j 11,12,13,14 -o %i|%T|%u|%N|%j"]
    assert fake.calls("scontrol") == ["scontrol -o show job 13", "scontrol -o show job 14"]
    assert fake.calls("sacct") == ["sacct -n -X -P -j 13,14 -o JobID,State"]


def test_a_job_nobody_knows_is_unknown_and_a_failed_squeue_still_asks_scontrol(fake):
    client = SlurmClient(10, fake.env)
    fake.answer("squeue", "", "slurm_load_jobs error: Unable to contact slurm controller", 1)
    fake.answer("scontrol", "JobId=7 JobName=x JobState=FAILED Reason=NonZeroExitCode\n")
    fake.answer("sacct", "", "accounting storage is disabled", 1)
    assert client.states(["7"]) == {"7": "FAILED"}
    fake.answer("scontrol", "")
    assert client.states(["8"]) == {"8": "UNKNOWN"}
    with pytest.raises(SlurmError) as e:
        client.queue(["7"])
    assert e.value.returncode == 1 and "Unable to contact" in e.value.stderr


def test_cancel_is_by_id_only_and_an_ended_job_is_no_failure(fake):
    client = SlurmClient(10, fake.env)
    with pytest.raises(ValueError, match="not a Slurm job id"):
        client.cancel("-u me")
    fake.answer("scancel", "", "scancel: error: Kill job error on job id 5: Invalid job id "
                "specified", 1)
    client.cancel("5")
    fake.answer("scancel", "", "scancel: error: Access/permission denied", 1)
    with pytest.raises(SlurmError, match="permission denied"):
        client.cancel("6")
    assert fake.calls("scancel") == ["scancel 5", "scancel 6"]
    fake.answer("scontrol", "", "", 0)
    client.requeue("9")
    assert fake.calls("scontrol") == ["scontrol requeue 9"]


def test_the_poller_batches_every_watched_job_and_backs_off_while_nothing_changes(fake):
    now = [0.0]
    poller = Poller(SlurmClient(10, fake.env), 1.0, 8.0, clock=lambda: now[0])
    fake.answer("squeue", "1|RUNNING|me|n1|a\n2|PENDING|me||b\n")
    assert poller.states(["1"]) == {"1": "RUNNING"}
    assert poller.states(["2"]) == {"2": "PENDING"}  # new job: asked at once, with job 1
    assert [c.split()[3] for c in fake.calls("squeue")] == ["1", "1,2"]
    intervals = []
    for _ in range(6):  # nothing changes: 2, 4, 8, 8 ... seconds between polls
        now[0] += poller.interval - 0.01
        poller.states(["1"])
        before = len(fake.calls("squeue"))
        now[0] += 0.01
        poller.states(["1"])
        assert len(fake.calls("squeue")) == before + 1  # due: one squeue for both jobs
        intervals.append(poller.interval)
    assert intervals == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert all(c.endswith("-j 1,2 -o %i|%T|%u|%N|%j") for c in fake.calls("squeue")[1:])
    fake.answer("squeue", "1|RUNNING|me|n1|a\n2|RUNNING|me|n2|b\n")
    now[0] += poller.interval
    assert poller.states() == {"1": "RUNNING", "2": "RUNNING"}
    assert poller.interval == 1.0  # a change: back to min_s
    calls = len(fake.calls("squeue"))
    assert poller.states(["2"], fresh=True) == {"2": "RUNNING"}
    assert len(fake.calls("squeue")) == calls + 1


def test_the_poller_stops_asking_about_an_ended_job_unless_fresh(fake):
    now = [0.0]
    poller = Poller(SlurmClient(10, fake.env), 1.0, clock=lambda: now[0])
    fake.answer("squeue", "1|RUNNING|me|n1|a\n")
    fake.answer("scontrol", "JobId=2 JobState=FAILED\n")
    assert poller.states(["1", "2"]) == {"1": "RUNNING", "2": "FAILED"}
    now[0] += 5
    assert poller.states() == {"1": "RUNNING", "2": "FAILED"}
    assert [c.split()[3] for c in fake.calls("squeue")] == ["1,2", "1"]
    assert fake.calls("scontrol") == ["scontrol -o show job 2"]  # not asked again
    assert poller.states(["2"], fresh=True) == {"2": "FAILED"}
    assert fake.calls("squeue")[-1].split()[3] == "1,2"
