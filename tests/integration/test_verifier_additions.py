"""The agent's additions to the system folders, for the verifier (``sandfleet.verifier.
additions``: TB 2.0 tasks whose reference solution installs with apt or pip into
/usr scored 0 because the sealed verifier saw only the image's /usr): new paths are seen,
the image's entries win, and what would change what an image program runs is hidden."""

# ruff: noqa: F811  (the fixtures imported from tests.seal_helpers are parameters here)
from __future__ import annotations

import os

import pytest

from sandfleet.verifier.additions import apt_packages, plan_additions
from sandfleet.verifier.tree import MemoryTree
from tests.seal_helpers import (  # noqa: F401  (fixtures)
    dirs,
    make,
    run,
    runtime,
    verify,
    write_file,
)

IMAGE = MemoryTree({
    "/bin": "link:usr/bin", "/usr/bin/python3": "file", "/usr/bin/git": "file",
    "/usr/local/bin": "dir", "/usr/sbin": "dir",
    "/usr/lib/python3/dist-packages/pytest/__init__.py": "file",
    "/usr/lib/python3/dist-packages/pytest-8.4.1.dist-info/METADATA": "file",
    "/usr/local/lib/python3.11/dist-packages": "dir",
    "/usr/share/doc/git/copyright": "file",
    "/.tmax/verifier/bin/uvx": "file",
})
PATH = "/.tmax/verifier/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_new_paths_are_seen_and_the_images_entries_win():
    upper = MemoryTree({
        "/usr/sbin/nginx": "file", "/usr/share/nginx/html/index.html": "file",
        "/usr/bin/git": "file",  # the agent's copy of an image program: the image's wins
        "/usr/share/doc/git/copyright": "file",
        "/usr/share/doc/git/NEWS": "file",  # new, in a folder the image has
        "/usr/bin/.wh": "other",  # an overlay whiteout (a device): the image's stays
        "/usr/local/lib/python3.11/dist-packages/grpc/__init__.py": "file",
        "/usr/local/lib/python3.11/dist-packages/grpcio-1.73.0.dist-info/METADATA": "file",
    })
    got = plan_additions(IMAGE, upper, ["/usr"], PATH)
    assert got.copy == [
        ("/usr/local/lib/python3.11/dist-packages/grpc", "dir"),
        ("/usr/local/lib/python3.11/dist-packages/grpc/__init__.py", "file"),
        ("/usr/local/lib/python3.11/dist-packages/grpcio-1.73.0.dist-info", "dir"),
        ("/usr/local/lib/python3.11/dist-packages/grpcio-1.73.0.dist-info/METADATA", "file"),
        ("/usr/sbin/nginx", "file"),
        ("/usr/share/doc/git/NEWS", "file"),
        ("/usr/share/nginx", "dir"), ("/usr/share/nginx/html", "dir"),
        ("/usr/share/nginx/html/index.html", "file")]
    assert got.hidden == []


def test_what_would_run_the_agents_code_in_an_image_program_is_hidden():
    site = "/usr/local/lib/python3.11/dist-packages"
    upper = MemoryTree({
        "/usr/local/bin/python3": "file",  # before the image's /usr/bin/python3 on PATH
        "/usr/local/sbin/uvx": "file",  # before the verifier tools' uvx
        "/usr/local/bin/mytool": "file",  # a new name: seen
        f"{site}/pytest/__init__.py": "file",  # before the image's pytest
        f"{site}/pytest-9.0.dist-info/METADATA": "file",
        f"{site}/sitecustomize.py": "file",
        f"{site}/evil.pth": "file:import os; os.system('echo 1 > /logs/verifier/reward.txt')",
        # Python reads a .pth whole: an import line past what the plan reads still runs
        f"{site}/long.pth": "file:" + "/opt/lib\n" * 150000 + "import os\n",
        f"{site}/paths.pth": "file:/opt/lib\n",  # path lines only: seen
        f"{site}/plug-1.0.dist-info/entry_points.txt": "file:[pytest11]\nplug = plug\n",
        f"{site}/plug.py": "file",
        "/usr/lib/python3.11": "link:/tmp/mine",  # a new folder: a link is seen (no site)
        "/usr/local/lib/python3.11/pytest.py": "file",  # the stdlib's folder: before sites
        "/usr/local/lib/python3.11/lib-dynload/_pytest.so": "file",
        "/usr/local/lib/python311.zip": "file",
        "/usr/local/lib/python3.11/ensurepip/__init__.py": "file",  # python3-venv's: seen
    })
    got = plan_additions(IMAGE, upper, ["/usr"], PATH)
    assert dict(got.hidden) == {
        "/usr/local/bin/python3": "shadows the image's program python3",
        "/usr/local/sbin/uvx": "shadows the image's program uvx",
        f"{site}/pytest": "shadows the image's Python module pytest",
        f"{site}/pytest-9.0.dist-info": "shadows the image's Python module dist:pytest",
        f"{site}/sitecustomize.py": "a Python start-up hook",
        f"{site}/evil.pth": "a .pth file that runs code at every Python start-up (or too long "
                            "to read)",
        f"{site}/long.pth": "a .pth file that runs code at every Python start-up (or too long "
                            "to read)",
        f"{site}/plug-1.0.dist-info/entry_points.txt": "declares a pytest plugin (or too long "
                                                       "to read)",
        **dict.fromkeys(("/usr/local/lib/python3.11/pytest.py", "/usr/local/lib/python311.zip",
                         "/usr/local/lib/python3.11/lib-dynload"),  # (a folder the image has not)
                        "in the Python standard library's place (before every site folder)")}
    assert {p for p, _ in got.copy} == {
        "/usr/local/bin/mytool", f"{site}/paths.pth",
        f"{site}/plug-1.0.dist-info", "/usr/local/lib/python3.11/ensurepip",
        "/usr/local/lib/python3.11/ensurepip/__init__.py",
        f"{site}/plug.py", "/usr/lib/python3.11", "/usr/local/sbin"}


def test_what_the_verifiers_script_installs_is_not_the_agents():
    """Harbor's ``apt-get install -y curl`` then ``curl -LsSf .../install.sh | sh`` on an
    image without curl: the agent's curl would run as the verifier before the tests (and
    could rewrite them). The programs the scripts exercise (TB 2.0's configure-git-webserver
    reaches the agent's git server with the agent's ssh) stay the agent's."""
    upper = MemoryTree({"/usr/local/bin/curl": "file", "/usr/sbin/nginx": "file",
                        "/usr/local/bin/ssh": "file", "/usr/local/bin/jq": "file"})
    scripts = ["apt-get update\napt-get install -y curl\ncurl -LsSf https://x/install.sh | sh\n",
               ("DEBIAN_FRONTEND=noninteractive apt-get -q install -y --no-install-recommends "
                "jq=1.6-2.1 expect && ssh git@localhost true\n")]
    words = apt_packages(scripts)
    assert words == {"curl", "jq", "expect"}
    got = plan_additions(IMAGE, upper, ["/usr"], PATH, words)
    why = "a package the verifier's script installs"
    assert got.hidden == [("/usr/local/bin/curl", f"{why} (curl)"),
                          ("/usr/local/bin/jq", f"{why} (jq)")]
    assert got.copy == [("/usr/local/bin/ssh", "file"), ("/usr/sbin/nginx", "file")]


def test_a_link_where_programs_or_modules_are_looked_for_is_hidden():
    image = MemoryTree({"/usr/bin/python3": "file", "/usr/lib/python3/dist-packages": "dir"})
    upper = MemoryTree({"/usr/local": "link:/tmp/evil",  # holds PATH's /usr/local/bin
                        "/usr/games": "link:/tmp/games"})  # on no path the verifier reads
    got = plan_additions(image, upper, ["/usr"], "/usr/local/bin:/usr/bin")
    why = "a link where the verifier looks for programs or modules"
    assert got.hidden == [("/usr/local", why)]
    assert got.copy == [("/usr/games", "link")]


def test_a_file_of_the_image_hides_the_agents_folder_and_no_folder_outside_is_read():
    image = MemoryTree({"/usr/share/thing": "file", "/etc/alternatives/editor": "link:/x"})
    upper = MemoryTree({"/usr/share/thing/inside": "file", "/etc/passwd": "file",
                        "/etc/alternatives/nginx": "link:/usr/sbin/nginx"})
    got = plan_additions(image, upper, ["/usr", "/etc/alternatives"], "/usr/bin")
    assert got.copy == [("/etc/alternatives/nginx", "link")] and got.hidden == []


# --------------------------------------------------------------------------- local runtime

ADDED_SH = """\
echo 0 > /logs/verifier/reward.txt
apt-get install -y curl >/dev/null 2>&1
curl --version || echo no-curl
python3 /tests/check.py
"""
CHECK_PY = """\
import subprocess, sys
import newmod
import importlib.util
print("newmod", newmod.X, "python", sys.executable, flush=True)
print("stdlib-planted", importlib.util.find_spec("agentstd") is not None, flush=True)
import eigenfake
print("cmeel-path", eigenfake.X, flush=True)
subprocess.run(["sh", "-c", "mytool; cat /usr/share/mine/data.txt; ls /usr/local/bin; "
                "test -u /usr/local/bin/mytool && echo setuid-kept"])
"""
FAKE_PYTHON = "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\nkill -9 $PPID\n"
PTH = "import sys; sys.stderr.write('pth-ran\\n')\n"
CMEEL = "cmeel.prefix/lib/python3.11/site-packages"


@pytest.mark.sandbox
def test_the_verifier_sees_what_the_agent_installed_but_runs_the_images_programs(
        runtime, make, tmp_path):
    """As ``apt-get install nginx`` or ``pip install grpcio`` into the system Python leave
    them: a new program, a new module in a site folder (cmeel's layout too) and a data file
    are seen; a python3 before the image's on PATH, a ``.pth`` that runs code and a
    ``sitecustomize`` are not,
    nor a package the verifier's own script installs (its curl), nor the agent's copy of an
    image file. With SANDFLEET_VERIFIER_ADDITIONS=0, none."""
    sid = make()
    site = run(runtime, sid, "python3 -c 'import site; print(site.getsitepackages()[0])'"
               ).output.strip()
    assert site.startswith("/usr/"), site
    stdlib = run(runtime, sid, "python3 -c 'import os; print(os.path.dirname(os.__file__))'"
                 ).output.strip()
    run(runtime, sid, " && ".join([
        write_file("/usr/local/bin/mytool", "#!/bin/sh\necho mytool-ran\n", "4755"),
        write_file("/usr/local/bin/python3", FAKE_PYTHON, "755"),
        write_file(f"{site}/newmod.py", "X = 42\n"),
        write_file(f"{stdlib}/agentstd.py", "X = 1\n"),  # before every site folder
        write_file(f"{site}/hook.pth", PTH),
        write_file(f"{site}/cmeel.pth", "import cmeel_pth\n"),  # (as cmeel's wheels do)
        write_file(f"{site}/{CMEEL}/eigenfake.py", "X = 7\n"),
        write_file(f"{site}/sitecustomize.py", "import os\nos._exit(0)\n"),
        write_file("/usr/share/mine/data.txt", "agent-data\n"),
        write_file("/usr/local/bin/curl", FAKE_PYTHON, "755"),
        "echo '# agent' >> /usr/bin/tail"]))
    result, reward = verify(runtime, sid, tmp_path, ADDED_SH, files={"check.py": CHECK_PY})
    assert reward == "0", result.output
    assert "no-curl" in result.output, result.output  # (named by test.sh, not the image's)
    assert "mytool-ran" in result.output and "newmod 42" in result.output, result.output
    assert "python /usr/bin/python3" in result.output and "agent-data" in result.output
    assert "pth-ran" not in result.output and "cmeel-path 7" in result.output
    assert "stdlib-planted False" in result.output, result.output
    assert "setuid-kept" not in result.output  # set-user-ID dropped on the copy
    listed = result.output.split("agent-data", 1)[1]
    assert "mytool" in listed and "python3" not in listed and "curl" not in listed
    tail = run(runtime, sid, "tail -c 8 /usr/bin/tail").output  # the agent's own: as it was
    assert "# agent" in tail, tail
    os.environ["SANDFLEET_VERIFIER_ADDITIONS"] = "0"
    try:
        result, reward = verify(runtime, sid, tmp_path, ADDED_SH, files={"check.py": CHECK_PY})
    finally:
        del os.environ["SANDFLEET_VERIFIER_ADDITIONS"]
    assert reward == "0" and "mytool-ran" not in result.output, result.output
    assert "No module named 'newmod'" in result.output, result.output
