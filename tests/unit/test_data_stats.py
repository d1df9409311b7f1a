"""`tmax data stats`: a gen run's yield per stage, pass@k from an eval, PNG plots, JSON,
errors. Tasks are written by gen's own ``draft_of`` + ``write_task``, the run's records by
gen's ``Record``/``Stage`` (one JSON line each, as ``Generator._append`` writes them), the
eval's results by ``append_jsonl(Trajectory(...).to_dict())``, as the eval runner does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tmax.cli import main
from tmax.data.axes import sample_axes
from tmax.data.config import load_gen_config
from tmax.data.gen import RECORDS, Record, Stage, TaskReply, draft_of, task_id_of
from tmax.data.stats import StatsError, dataset_stats, format_stats, ks_for, write_plots
from tmax.rollout.trajectory import Trajectory, append_jsonl
from tmax.tasks import write_task

DOCKERFILE = "FROM python:3.11-slim\nWORKDIR /app\n"
TEST_SH = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
           "test -f /app/done && echo 1 > /logs/verifier/reward.txt "
           "|| echo 0 > /logs/verifier/reward.txt\n")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_gen_task(root: Path, seed: int, domain: str, difficulty: str) -> Path:
    """A native task as `tmax gen` writes it (id gen-<seed>, every axis in metadata.axes)."""
    config = load_gen_config()
    axes = sample_axes(config.axes, seed) | {"domain": domain}
    reply = TaskReply(instruction=f"Create the file /app/done to finish task number {seed}.",
                      difficulty=difficulty, dockerfile=DOCKERFILE, test_sh=TEST_SH,
                      solve_sh="#!/bin/bash\ntouch /app/done\n")
    return write_task(draft_of(reply, seed, axes, config), root).root


def record(seed: int, domain: str, outcome: str, failed: list[str] = (), **flags) -> dict:
    """A gen record; ``failed``: the stages that failed, in order (one per repair round)."""
    stages = [Stage(name, False, 0.1, i + 1, "boom") for i, name in enumerate(failed)]
    if outcome == "kept":
        stages = [Stage(n, True, 0.1, 1) for n in ("parse", "validate", "build", "check",
                                                    "write")]
    axes = sample_axes(load_gen_config().axes, seed) | {"domain": domain}
    return Record(seed, task_id_of(seed), axes, outcome=outcome, reason=",".join(failed),
                  rounds=max(len(failed), 1), stages=stages, **flags).to_dict()


KEPT = {"parsed": True, "built": True, "checked": True, "kept": True}


@pytest.fixture
def run(tmp_path) -> Path:
    """A gen run folder: 6 seeds, 2 kept (their tasks in RUN/tasks), 3 dropped, 1 error;
    seed 3 first failed on the teacher (error), then a rerun kept it (the later line wins)."""
    out = tmp_path / "gen1"
    out.mkdir()
    lines = [record(0, "security", "kept", **KEPT),
             record(1, "security", "dropped", ["check"], parsed=True, built=True),
             record(2, "debugging", "dropped", ["parse"]),
             record(3, "debugging", "error"),
             record(4, "debugging", "dropped", ["build", "build"], parsed=True),
             record(5, "security", "error"),
             record(3, "debugging", "kept", **KEPT)]
    (out / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    write_gen_task(out / "tasks", 0, "security", "easy")
    write_gen_task(out / "tasks", 3, "debugging", "hard")
    return out


def test_yield_per_stage_of_a_run_folder_by_hand(run):
    # attempted: seeds 0-4 (5 is unfinished); parsed 0,1,3,4; built 0,1,3; checked/kept 0,3
    # security = seeds 0,1; debugging = seeds 2,3,4
    want = {"debugging": {"attempted": 3, "parsed": 2, "built": 1, "checked": 1, "kept": 1},
            "security": {"attempted": 2, "parsed": 2, "built": 2, "checked": 1, "kept": 1},
            "all": {"attempted": 5, "parsed": 4, "built": 3, "checked": 2, "kept": 2}}
    for folder in (run, run / "tasks"):  # the run folder, or its tasks/ folder
        s = dataset_stats(folder)
        assert s["tasks"] == 2 and s["tasks_dir"] == str(run / "tasks")
        assert s["counts"]["domain"] == {"debugging": 1, "security": 1}
        assert s["counts"]["difficulty"] == {"easy": 1, "hard": 1}
        y = s["yield"]
        assert y["run"] == str(run) and y["records"] == 6 and y["unfinished"] == 1
        assert y["table"] == want
        assert y["drop_reasons"] == {"check": 1, "parse": 1, "build": 1}


def test_side_by_side_text_has_the_yield_and_a_plain_folder_has_none(run, tmp_path):
    write_gen_task(tmp_path / "bench", 7, "security", "medium")
    res = CliRunner().invoke(main, ["data", "stats", str(run), str(tmp_path / "bench")])
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.output.splitlines()]
    assert rows[0] == ["gen1", "bench"]
    assert ["tasks", "2", "1"] in rows
    assert ["yield", "attempted", "5", "-"] in rows and ["yield", "kept", "2", "-"] in rows
    assert ["yield", "unfinished", "1", "-"] in rows
    assert ["dropped", "at", "build", "1", "-"] in rows
    assert ["all", "5", "4", "3", "2", "2"] in rows  # gen's own yield table, per run
    assert "pass@1" not in res.output
    assert "yield" not in format_stats([dataset_stats(tmp_path / "bench")])


def write_eval(path: Path) -> Path:
    """results.jsonl as the eval runner appends it. The records' own domain is wrong on
    purpose: the stats group by the dataset's tasks."""
    def traj(task, trial, reward, **kw):
        append_jsonl(path, Trajectory(task=task, policy="p", trial=trial, domain="wrong",
                                      reward=reward, **kw).to_dict())

    traj("gen-000000", 0, None, attempt=0, infra_failure={"cause": "node lost"})
    for trial, reward in enumerate([1.0, 0.0, 0.0, 0.0]):
        traj("gen-000000", trial, reward, attempt=1 if trial == 0 else 0)
    for trial, reward in enumerate([1.0, 1.0, 0.0]):
        traj("gen-000003", trial, reward)
    traj("gen-000003", 3, None, verifier_error="no reward file")  # not scored
    traj("not-in-the-dataset", 0, 1.0)
    return path


def test_pass_at_k_from_an_eval_by_hand(run, tmp_path):
    write_eval(tmp_path / "results.jsonl")
    e = dataset_stats(run, tmp_path / "results.jsonl")["eval"]
    # gen-000000: n=4 scored trials, c=1 pass (the infra-failed attempt is replaced):
    #   pass@1 = 1/4 = 0.25; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5;
    #   pass@4 = 1 - C(3,4)/C(4,4) = 1 - 0 = 1.
    # gen-000003: n=3 (trial 3 had a verifier error), c=2:
    #   pass@1 = 2/3; pass@2 = 1 - C(1,2)/C(3,2) = 1 - 0 = 1; pass@4: n < 4, not counted.
    # overall: pass@1 = (0.25 + 2/3) / 2 = 0.458333; pass@2 = (0.5 + 1) / 2 = 0.75;
    #   pass@4 = 1.0 (gen-000000 only).
    assert e["trials"] == 4 and e["ks"] == [1, 2, 4]
    assert e["n_tasks"] == 2 and e["n_trials"] == 7
    assert e["unmatched_tasks"] == 1 and e["tasks_without_eval"] == 0
    assert e["pass_at_k"] == pytest.approx({1: 0.458333, 2: 0.75, 4: 1.0}, abs=1e-6)
    assert e["by_domain"]["security"]["pass_at_k"] == pytest.approx({1: 0.25, 2: 0.5, 4: 1.0})
    assert e["by_domain"]["debugging"]["pass_at_k"] == pytest.approx(
        {1: 2 / 3, 2: 1.0, 4: None}, abs=1e-6)
    assert set(e["by_difficulty"]) == {"easy", "hard"}
    assert e["by_difficulty"]["easy"]["pass_at_k"][2] == pytest.approx(0.5)
    assert "wrong" not in e["by_domain"]


def test_one_eval_for_every_folder_or_one_each(run, tmp_path):
    (tmp_path / "ev").mkdir()
    write_eval(tmp_path / "ev" / "results.jsonl")
    bench = write_gen_task(tmp_path / "bench", 0, "security", "easy").parent  # gen-000000 only
    res = CliRunner().invoke(main, ["data", "stats", str(run), str(bench),
                                    "--eval", str(tmp_path / "ev")])  # the eval's folder
    assert res.exit_code == 0, res.output
    rows = [line.split() for line in res.output.splitlines()]
    assert ["pass@1", "0.458", "0.250"] in rows and ["pass@4", "1.000", "1.000"] in rows
    assert ["eval", "tasks", "not", "in", "dataset", "1", "2"] in rows
    assert ["domain=debugging", "pass@2", "1.000", "-"] in rows
    res = CliRunner().invoke(main, ["data", "stats", str(run), str(bench), "--eval",
                                    str(tmp_path / "ev"), "--eval", str(tmp_path / "ev"),
                                    "--eval", str(tmp_path / "ev")])
    assert res.exit_code == 2 and "3 given for 2 folders" in res.output


def test_plots_are_written_as_valid_pngs(run, tmp_path):
    write_eval(tmp_path / "results.jsonl")
    bench = write_gen_task(tmp_path / "bench", 9, "debugging", "medium").parent
    res = CliRunner().invoke(main, ["data", "stats", str(run), str(bench), "--eval",
                                    str(tmp_path / "results.jsonl"), "--plot",
                                    str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert {"axis_domain.png", "axis_difficulty.png", "balance.png", "lengths.png",
            "yield.png", "pass_at_k.png"} <= set(written)
    assert not [n for n in written if not n.endswith(".png")]  # no temp file left
    printed = [line.split(" ", 1)[1] for line in res.output.splitlines()
               if line.startswith("plot ")]
    assert sorted(Path(p).name for p in printed) == written
    for name in written:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 2000, name
    # without a run or an eval: no yield or pass@k plot
    names = {p.name for p in write_plots([dataset_stats(bench)], tmp_path / "p2")}
    assert "yield.png" not in names and "pass_at_k.png" not in names
    assert "balance.png" in names


def test_json_has_counts_yield_and_pass_at_k(run, tmp_path):
    write_eval(tmp_path / "results.jsonl")
    res = CliRunner().invoke(main, ["data", "stats", str(run), "-o", "json", "--eval",
                                    str(tmp_path / "results.jsonl"), "--plot",
                                    str(tmp_path / "plots")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (s,) = json.loads(res.stdout)  # the plot paths go to stderr
    assert s["counts"]["domain"] == {"debugging": 1, "security": 1}
    assert s["yield"]["table"]["all"]["kept"] == 2
    assert s["eval"]["pass_at_k"]["2"] == pytest.approx(0.75)
    assert s["lengths"]["verifier_lines"] == [3, 3]
    assert "plot " in res.stderr


def test_clear_errors_name_the_folder_and_the_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StatsError, match=f"{tmp_path / 'empty'}: no tasks and no"):
        dataset_stats(tmp_path / "empty")
    res = CliRunner().invoke(main, ["data", "stats", str(tmp_path / "empty")])
    assert res.exit_code == 1 and "empty: no tasks" in res.output
    write_gen_task(tmp_path / "ds", 0, "security", "easy")
    bad = tmp_path / "bad.jsonl"
    append_jsonl(bad, Trajectory(task="gen-000000", policy="p", reward=1.0).to_dict())
    with bad.open("a") as f:
        f.write('{"task": "gen-000000", "policy": \n')
    with pytest.raises(StatsError, match=r"bad\.jsonl:2: not a trajectory record"):
        dataset_stats(tmp_path / "ds", bad)
    bad.write_text("\n" + json.dumps(record(0, "security", "kept", **KEPT)) + "\n")
    with pytest.raises(StatsError, match=r"bad\.jsonl:2: .*'task'"):  # gen records, not eval
        dataset_stats(tmp_path / "ds", bad)
    torn = tmp_path / "torn.jsonl"
    append_jsonl(torn, Trajectory(task="gen-000000", policy="p", reward=1.0).to_dict())
    with torn.open("a") as f:
        f.write('{"task": "gen-0')  # a crash mid-write: skipped, as read_jsonl does
    assert dataset_stats(tmp_path / "ds", torn)["eval"]["pass_at_k"] == {1: 1.0}
    (tmp_path / "noresults").mkdir()
    with pytest.raises(StatsError, match="noresults: no results.jsonl"):
        dataset_stats(tmp_path / "ds", tmp_path / "noresults")


def test_ks_are_powers_of_two_and_the_most_trials():
    assert [ks_for(n) for n in (0, 1, 2, 3, 4, 6, 8)] == [
        [], [1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 6], [1, 2, 4, 8]]
