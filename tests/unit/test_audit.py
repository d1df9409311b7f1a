"""tmax audit / tmax repair without sandboxes: the probes' pure parts, the leak repair on
copies of planted-defect tasks (tests/data/audit-tasks), records, shards and the leak scan.
The probes, repairs and CLI in real sandboxes are in test_audit_sandbox.py."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import yaml

from tmax.audit import LABELS, describe
from tmax.audit.probes import ProbeReport
from tmax.audit.repair import RepairFailed, leaked_files, move_leaks
from tmax.audit.run import AuditRecord, cut_torn_tail, read_records
from tmax.audit.static import (
    Stat,
    added,
    changed,
    instruction_names_other,
    is_program,
    leak_matches,
    mentions,
    mutation_candidates,
    mutations,
    named_paths,
    parse_listing,
)

PLANTED = Path(__file__).parents[1] / "data" / "audit-tasks"
EXPECTED = yaml.safe_load((PLANTED / "expected.yaml").read_text())


# ---- labels and reports


def test_eight_labels_each_with_a_meaning_and_unknown_ones_are_named():
    assert len(LABELS) == 8 and all(LABELS.values())
    assert describe("answer_leak").startswith("answer_leak: the environment holds the answer")
    with pytest.raises(ValueError, match="unknown audit label 'leaky'.*answer_leak"):
        describe("leaky")


def test_the_strongest_proven_label_wins_and_nothing_proven_is_no_label():
    report = ProbeReport("t")
    assert report.label is None  # never "clean" by default
    report.add("instruction_verifier_mismatch", "paths", "x")
    report.add("verifier_too_weak", "mutation", "y")
    assert report.label == "verifier_too_weak"
    report.add("answer_leak", "copy", "z")
    assert report.label == "answer_leak"
    report.add("solution_broken", "oracle", "w")
    assert report.to_dict()["label"] == "solution_broken"


# ---- listings


def test_listings_parse_and_diff_by_size_time_and_mode():
    data = b"\0".join([b"5\t100.0\t644\t/app/a.txt", b"7\t100.0\t755\t/app/run.sh",
                       b"garbage", b"3\t1.0\t644\t/tmp/x", b"9\t2.0\t644\t/app/with\ttab", b""])
    files = parse_listing(data)
    assert files["/app/a.txt"] == Stat(5, "100.0", 0o644)
    assert files["/app/with\ttab"].size == 9 and len(files) == 4
    base = {"/app/a.txt": Stat(5, "100.0", 0o644), "/app/run.sh": Stat(7, "1.0", 0o755)}
    # run.sh differs from the base by time; a.txt is the base's own; an answer may hide in
    # a scratch folder (/tmp) too
    assert added(files, base) == ["/app/run.sh", "/app/with\ttab", "/tmp/x"]
    after = dict(files, **{"/app/run.sh": Stat(7, "100.0", 0o700),
                           "/app/out.txt": Stat(1, "200.0", 0o644),
                           "/app/__pycache__/m.pyc": Stat(1, "200.0", 0o644)})
    assert changed(files, after) == ["/app/out.txt", "/app/run.sh"]  # mode counts


def test_programs_are_sources_scripts_binaries_and_executables():
    assert is_program("/app/solve.py", b"print(1)", 0o644)
    assert is_program("/app/Makefile", b"all:", 0o644)
    assert is_program("/app/tool", b"#!/bin/sh\n", 0o644)
    assert is_program("/app/bin", b"\x7fELF...", 0o644)
    assert is_program("/app/run", b"x", 0o755)
    assert not is_program("/app/out.txt", b"42\n", 0o644)
    assert not is_program("/app/report.json", b"{}", 0o600)


# ---- leak matching


def test_a_leak_equals_or_contains_an_answer_modulo_line_ends_and_edges():
    answers = {"oracle:/app/out.txt": b"alice 3\nbob 2\n", "tests:expected.txt": b"42\n"}
    assert leak_matches(b"alice 3\r\nbob 2", answers, 4) == ["oracle:/app/out.txt"]
    assert leak_matches(b"# last run\nalice 3  \nbob 2\n# end\n", answers, 4) == \
        ["oracle:/app/out.txt"]
    assert leak_matches(b"alice 3\n", answers, 4) == []      # a part is not the answer
    assert leak_matches(b"the answer is 42", answers, 4) == []  # shorter than 4: not sought
    assert leak_matches(b"the answer is 42", answers, 2) == ["tests:expected.txt"]


# ---- paths


def test_named_paths_and_what_counts_as_naming_an_output():
    text = ("Write the report to `/app/report.txt` and the counts to out.csv. Extract "
            "the archive into /app/logs/ (for example /app/logs/app.log).")
    named = named_paths(text)
    assert {"/app/report.txt", "/app/logs", "/app/logs/app.log"} <= named[0]
    assert named[1] == {"out.csv"}  # names inside the absolute paths are not listed twice
    assert mentions(named, "/app/report.txt", "/app")
    assert mentions(named, "/app/out.csv", "/app")            # by name, in the workdir
    assert mentions(named, "/app/logs/db.log", "/app")        # in a folder it names
    assert not mentions(named, "/app/result.csv", "/app")     # a name it never says
    assert not mentions(named_paths("Work in /app."), "/app/x.txt", "/app")  # the workdir
    assert instruction_names_other(named, "/app/out/report.txt") == "/app/report.txt"
    assert instruction_names_other(named, "/app/report.txt") is None


def test_mutation_targets_leave_out_version_control_bookkeeping_the_verifier_never_names():
    # TB 2.0's git-leak-recovery: the verifier checks /app/repo through git; the oracle's
    # commands also rewrote git's reflog and refs cache, which emptied still score 1
    # (a false verifier_too_weak before)
    verifier = named_paths("repo = Path('/app/repo'); check /app/repo and /app/flag.txt")
    outputs = ["/app/repo/.git/info/refs", "/app/repo/.git/logs/HEAD", "/app/notes.md",
               "/app/flag.txt"]
    assert mutation_candidates(outputs, verifier, "/app") == ["/app/flag.txt"]
    # nothing named: every output but git's bookkeeping
    assert mutation_candidates(outputs, named_paths("run the tests"), "/app") == [
        "/app/notes.md", "/app/flag.txt"]
    # a verifier that names a file inside .git itself gets it mutated
    hooks = named_paths("assert Path('/app/repo/.git/hooks/pre-commit').exists()")
    assert mutation_candidates(["/app/repo/.git/hooks/pre-commit", "/app/repo/.git/index"],
                               hooks, "/app") == ["/app/repo/.git/hooks/pre-commit"]
    # relative paths with a folder, the home folder, build files without an extension
    assert mentions(named_paths("Write it to output/report.txt."), "/app/output/report.txt",
                    "/app", exact=True)
    assert mentions(named_paths("Save it as ~/out.txt"), "/root/out.txt", "/app")
    assert mentions(named_paths("Save it as `$HOME/r.txt`"), "/root/r.txt", "/app")
    assert mentions(named_paths("Write a Makefile in /app"), "/app/Makefile", "/app")
    both = named_paths("Read /data/config.json, write the fix to /app/config.json.")
    assert mentions(both, "/app/config.json", "/app", exact=True)  # named as itself
    assert not mentions(both, "/app/out/config.json", "/app", exact=True)


# ---- mutations


def test_mutations_empty_and_alter_every_kind_of_content():
    assert dict(mutations(b"total 41\n"))["altered"] == b"total 52\n"
    assert dict(mutations(b"hello world"))["altered"] == b"dlrow olleh"
    assert dict(mutations(b"aba"))["altered"] == b"aba\ntmax mutation probe\n"
    assert dict(mutations(b"x"))["empty"] == b""


# ---- the answer-leak repair, on a copy of a planted task


def _copy(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(PLANTED / name, dest)
    return dest


def _leak_record(image_path: str, data: bytes) -> AuditRecord:
    import hashlib

    return AuditRecord("t", "/x", "d", "answer_leak", "probes", probes={
        "leak_scan": {"candidates": [{"path": image_path, "matches": ["tests:e"],
                                      "sha256": hashlib.sha256(data).hexdigest()}]},
        "copy": [{"file": image_path, "to": ["/app/o"], "variant": "as is", "reward": 1.0}]})


def test_a_leaked_file_moves_into_tests_with_its_copy_line_and_the_verifier_follows(
        tmp_path):
    root = _copy("leak-opt-grader", tmp_path)
    leaked = (root / "environment/grader/expected.txt").read_bytes()
    record = _leak_record("/opt/grader/expected.txt", leaked)
    assert leaked_files(record) == {"/opt/grader/expected.txt": record.probes["leak_scan"][
        "candidates"][0]["sha256"]}
    changes = move_leaks(root, leaked_files(record))
    assert not (root / "environment/grader").exists()  # nor its emptied folder
    assert (root / "tests/expected.txt").read_bytes() == leaked
    dockerfile = (root / "environment/Dockerfile").read_text()
    assert "grader" not in dockerfile and "COPY data/orders.csv" in dockerfile
    check = (root / "tests/check.py").read_text()
    assert "/opt/grader/expected.txt" not in check and "/tests/expected.txt" in check
    assert any("moved environment/grader/expected.txt" in c for c in changes)
    from tmax.tasks.native import load_task

    load_task(root)  # still a valid task


def test_a_leak_made_by_a_build_step_cannot_be_moved_and_says_so(tmp_path):
    root = _copy("leak-opt-grader", tmp_path)
    record = _leak_record("/etc/answer", b"made by RUN echo")
    with pytest.raises(RepairFailed, match="/etc/answer .* not a file of environment/"):
        move_leaks(root, leaked_files(record))


def test_copy_lines_keep_their_other_sources_and_folder_copies_stay(tmp_path):
    from tmax.audit.repair import _drop_from_definition

    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.11-slim\nCOPY a.txt ./b.txt /app/\n"
                          "COPY --chown=1:1 data/ /app/data/\nCOPY b.txt /opt/b.txt\n")
    assert _drop_from_definition(dockerfile, "b.txt")
    assert dockerfile.read_text() == ("FROM python:3.11-slim\nCOPY a.txt /app/\n"
                                      "COPY --chown=1:1 data/ /app/data/\n")
    assert not _drop_from_definition(dockerfile, "data/x.txt")  # the folder copy stays
    definition = tmp_path / "container.def"
    definition.write_text("Bootstrap: localimage\n%files\n  a.txt /a.txt\n  b.txt /b\n"
                          "%post\n  echo b.txt\n")
    assert _drop_from_definition(definition, "b.txt")
    assert definition.read_text() == ("Bootstrap: localimage\n%files\n  a.txt /a.txt\n"
                                      "%post\n  echo b.txt\n")


# ---- records


def test_records_resume_and_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "audit.jsonl"
    good = AuditRecord("a", "/a", "d1", None, None)
    newer = AuditRecord("a", "/a", "d2", "answer_leak", "probes")
    path.write_text(json.dumps(good.to_dict()) + "\n" + json.dumps(newer.to_dict()) + "\n"
                    + '{"task": "b", "pa')
    cut_torn_tail(path)
    assert path.read_text().endswith("}\n")
    records = read_records(path)
    assert list(records) == ["a"] and records["a"].digest == "d2"


def test_the_planted_set_covers_every_kind_three_times_with_clean_controls():
    kinds: dict[str, int] = {}
    for task_id, entry in EXPECTED.items():
        assert (PLANTED / task_id / "task.toml").is_file(), task_id
        assert entry["label"] is None or entry["label"] in LABELS, task_id
        kinds[entry["kind"]] = kinds.get(entry["kind"], 0) + 1
    assert all(n >= 3 for n in kinds.values()), kinds
    assert kinds.get("clean", 0) >= 5


def test_array_tasks_rerun_the_command_line_with_their_shard_and_sbatch_options(tmp_path):
    import click

    from tmax.audit.cli import audit_cmd
    from tmax.launch.array import ArrayOptions
    from tmax.launch.cli import ARRAY_PARAMS, shard_argv

    ctx = audit_cmd.make_context("audit", [
        "t1", "t2", "--out", "rel/out", "--fleet", str(tmp_path), "--jobs", "3", "--teacher",
        "--array", "4", "--partition", "cpu", "--setup", "module load x", "-o", "json"])
    argv = shard_argv(ctx.params, audit_cmd, (*ARRAY_PARAMS, "shard", "no_progress"))
    assert argv == ["--out", str(Path("rel/out").resolve()), "--teacher", "--fleet",
                    str(tmp_path), "--jobs", "3", "--output", "json", "t1", "t2"]
    again = audit_cmd.make_context("audit", argv)  # what each array task parses
    assert {k: again.params[k] for k in ("task_specs", "jobs", "use_teacher", "output")} == \
        {"task_specs": ("t1", "t2"), "jobs": 3, "use_teacher": True, "output": "json"}
    assert again.params["array"] is None
    assert ArrayOptions(name="tmax-audit", partition="cpu", cpus=4, time_min=30,
                        setup=("module load x",)).submitit_parameters() == {
        "name": "tmax-audit", "timeout_min": 30, "cpus_per_task": 4, "nodes": 1,
        "tasks_per_node": 1, "slurm_array_parallelism": 256, "slurm_partition": "cpu",
        "slurm_setup": ["module load x"]}
    with pytest.raises(click.UsageError, match="leave out --shard"):
        from tmax.audit.cli import audit_shard
        from tmax.launch.cli import submit_shards

        ctx = audit_cmd.make_context("audit", ["t1", "--out", "o", "--array", "2",
                                               "--shard", "0/2"])
        submit_shards(ctx, audit_shard, tmp_path)


def test_shards_split_the_sorted_tasks_and_bad_shards_are_refused(monkeypatch):
    import click

    from tmax.audit.cli import _tasks
    from tmax.data.cli import parse_shard

    specs = tuple(str(PLANTED / t) for t in ("weak-fixed-rle", "clean-config-edit",
                                             "leak-opt-grader"))
    ids = [[t.task_id for t in _tasks(specs, (k, 2))] for k in (0, 1)]
    assert ids == [["clean-config-edit", "weak-fixed-rle"], ["leak-opt-grader"]]
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert parse_shard("slurm") == (1, 3)
    with pytest.raises(click.BadParameter, match="0 <= K < N"):
        parse_shard("3/3")


def test_the_leak_scan_reads_task_folders_first_within_its_byte_budget():
    from tmax.audit.probes import scan_list
    from tmax.audit.settings import ProbeSettings

    files = {"/usr/lib/x.so": Stat(10, "1", 0o644), "/app/big.txt": Stat(60, "1", 0o644),
             "/app/small.txt": Stat(20, "1", 0o644), "/usr/share/doc/a/ex.txt":
             Stat(30, "1", 0o644), "/app/huge.bin": Stat(500, "1", 0o644)}
    settings = ProbeSettings(max_file_bytes=100, max_scan_bytes=100)
    # huge.bin is over the file limit; system files come last; the budget stops at 100
    assert scan_list(files, {}, settings) == (["/app/small.txt", "/usr/share/doc/a/ex.txt"], 2)
    # with no base listing, system folders (but /usr/share/doc) are not scanned at all
    assert scan_list(files, None, ProbeSettings(max_file_bytes=100)) == (
        ["/app/small.txt", "/usr/share/doc/a/ex.txt", "/app/big.txt"], 0)


def test_an_unavailable_teacher_leaves_the_repair_unfinished_never_dropped(tmp_path):
    import socket

    from tmax.audit.repair import Repairer
    from tmax.llm import Teacher
    from tmax.tasks.native import load_task

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from tmax.audit.llm import load_audit_config

    shipped = load_audit_config()
    config = shipped.model_copy(update={"teacher": shipped.teacher.model_copy(update={
        "base_url": f"http://127.0.0.1:{port}/v1", "api_key_env": None, "max_retries": 0,
        "backoff_s": 0.0})})
    task = load_task(PLANTED / "weak-exists-max-temp")
    audit = AuditRecord(task.task_id, str(task.root), "d1", "verifier_too_weak", "probes")

    async def go():
        async with Teacher(config.teacher) as teacher:
            repairer = Repairer(None, None, tmp_path / "clean", teacher=teacher,
                                config=config)
            return await repairer.run([(task, audit)], progress=False), repairer

    (record,), _ = asyncio.run(go())
    assert record.action == "error" and "teacher is unavailable" in record.reason
    assert "rerun" in record.reason
    assert not (tmp_path / "clean" / "tasks" / task.task_id).exists()
    asyncio.run(go())  # a rerun tries it again: an unfinished record is not done
    lines = (tmp_path / "clean" / "repair.jsonl").read_text().splitlines()
    assert [json.loads(line)["action"] for line in lines] == ["error", "error"]


def test_hidden_folders_and_stage_copies_in_copy_lines_and_exact_path_rewrites(tmp_path):
    from tmax.audit.repair import _drop_from_definition

    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\nCOPY .answers/expected.txt /app/\n"
                          "COPY --from=build expected.txt /app/\n")
    assert _drop_from_definition(dockerfile, ".answers/expected.txt")
    assert dockerfile.read_text() == "FROM x\nCOPY --from=build expected.txt /app/\n"
    assert not _drop_from_definition(dockerfile, "expected.txt")  # a stage's file, not ours
    root = _copy("leak-opt-grader", tmp_path / "t")
    check = root / "tests" / "check.py"
    check.write_text(check.read_text() + "\nOTHER = '/data/opt/grader/expected.txt'\n")
    leaked = (root / "environment/grader/expected.txt").read_bytes()
    move_leaks(root, leaked_files(_leak_record("/opt/grader/expected.txt", leaked)))
    text = check.read_text()
    assert "'/data/opt/grader/expected.txt'" in text  # a longer path is not this one
    assert "/tests/expected.txt" in text


def test_a_task_that_breaks_the_audit_is_recorded_and_the_others_go_on(tmp_path):
    from tmax.audit.run import Auditor
    from tmax.tasks.native import load_task

    class Images:
        def entry(self, task):
            raise ValueError("no plan")

    class Prober:
        images = Images()

        async def run(self, task):
            if task.task_id == "leak-opt-grader":
                raise RuntimeError("planted link")
            return ProbeReport(task.task_id)

    tasks = [load_task(PLANTED / t) for t in ("leak-opt-grader", "clean-config-edit")]
    records = asyncio.run(Auditor(Prober(), tmp_path).run(tasks, progress=False))
    assert records[0].error == "audit failed: RuntimeError: planted link"
    assert records[1].error == "" and records[1].label is None
    assert len((tmp_path / "audit.jsonl").read_text().splitlines()) == 2


def test_a_leak_in_another_layout_matches_as_json_or_with_blanks_made_one():
    """A reference the verifier compares parsed (pretty-printed, keys in another order)
    or a table aligned with other blanks is the answer all the same."""
    compact = b'{"acme": {"orders": 4, "total": 699.51}, "stark": {"orders": 5, "total": 1327.6}}'
    pretty = (b'{\n    "stark": {\n        "total": 1327.6,\n        "orders": 5\n    },\n'
              b'    "acme": {\n        "total": 699.51,\n        "orders": 4\n    }\n}\n')
    answers = {"oracle:/app/totals.json": compact}
    assert leak_matches(pretty, answers, 4) == ["oracle:/app/totals.json"]
    other = pretty.replace(b"699.51", b"699.52")
    assert leak_matches(other, answers, 4) == []  # another value is not the answer
    assert leak_matches(b"[1, 2]", {"a": b"[1,2,3]"}, 4) == []  # a part of an array is not
    assert leak_matches(b"{}", {"a": b"{ }"}, 1) == []  # an empty value matches nothing
    table = {"oracle:/app/report.txt": b"alice\t3\nbob\t2\n"}
    assert leak_matches(b"header\nalice   3\nbob     2\n", table, 4) == \
        ["oracle:/app/report.txt"]
