"""tmax audit / tmax repair in real sandboxes (slow): the probes, the repairs (with and
without an LLM teacher), the CLI and Slurm array shards on planted-defect tasks
(tests/data/audit-tasks)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import link_base

PLANTED = Path(__file__).parents[1] / "data" / "audit-tasks"
EXPECTED = yaml.safe_load((PLANTED / "expected.yaml").read_text())


SUBSET = ["leak-opt-grader", "leak-guarded-varlib", "leak-reference-json", "weak-exists-max-temp",
          "weak-fixed-wordfreq", "weak-always-or-true", "mismatch-output-dir",
          "broken-solution-off-by-one", "clean-program-fresh-inputs", "clean-recompute-input",
          "weak-exploit-import-exit"]


@pytest.fixture(scope="module")
def audit_store(base_store):
    """A store with the SUBSET's images (built with their checks), kept between sessions
    next to the base (content-addressed: only changed tasks are rebuilt)."""
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker
    from tmax.images.store import ImageStore
    from tmax.tasks.native import load_task

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    store = ImageStore(cache / "test-audit")
    link_base(store, base_store)
    builds = ImageBuilds(store, LocalBuilder(cache), checker=image_checker(cache, "local"))
    results = builds.build_all([load_task(PLANTED / t) for t in SUBSET], jobs=2,
                               progress=False)
    failed = {r.task_id: r.error for r in results if r.status == "failed"}
    assert not failed, f"planted images failed to build: {failed}"
    return builds


def _audit(builds, fleet, task_ids, out, **kw):
    from tmax.audit.probes import Prober
    from tmax.audit.run import Auditor
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages
    from tmax.tasks.native import load_task

    async def go():
        async with open_fleet(fleet.state) as client:
            auditor = Auditor(Prober(client, TaskImages(builds.store.root)), out, **kw)
            return await auditor.run([load_task(PLANTED / t) for t in task_ids], jobs=2,
                                     progress=False)

    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
def test_probes_alone_label_each_planted_defect_and_leave_clean_tasks_unlabelled(
        audit_store, example_fleet, tmp_path):
    records = _audit(audit_store, example_fleet, SUBSET, tmp_path / "audit")
    got = {r.task: r.label for r in records}
    assert got == {t: EXPECTED[t]["label"] for t in SUBSET}
    by = {r.task: r for r in records}
    assert all(r.labelled_by == ("probes" if r.label else None) for r in records)
    assert not any(r.error for r in records)
    # the probe that proves each one
    probes = {t: {f["probe"] for f in by[t].findings} for t in SUBSET}
    assert "copy" in probes["leak-opt-grader"] and "copy" in probes["leak-guarded-varlib"]
    assert "copy" in probes["leak-reference-json"]  # matched as a JSON value
    appended = [c for c in by["leak-guarded-varlib"].probes["copy"] if c["reward"] == 1.0]
    assert [c["variant"] for c in appended] == ["appended"]  # the exact copy is refused
    assert "mutation" in probes["weak-exists-max-temp"]
    assert "replay" in probes["weak-fixed-wordfreq"]
    assert "nop" in probes["weak-always-or-true"]
    assert probes["mismatch-output-dir"] == {"paths"}
    # the exploit probes: os._exit(0) on import passes the one task graded on its runner's
    # exit status; the runtime hacks forge nothing on the local runtime
    assert probes["weak-exploit-import-exit"] == {"exploit"}
    assert "exit-on-import" in json.dumps(by["weak-exploit-import-exit"].probes["exploits"])
    for t in SUBSET:
        runs = by[t].probes.get("exploits", [])
        assert not [r for r in runs if r["reward"] == 1.0 and
                    "exit-on-import" not in r["hacks"]], (t, runs)
    assert all(r.sandbox_s > 0 and r.sandboxes >= 2 for r in records)
    # a rerun on the same folder probes nothing again
    again = _audit(audit_store, example_fleet, SUBSET, tmp_path / "audit")
    assert [r.to_dict() for r in again] == [r.to_dict() for r in records]
    lines = (tmp_path / "audit" / "audit.jsonl").read_text().splitlines()
    assert len(lines) == len(SUBSET)


def _repair(builds, fleet, pairs, clean, **kw):
    from tmax.audit.probes import Prober
    from tmax.audit.repair import Repairer
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages

    async def go():
        async with open_fleet(fleet.state) as client:
            repairer = Repairer(Prober(client, TaskImages(builds.store.root)), builds, clean,
                                **kw)
            return await repairer.run(pairs, progress=False)

    return asyncio.run(go())


def _teacher_config(server):
    from tmax.audit.llm import load_audit_config

    shipped = load_audit_config()
    return shipped.model_copy(update={"teacher": shipped.teacher.model_copy(update={
        "base_url": server.url, "api_key_env": None, "backoff_s": 0.0})})


def _with_teacher(server, config, make):
    """``make(teacher)`` under an open Teacher, in one event loop."""
    from tmax.llm import Teacher

    async def go():
        async with Teacher(config.teacher) as teacher:
            return await make(teacher)

    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
def test_an_answer_leak_is_repaired_without_an_llm_and_the_rest_is_kept_or_dropped(
        audit_store, example_fleet, tmp_path):
    from tmax.audit.report import repair_report, write_report
    from tmax.tasks.native import load_task

    ids = ["leak-opt-grader", "leak-guarded-varlib", "broken-solution-off-by-one",
           "weak-exists-max-temp", "clean-recompute-input"]
    audits = _audit(audit_store, example_fleet, ids, tmp_path / "audit")
    clean = tmp_path / "clean"
    pairs = [(load_task(PLANTED / t), a) for t, a in zip(ids, audits)]
    repairs = {r.task: r for r in _repair(audit_store, example_fleet, pairs, clean)}
    assert {t: r.action for t, r in repairs.items()} == {
        "leak-opt-grader": "repaired", "leak-guarded-varlib": "repaired",
        "broken-solution-off-by-one": "dropped", "weak-exists-max-temp": "dropped",
        "clean-recompute-input": "kept"}
    assert "needs a teacher" in repairs["weak-exists-max-temp"].reason
    assert "solution_broken: not repaired" in repairs["broken-solution-off-by-one"].reason
    # the repaired task: the answer is out of the image, in tests/; it passes its checks
    # (oracle 1, nop < 1: the store's entry), and the copy probe no longer scores
    fixed = load_task(clean / "tasks" / "leak-opt-grader")
    assert not (fixed.environment_dir / "grader").exists()
    assert "/tests/expected.txt" in (fixed.tests_dir / "check.py").read_text()
    entry = audit_store.store.read().tasks["leak-opt-grader"]
    assert entry.checks.ok and entry.checks.oracle_reward == 1.0
    assert entry.checks.nop_reward < 1.0
    assert repairs["leak-opt-grader"].after is None and repairs["leak-opt-grader"].sandbox_s
    assert sorted(p.name for p in (clean / "tasks").iterdir()) == [
        "clean-recompute-input", "leak-guarded-varlib", "leak-opt-grader"]
    report = repair_report(audits, list(repairs.values()))
    assert report["before"]["answer_leak"] == 2 and report["after"] == {"unlabelled": 3}
    assert report["actions"] == {"repaired": 2, "dropped": 2, "kept": 1}
    written = write_report(report, clean)
    assert (clean / "labels.png").read_bytes()[:4] == b"\x89PNG" and len(written) == 3
    # a rerun does nothing again
    again = _repair(audit_store, example_fleet, pairs, clean)
    assert [r.to_dict() for r in again] == [repairs[t].to_dict() for t in ids]


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_llm_auditor_labels_what_probes_cannot_and_a_teacher_repair_must_hold(
        audit_store, example_fleet, tmp_path):
    from tmax.agent.scripted_server import ScriptedServer
    from tmax.audit.probes import Prober
    from tmax.audit.repair import Repairer
    from tmax.audit.run import Auditor
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages
    from tmax.tasks.native import load_task

    still_weak = ("import os\nok = os.path.getsize('/app/max_temp.txt') > 0\n"
                  "open('/logs/verifier/reward.txt', 'w').write('1' if ok else '0')\n")
    hardened = ("import os\nreadings = open('/app/data/temps.txt').read().split()\n"
                "want = max(readings, key=float)\n"
                "try:\n    got = open('/app/max_temp.txt').read().strip()\n"
                "except OSError:\n    got = None\n"
                "os.makedirs('/logs/verifier', exist_ok=True)\n"
                "open('/logs/verifier/reward.txt', 'w').write('1' if got == want else '0')\n")
    mismatch = PLANTED / "mismatch-output-dir" / "instruction.md"
    renamed = mismatch.read_text().replace("/app/output/", "/app/outputs/")
    assert renamed != mismatch.read_text()
    script = [
        {"content": json.dumps({"label": "clean", "rationale": "recomputes from the input"})},
        {"content": json.dumps({"files": {"tests/check.py": still_weak},
                                "rationale": "check it is not empty"})},
        {"content": json.dumps({"files": {"tests/check.py": hardened},
                                "rationale": "recompute the maximum from the input"})},
        {"content": json.dumps({"files": {"instruction.md": renamed},
                                "rationale": "the instruction names the folder it reads"})},
    ]
    ids = ["clean-recompute-input", "weak-exists-max-temp", "mismatch-output-dir"]
    with ScriptedServer(script) as server:
        config = _teacher_config(server)

        async def go(teacher):
            async with open_fleet(example_fleet.state) as client:
                prober = Prober(client, TaskImages(audit_store.store.root))
                tasks = [load_task(PLANTED / t) for t in ids]
                audits = await Auditor(prober, tmp_path / "audit", teacher=teacher,
                                       config=config).run(tasks, progress=False)
                repairer = Repairer(prober, audit_store, tmp_path / "clean", teacher=teacher,
                                    config=config, rounds=2)
                return audits, await repairer.run(list(zip(tasks, audits)), progress=False)

        audits, repairs = _with_teacher(server, config, go)
        requests = list(server.requests)
    by = {a.task: a for a in audits}
    assert by["clean-recompute-input"].label == "clean"
    assert by["clean-recompute-input"].labelled_by == "auditor"
    assert by["clean-recompute-input"].rationale == "recomputes from the input"
    # a probe-proven label is not asked about: one auditor request, then two repairs
    assert by["weak-exists-max-temp"].labelled_by == "probes"
    assert len(requests) == 4
    assert by["mismatch-output-dir"].label == "instruction_verifier_mismatch"
    weak = next(r for r in repairs if r.task == "weak-exists-max-temp")
    assert weak.action == "repaired" and weak.attempts == 2, weak
    feedback = "\n".join(m["content"] for m in requests[2]["messages"])
    assert "still find verifier_too_weak" in feedback  # the rejection went back
    fixed = load_task(tmp_path / "clean" / "tasks" / "weak-exists-max-temp")
    assert (fixed.tests_dir / "check.py").read_text() == hardened
    # the mismatch: the teacher's instruction names the verifier's folder; rebuilt, it
    # passes oracle, fails nop, and the paths probe no longer finds a mismatch
    moved = next(r for r in repairs if r.task == "mismatch-output-dir")
    assert moved.action == "repaired" and moved.attempts == 1, moved
    assert "instruction.md" in json.dumps(moved.to_dict())
    again = load_task(tmp_path / "clean" / "tasks" / "mismatch-output-dir")
    assert again.instruction.strip() == renamed.strip()
    entry = audit_store.store.read().tasks["mismatch-output-dir"]
    assert entry.checks.ok and entry.checks.oracle_reward == 1.0


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_cli_audits_resumes_repairs_and_explains_bad_input(audit_store, example_fleet,
                                                               tmp_path):
    from click.testing import CliRunner

    from tmax.cli import main

    runner = CliRunner()
    ids = ["clean-program-fresh-inputs", "mismatch-output-dir", "broken-solution-off-by-one"]
    specs = [str(PLANTED / t) for t in ids]
    where = ["--fleet", str(example_fleet.state), "--store", str(audit_store.store.root)]
    out = tmp_path / "audit"
    got = runner.invoke(main, ["audit", *specs, *where, "--out", str(out), "-o", "json",
                               "--no-progress"])
    assert got.exit_code == 0, got.output
    result = json.loads(got.output[got.output.index("{"):])
    assert result["counts"] == {"instruction_verifier_mismatch": 1, "solution_broken": 1,
                                "unlabelled": 1}
    first = (out / "audit.jsonl").read_text()
    again = runner.invoke(main, ["audit", *specs, *where, "--out", str(out), "--no-progress"])
    assert again.exit_code == 0 and "3 tasks audited" in again.output
    assert "instruction_verifier_mismatch    mismatch-output-dir" in again.output
    assert (out / "audit.jsonl").read_text() == first  # nothing probed twice
    clean = tmp_path / "clean"
    fixed = runner.invoke(main, ["repair", *specs, *where, "--audit", str(out), "--out",
                                 str(clean), "-o", "json", "--no-progress"])
    assert fixed.exit_code == 0, fixed.output
    report = json.loads(fixed.output[fixed.output.index("{"):])
    assert report["actions"] == {"kept": 1, "dropped": 2}
    assert report["drop_reasons"] == {
        "instruction_verifier_mismatch: no teacher to repair it": 1,
        "solution_broken (not repairable)": 1}
    assert [p.name for p in (clean / "tasks").iterdir()] == ["clean-program-fresh-inputs"]
    assert {p.name for p in clean.iterdir()} >= {"report.json", "report.txt", "labels.png",
                                                 "repair.jsonl"}
    # bad input: a task with no audit record, an image not built; no tracebacks
    other = str(PLANTED / "weak-fixed-rle")
    bad = runner.invoke(main, ["repair", other, *where, "--audit", str(out), "--out",
                               str(tmp_path / "c2")])
    assert bad.exit_code != 0 and "no audit record of 1 tasks (weak-fixed-rle" in bad.output
    empty = runner.invoke(main, ["audit", other, "--fleet", str(example_fleet.state),
                                 "--store", str(tmp_path / "no-store"), "--out",
                                 str(tmp_path / "a2"), "--no-progress"])
    assert empty.exit_code == 1, empty.output
    assert "not audited weak-fixed-rle: no usable image" in \
        empty.output and "tmax images build" in empty.output
    assert "Traceback" not in bad.output + empty.output


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.slurm
def test_audit_array_runs_one_shard_per_slurm_array_task_and_reads_them_as_one(
        local_slurm, audit_store, example_fleet, tmp_path):
    from click.testing import CliRunner

    from tmax.audit.run import read_all_records
    from tmax.cli import main

    ids = ["mismatch-output-dir", "weak-always-or-true", "clean-recompute-input"]
    out = tmp_path / "audit"
    got = CliRunner().invoke(main, [
        "audit", *(str(PLANTED / t) for t in ids), "--fleet", str(example_fleet.state),
        "--store", str(audit_store.store.root), "--out", str(out), "--array", "2",
        "--jobs", "1", "--time-min", "20", "-o", "json", "--no-progress"])
    logs = "\n".join(p.read_text() for p in sorted((out / "slurm").rglob("*.err")))
    assert got.exit_code == 0, got.output + logs
    result = json.loads(got.output[got.output.index("{"):])
    assert result["array"]["shards"] == 2 and result["array"]["failed"] == 0
    array_ids = {j.split("_")[0] for j in result["array"]["jobs"]}
    assert len(array_ids) == 1  # one sbatch --array, two tasks
    shards = sorted(p.name for p in out.glob("audit*.jsonl"))
    assert shards == ["audit.shard-0-of-2.jsonl", "audit.shard-1-of-2.jsonl"], logs
    per_shard = [len((out / s).read_text().splitlines()) for s in shards]
    assert sorted(per_shard) == [1, 2]  # the 3 tasks split, none audited twice
    want = {t: EXPECTED[t]["label"] for t in ids}
    assert {t: r.label for t, r in read_all_records(out).items()} == want
    assert {r["task"]: r["label"] for r in result["records"]} == want
    # the repair of the same tasks as an array too: one report over both shards
    clean = tmp_path / "clean"
    fixed = CliRunner().invoke(main, [
        "repair", *(str(PLANTED / t) for t in ids), "--fleet", str(example_fleet.state),
        "--store", str(audit_store.store.root), "--audit", str(out), "--out", str(clean),
        "--array", "2", "--jobs", "1", "--time-min", "20", "-o", "json", "--no-progress"])
    logs = "\n".join(p.read_text() for p in sorted((clean / "slurm").rglob("*.err")))
    assert fixed.exit_code == 0, fixed.output + logs
    report = json.loads(fixed.output[fixed.output.index("{"):])
    assert report["actions"] == {"kept": 1, "dropped": 2} and report["array"]["failed"] == 0
    assert sorted(p.name for p in clean.glob("repair*.jsonl")) == [
        "repair.shard-0-of-2.jsonl", "repair.shard-1-of-2.jsonl"]
    assert json.loads((clean / "report.json").read_text())["actions"] == report["actions"]
    assert [p.name for p in (clean / "tasks").iterdir()] == ["clean-recompute-input"]
