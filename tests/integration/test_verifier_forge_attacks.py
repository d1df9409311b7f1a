"""Three reward forgeries of the standard verifier boilerplates, against the sealed local runtime's verifier.

Each forged every reward it tried before ``sandfleet.verifier.plan`` (commit 09e816e):

- Harbor's boilerplate (``curl .../uv/<v>/install.sh | sh; source $HOME/.local/bin/env;
  uvx ... pytest``): the installer cannot run offline, the script sources the agent's
  ``$HOME/.local/bin/env``, whose ``uvx() { return 0; }`` passes. Now the offline stand-in
  leaves what the installer leaves there (uv, uvx, env), over the agent's files.
- ``python3 -m <runner>`` in the workdir (pytest; here the standard library's unittest,
  which the base image has): Python imports the agent's ``unittest.py`` (or a module the
  runner imports, ``argparse.py``) from the working directory first. Now the image's
  modules come first and the workdir's after them.
- A venv at the top level (``/venv``, ``ENV PATH=/venv/bin:$PATH``): the image's copy was
  bound only for PATH folders below the top level. Now a top-level venv of the image is
  the image's too.

Each test also runs what a legitimate task does through the same path (files graded in the
agent's home, tests that import the agent's module from the workdir) and checks it still
scores. The image: the Debian base plus a top-level venv and prepared verifier tools whose
``uvx`` stands for "the tests ran and failed" (exit 1; the real uv needs the network to
prepare, which the Harbor examples' tests cover).
"""

# ruff: noqa: F811  (the fixtures imported from tests.seal_helpers are parameters here)
from __future__ import annotations

from pathlib import Path

import pytest

from tests.seal_helpers import (  # noqa: F401  (fixtures)
    FORGE_SH,
    HOST_PATH,
    dirs,
    make,
    run,
    runtime,
    verify,
    write_file,
)

UVX_FAILS = "#!/bin/sh\necho image-uvx \"$@\"\nexit 1\n"


@pytest.fixture(scope="module")
def forge_sif(base_sif, tmp_path_factory) -> Path:
    """The base image plus a venv at /venv (``pyvenv.cfg``; its ``runner`` sources its
    library, which writes reward 0.25) and verifier tools with uv and uvx (uvx exits 1)."""
    from sandfleet.runtime import sif

    root = tmp_path_factory.mktemp("forge-image") / "root"
    sif.extract(base_sif, root)
    files = {"venv/pyvenv.cfg": "home = /usr/bin\n",
             "venv/bin/runner": "#!/bin/sh\n. /venv/lib/grade.sh\n",
             "venv/lib/grade.sh": "echo 0.25 > /logs/verifier/reward.txt\n",
             ".tmax/verifier/bin/uv": "#!/bin/sh\necho image-uv\n",
             ".tmax/verifier/bin/uvx": UVX_FAILS,
             ".tmax/verifier/env": "PATH=/.tmax/verifier/bin:$PATH\nUV_OFFLINE=1\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        (root / name).chmod(0o755)
    return sif.pack(root, root.parent / "forge.sif")


HARBOR_SH = """\
apt-get install -y curl >/dev/null 2>&1
curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh
source $HOME/.local/bin/env
cat $HOME/answer.txt
uvx --with pytest==8.4.1 pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


@pytest.mark.sandbox
@pytest.mark.parametrize("attack", [
    write_file("/root/.local/bin/env", "uvx() { return 0; }\n"),
    write_file("/root/.local/bin/env", 'export PATH="$HOME/.local/bin:$PATH"\n') + " && "
    + write_file("/root/.local/bin/uvx", "#!/bin/sh\nexit 0\n", "755"),
    write_file("/root/.local/bin/env", "alias uvx=true; shopt -s expand_aliases\n"),
], ids=["function", "program", "alias"])
def test_the_installer_stand_in_leaves_its_files_over_the_agents(attack, runtime, make,
                                                                  forge_sif, tmp_path):
    sid = make(image=forge_sif)
    run(runtime, sid, write_file("/root/answer.txt", "agent-answer\n") + " && " + attack
        + " && " + write_file("/root/.local/bin/mine", "kept\n"))
    result, reward = verify(runtime, sid, tmp_path, HARBOR_SH)
    assert reward == "0", result.output
    assert "image-uvx --with pytest==8.4.1" in result.output, result.output
    assert "agent-answer" in result.output  # a task graded on the agent's home still is
    # the agent keeps its own files (set aside where the installer's went)
    after = run(runtime, sid, "ls -a /root/.local/bin; cat /root/.local/bin/mine").output
    assert "kept" in after and ".tmax-set-aside-env-" in after, after


@pytest.mark.sandbox
def test_the_installer_stand_in_serves_a_verifier_user_without_a_home(runtime, make,
                                                                      forge_sif, tmp_path):
    """The verifier as the image's ``nobody`` (home /nonexistent, which nothing made): the
    stand-in makes $HOME/.local/bin (the user's) and its files, and the script goes on."""
    sid = make(image=forge_sif)
    result, reward = verify(runtime, sid, tmp_path,
                            HARBOR_SH.replace("cat $HOME/answer.txt",
                                              "echo home=$HOME; stat -c owner=%u $HOME/.local/bin"),
                            user="nobody")
    assert reward == "0" and "image-uvx" in result.output, result.output
    assert "home=/nonexistent" in result.output and "owner=65534" in result.output


UNITTEST_SH = """\
cd /app
python3 -m unittest discover -s /tests -p 'test_*.py'
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
TEST_SOLUTION = ("import unittest\nimport solution\n\n\nclass T(unittest.TestCase):\n"
                 "    def test_answer(self):\n        self.assertEqual(solution.answer(), 42)\n")


@pytest.mark.sandbox
@pytest.mark.parametrize("attack", [
    write_file("/app/unittest.py", "import sys\nsys.exit(0)\n"),
    write_file("/app/argparse.py", "import os\nos._exit(0)\n"),
    write_file("/app/unittest/__init__.py", "import os\nos._exit(0)\n")
    + " && " + write_file("/app/unittest/__main__.py", "import os\nos._exit(0)\n"),
], ids=["runner", "stdlib-module", "runner-package"])
def test_python_m_in_the_workdir_runs_the_images_runner(attack, runtime, make, forge_sif,
                                                        tmp_path):
    sid = make(image=forge_sif, workdir="/app")
    wrong = write_file("/app/solution.py", "def answer():\n    return 41\n")
    run(runtime, sid, f"{wrong} && {attack}")
    result, reward = verify(runtime, sid, tmp_path, UNITTEST_SH,
                            files={"test_solution.py": TEST_SOLUTION})
    assert reward == "0" and "41 != 42" in result.output, result.output
    # the same tests, the agent's module right: they import it from the workdir and pass
    run(runtime, sid, write_file("/app/solution.py", "def answer():\n    return 6 * 7\n"))
    result, reward = verify(runtime, sid, tmp_path, UNITTEST_SH,
                            files={"test_solution.py": TEST_SOLUTION})
    assert reward == "1" and "OK" in result.output, result.output


RUNNER_SH = "echo 0 > /logs/verifier/reward.txt\nrunner\n"


@pytest.mark.sandbox
@pytest.mark.parametrize("attack", [
    "cp /tmp/forge /venv/bin/runner",
    "cp /tmp/forge /venv/lib/grade.sh",
    ("cp -a /venv /root/venv && cp /tmp/forge /root/venv/bin/runner && rm -rf /venv "
     "&& ln -s /root/venv /venv"),
], ids=["program", "library", "linked"])
def test_a_top_level_venv_on_path_is_the_images(attack, runtime, make, forge_sif, tmp_path):
    """Chosen for a venv the agent is asked to fill: a venv the image has on its PATH is
    the image's for the verifier, wherever it lives (as /opt/venv was before); what the
    agent installed into it is not seen. A task that grades such work names the agent's
    files another way (a venv the image lacks, or one off the image's PATH, stays the
    agent's)."""
    sid = make(image=forge_sif)
    run(runtime, sid, write_file("/tmp/forge", FORGE_SH, "755") + f" && {attack}")
    result, reward = verify(runtime, sid, tmp_path, RUNNER_SH,
                            env={"PATH": f"/venv/bin:{HOST_PATH}"})
    assert (result.exit_code, reward) == (0, "0.25"), result.output


@pytest.fixture(scope="module")
def uv_sif(base_sif, tmp_path_factory) -> Path:
    """The base image plus the real uv (PyPI's wheel, cached per node) in its verifier
    tools, offline as an image build leaves them."""
    import os
    import shutil

    from sandfleet.runtime import sif
    from tmax.images.verifier_staging import stage_uv
    from tmax.images.verifier_tools import DEFAULT_UV

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    root = tmp_path_factory.mktemp("uv-image") / "root"
    sif.extract(base_sif, root)
    tools = stage_uv(DEFAULT_UV, cache, root.parent / "uv.log", 600) / ".tmax" / "verifier"
    shutil.copytree(tools / "bin", root / ".tmax" / "verifier" / "bin")
    (root / ".tmax" / "verifier" / "env").write_text(
        "PATH=/.tmax/verifier/bin:$PATH\nUV_CACHE_DIR=/.tmax/verifier/cache\nUV_OFFLINE=1\n"
        "UV_PYTHON_DOWNLOADS=never\nUV_NO_PROGRESS=1\n")
    return sif.pack(root, root.parent / "uv.sif")


UV_RUN_SH = """\
cd /app
uv run --no-project python -m unittest discover -s /tests -p 'test_*.py'
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
# a uv-managed Python of the agent's: a copy of the image's interpreter and standard library
# whose sitecustomize ends any test run with status 0
UV_PYTHON_ATTACK = (
    'P=$(readlink -f "$(command -v python3)"); V=$(basename "$P"); '
    "M=/root/.local/share/uv/python/cpython-$($P -c 'import platform; "
    "print(platform.python_version())')-linux-$(uname -m)-gnu; "
    'mkdir -p $M/bin $M/lib && cp "$P" $M/bin/ && ln -s $V $M/bin/python3 && '
    "cp -a /usr/lib/$V $M/lib/ && rm -f $M/lib/$V/sitecustomize.py && "
    + write_file("$M/lib/$V/sitecustomize.py",
                 "import os, sys\nif 'unittest' in sys.orig_argv: os._exit(0)\n"))


@pytest.mark.sandbox
def test_uv_never_runs_a_python_the_agent_installed_for_it(runtime, make, uv_sif, tmp_path):
    """uv tries the Pythons it installed ($HOME/.local/share/uv/python) before PATH, offline
    and with downloads off: it ran the agent's, which passed every test run (forged 1).
    Now the verifier's uv sees the image's installed Pythons only (here none)."""
    sid = make(image=uv_sif, workdir="/app")
    run(runtime, sid, write_file("/app/solution.py", "def answer():\n    return 41\n")
        + " && " + UV_PYTHON_ATTACK)
    result, reward = verify(runtime, sid, tmp_path, UV_RUN_SH,
                            files={"test_solution.py": TEST_SOLUTION})
    assert reward == "0" and "41 != 42" in result.output, result.output
    # the same tests, the agent's module right, through the image's Python: they pass
    run(runtime, sid, write_file("/app/solution.py", "def answer():\n    return 6 * 7\n"))
    result, reward = verify(runtime, sid, tmp_path, UV_RUN_SH,
                            files={"test_solution.py": TEST_SOLUTION})
    assert reward == "1", result.output


APT_SH = """\
apt-get update >/dev/null 2>&1
uvx --with pytest==8.4.1 pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


@pytest.mark.sandbox
def test_apt_runs_no_hook_of_the_agents(runtime, make, forge_sif, tmp_path):
    """Harbor's boilerplate runs ``apt-get update`` as root; apt runs the commands its
    configuration names (``APT::Update::Pre-Invoke``) even offline. From the agent's
    /etc/apt, one replaced the verifier's uvx in its own tools layer (forged 1). Now /etc/apt
    (and dpkg's configuration) is the image's for the verifier."""
    sid = make(image=forge_sif)
    run(runtime, sid, write_file("/root/hook.sh", "cp /root/uvx /.tmax/verifier/bin/uvx\n", "755")
        + " && " + write_file("/root/uvx", "#!/bin/sh\nexit 0\n", "755") + " && "
        + write_file("/etc/apt/apt.conf.d/00forge",
                     'APT::Update::Pre-Invoke { "/root/hook.sh"; };\n'))
    result, reward = verify(runtime, sid, tmp_path, APT_SH)
    assert reward == "0" and "image-uvx --with pytest==8.4.1" in result.output, result.output
