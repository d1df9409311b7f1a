"""Harbor's separate verifier (``[verifier] environment_mode = "separate"``, Harbor 1.2+):
tests/ is the verifier's own environment (tests/Dockerfile, built with tests/ as its context,
/tests baked into it), and the verifier sees only the artifacts the agent's sandbox hands
over (/logs/artifacts and the task's top-level ``artifacts``), at the same paths.

The build makes both images; the build-time checks and rollouts grade in a fresh sandbox of
the verifier's image, after the agent's sandbox is gone.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from sandfleet.client import AsyncFleetClient
from tests.conftest import checked_build, passing_checks_log
from tests.unit.test_tasks import make_task
from tmax.tasks import load_task

SEPARATE_TOML = """\
schema_version = "1.3"
artifacts = ["/app/out/answer.txt", {source = "/app/table.csv"}]

[metadata]
difficulty = "easy"
domain = "file-operations"

[verifier]
timeout_sec = 120.0
environment_mode = "separate"

[verifier.environment]
cpus = 2
memory = "3G"

[environment]
allow_internet = false
cpus = 1
"""
# the verifier's image: its own files (/opt/graded-here), /tests baked in, no agent's /app
VERIFIER_DOCKERFILE = ("FROM python:3.11-slim\nRUN echo graded-here > /opt/graded-here\n"
                       "COPY . /tests/\n")
# full reward only for the handed answer, in the verifier's image, without what was not handed
TEST_SH = """\
#!/bin/bash
mkdir -p /logs/verifier
ok=1
[ "$(cat /app/out/answer.txt 2>/dev/null)" = 42 ] || ok=0
[ "$(cat /opt/graded-here)" = graded-here ] || ok=0
[ ! -e /app/not-handed.txt ] || ok=0
[ "$(cat /logs/artifacts/note.txt 2>/dev/null)" = note ] || ok=0
[ -f /tests/baked-only.txt ] || ok=0
[ "$(cat /logs/artifacts/nproc.txt 2>/dev/null)" = 1 ] || ok=0  # the task's [environment]
[ "$(nproc)" = 2 ] || ok=0                                      # [verifier.environment]
echo $ok > /logs/verifier/reward.txt
"""
SOLVE = ("#!/bin/bash\nmkdir -p /app/out /logs/artifacts\necho 42 > /app/out/answer.txt\n"
         "echo x > /app/not-handed.txt\necho note > /logs/artifacts/note.txt\n"
         "nproc > /logs/artifacts/nproc.txt\n")


def separate_task(root: Path, name: str = "separate", **overrides) -> Path:
    return make_task(root, name, **{
        "task.toml": SEPARATE_TOML, "tests/Dockerfile": VERIFIER_DOCKERFILE,
        "tests/test.sh": TEST_SH, "tests/baked-only.txt": "in the verifier's image\n",
        "solution/solve.sh": SOLVE} | overrides)


def test_the_mode_the_artifacts_and_the_verifiers_definition_are_read(tmp_path):
    task = load_task(separate_task(tmp_path))
    assert task.separate_verifier
    assert task.artifacts == ("/logs/artifacts", "/app/out/answer.txt", "/app/table.csv")
    assert task.verifier_definition == task.tests_dir / "Dockerfile"
    assert not [w for w in task.warnings if w.field in ("artifacts",
                                                        "verifier.environment_mode")]
    # [verifier.environment] alone implies the mode; tests/ without a Dockerfile: a fresh
    # sandbox of the task's own image
    implied = load_task(separate_task(tmp_path, "implied", **{
        "task.toml": SEPARATE_TOML.replace('environment_mode = "separate"\n', ""),
        "tests/Dockerfile": None}))
    assert implied.separate_verifier and implied.verifier_definition is None
    shared = load_task(make_task(tmp_path, "shared"))
    assert not shared.separate_verifier and shared.verifier_definition is None
    explicit = load_task(separate_task(tmp_path, "explicit", **{
        "task.toml": SEPARATE_TOML.replace('"separate"', '"shared"')}))
    assert not explicit.separate_verifier and explicit.verifier_definition is None


def test_the_verifiers_environment_is_read_as_an_environment(tmp_path):
    """[verifier.environment] is Harbor's EnvironmentConfig: its sizes, its network and
    its defaults, not the task's; without one the verifier's sandbox gets the task's."""
    from tmax.tasks import validate_task

    config = load_task(separate_task(tmp_path)).config
    got = config.verifier_resources
    assert (got.cpus, got.memory_mb, got.storage_mb, got.network) == (2, 3072, 10240, False)
    assert (config.environment.cpus, config.environment.memory_mb) == (1, 2048)
    online = load_task(separate_task(tmp_path, "online", **{"task.toml": SEPARATE_TOML.replace(
        'memory = "3G"\n', 'memory = "3G"\nallow_internet = true\n')})).config
    assert online.verifier_resources.network and not online.environment.network
    assert online.to_toml_dict()["verifier"]["environment"] == {
        "cpus": 2, "memory": "3G", "allow_internet": True}
    shared = load_task(make_task(tmp_path, "shared")).config
    assert shared.verifier_resources is shared.environment
    problems = validate_task(separate_task(tmp_path, "bad", **{"task.toml": SEPARATE_TOML.replace(
        "cpus = 2\n", "cpus = 0\n")}))
    assert [p.field for p in problems if p.severity == "error"] == ["verifier.environment.cpus"]


@pytest.mark.parametrize("override, field", [
    ({"task.toml": SEPARATE_TOML.replace('"/app/out/answer.txt"', '"out/answer.txt"')},
     "artifacts[0]"),
    ({"task.toml": SEPARATE_TOML + '\n[[steps]]\nname = "one"\n',
      "steps/one/instruction.md": "Do it.\n"}, "verifier.environment_mode"),
])
def test_what_a_separate_verifier_cannot_do_is_an_error(tmp_path, override, field):
    from tmax.tasks import validate_task

    problems = validate_task(separate_task(tmp_path, **override))
    assert field in {p.field for p in problems if p.severity == "error"}


def test_the_image_digest_covers_the_verifiers_environment(tmp_path):
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.store import ImageStore

    builds = ImageBuilds(ImageStore(tmp_path / "store"), LocalBuilder(tmp_path / "cache"))
    src = separate_task(tmp_path)
    first = builds.plan(load_task(src))
    assert first.verifier_image is not None and first.verifier_image.base == "debian-slim"
    (src / "tests" / "baked-only.txt").write_text("changed\n")  # baked into its image
    assert builds.plan(load_task(src)).digest != first.digest


@pytest.fixture(scope="module")
def separate_store(tmp_path_factory, base_store):
    """The separate-verifier task, built with checks into a store of its own."""
    return checked_build(tmp_path_factory.mktemp("separate"), base_store, separate_task)


def _ls_sif(image: Path, path: str) -> bool:
    """Whether the image (a SIF, or any layer of a layered one) lists ``path``."""
    from sandfleet import layers

    return any(f"squashfs-root/{path.lstrip('/')}" in subprocess.run(
        ["unsquashfs", "-o", str(layer.offset), "-l", str(layer.path), path.lstrip("/")],
        capture_output=True, text=True, timeout=120).stdout for layer in layers.read(image))


@pytest.mark.sandbox
def test_both_images_build_and_the_checks_grade_in_the_verifiers(separate_store):
    """nop 0 and oracle 1: the oracle's answer reaches the verifier's sandbox, its other
    files do not, and test.sh sees the verifier image's own files and baked /tests."""
    store, task, _ = separate_store
    checks_log = passing_checks_log(*separate_store)
    entry = store.read().tasks[task.task_id]
    assert "artifacts for the verifier: ['/logs/artifacts', '/app/out/answer.txt']" in \
        checks_log and "## separate verifier in sandbox" in checks_log
    assert entry.verifier_sif == f"sif/{entry.digest}.verifier.sif"
    agent_image, verifier_image = store.path(entry.sif), store.path(entry.verifier_sif)
    assert _ls_sif(verifier_image, "/opt/graded-here") and \
        _ls_sif(verifier_image, "/tests/baked-only.txt")
    assert not _ls_sif(agent_image, "/opt/graded-here")  # the agent never sees it
    # the store knows both files: gc keeps them, verify checks them both
    assert [p for p in store.gc(dry_run=True) if p.suffix == ".sif"] == []
    assert store.verify() == []
    original = verifier_image.read_bytes()
    try:
        verifier_image.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert [(p["image"], p["reason"]) for p in store.verify()] == [
            (f"task {task.task_id}", "content changed since it was built (sha256 mismatch)")]
    finally:
        verifier_image.write_bytes(original)


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_rollout_hands_its_artifacts_to_a_fresh_verifier_sandbox(separate_store,
                                                                    example_fleet):
    """Through the fleet: the agent writes the answer (and a file it does not hand over);
    the reward comes from test.sh in a sandbox of the verifier's image. An agent that
    writes nothing gets 0, graded, not a verifier error."""
    from tmax.agent.config import AgentConfig
    from tmax.agent.policies.simple import ScriptedPolicy
    from tmax.rollout.run import TaskImages, rollout

    store, task, result = separate_store
    assert result.status == "built", result.error
    images = TaskImages(store.root)

    def run(commands: list[str]):
        async def go():
            async with AsyncFleetClient(example_fleet.state) as client:
                return await rollout(task, ScriptedPolicy(commands), client, images,
                                     AgentConfig())
        return asyncio.run(go())

    solved = run(SOLVE.splitlines()[1:])
    assert (solved.reward, solved.verifier_error, solved.infra_failure) == (1.0, None, None), \
        solved.verifier_output
    assert solved.timings["verifier"] > 0
    idle = run(["true"])
    assert (idle.reward, idle.verifier_error, idle.infra_failure) == (0.0, None, None)
    # an artifact that is a link out of the agent's tree, or a fifo, is not handed over
    # (nothing is followed); the verifier grades without it
    for trick in ("ln -s /etc/hostname /app/out/answer.txt", "mkfifo /app/out/answer.txt",
                  "truncate -s 20G /app/out/answer.txt"):  # sparse: no worker disk filled
        tricked = run([f"mkdir -p /app/out && {trick}"])
        assert (tricked.reward, tricked.verifier_error, tricked.infra_failure) == \
            (0.0, None, None), (trick, tricked.verifier_output)
    # the artifacts are archived with the image's own tar, not one the agent replaced
    sabotaged = run([*SOLVE.splitlines()[1:],
                     "printf '#!/bin/sh\\nsleep 600\\n' > /usr/bin/tar && chmod +x /usr/bin/tar"])
    assert (sabotaged.reward, sabotaged.infra_failure) == (1.0, None), \
        sabotaged.verifier_output


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_verifier_image_without_its_tests_is_a_clear_build_error(image_store):
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder

    builds = ImageBuilds(image_store, LocalBuilder(Path.home() / ".cache" / "tmax"))
    task = load_task(separate_task(image_store.root.parent / "tasks", **{
        "tests/Dockerfile": "FROM python:3.11-slim\nRUN echo no tests here\n"}))
    result = builds.build(task, check=False)
    assert result.status == "failed" and "must copy the tests there" in result.error
