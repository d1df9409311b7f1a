"""The verifier plan (``sandfleet.verifier.plan``), pure: hand-built image and agent trees
in, fixes, mounts and environment out. No root, no sandbox."""

from __future__ import annotations

import os
import subprocess
import sys

from sandfleet.verifier import (
    PYTHON_DIR,
    VERIFIER_TOOLS,
    Fix,
    MemoryTree,
    Mount,
    path_roots,
    plan_view,
    trusted_first,
)
from sandfleet.verifier.plan import INSTALLER_ENV, pathguard_source

IMAGE = {"/usr/bin/python3": "file", "/usr/bin/pytest": "file", "/bin": "link:usr/bin",
         "/lib": "link:usr/lib", "/etc/passwd": "file:root:x:0:0::/root:/bin/bash",
         "/etc/python3.11/sitecustomize.py": "file", "/app": "dir", "/root": "dir",
         "/tmp": "dir"}
WORK = "/app"


def plan(image: dict, agent: dict, **kw):
    kw.setdefault("path", "/usr/local/bin:/usr/bin:/bin")
    kw.setdefault("workdir", WORK)
    return plan_view(MemoryTree(image), MemoryTree(agent), nonce="N", **kw)


def sources(p) -> dict[str, str]:
    return {m.dest: m.source for m in p.mounts}


def test_the_images_system_goes_over_the_agents_and_its_stray_root_files_are_set_aside():
    agent = {**IMAGE, "/usr/bin/pytest": "file:exit 0", "/conftest.py": "file",
             "/lib": "dir", "/etc/ld.so.preload": "file:/tmp/evil.so", "/app/x.py": "file"}
    p = plan(IMAGE, agent)
    assert sources(p)["/usr"] == "image:/usr"
    assert sources(p)["/etc/python3.11"] == "image:/etc/python3.11"
    assert sources(p)["/etc/ld.so.preload"] == "empty"  # (the image has none)
    ops = [(f.op, f.path) for f in p.fixes]
    assert ("set_aside", "/conftest.py") in ops
    # the agent's /lib folder where the image has a link: set aside, the image's link made
    assert ops.index(("set_aside", "/lib")) < ops.index(("symlink", "/lib"))
    assert next(f.target for f in p.fixes if f.op == "symlink") == "usr/lib"
    assert ("set_aside", "/etc/ld.so.preload") in ops and ("touch", "/etc/ld.so.preload") in ops
    names = {n: (k, t) for n, k, t in p.entries}
    assert names["lib"] == ("link", "usr/lib") and names["app"] == ("dir", "")
    assert "usr" not in names and "conftest.py" not in names
    assert any(n.startswith(".tmax-set-aside-conftest.py-N") for n in names)
    assert "/etc/ld.so.preload" in p.guarded and "/usr" not in p.guarded


def test_a_top_level_venv_on_path_is_the_images_and_other_top_level_folders_the_agents():
    image = {**IMAGE, "/venv/bin/pytest": "file", "/venv/pyvenv.cfg": "file",
             "/go/bin/tool": "file", "/opt/tool/bin/t": "file"}
    path = "/venv/bin:/go/bin:/opt/tool/bin:/app/bin:/usr/bin"
    p = plan(image, {**image, "/venv/bin/pytest": "file:exit 0"}, path=path)
    overlays = [m for m in p.mounts if m.source.startswith("overlay:")]
    assert overlays == [Mount("overlay:/opt/tool", "/opt/tool", True),
                        Mount("overlay:/venv", "/venv", True)]
    env = p.env({"PATH": path, "HOME": "/root"})
    assert env["PATH"].split(":")[:3] == ["/venv/bin", "/opt/tool/bin", "/usr/bin"]
    assert env["PATH"].split(":")[3:] == ["/go/bin", "/app/bin"]
    # the venv is the agent's work where it holds the workdir
    assert not [m for m in plan(image, image, path=path, workdir="/venv/src").mounts
                if m.dest == "/venv"]
    assert path_roots("/venv/bin:/app/bin", top_level=lambda r: True) == ["/app", "/venv"]
    assert path_roots("/venv/bin", keep=["/venv"], top_level=lambda r: True) == []


def test_a_venv_the_image_lacks_and_an_agent_venv_marker_are_not_the_images():
    p = plan(IMAGE, {**IMAGE, "/venv/bin/pytest": "file", "/venv/pyvenv.cfg": "file"},
             path="/venv/bin:/usr/bin")
    assert "/venv" not in sources(p)


def test_the_installer_stand_in_leaves_uvs_files_over_the_agents_in_the_verifiers_home():
    image = {**IMAGE, f"{VERIFIER_TOOLS}/bin/uv": "file", f"{VERIFIER_TOOLS}/bin/uvx": "file",
             f"{VERIFIER_TOOLS}/env": "file:PATH=/.tmax/verifier/bin:$PATH\nUV_OFFLINE=1"}
    agent = {**IMAGE, "/root/.local/bin/env": "file:uvx() { return 0; }",
             "/root/.local/bin/other": "file", "/root/answer.txt": "file"}
    p = plan(image, agent, home="/root")
    assert p.installer == "/root/.local/bin"
    src = sources(p)
    assert src["/root/.local/bin/env"] == "file:installer-env"
    assert src["/root/.local/bin/uv"] == "tools:/bin/uv"
    assert p.files["installer-env"] == INSTALLER_ENV
    ops = [(f.op, f.path) for f in p.fixes]
    assert ("set_aside", "/root/.local/bin/env") in ops and ("touch", "/root/.local/bin/env") in ops
    assert not any(path.endswith(("other", "answer.txt")) for _, path in ops)
    # mounted after the tools they come from
    dests = p.mount_dests()
    assert dests.index(VERIFIER_TOOLS) < dests.index("/root/.local/bin/uv")
    env = p.env({"PATH": "/usr/bin:/bin", "HOME": "/root"})
    assert env["PATH"].startswith("/.tmax/verifier/bin:/usr/bin") and env["UV_OFFLINE"] == "1"
    # a user's home made where the agent has none: its folders are the user's
    p = plan(image, IMAGE, home="/home/u")
    made = {f.path: f.user for f in p.fixes if f.op == "mkdir"}
    assert {k: v for k, v in made.items() if k.startswith("/home")} == {
        "/home": False, "/home/u": True, "/home/u/.local": True, "/home/u/.local/bin": True}
    assert PYTHON_DIR not in made
    # no uv in the tools, or no tools: nothing left
    assert not plan(IMAGE, agent, home="/root").installer
    assert not plan({**image, f"{VERIFIER_TOOLS}/bin/uvx": "link:uv"}, agent,
                    home="/root").installer


def test_the_agents_links_on_the_way_to_a_mount_point_are_set_aside_top_down():
    image = {**IMAGE, "/opt/venv/bin/pytest": "file", f"{VERIFIER_TOOLS}/bin/uv": "file",
             f"{VERIFIER_TOOLS}/bin/uvx": "file"}
    agent = {**IMAGE, "/opt": "link:/usr/lib", "/root/.local": "link:/etc"}
    p = plan(image, agent, path="/opt/venv/bin:/usr/bin", home="/root")
    opt = [f for f in p.fixes if f.path.startswith("/opt")]
    assert opt == [Fix("set_aside", "/opt", opt[0].target), Fix("mkdir", "/opt"),
                   Fix("mkdir", "/opt/venv")]
    assert opt[0].target.startswith("/.tmax-set-aside-opt-N")
    ops = [(f.op, f.path) for f in p.fixes]
    assert ops.index(("set_aside", "/root/.local")) < ops.index(("mkdir", "/root/.local"))
    guarded = [g for g in p.guarded if g.startswith(("/opt", "/root/.local"))]
    assert guarded[:4] == ["/opt/venv", "/root/.local", "/root/.local/bin", "/root/.local/bin/uv"]


def test_python_starts_with_the_guard_and_the_agents_system_opt_in_plans_only_its_own():
    p = plan(IMAGE, IMAGE)
    assert sources(p)[PYTHON_DIR] == "dir:python"
    # where the agent has no /.tmax, bwrap makes it in the verifier's own root (no name is
    # added at the agent's /); where it has one, the mount point is made in it and held
    assert not [f for f in p.fixes if f.path.startswith("/.tmax")]
    assert PYTHON_DIR not in p.guarded and ".tmax" not in [n for n, _, _ in p.entries]
    p = plan(IMAGE, {**IMAGE, "/.tmax/verifier": "dir"})
    assert Fix("mkdir", PYTHON_DIR) in p.fixes and PYTHON_DIR in p.guarded
    assert p.dirs["python"] == {"sitecustomize.py": pathguard_source()}
    assert p.env({"PATH": "/usr/bin", "PYTHONPATH": "/x"})["PYTHONPATH"] == f"{PYTHON_DIR}:/x"
    own = plan(IMAGE, {**IMAGE, "/conftest.py": "file"}, agent_system=True)
    assert [m.source for m in own.mounts] == ["logs"]
    assert not [f for f in own.fixes if f.op == "set_aside"]
    assert "PYTHONPATH" not in own.env({"PATH": "/usr/bin"})


def test_a_root_of_too_many_names_is_the_verifiers_whole():
    agent = {**IMAGE, **{f"/f{i}": "dir" for i in range(600)}}
    p = plan(IMAGE, agent)
    assert p.root == "whole" and not p.entries and not p.guarded


def test_trusted_first_puts_the_agents_path_folders_behind_the_images():
    path = "/go/bin:/opt/venv/bin:/usr/local/bin:./x:/usr/../tmp:/bin"
    assert trusted_first(path, ["/usr", "/bin", "/opt/venv", "/tests"]) == (
        "/opt/venv/bin:/usr/local/bin:/bin:/go/bin:./x:/usr/../tmp")
    assert trusted_first("/a:/b", []) == "/a:/b"


def test_the_guard_keeps_the_images_modules_first_and_the_workdirs_importable(tmp_path):
    """``python -m pytest`` in a folder holding an agent's pytest.py, argparse.py and a
    pytest11 entry point: the image's pytest runs the tests, which import the agent's
    module from that folder."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(pathguard_source())
    work = tmp_path / "work"
    (work / "t").mkdir(parents=True)
    (work / "pytest.py").write_text("import sys; sys.exit(0)\n")
    (work / "argparse.py").write_text("import os; os._exit(0)\n")
    dist = work / "evil-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\nevil = evilplugin\n")
    (work / "evilplugin.py").write_text("import os\ndef pytest_configure(config):\n"
                                        "    os._exit(0)\n")
    (work / "solution.py").write_text("def answer():\n    return 41\n")
    (work / "t" / "test_s.py").write_text("import solution\n"
                                          "def test_answer():\n"
                                          "    assert solution.answer() == 42\n")
    env = {**os.environ, "PYTHONPATH": str(guard)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "t"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "assert 41 == 42" in out.stdout, out.stdout + out.stderr
    (work / "solution.py").write_text("def answer():\n    return 42\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "t"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    # without the guard the agent's pytest.py "passes" the failing tests: what it stops
    (work / "solution.py").write_text("def answer():\n    return 41\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "t"], cwd=work, env=os.environ,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "passed" not in out.stdout


def test_the_guard_imports_the_images_own_sitecustomize(tmp_path):
    guard, image = tmp_path / "guard", tmp_path / "image"
    guard.mkdir()
    image.mkdir()
    (guard / "sitecustomize.py").write_text(pathguard_source())
    (image / "sitecustomize.py").write_text("import builtins; builtins.IMAGE_SITE = 1\n")
    code = "import builtins, sys; print(builtins.IMAGE_SITE, sys.modules['sitecustomize'].__file__)"
    out = subprocess.run([sys.executable, "-c", code],
                         env={**os.environ, "PYTHONPATH": f"{guard}:{image}"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", str(image / "sitecustomize.py")], out.stderr


def test_uv_finds_only_the_images_installed_pythons_never_the_agents():
    """uv tries the Pythons it installed ($HOME/.local/share/uv/python) before PATH, offline
    too: an agent's there would run ``uvx ... pytest`` with a sitecustomize of its own."""
    agent = {**IMAGE, "/root/.local/share/uv/python/cpython-3.11.7-linux-x86_64-gnu/bin/"
                      "python3": "file"}
    p = plan(IMAGE, agent, home="/root")  # the image has none: uv finds none
    env = p.env({"PATH": "/usr/bin", "HOME": "/root"})
    assert env["UV_PYTHON_INSTALL_DIR"] == f"{PYTHON_DIR}/no-uv-pythons"
    assert not [m for m in p.mounts if "/.local/share" in m.dest]
    # the image's (uv python install at build time): its copy, the verifier's own layer
    image = {**IMAGE, "/root/.local/share/uv/python/cpython-3.12.3-linux-x86_64-gnu/bin/"
                      "python3": "file"}
    p = plan(image, {**agent, "/root/.local/share": "link:/tmp"}, home="/root")
    assert sources(p)["/root/.local/share/uv/python"] == "overlay:/root/.local/share/uv/python"
    assert p.env({"PATH": "/usr/bin"})["UV_PYTHON_INSTALL_DIR"] == "/root/.local/share/uv/python"
    assert [f.op for f in p.fixes if f.path == "/root/.local/share"] == ["set_aside", "mkdir"]
    # a task's own setting stands; the agent's system opted in: nothing planned
    assert p.env({"UV_PYTHON_INSTALL_DIR": "/opt/py"})["UV_PYTHON_INSTALL_DIR"] == "/opt/py"
    own = plan(IMAGE, agent, home="/root", agent_system=True)
    assert "UV_PYTHON_INSTALL_DIR" not in own.env({"PATH": "/usr/bin"})


def test_curls_configuration_in_the_verifiers_home_is_the_images_or_empty():
    """An agent's ~/.curlrc (``url = "file:///root/x.sh"``) turned Harbor's
    ``curl -LsSf .../install.sh | sh`` into its own script run by the verifier, offline."""
    agent = {**IMAGE, "/root/.curlrc": 'file:url = "file:///root/x.sh"'}
    p = plan(IMAGE, agent, home="/root")
    assert sources(p)["/root/.curlrc"] == "empty" and "/root/.curlrc" in p.guarded
    assert [f.op for f in p.fixes if f.path == "/root/.curlrc"] == ["set_aside", "touch"]
    image = {**IMAGE, "/root/.curlrc": "file:--retry 3"}
    assert sources(plan(image, agent, home="/root"))["/root/.curlrc"] == "image:/root/.curlrc"
    # a home nobody made (the image's nobody): made, the user's, with an empty one
    p = plan(IMAGE, IMAGE, home="/nonexistent")
    assert sources(p)["/nonexistent/.curlrc"] == "empty"
    assert Fix("mkdir", "/nonexistent", user=True) in p.fixes
    assert "/root/.curlrc" not in sources(plan(IMAGE, agent, home="/root", agent_system=True))


def test_the_guard_never_imports_a_sitecustomize_from_the_working_directory(tmp_path):
    """A test.sh that adds the workdir to PYTHONPATH after the verifier's (``export
    PYTHONPATH=$PYTHONPATH:/app``): the agent's sitecustomize.py there ran as the image's."""
    guard, work = tmp_path / "guard", tmp_path / "work"
    guard.mkdir()
    work.mkdir()
    (guard / "sitecustomize.py").write_text(pathguard_source())
    (work / "sitecustomize.py").write_text("import os\nos._exit(0)\n")
    (work / "solution.py").write_text("ANSWER = 41\n")
    out = subprocess.run([sys.executable, "-c", "import solution; raise SystemExit(solution.ANSWER)"],
                         cwd=work, env={**os.environ, "PYTHONPATH": f"{guard}:{work}"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 41, out.stderr  # the agent's module still imports
