"""The task model: native loading and validation, readers, the atomic writer, the CLI."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from tmax.cli import main
from tmax.tasks import (
    DOMAINS,
    TaskError,
    find_tasks,
    load_task,
    read_any,
    validate_task,
    write_task,
)
from tmax.tasks.readers import fold_setup_script

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "tasks"
DATA = Path(__file__).parents[1] / "data"


def make_task(root: Path, name: str = "demo", **overrides) -> Path:
    """A minimal valid native task; ``overrides`` maps relative paths to text (None deletes)."""
    files = {
        "instruction.md": "Write 42 to /app/answer.txt.\n",
        "task.toml": '[metadata]\ndifficulty = "easy"\ndomain = "file-operations"\n',
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n",
        "tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                         "grep -qx 42 /app/answer.txt && r=1 || r=0\n"
                         "echo $r > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\necho 42 > /app/answer.txt\n",
    } | overrides
    task = root / name
    for rel, text in files.items():
        if text is not None:
            (task / rel).parent.mkdir(parents=True, exist_ok=True)
            (task / rel).write_text(text)
    return task


def errors(path: Path):
    return [p for p in validate_task(path) if p.severity == "error"]


def test_another_datasets_domain_is_kept_with_a_warning_and_a_misspelling_is_an_error(
        tmp_path):
    from tmax.tasks.native import load_task

    task = make_task(tmp_path, "mcm", **{"task.toml": '[metadata]\ndomain = "MCM"\n'})
    problems = validate_task(task)
    assert not [p for p in problems if p.severity == "error"], problems
    said = [p for p in problems if p.field == "metadata.domain"]
    assert [p.severity for p in said] == ["warning"]
    assert "domain 'MCM' is not one of TMax's nine; kept as written" in said[0].message
    assert load_task(task).config.metadata.domain == "MCM"
    typo = make_task(tmp_path, "typo", **{"task.toml": '[metadata]\ndomain = "debuging"\n'})
    with pytest.raises(TaskError, match="did you mean 'debugging'"):
        load_task(typo)


def test_another_datasets_difficulty_is_kept_with_a_warning_and_a_misspelling_is_an_error(
        tmp_path):
    # gordonyang-tbench's distant-estimate: Harbor's [metadata] is free-form
    from tmax.tasks.native import load_task

    task = make_task(tmp_path, "vh", **{"task.toml": '[metadata]\ndifficulty = "very hard"\n'
                                        'domain = "debugging"\n'})
    problems = validate_task(task)
    assert not [p for p in problems if p.severity == "error"], problems
    said = [p for p in problems if p.field == "metadata.difficulty"]
    assert [p.severity for p in said] == ["warning"]
    assert "difficulty 'very hard' is not one of TMax's three; kept as written" in said[0].message
    loaded = load_task(task)
    assert loaded.difficulty == "very hard" and loaded.summary()["difficulty"] == "very hard"
    typo = make_task(tmp_path, "typo", **{"task.toml": '[metadata]\ndifficulty = "meduim"\n'})
    with pytest.raises(TaskError, match="did you mean 'medium'"):
        load_task(typo)


def test_minimal_task_loads(tmp_path):
    task = load_task(make_task(tmp_path))
    assert task.task_id == "demo"
    assert task.domain == "file-operations"
    assert task.definition_kind == "dockerfile"
    assert task.config.agent.timeout_sec == 900.0  # default
    assert task.config.environment.network is False


@pytest.mark.parametrize("override, file, field, words", [
    ({"instruction.md": None}, "instruction.md", "", "missing instruction"),
    ({"instruction.md": "  \n"}, "instruction.md", "", "empty"),
    ({"tests/test.sh": None}, "tests/test.sh", "", "no verifier"),
    ({"tests/test.sh": "#!/bin/bash\necho done\n"}, "tests/test.sh", "", "writes no reward"),
    ({"task.toml": "[metadata\n"}, "task.toml", "", "not valid TOML"),
    ({"task.toml": "[environment]\nallow_internt = false\n"}, "task.toml",
     "environment.allow_internt", "did you mean 'allow_internet'"),
    ({"task.toml": "[agent]\ntimeout = 3\n"}, "task.toml", "agent.timeout", "unknown key"),
    ({"task.toml": "[metadata]\ndomain = 'securty'\n"}, "task.toml", "metadata.domain",
     "invalid domain 'securty': did you mean 'security'?"),
    ({"task.toml": "[environment]\ncpus = 0\n"}, "task.toml", "environment.cpus", ""),
    ({"task.toml": None}, "task.toml", "", "missing task.toml"),
    ({"environment/Dockerfile": None}, "environment", "", "no environment definition"),
    ({"environment/Dockerfile": "FROM python:3.11-slim\nCOPY data.csv /app/\n"},
     "environment/Dockerfile", "line 2", "not found"),
    ({"environment/Dockerfile": "RUN echo hi\n"}, "environment/Dockerfile", "line 1",
     "RUN before the first FROM"),
])
def test_malformed_task_names_file_and_field(tmp_path, override, file, field, words):
    path = make_task(tmp_path, **override)
    found = errors(path)
    assert found, "expected an error"
    p = found[0]
    assert (p.task, p.file, p.field) == ("demo", file, field)
    assert words in p.message
    assert p.fix, "every error says what to do"
    with pytest.raises(TaskError) as exc:
        load_task(path)
    assert f"demo: {file}" in str(exc.value)


def test_unknown_key_lists_known_keys(tmp_path):
    path = make_task(tmp_path, **{"task.toml": "[environment]\nmemorymb = 512\n"})
    (p,) = errors(path)
    assert "memory_mb" in p.fix and "network" in p.fix


def test_all_errors_reported_at_once(tmp_path):
    path = make_task(tmp_path, **{"instruction.md": None, "tests/test.sh": None})
    assert {p.file for p in errors(path)} == {"instruction.md", "tests/test.sh"}


def test_missing_solution_is_a_warning(tmp_path):
    path = make_task(tmp_path, **{"solution/solve.sh": None})
    task = load_task(path)
    assert [w.file for w in task.warnings] == ["solution/solve.sh"]


def test_apptainer_definition_checked(tmp_path):
    path = make_task(tmp_path, **{
        "environment/Dockerfile": None,
        "environment/container.def": "Bootstrap: docker\nFrom: debian:bookworm\n"
                                     "%files\n    data.txt /app/data.txt\n"})
    (p,) = errors(path)
    assert p.file == "environment/container.def" and "data.txt" in p.message
    (path / "environment/data.txt").write_text("x")
    assert load_task(path).definition_kind == "apptainer"


def test_find_tasks(tmp_path):
    a, b = make_task(tmp_path, "a"), make_task(tmp_path, "b")
    (tmp_path / "not-a-task").mkdir()
    assert find_tasks(tmp_path) == [a, b]
    assert find_tasks(a) == [a]
    with pytest.raises(FileNotFoundError):
        find_tasks(tmp_path / "nope")


# --------------------------------------------------------------------------- readers


def test_tb1_reader_maps_fields_and_files():
    draft = read_any(DATA / "tb1" / "word-count")
    assert draft.source_format == "tb1"
    assert draft.instruction.startswith("Count the words")  # from descriptions[base]
    cfg = draft.config
    assert (cfg.agent.timeout_sec, cfg.verifier.timeout_sec) == (300, 60)
    assert cfg.metadata.domain == "data-processing"
    assert set(draft.files) == {
        "environment/Dockerfile", "environment/text.txt", "tests/test_outputs.py",
        "tests/run-tests.sh", "tests/test.sh", "solution/solve.sh"}
    assert b"wc -w < /app/text.txt" in draft.files["solution/solve.sh"].data
    assert draft.files["tests/test.sh"].mode == 0o755
    assert b"bash /tests/run-tests.sh" in draft.files["tests/test.sh"].data


def test_tb1_build_context_is_the_task_folder(tmp_path):
    """A TB1 Dockerfile may COPY from tests/ (its build context is the whole folder): what it
    copies stays in environment/ as well as in tests/; what it does not copy stays out."""
    import shutil

    task = tmp_path / "word-count"
    shutil.copytree(DATA / "tb1" / "word-count", task)
    (task / "tests" / "gen.py").write_text("print('data')\n")
    with open(task / "Dockerfile", "a") as f:
        f.write("COPY tests/gen.py /app/gen.py\n")
    draft = read_any(task)
    assert "environment/tests/gen.py" in draft.files and "tests/gen.py" in draft.files
    assert "environment/solution.sh" not in draft.files
    assert "environment/run-tests.sh" not in draft.files


def test_tb1_without_run_tests_uses_pytest_lite():
    draft = read_any(DATA / "tb1" / "hello-file")
    assert "tests/tmax_pytest_lite.py" in draft.files
    assert b"/tests/test_outputs.py" in draft.files["tests/test.sh"].data
    assert draft.config.metadata.domain == "file-operations"  # from category file_operations


def test_tmax_v1_reader_folds_setup_into_definition():
    draft = read_any(DATA / "tmax-v1" / "config-port")
    assert draft.source_format == "tmax-v1"
    assert draft.config.metadata.domain == "system-administration"
    assert draft.config.metadata.axes == {"scenario": "config edit", "tooling": "coreutils"}
    definition = draft.files["environment/container.def"].data.decode()
    assert "setup.sh /opt/tmax/setup.sh" in definition
    post = definition.split("%post", 1)[1].split("%environment", 1)[0]
    assert post.rstrip().endswith("bash /opt/tmax/setup.sh && rm -f /opt/tmax/setup.sh")
    assert draft.files["tests/truth.txt"].data == b"port=9090"
    assert {"tests/test_initial_state.py", "tests/test_final_state.py",
            "environment/setup.sh"} <= set(draft.files)


def test_fold_setup_script_without_sections():
    out = fold_setup_script("Bootstrap: docker\nFrom: debian:bookworm\n", "setup.sh", "/s.sh")
    assert out.endswith("%files\n    setup.sh /s.sh\n\n%post\n    bash /s.sh && rm -f /s.sh\n")


@pytest.mark.parametrize("fmt_dir, file, text, words", [
    ("tb1/hello-file", "task.yaml", "instruction: [unclosed\n", "not valid YAML"),
    ("tb1/hello-file", "task.yaml", "difficulty: easy\n", "missing instruction"),
    ("tmax-v1/config-port", "task.json", "{\"description\": \"x\", \"bogus\": 1}",
     "unknown key"),
    ("tmax-v1/config-port", "task.json", "{not json", "not valid JSON"),
])
def test_reader_errors_name_file_and_key(tmp_path, fmt_dir, file, text, words):
    src = tmp_path / "bad-task"
    shutil.copytree(DATA / fmt_dir, src)
    (src / file).write_text(text)
    with pytest.raises(TaskError) as exc:
        read_any(src)
    p = exc.value.problems[0]
    assert (p.task, p.file) == ("bad-task", file)
    assert words in p.message


# --------------------------------------------------------------------------- writer


def test_convert_roundtrip_produces_valid_native_tasks(tmp_path):
    for src in [DATA / "tb1" / "hello-file", DATA / "tb1" / "word-count",
                DATA / "tmax-v1" / "config-port"]:
        task = write_task(read_any(src), tmp_path)
        assert task.root == tmp_path / task.task_id
        assert errors(task.root) == []
        assert tomllib.loads((task.root / "task.toml").read_text())["metadata"]["source"]
        assert (task.root / "tests/test.sh").stat().st_mode & 0o111
        assert oct(task.root.stat().st_mode & 0o777) == "0o755"
    # native -> native is a faithful copy
    again = write_task(read_any(tmp_path / "word-count"), tmp_path / "copy")
    assert (again.root / "environment/text.txt").read_bytes() == \
        (DATA / "tb1/word-count/text.txt").read_bytes()


def test_writer_refuses_to_overwrite_and_leaves_nothing_behind(tmp_path):
    draft = read_any(DATA / "tb1" / "hello-file")
    write_task(draft, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(TaskError, match="already exists"):
        write_task(draft, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_writer_failure_leaves_no_half_written_task(tmp_path):
    draft = read_any(DATA / "tb1" / "hello-file")
    del draft.files["tests/test.sh"]  # the result would not validate
    with pytest.raises(TaskError, match="no verifier"):
        write_task(draft, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_writer_force_replaces_atomically(tmp_path):
    draft = read_any(DATA / "tb1" / "hello-file")
    write_task(draft, tmp_path)
    draft.instruction = "new text"
    task = write_task(draft, tmp_path, overwrite=True)
    assert task.instruction.strip() == "new text"
    assert [p.name for p in tmp_path.iterdir()] == ["hello-file"]
    # a failing forced rewrite keeps the old version
    del draft.files["tests/test.sh"]
    with pytest.raises(TaskError):
        write_task(draft, tmp_path, overwrite=True)
    assert load_task(tmp_path / "hello-file").instruction.strip() == "new text"


# --------------------------------------------------------------------------- CLI


def run_cli(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def test_cli_validate_json_and_exit_codes(tmp_path):
    make_task(tmp_path, "good")
    make_task(tmp_path, "bad", **{"tests/test.sh": None})
    res = run_cli("tasks", "validate", tmp_path, "-o", "json")
    assert res.exit_code == 1
    report = json.loads(res.output)
    by_task = {t["task"]: t for t in report["tasks"]}
    assert by_task["good"]["problems"] == []
    assert by_task["bad"]["problems"][0]["file"] == "tests/test.sh"
    assert run_cli("tasks", "validate", tmp_path / "good").exit_code == 0


def test_cli_convert_then_validate(tmp_path):
    out = tmp_path / "native"
    res = run_cli("tasks", "convert", DATA / "tb1", DATA / "tmax-v1", "-d", out, "-o", "json")
    assert res.exit_code == 0, res.output
    converted = json.loads(res.output)["converted"]
    assert sorted(c["task"] for c in converted) == ["config-port", "hello-file", "word-count"]
    assert run_cli("tasks", "validate", out).exit_code == 0
    res = run_cli("tasks", "ls", out, "-o", "json")
    rows = {r["id"]: r for r in json.loads(res.output)["tasks"]}
    assert rows["config-port"]["environment"] == "apptainer"
    assert rows["hello-file"]["environment"] == "dockerfile"


def test_cli_show(tmp_path):
    res = run_cli("tasks", "show", make_task(tmp_path), "-o", "json")
    shown = json.loads(res.output)
    assert shown["id"] == "demo" and "solution/solve.sh" in shown["files"]
    assert shown["instruction"].startswith("Write 42")


def test_cli_missing_path_is_a_clear_error(tmp_path):
    res = run_cli("tasks", "ls", tmp_path / "nope")
    assert res.exit_code != 0 and "no such task or folder" in res.output


# --------------------------------------------------------------------------- examples


def test_examples_are_valid_and_cover_all_domains():
    tasks = [load_task(p) for p in find_tasks(EXAMPLES)]
    assert len(tasks) >= 16
    assert {t.config.metadata.domain for t in tasks} == set(DOMAINS)
    for t in tasks:
        assert t.warnings == (), t.warnings
        assert (t.solution_dir / "solve.sh").is_file()
        assert not t.config.environment.network, f"{t.task_id} must not need the network"
    difficulties = [t.difficulty for t in tasks]
    assert difficulties.count("easy") >= 6 and difficulties.count("hard") >= 3


def test_a_test_sh_moving_its_tests_where_the_agent_runs_is_warned_about(tmp_path):
    """A real task's test.sh hides /tests in /tmp while it runs the agent's program: that
    hands them to the agent's processes, which run on beside the verifier."""
    test_sh = ("#!/bin/bash\nif [ -d /tests ]; then mv /tests /tmp/tests.hidden; fi\n"
               "mv /tmp/tests.hidden /tests\necho 1 > /logs/verifier/reward.txt\n")
    task = make_task(tmp_path, "hides", **{"tests/test.sh": test_sh})
    [warning] = [p for p in validate_task(task) if "out of /tests" in p.message]
    assert (warning.severity, warning.file) == ("warning", "tests/test.sh")
    assert "(to /tmp/tests.hidden)" in warning.message
    fine = ("#!/bin/bash\ncp /tests/data.csv /tests/work.csv  # within /tests\n"
            "# mv /tests /tmp/x is only a comment\ncp -r /tests/fixtures /logs/verifier/\n"
            "echo 1 > /logs/verifier/reward.txt\n")
    task = make_task(tmp_path, "keeps", **{"tests/test.sh": fine})
    assert not [p for p in validate_task(task) if "out of /tests" in p.message]
    copied = make_task(tmp_path, "copies", **{"tests/test.sh": "cp -a /tests/golden.txt "
                                              "/app/\necho 1 > /logs/verifier/reward.txt\n"})
    assert [p.message for p in validate_task(copied) if "(to /app/)" in p.message]
