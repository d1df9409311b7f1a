"""tmax.launch.array: one function over many arguments as a real Slurm job array."""

from __future__ import annotations

import subprocess
import time

import pytest

from tmax.launch.array import ArrayOptions, run_array

pytestmark = pytest.mark.slow


def square(x: int) -> int:
    return x * x


def fail_on_odd(x: int) -> int:
    if x % 2:
        raise ValueError(f"odd input {x}")
    return x


def sleep_long(_: int) -> None:
    time.sleep(600)


def squeue(env: dict[str, str]) -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


@pytest.mark.slurm
def test_results_come_back_in_order_and_a_failed_task_is_named_with_its_log(
        local_slurm, tmp_path, capfd):
    options = ArrayOptions(name="t-array", time_min=5)
    got = run_array(square, [(i,) for i in range(3)], tmp_path, options, progress=True,
                    poll_s=0.3)
    assert [o.result for o in got] == [0, 1, 4] and all(o.error is None for o in got)
    # Slurm's client chatter (this cluster has no accounting: sacct says so on every poll)
    # goes to the array's log; the progress bar reaches the terminal
    err = capfd.readouterr().err
    assert "accounting storage is disabled" not in err and "t-array" in err
    assert "accounting storage is disabled" in (tmp_path / "slurm-client.log").read_text()
    assert len({o.job_id.split("_")[0] for o in got}) == 1  # one sbatch --array
    mixed = run_array(fail_on_odd, [(0,), (1,)], tmp_path, options, progress=False,
                      poll_s=0.3)
    assert mixed[0].result == 0 and mixed[0].error is None
    assert "odd input 1" in (mixed[1].error or "") and mixed[1].log.endswith(".err")


@pytest.mark.slurm
def test_an_interrupted_wait_cancels_its_unfinished_tasks_by_id(local_slurm, tmp_path,
                                                                 monkeypatch):
    import tmax.launch.array as array

    before = squeue(local_slurm.env)
    calls = {"n": 0}
    real_sleep = time.sleep

    def interrupt(seconds: float) -> None:  # Ctrl-C once both tasks are queued or running
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(array.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_array(sleep_long, [(0,), (1,)], tmp_path, ArrayOptions(name="t-cancel",
                                                                   time_min=10),
                  progress=False, poll_s=0.5)
    monkeypatch.undo()
    deadline = time.monotonic() + 60
    while squeue(local_slurm.env) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert squeue(local_slurm.env) - before == set()  # none of its tasks is left
