"""Offline verifiers, built (slow): the image digest covering what is prepared, and real
builds whose unmodified boilerplates (Harbor's uvx, Terminal-Bench 1's uv, pip, a Python
the image lacks) score the oracle 1 in a sandbox with no network; the agent sees none of
the tools. The plans themselves are test_verifier_tools.py."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import link_base
from tests.unit.test_tasks import make_task
from tests.unit.test_verifier_tools import HARBOR, TB1_RUN_TESTS, UVX_312

# --------------------------------------------------------------------------- the digest


@pytest.mark.slow
def test_the_image_digest_covers_what_is_prepared(image_store, tmp_path):
    """A test.sh change that changes what the image holds rebuilds it; other changes to
    tests/ (and a verifier that needs nothing) leave the digest as it was."""
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.tasks import load_task

    builds = ImageBuilds(image_store, LocalBuilder(tmp_path / "cache"))
    src = make_task(tmp_path, "t")
    plain = builds.plan(load_task(src)).digest
    (src / "tests" / "test.sh").write_text(HARBOR)
    first = builds.plan(load_task(src))
    assert first.digest != plain and first.verifier.uv == "0.9.7"
    (src / "tests" / "test_outputs.py").write_text("def test_x(): pass\n")
    (src / "tests" / "test.sh").write_text(HARBOR.replace("# Install uv", "# uv, pinned"))
    assert builds.plan(load_task(src)).digest == first.digest
    (src / "tests" / "test.sh").write_text(HARBOR.replace("pytest==8.4.1", "pytest==8.3.3"))
    assert builds.plan(load_task(src)).digest not in (first.digest, plain)
    (src / "tests" / "test.sh").write_text(HARBOR.replace("uv/0.9.7/", "uv/0.8.14/"))
    assert builds.plan(load_task(src)).digest not in (first.digest, plain)


# --------------------------------------------------------------------------- a real build

TEST_OUTPUTS = "def test_answer():\n    assert open('/app/answer.txt').read().strip() == '42'\n"
PIP_TESTS = ("#!/bin/bash\npip install pytest==8.4.1 pytest-timeout==2.3.1\n"
             "python3 -m pytest -p timeout --timeout 60 $TEST_DIR/test_outputs.py -rA\n")


@pytest.mark.slow
@pytest.mark.sandbox
def test_unmodified_boilerplates_grade_without_a_network(image_store, tmp_path):
    """One image, three real boilerplates in its tests/: Harbor's uvx test.sh (the build's
    checks: nop 0, oracle 1, in a sandbox with no network), Terminal-Bench 1's `uv venv` +
    `uv pip install` run-tests.sh, and a `pip install pytest` script. The agent sees none
    of the tools."""
    from sandfleet.runtime.base import SandboxSpec
    from sandfleet.runtime.local import LocalRuntime
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker
    from tmax.tasks import load_task

    cache = Path.home() / ".cache" / "tmax"  # uv's wheel is fetched once per machine
    src = make_task(tmp_path / "tasks", "offline", **{
        "tests/test.sh": HARBOR, "tests/test_outputs.py": TEST_OUTPUTS,
        "tests/run-tests.sh": TB1_RUN_TESTS.replace("uv pip install rdflib==7.1.4\n", ""),
        "tests/pip-tests.sh": PIP_TESTS})
    task = load_task(src)
    assert not task.config.environment.network
    builds = ImageBuilds(image_store, LocalBuilder(cache), checker=image_checker(cache, "local"))
    result = builds.build(task)
    checks_log = image_store.path(f"logs/offline-{result.digest}.checks.log")
    assert result.status == "built", result.error
    assert result.checks["ok"], checks_log.read_text()
    assert (result.checks["nop_reward"], result.checks["oracle_reward"]) == (0.0, 1.0)
    assert "1 passed" in checks_log.read_text()  # pytest ran, from the image's uv cache
    build_log = image_store.path(result.log).read_text()
    assert "failed: tests/" not in build_log, build_log[-3000:]

    sif = image_store.path(image_store.read().tasks["offline"].sif)
    runtime = LocalRuntime(tmp_path / "state", tmp_path / "rt-cache")
    runtime.start("offline", SandboxSpec(image=sif, workdir="/app"))
    try:
        agent = runtime.exec("offline", "echo 42 > /app/answer.txt; command -v uv uvx pytest; "
                             "ls -A /.tmax/verifier; python3 -c 'import pytest' 2>&1 | tail -1",
                             timeout=60)
        assert agent.output == "ModuleNotFoundError: No module named 'pytest'\n"
        tests = shutil.copytree(src / "tests", tmp_path / "tests")
        for script in ("run-tests.sh", "pip-tests.sh"):
            graded = runtime.verify(
                "offline", ["/bin/bash", "-c", f"TEST_DIR=/tests bash /tests/{script}"],
                tests=tests, logs=tmp_path / script, timeout=300, cwd="/app")
            assert graded.exit_code == 0 and "1 passed" in graded.output, graded.output
    finally:
        runtime.stop("offline")


# gordonyang-tbench's chat-server: the image has pytest, test.sh adds the ctrf plugin with pip
CTRF_TESTS = ("#!/bin/bash\npip3 install --quiet --break-system-packages pytest-json-ctrf==0.3.5\n"
              "pytest --version\nif pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA; "
              "then r=1; else r=0; fi\necho $r > /logs/verifier/reward.txt\n")
UPGRADE_TESTS = ("#!/bin/bash\npip install pytest==8.4.1\npytest --version\n"
                 "python3 -m pytest --version\npytest /tests/test_outputs.py -rA && r=1 || r=0\n"
                 "echo $r > /logs/verifier/reward.txt\n")


IMAGE_PYTEST = "FROM python:3.11-slim\nRUN pip install pytest==8.3.5\nWORKDIR /app\n"
VENV_PYTEST = ("FROM python:3.11-slim\nRUN python3 -m venv /opt/venv && "
               "/opt/venv/bin/pip install pytest==8.3.5\nENV PATH=/opt/venv/bin:$PATH\n"
               "WORKDIR /app\n")


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("dockerfile, script, version", [
    (IMAGE_PYTEST, CTRF_TESTS, "8.3.5"), (IMAGE_PYTEST, UPGRADE_TESTS, "8.4.1"),
    (VENV_PYTEST, UPGRADE_TESTS, "8.4.1")], ids=["plugin", "upgrade", "venv-on-path"])
def test_pip_lines_keep_the_images_packages_or_upgrade_them_whole(image_store, tmp_path,
                                                                 dockerfile, script, version):
    """An image with pytest 8.3.5: `pip install pytest-json-ctrf` leaves pytest at 8.3.5 (as
    pip in the image would; installing the newest pytest beside it once mixed a 9.x
    `pytest` script with the image's 8.3.5 modules, an ImportError that scored every oracle
    0), and `pip install pytest==8.4.1` gives 8.4.1 to the script and to `python3 -m`, also
    where the image's PATH starts with a venv (its pip and Python are the ones test.sh runs).
    Graded by the build's checks, as rollouts grade. The agent's pytest stays as built, and
    its changes to the image's ``.pth`` file do not reach the verifier."""
    from sandfleet.runtime.base import SandboxSpec
    from sandfleet.runtime.local import LocalRuntime
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import ENV_PROBE, image_checker, parse_probe
    from tmax.tasks import load_task
    from tmax.tasks.environment import verifier_env

    cache = Path.home() / ".cache" / "tmax"
    src = make_task(tmp_path / "tasks", "pins", **{
        "environment/Dockerfile": dockerfile, "tests/test.sh": script,
        "tests/test_outputs.py": TEST_OUTPUTS})
    builds = ImageBuilds(image_store, LocalBuilder(cache), checker=image_checker(cache, "local"))
    result = builds.build(load_task(src))
    assert result.status == "built", result.error
    checks_log = image_store.path(f"logs/pins-{result.digest}.checks.log").read_text()
    assert (result.checks["nop_reward"], result.checks["oracle_reward"]) == (0.0, 1.0), \
        checks_log
    oracle = checks_log[checks_log.index("## oracle"):]
    shown = re.findall(r"^pytest (\S+)$", oracle, re.MULTILINE)
    assert shown == [version] * (2 if script == UPGRADE_TESTS else 1), oracle
    sif = image_store.path(image_store.read().tasks["pins"].sif)
    runtime = LocalRuntime(tmp_path / "state", tmp_path / "rt-cache")
    runtime.start("pins", SandboxSpec(image=sif, workdir="/app"))
    try:
        image_env = parse_probe(runtime.exec("pins", ENV_PROBE, timeout=60, cwd="/").output)
        agent = runtime.exec("pins", "pytest --version", timeout=60)
        assert agent.output.strip() == "pytest 8.3.5"
        # the agent, root and hostile: a wrong answer, every tmax-verifier.pth it can find
        # made to end pytest with 0, and a site folder of its own where the verifier's goes
        tamper = runtime.exec("pins", FORGE_PTH, timeout=60)
        assert "pth" in tamper.output and "no site" in tamper.output, tamper.output
        assert "agent's pytest: 0" in tamper.output  # the forgery works where it reaches
        tests = shutil.copytree(src / "tests", tmp_path / "tests")
        forged = runtime.verify("pins", ["/bin/bash", "/tests/test.sh"], tests=tests,
                                logs=tmp_path / "forged", timeout=300, cwd="/app",
                                env=verifier_env(image_env, image_env["PATH"], {}))
        assert "1 failed" in forged.output, forged.output
        assert (tmp_path / "forged" / "reward.txt").read_text().strip() == "0"
    finally:
        runtime.stop("pins")


FORGE_PTH = """\
echo 41 > /app/answer.txt
line="import os, sys; os.path.basename(sys.argv[0]).startswith('pytest') and os._exit(0)"
for f in $(find /usr /opt -name tmax-verifier.pth 2>/dev/null); do
    printf '%s\\n' "$line" >> "$f" && echo "pth $f"
done
mkdir -p /.tmax/verifier/site 2>/dev/null && echo made || echo no site
pytest /tests-that-do-not-exist >/dev/null 2>&1; echo "agent's pytest: $?"
"""


TEST_312 = ("import sys\n\ndef test_answer():\n    assert sys.version_info[:2] == (3, 12)\n"
            "    assert open('/app/answer.txt').read().strip() == '42'\n")



@pytest.mark.slow
@pytest.mark.sandbox
def test_uvx_python_312_grades_offline_on_a_311_image(image_store, base_store, tmp_path):
    """A real build: a python:3.11-slim task whose unmodified verifier asks uvx for 3.12
    scores nop 0 and oracle 1 with no network, pytest running on Ubuntu 24.04's Python 3.12
    (its own C library) inside the Debian 12 image; the agent sees none of it."""

    from sandfleet.runtime.base import SandboxSpec
    from sandfleet.runtime.local import LocalRuntime
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker
    from tmax.tasks import load_task

    cache = Path.home() / ".cache" / "tmax"
    ImageBuilds(base_store, LocalBuilder(cache)).ensure_base("ubuntu-noble")
    link_base(image_store, base_store, "ubuntu-noble")
    src = make_task(tmp_path / "tasks", "py312", **{
        "tests/test.sh": UVX_312, "tests/test_outputs.py": TEST_312})
    builds = ImageBuilds(image_store, LocalBuilder(cache), checker=image_checker(cache, "local"))
    result = builds.build(load_task(src))
    checks_log = image_store.path(f"logs/py312-{result.digest}.checks.log").read_text()
    assert result.status == "built", result.error
    assert (result.checks["nop_reward"], result.checks["oracle_reward"]) == (0.0, 1.0), \
        checks_log[-3000:]
    assert "1 passed" in checks_log and "Python 3.12" in \
        image_store.path(result.log).read_text()
    sif = image_store.path(image_store.read().tasks["py312"].sif)
    runtime = LocalRuntime(tmp_path / "state", tmp_path / "rt-cache")
    runtime.start("py312", SandboxSpec(image=sif, workdir="/app"))
    try:
        agent = runtime.exec("py312", "python3 --version; ls /.tmax/verifier | wc -l; "
                             "command -v python3.12 || echo none", timeout=60)
        assert agent.output == "Python 3.11.2\n0\nnone\n"
    finally:
        runtime.stop("py312")


@pytest.mark.slow
@pytest.mark.sandbox
def test_tasks_with_the_same_tools_share_one_tools_layer(image_store, tmp_path):
    """Two tasks on one base whose test.sh is Harbor's uvx boilerplate: one tools layer
    (``layers/tools-<key>.sqfs``) for both, and the second task's checks grade through it
    (nop 0, oracle 1); each keeps a layer of its own."""
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker
    from tmax.tasks import load_task

    cache = Path.home() / ".cache" / "tmax"
    builds = ImageBuilds(image_store, LocalBuilder(cache), checker=image_checker(cache, "local"))
    dockerfiles = {"one": "FROM python:3.11-slim\nWORKDIR /app\n",
                   "two": "FROM python:3.11-slim\nRUN echo two > /two\nWORKDIR /app\n"}
    for name, dockerfile in dockerfiles.items():
        result = builds.build(load_task(make_task(tmp_path / "tasks", name, **{
            "tests/test.sh": HARBOR, "tests/test_outputs.py": TEST_OUTPUTS,
            "environment/Dockerfile": dockerfile})))
        assert result.status == "built", result.error
        assert (result.checks["nop_reward"], result.checks["oracle_reward"]) == (0.0, 1.0)
    one, two = (image_store.read().tasks[n] for n in dockerfiles)
    assert one.layers[1] == two.layers[1] and one.layers[1].path.startswith("layers/tools-")
    assert one.layers[0] != two.layers[0]
    assert image_store.verify() == []
