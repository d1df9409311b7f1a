"""Harbor tasks written back and exported: every key kept when a task is written back,
native to Harbor to native lossless, TMax's keys under [metadata.tmax] in an export that
meets Harbor's rules, ``convert --to harbor`` and back, TB1 tasks' keys kept."""

from __future__ import annotations

import shutil
import tomllib

import pytest
import yaml
from click.testing import CliRunner

from tests.harbor_cases import (
    DATA,
    EXAMPLES,
    HARBOR_TOML,
    WILD_V2,
    errors,
    files_of,
    harbor_network,
    harbor_problems,
    make_task,
    native_dict,
    tmax_native_task,
    warnings,
)
from tmax.cli import main
from tmax.tasks import TaskError, load_task, read_any, write_task
from tmax.tasks.check import run_solution
from tmax.tasks.model import MissingSolution


@pytest.mark.parametrize("toml", [*HARBOR_TOML.values(), WILD_V2], ids=[*HARBOR_TOML, "2.0"])
def test_writing_a_task_back_keeps_every_key(tmp_path, toml):
    src = make_task(tmp_path / "src", toml)
    out = write_task(read_any(src), tmp_path / "out")
    assert native_dict(out.root) == tomllib.loads(toml)
    assert load_task(out.root).config == load_task(src).config


def test_writing_back_a_tmax_file_keeps_every_key(tmp_path):
    for example in sorted(EXAMPLES.iterdir())[:4]:
        out = write_task(read_any(example), tmp_path)
        assert native_dict(out.root) == native_dict(example)



@pytest.mark.parametrize("make", [
    tmax_native_task,
    lambda root: EXAMPLES / "hello-world-file",
    lambda root: make_task(root, HARBOR_TOML["1.0"], name="harbor-10"),
    lambda root: make_task(root, HARBOR_TOML["1.3"], name="harbor-13"),
    lambda root: make_task(root, "[metadata]\n", name="bare"),
], ids=["tmax-keys", "example", "harbor-1.0", "harbor-1.3", "bare"])
def test_native_to_harbor_to_native_is_lossless(tmp_path, make):
    src = make(tmp_path / "src")
    original = load_task(src)
    harbor = write_task(read_any(src), tmp_path / "harbor", layout="harbor")
    doc = native_dict(harbor.root)
    assert harbor_problems(harbor.root) == []
    assert harbor_network(doc) == original.config.environment.network
    assert harbor.config == original.config  # TMax reads the export as the original
    back = write_task(read_any(harbor.root), tmp_path / "back")
    assert native_dict(back.root) == native_dict(src)
    assert back.config == original.config
    assert files_of(back.root) == files_of(src) == files_of(harbor.root)


def test_harbor_export_moves_tmax_keys_under_metadata_tmax(tmp_path):
    harbor = write_task(read_any(tmax_native_task(tmp_path)), tmp_path / "h", layout="harbor")
    doc = native_dict(harbor.root)
    stash = doc["metadata"]["tmax"]
    assert stash["environment"] == {"network": True}
    assert stash["verifier"] == {"agent_system": True}
    assert "network" not in doc["environment"] and "agent_system" not in doc["verifier"]
    # TMax's defaults that Harbor's differ from are written out
    assert doc["verifier"]["timeout_sec"] == 120.0 and doc["agent"]["timeout_sec"] == 900.0
    assert doc["environment"]["network_mode"] == "public" and doc["environment"]["cpus"] == 2
    assert "memory_mb" not in doc["environment"]  # memory = "3G" says it for Harbor already
    assert set(stash["added"]) >= {"schema_version", "verifier.timeout_sec",
                                   "environment.network_mode"}
    # TMax's [metadata] keys are free-form data for Harbor and stay where they are
    assert doc["metadata"]["domain"] == "debugging" and doc["metadata"]["skills"] == ["gdb"]
    assert harbor.config.verifier.agent_system is True


def test_a_complete_harbor_task_exports_unchanged(tmp_path):
    src = make_task(tmp_path, HARBOR_TOML["1.1"], name="tb2")
    harbor = write_task(read_any(src), tmp_path / "h", layout="harbor")
    assert native_dict(harbor.root) == tomllib.loads(HARBOR_TOML["1.1"])


def test_harbor_export_refuses_an_apptainer_definition(tmp_path):
    draft = read_any(DATA / "tmax-v1" / "config-port")
    with pytest.raises(TaskError, match="Harbor builds environment/Dockerfile"):
        write_task(draft, tmp_path, layout="harbor")
    assert list(tmp_path.iterdir()) == []


def test_a_malformed_metadata_tmax_is_an_error(tmp_path):
    path = make_task(tmp_path, "[metadata.tmax.environment]\ncpus = 3\n")
    (p,) = errors(path)
    assert p.field == "metadata.tmax" and "environment" in p.message
    path = make_task(tmp_path / "b", "[environment]\nnetwork = false\n"
                                     "[metadata.tmax.environment]\nnetwork = true\n")
    (p,) = errors(path)
    assert "twice" in p.message


def test_cli_convert_to_harbor_and_back(tmp_path):
    runner = CliRunner()
    src = tmax_native_task(tmp_path / "src")
    res = runner.invoke(main, ["tasks", "convert", str(src), "-d", str(tmp_path / "h"),
                               "--to", "harbor"])
    assert res.exit_code == 0, res.output
    assert "(native -> harbor)" in res.output
    exported = tmp_path / "h" / "tmax-native"
    assert harbor_problems(exported) == []
    res = runner.invoke(main, ["tasks", "validate", str(exported)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["tasks", "convert", str(exported), "-d", str(tmp_path / "n")])
    assert res.exit_code == 0, res.output
    assert native_dict(tmp_path / "n" / "tmax-native") == native_dict(src)


def test_converted_tb1_tasks_export_for_harbor(tmp_path):
    for src in (DATA / "tb1" / "hello-file", DATA / "tb1" / "word-count"):
        harbor = write_task(read_any(src), tmp_path, layout="harbor")
        assert harbor_problems(harbor.root) == []
        assert harbor_network(native_dict(harbor.root)) is False


# --------------------------------------------------------------------------- TB1 keys


def test_tb1_unknown_keys_are_kept_in_metadata(tmp_path):
    src = tmp_path / "legacy-task"
    shutil.copytree(DATA / "tb1" / "hello-file", src)
    meta = yaml.safe_load((src / "task.yaml").read_text())
    meta |= {"author": "Jane Doe", "env_name": "python-3-13", "language": "python",
             "parser_name": "pytest", "run_tests_in_same_shell": False,
             "expert_time_estimate_min": 10, "skills": ["touch"], "notes": None,
             "difficulty": "extreme"}
    (src / "task.yaml").write_text(yaml.safe_dump(meta))
    draft = read_any(src)
    free = draft.config.metadata.free
    assert free["author"] == "Jane Doe"
    assert free["env_name"] == "python-3-13"
    assert free["language"] == "python"
    assert free["parser_name"] == "pytest" and free["run_tests_in_same_shell"] is False
    assert free["expert_time_estimate_min"] == 10
    assert free["tb1_skills"] == ["touch"]  # a name TMax types in [metadata]
    assert free["tb1_difficulty"] == "extreme"  # read as medium, the original kept
    assert "notes" not in free
    assert {w.field for w in draft.warnings} >= {"notes", "difficulty"}
    task = write_task(draft, tmp_path / "out")
    assert native_dict(task.root)["metadata"]["env_name"] == "python-3-13"
    assert errors(task.root) == []


def test_tb1_description_variants_are_kept(tmp_path):
    src = tmp_path / "variants"
    shutil.copytree(DATA / "tb1" / "hello-file", src)
    (src / "task.yaml").write_text(yaml.safe_dump({"descriptions": [
        {"key": "base", "description": "Make the file."},
        {"key": "hard", "description": "Make the file, no hints."}]}))
    draft = read_any(src)
    assert draft.instruction == "Make the file."
    assert draft.config.metadata.free["descriptions"][1]["key"] == "hard"


# --------------------------------------------------------------------------- no solution


def test_missing_solution_is_a_clear_message(tmp_path):
    path = make_task(tmp_path, HARBOR_TOML["1.4"], **{"solution/solve.sh": None})
    (w,) = [w for w in warnings(path) if w.file == "solution/solve.sh"]
    assert "no reference solution" in w.message and "optional in Harbor" in w.fix
    task = load_task(path)
    with pytest.raises(MissingSolution, match="no reference solution") as exc:
        run_solution(object(), task)  # raises before touching the sandbox
    assert isinstance(exc.value, RuntimeError)  # what the image build and check report
    assert str(tmp_path) not in str(exc.value)  # a sentence, not a bare path


def test_export_sets_harbor_baseline_when_only_the_agent_has_a_policy(tmp_path):
    src = make_task(tmp_path, "[agent]\nnetwork_mode = \"no-network\"\n", name="agent-only")
    harbor = write_task(read_any(src), tmp_path / "h", layout="harbor")
    doc = native_dict(harbor.root)
    assert doc["environment"]["network_mode"] == "no-network"  # the verifier's phase too
    back = write_task(read_any(harbor.root), tmp_path / "n")
    assert native_dict(back.root) == native_dict(src)
