"""The real-format Harbor examples (examples/harbor): three small tasks written the way
Harbor / Terminal-Bench 2 tasks are (Harbor's task.toml keys, the uvx verifier boilerplate,
Docker-faithful Dockerfiles over python:3.12-slim, ubuntu:24.04 and Terminal-Bench's
python-3-13 image, one reward.json with sub-scores).

Each is read by TMax with no problem at all, survives native -> harbor -> native unchanged,
has its verifier tools prepared with nothing left needing a network, and builds into an
image whose checks pass: the untouched environment scores 0, the reference solution 1.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from tests.harbor_cases import files_of, harbor_network, harbor_problems, native_dict
from tests.unit.test_tasks import run_cli
from tmax.images import verifier_scripts
from tmax.tasks import find_tasks, load_task, read_any, write_task

REPO = Path(__file__).resolve().parents[2]
HARBOR = REPO / "examples" / "harbor"
TASKS = [p.name for p in find_tasks(HARBOR)]
CACHE = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))


def test_there_are_three_examples():
    assert TASKS == ["fix-order-report", "prune-backups", "semver-sort"]


def test_validate_reports_no_problem_at_all():
    res = run_cli("tasks", "validate", HARBOR, "--strict", "-o", "json")
    report = json.loads(res.output)
    assert {t["task"]: t["problems"] for t in report["tasks"]} == {name: [] for name in TASKS}
    assert res.exit_code == 0 and report["ok"]


@pytest.mark.parametrize("name", TASKS)
def test_harbor_keys_are_read_as_harbor_means_them(name):
    config = load_task(HARBOR / name).config
    doc = native_dict(HARBOR / name)
    assert config.harbor_schema == doc["schema_version"] == "1.1"
    assert config.task.name == f"tmax/{name}" and config.task.authors[0].name == "TMax"
    assert doc["environment"]["allow_internet"] is False and not config.environment.network
    assert config.environment.memory_mb == int(doc["environment"]["memory"][:-1]) * 1024
    assert config.metadata.free["expert_time_estimate_min"] > 0  # Harbor's free metadata


@pytest.mark.parametrize("name", TASKS)
def test_native_to_harbor_to_native_is_lossless(tmp_path, name):
    src = HARBOR / name
    original = load_task(src)
    harbor = write_task(read_any(src), tmp_path / "harbor", layout="harbor")
    assert harbor_problems(harbor.root) == []
    assert native_dict(harbor.root) == native_dict(src)  # already complete for Harbor
    assert harbor_network(native_dict(harbor.root)) is False
    assert harbor.config == original.config
    back = write_task(read_any(harbor.root), tmp_path / "back")
    assert native_dict(back.root) == native_dict(src) and back.config == original.config
    assert files_of(back.root) == files_of(src) == files_of(harbor.root)


@pytest.mark.parametrize("name", TASKS)
def test_verifier_boilerplate_is_prepared_for_grading_offline(name):
    tools = verifier_scripts.plan(HARBOR / name / "tests")
    assert (tools.uv, tools.uv_pinned, tools.unprepared) == ("0.9.7", True, ())
    assert set(tools.packages) == {"pytest==8.4.1", "pytest-json-ctrf==0.3.5", "pytest"}


# --------------------------------------------------------------------------- images


@pytest.fixture(scope="session")
def harbor_store(base_store):
    """A store with the examples' images, built with checks next to the test bases (the
    bases they need are built into base_store once, then hard-linked; content-addressed,
    so later sessions rebuild only what changed). Returns (store, results by task)."""
    from tmax.images.bases import BaseMappingError
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker
    from tmax.images.store import ImageStore
    from tmax.images.types import BuildError

    tasks = [load_task(HARBOR / name) for name in TASKS]
    shared = ImageBuilds(base_store, LocalBuilder(CACHE))
    store = ImageStore(CACHE / "test-harbor-examples")
    needed = []
    for task in tasks:
        with contextlib.suppress(BaseMappingError, BuildError, ValueError):
            needed += shared.base_chain(shared.plan(task).base)  # else: that task fails
    for name in dict.fromkeys(needed):
        entry = shared.ensure_base(name)
        if store.read().bases.get(name) != entry:
            target = store.path(entry.sif)
            target.unlink(missing_ok=True)
            os.link(base_store.path(entry.sif), target)
            store.update(lambda m, n=name, e=entry: m.bases.__setitem__(n, e))
    builds = ImageBuilds(store, LocalBuilder(CACHE), checker=image_checker(CACHE, "local"))
    results = builds.build_all(tasks, jobs=3, progress=False)
    return store, {r.task_id: r for r in results}


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", TASKS)
def test_image_builds_and_passes_checks(harbor_store, name):
    """Built by the local builder; nop scores 0 and the reference solution 1, graded by the
    unmodified uvx test.sh with no network."""
    store, results = harbor_store
    result = results[name]
    log = store.path(result.log).read_text()[-4000:] if result.log else ""
    assert result.status != "failed", f"{result.error}\n{log}"
    checks = store.read().tasks[name].checks
    assert checks is not None and (checks.nop_reward, checks.oracle_reward) == (0.0, 1.0), \
        f"{checks}\n{store.path(checks.log).read_text()[-4000:] if checks else ''}"
    assert checks.ok
