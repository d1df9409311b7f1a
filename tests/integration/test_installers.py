"""Installer hosts served from the package registries while an image builds
(tmax.images.installers): which URLs get a stand-in, the curl/wget wrappers that serve them
(run here with sh, against a stand-in 'real' curl that records its arguments), and a real
build whose RUN steps install uv and Go from astral.sh's and go.dev's URLs with neither host
reachable."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_dockerfile import _build
from tests.integration.test_images import cat_sif, list_sif
from tmax.images import installer_scripts, installers
from tmax.images.plan import stage_script
from tmax.images.types import BuildError
from tmax.tasks.dockerfile import parse


def _stages(text: str):  # type: ignore[no-untyped-def]
    return parse(text, lambda image: "debian-slim").stages


def test_the_vendor_urls_of_run_steps_get_stand_ins_with_their_versions(monkeypatch):
    monkeypatch.delenv(installers.MODE_ENV, raising=False)
    found = installers.find(_stages(
        "FROM debian:bookworm\n"
        "RUN curl -LsSf https://astral.sh/uv/0.5.11/install.sh | sh\n"
        "RUN curl -LsSf https://astral.sh/uv/install.sh | sh && echo https://example.org/x\n"
        'RUN curl -L "https://golang.org/dl/go1.21.5.linux-$GOARCH.tar.gz" -o go.tar.gz\n'
        "RUN curl -fsSL https://deb.nodesource.com/setup_20.x | bash -\n"
        "RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y\n"
        "RUN curl -LsSf https://astral.sh/uv/0.5.11/install.sh | sh\n"  # the same URL again
        "RUN add-apt-repository -y ppa:deadsnakes/ppa && apt-get install -y python3.11\n"
        "RUN add-apt-repository ppa:git-core/ppa\n"))
    assert [(s.kind, s.version, s.line) for s in found] == [
        ("uv", "0.5.11", 2), ("uv", "", 3), ("go", "1.21.5", 4), ("node", "20", 5),
        ("rust", "", 6), ("ppa", "", 8)]
    go = found[2]
    assert go.url == "https://golang.org/dl/go1.21.5.linux-$GOARCH.tar.gz"


def test_a_stage_from_a_golang_tag_with_a_release_gets_that_go(monkeypatch):
    """The bases have one Go each: a stage FROM golang:<release>... (any registry prefix,
    digest) starts by putting that release's Go in /usr/local/go; a tag without one, a stage
    FROM an earlier stage and network mode do not."""
    monkeypatch.delenv(installers.MODE_ENV, raising=False)
    stages = _stages(
        "FROM public.ecr.aws/docker/library/golang:1.24-bookworm@sha256:" + "1a" * 32 +
        " AS build\nRUN go build ./...\n"
        "FROM build AS again\nRUN true\n"
        "FROM golang:bookworm\nRUN true\n"
        "FROM golang:1.22.7\nRUN true\n"
        "FROM node:22-bookworm-slim\nRUN npm ci\nFROM node:lts\n")
    found = installers.find(stages)
    assert [(s.kind, s.url, s.version, s.line) for s in found] == [
        ("go-image", "golang:1.24-bookworm", "1.24", 1),
        ("go-image", "golang:1.22.7", "1.22.7", 7),
        ("node-image", "node:22-bookworm-slim", "22", 9)]
    script = stage_script(stages[0])
    unpack = installers.image_tool_line("go-image", f"{installer_scripts.SHIM_DIR}/files/0-go-image", 1)
    assert unpack.startswith(f"if [ -f {installer_scripts.SHIM_DIR}/files/0-go-image ]; then rm -rf ")
    assert unpack in script and script.index(unpack) < script.index("go build ./...")
    assert "go-image" not in stage_script(stages[1]) + stage_script(stages[2])
    node = stage_script(stages[4])
    assert node.index(f"tar -xzf {installer_scripts.SHIM_DIR}/files/0-node-image -C /usr/local") < \
        node.index("npm ci")
    assert "NODE_OPTIONS=--use-openssl-ca" in node  # (it reads the build machine's CAs)
    assert "node-image" not in stage_script(stages[5])
    assert "NODE_OPTIONS" not in stage_script(stages[0]) + stage_script(stages[5])
    assert "golang:1.24-bookworm" in installers.stamp(found)  # (in the image digest)
    monkeypatch.setenv(installers.MODE_ENV, "network")
    assert installers.find(stages) == []


def test_a_url_pattern_matches_the_url_the_step_fetches_and_nothing_else():
    import re

    stand = installers.StandIn("go", "https://golang.org/dl/go1.21.5.linux-${GOARCH}.tar.gz",
                               "1.21.5", 4)
    pattern = re.compile(stand.pattern)  # (an ERE with no back-references: Python agrees)
    assert pattern.fullmatch("https://golang.org/dl/go1.21.5.linux-amd64.tar.gz")
    assert not pattern.fullmatch("https://golang.org/dl/go1.21.5.linux-amd64.tar.gz.sha256")
    assert not pattern.fullmatch("https://golangXorg/dl/go1.21.5.linux-amd64.tar.gz")
    assert not pattern.fullmatch("https://golang.org/dl/go1.21.5.linux-a/b.tar.gz")


def test_network_mode_serves_nothing_and_a_bad_mode_is_an_error(monkeypatch):
    text = "FROM debian:bookworm\nRUN curl -LsSf https://astral.sh/uv/0.5.11/install.sh | sh\n"
    monkeypatch.setenv(installers.MODE_ENV, "network")
    assert installers.find(_stages(text)) == []
    assert installer_scripts.SHIM_DIR not in stage_script(_stages(text)[-1])
    monkeypatch.setenv(installers.MODE_ENV, "offline")
    with pytest.raises(BuildError, match="TMAX_INSTALLERS.*registries, network"):
        installers.find(_stages(text))


def test_only_a_stage_with_stand_ins_puts_the_wrappers_first_on_its_run_steps_path(monkeypatch):
    monkeypatch.delenv(installers.MODE_ENV, raising=False)
    (plain,) = _stages("FROM debian:bookworm\nENV PATH=/opt/x/bin:/usr/bin:/bin\nRUN echo hi\n")
    assert installer_scripts.SHIM_DIR not in stage_script(plain)
    (served,) = _stages("FROM debian:bookworm\nENV PATH=/opt/x/bin:/usr/bin:/bin\n"
                        "RUN curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n")
    script = stage_script(served)
    assert f" PATH={installer_scripts.SHIM_DIR}/bin:/opt/x/bin:/usr/bin:/bin " in script
    assert re.search(r"# installers-1 [0-9a-f]{12}: https://astral.sh/uv/0.7.13/install.sh", script)


# --------------------------------------------------------------------------- the wrappers


@pytest.fixture
def wrappers(tmp_path):
    """The curl and wget wrappers, their staging folder moved under tmp_path, serving one
    file for one URL; a 'real' curl and wget that record their arguments in calls.txt."""
    shim = tmp_path / "shim"
    (shim / "bin").mkdir(parents=True)
    (shim / "served.sh").write_text("echo the stand-in\n")
    (shim / "table").write_text(
        "https://astral\\.sh/uv/0\\.7\\.13/install\\.sh\t" + f"{shim}/served.sh\n"
        "https://sh\\.rustup\\.rs/?\t" + f"{shim}/served.sh\n")
    for tool, script in (("curl", installers.CURL_SH), ("wget", installers.WGET_SH),
                         ("add-apt-repository", installers.ADD_APT_REPOSITORY_SH)):
        path = shim / "bin" / tool
        path.write_text((installers.COMMON_SH + script).replace(installer_scripts.SHIM_DIR, str(shim)))
        path.chmod(0o755)
    real = tmp_path / "real"
    real.mkdir()
    for tool in ("curl", "wget", "add-apt-repository"):
        (real / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {tmp_path}/calls.txt\n')
        (real / tool).chmod(0o755)
    tools = tmp_path / "tools"  # what the wrappers use, and no curl or wget of the host's
    tools.mkdir()
    for tool in ("grep", "cat", "cp", "basename", "dirname", "mkdir", "sh", "echo"):
        (tools / tool).symlink_to(shutil.which(tool))
    work = tmp_path / "work"
    work.mkdir()

    def run(command: str, *, with_real: bool = True) -> subprocess.CompletedProcess:
        path = f"{shim}/bin:" + (f"{real}:" if with_real else "") + str(tools)
        return subprocess.run([str(tools / "sh"), "-c", command], cwd=work, capture_output=True, text=True,
                              env={"PATH": path}, timeout=30)

    return run, tmp_path


URL = "https://astral.sh/uv/0.7.13/install.sh"


@pytest.mark.parametrize("command, where", [
    (f"curl -LsSf {URL}", "stdout"),
    (f"curl --proto '=https' --tlsv1.2 -sSf {URL}", "stdout"),
    (f"curl -fsSL {URL} -o /WORK/got.sh", "got.sh"),
    (f"curl -fsSLo got.sh {URL}", "got.sh"),
    (f"curl -L --output got.sh {URL}", "got.sh"),
    (f"curl --output-dir sub -LO {URL}", "sub/install.sh"),
    (f"curl -fsSL --create-dirs -o new/dir/got.sh {URL}", "new/dir/got.sh"),
    (f"curl -H'Authorization: token x' -sSLo got.sh {URL}", "got.sh"),
    (f"curl -AMozilla/5.0 {URL}", "stdout"),
    (f"curl -LO {URL}", "install.sh"),
    (f"curl -H 'Accept: */*' -x http://proxy.invalid:3128 {URL}", "stdout"),
    (f"wget -qO- {URL}", "stdout"),
    (f"wget -q -O - {URL}", "stdout"),
    (f"wget -O got.sh {URL}", "got.sh"),
    (f"wget {URL}", "install.sh"),
    (f"wget -P sub {URL}", "sub/install.sh"),
    ("wget https://sh.rustup.rs", "index.html"),
    (f"wget --referer https://example.org/ -O got.sh {URL}", "got.sh"),
])
def test_a_served_url_is_served_where_the_tool_would_write_it(wrappers, command, where):
    run, tmp = wrappers
    (tmp / "work" / "sub").mkdir()
    result = run(command.replace("/WORK", str(tmp / "work")))
    assert result.returncode == 0, result.stderr
    got = result.stdout if where == "stdout" else (tmp / "work" / where).read_text()
    assert got == "echo the stand-in\n"
    assert not (tmp / "calls.txt").exists()  # the real tool was not called
    assert "served from the package registries" in result.stderr


@pytest.mark.parametrize("command", [
    "curl -fsSL https://example.org/install.sh -o x",
    f"curl -fsSL {URL}.sha256",
    "curl -s http://astral.sh/uv/0.7.13/install.sh",  # http: not what the table says
    "wget -q https://pypi.org/simple/",
    "curl --version",
    "add-apt-repository -y ppa:git-core/ppa",
    f"curl -I {URL}",  # headers, a status code, two URLs, a method: the real tool's business
    f"curl -sS -w %{{http_code}} -o /dev/null {URL}",
    f"curl -o a.sh https://example.org/a.sh -o b.sh {URL}",
    f"curl -XPOST {URL}",
    f"curl --output=x {URL}",  # (not curl's syntax: the real one says so)
    f"wget --spider {URL}",
])
def test_anything_else_goes_to_the_real_tool_with_its_arguments_unchanged(wrappers, command):
    run, tmp = wrappers
    result = run(command)
    assert result.returncode == 0, result.stderr
    assert (tmp / "calls.txt").read_text() == command + "\n"


def test_wget_does_not_overwrite_a_file_of_the_same_name(wrappers):
    run, tmp = wrappers
    (tmp / "work" / "install.sh").write_text("mine\n")
    assert run(f"wget -q {URL}").returncode == 0
    assert (tmp / "work" / "install.sh").read_text() == "mine\n"
    assert (tmp / "work" / "install.sh.1").read_text() == "echo the stand-in\n"


def test_the_deadsnakes_ppa_is_not_added_and_says_why(wrappers):
    run, tmp = wrappers
    result = run("add-apt-repository -y ppa:deadsnakes/ppa")
    assert result.returncode == 0 and "not added" in result.stderr
    assert not (tmp / "calls.txt").exists()
    result = run("add-apt-repository -y ppa:deadsnakes/ppa", with_real=False)
    assert result.returncode == 127  # software-properties-common not installed: as Docker


def test_an_image_without_the_tool_fails_as_it_would_under_docker(wrappers):
    run, _ = wrappers
    result = run(f"curl -LsSf {URL}", with_real=False)
    assert result.returncode == 127 and "curl: not found" in result.stderr
    assert result.stdout == ""  # nothing was served


# --------------------------------------------------------------------------- a real build


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
def test_uv_go_and_node_install_from_their_vendor_urls_with_only_the_registries(
        tmp_path, image_store):
    """The build's RUN steps reach PyPI and Debian only (this machine reaches nothing else:
    astral.sh, golang.org and deb.nodesource.com do not resolve), yet uv's installer script,
    Go's tarball and NodeSource's setup script work as the Dockerfile uses them; before curl is installed a download fails with 127,
    as under Docker; no wrapper is left in the image."""
    result, store = _build(tmp_path, image_store, (
        "FROM debian:bookworm-slim\n"
        "RUN curl -LsSf https://astral.sh/uv/0.7.13/install.sh > /x.sh; echo $? > /before\n"
        "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends curl\n"
        "RUN curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n"
        "ENV PATH=/root/.local/bin:$PATH\n"
        "RUN uv --version > /uv.txt && . /root/.local/bin/env && uvx --version > /uvx.txt\n"
        "RUN ARCH=$(uname -m) && if [ \"$ARCH\" = x86_64 ]; then GOARCH=amd64; "
        "else GOARCH=arm64; fi && curl -L \"https://golang.org/dl/go1.21.5.linux-$GOARCH"
        ".tar.gz\" -o go.tar.gz && tar -C /usr/local -xzf go.tar.gz && rm go.tar.gz\n"
        "RUN /usr/local/go/bin/go version > /go.txt\n"
        "RUN curl -fsSL https://deb.nodesource.com/setup_20.x | bash - && node --version > "
        "/node.txt && npm --version > /npm.txt && npx --version > /npx.txt\n"
        "RUN echo $PATH > /path.txt\n"), {})
    assert result.status == "built", result.error
    sif = store.path(store.read().tasks["demo"].sif)

    def cat(path: str) -> str:
        out = tmp_path / f"cat-{path.strip('/').replace('/', '_')}"
        out.mkdir(exist_ok=True)
        return cat_sif(sif, path, out)

    assert cat("/before").strip() == "127"
    assert cat("/uv.txt").startswith("uv 0.7.13")
    assert "0.7.13" in cat("/uvx.txt")
    assert 'export PATH="$HOME/.local/bin:$PATH"' in cat("/root/.local/bin/env")
    assert '. "$HOME/.local/bin/env"' in cat("/root/.profile")
    assert cat("/go.txt").startswith("go version go1.21.")
    assert cat("/node.txt").startswith("v20.") and cat("/npm.txt").strip()[0].isdigit()
    assert cat("/npx.txt") == cat("/npm.txt")  # npx is npm's, under /usr/local
    assert installer_scripts.SHIM_DIR in cat("/path.txt")  # (what the step saw, not the image)
    assert ".tmax-build" not in list_sif(sif)
    log = store.path(result.log).read_text()
    assert "installer stand-in: Dockerfile line 2: https://astral.sh/uv/0.7.13/install.sh" \
        in log and "go 1.21." in log


GO_PROGRAM = {"go.mod": "module hello\n\ngo 1.22\n",
              "main.go": 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hi") }\n'}


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the local builder needs root")
@pytest.mark.parametrize("image, files, run, version, log_line", [
    ("golang:1.22-bookworm", GO_PROGRAM,
     "go version > /version.txt && go build -o /usr/local/bin/hello . && hello > /out.txt",
     "go version go1.22.", "FROM golang:1.22-bookworm -> go 1.22."),
    ("node:22-bookworm-slim", {"main.js": "console.log('hi')\n"},
     # npm reaches its registry through this machine's proxy, if any, as pip does, even where
     # the Dockerfile points NODE_EXTRA_CA_CERTS at its author's missing proxy certificate
     # (opportunity-web's ENV): official Node.js builds then read SSL_CERT_FILE
     ("node --version > /version.txt && node main.js > /out.txt && NODE_EXTRA_CA_CERTS="
      "/usr/local/share/ca-certificates/fwdproxy.crt npm view is-number@7.0.0 version"),
     "v22.", "FROM node:22-bookworm-slim -> Node.js 22."),
])
def test_a_tag_with_a_release_builds_with_that_release(tmp_path, image_store, image, files,
                                                       run, version, log_line):
    """ansible-ci-control-plane's `FROM golang:1.24-bookworm` over a base whose Go is older
    (golang-bookworm's is 1.23, and its go.mod says `go 1.24`), token-revocation-freshness's
    `FROM node:22-bookworm-slim` over one with Node.js 18: the stage builds with the tag's
    release from PyPI (here over a base with neither)."""
    from tests.integration.test_dockerfile import _build_task, _user_base
    from tests.unit.test_tasks import make_task

    name = image.split(":")[0]
    user = _user_base(tmp_path, "bare", f"{name}:*", (
        "%environment\n    export PATH=/go/bin:/usr/local/go/bin:/usr/local/sbin:/usr/local/bin"
        ":/usr/sbin:/usr/bin:/sbin:/bin\n    export GOTOOLCHAIN=local\n"))
    task = make_task(tmp_path, **{"environment/Dockerfile": (
        f"FROM {image}\nWORKDIR /src\nCOPY . ./\nRUN {run}\n"),
        **{f"environment/{k}": v for k, v in files.items()}})
    _, result, sif, out = _build_task(tmp_path, image_store, task, user)
    assert cat_sif(sif, "/version.txt", out).startswith(version)
    assert cat_sif(sif, "/out.txt", out) == "hi\n"
    assert log_line in image_store.path(result.log).read_text()


def test_the_served_installers_are_well_formed_shell():
    for script in (installers.UV_INSTALL_SH, installers.NODE_SETUP_SH, installers.RUSTUP_SH,
                   installers.COMMON_SH + installers.ADD_APT_REPOSITORY_SH,
                   installers.COMMON_SH + installers.CURL_SH,
                   installers.COMMON_SH + installers.WGET_SH):
        check = subprocess.run(["sh", "-n"], input=script, capture_output=True, text=True,
                               timeout=10)
        assert check.returncode == 0, check.stderr


def test_the_uv_installer_puts_uv_where_the_vendors_does(tmp_path):
    """UV_INSTALL_DIR, XDG_BIN_HOME, the default ~/.local/bin and, before 0.5,
    $CARGO_HOME/bin; UV_UNMANAGED_INSTALL and --no-modify-path write no profile line."""
    src = tmp_path / "src"
    src.mkdir()
    for tool in ("uv", "uvx"):
        (src / tool).write_text(f"#!/bin/sh\necho {tool}\n")

    def install(version: str, legacy: bool, home: Path, *args: str, **env: str) -> None:
        script = installers.UV_INSTALL_SH.replace("@SRC@", str(src)).replace(
            "@VERSION@", version).replace("@LEGACY@", "1" if legacy else "")
        home.mkdir(parents=True, exist_ok=True)
        subprocess.run(["sh", "-s", "--", *args], input=script, text=True, check=True,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(home), **env},
                       capture_output=True, timeout=30)

    install("0.7.13", False, tmp_path / "h1")
    assert (tmp_path / "h1/.local/bin/uvx").stat().st_mode & 0o111
    assert '. "$HOME/.local/bin/env"' in (tmp_path / "h1/.profile").read_text()
    install("0.4.30", True, tmp_path / "h2")
    assert (tmp_path / "h2/.cargo/bin/uv").exists() and (tmp_path / "h2/.cargo/env").exists()
    install("0.7.13", False, tmp_path / "h3", UV_INSTALL_DIR=str(tmp_path / "opt"))
    assert (tmp_path / "opt/uv").exists() and (tmp_path / "opt/env").exists()
    install("0.4.30", True, tmp_path / "h6", UV_INSTALL_DIR=str(tmp_path / "old"))
    assert (tmp_path / "old/bin/uv").exists() and (tmp_path / "old/env").exists()
    install("0.7.13", False, tmp_path / "h7", UV_INSTALL_DIR=str(tmp_path / "h7/.cargo"),
            UV_UNMANAGED_INSTALL=str(tmp_path / "ignored"))
    assert (tmp_path / "h7/.cargo/bin/uv").exists() and not (tmp_path / "ignored").exists()
    onpath = tmp_path / "onpath"
    install("0.7.13", False, tmp_path / "h8", UV_INSTALL_DIR=str(onpath),
            PATH=f"{onpath}:/usr/bin:/bin")
    assert (onpath / "uv").exists() and not (onpath / "env").exists()
    assert not (tmp_path / "h8/.profile").exists()
    install("0.7.13", False, tmp_path / "h4", "--no-modify-path",
            XDG_BIN_HOME=str(tmp_path / "xdg"))
    assert (tmp_path / "xdg/uv").exists() and not (tmp_path / "h4/.profile").exists()
    install("0.7.13", False, tmp_path / "h5", UV_UNMANAGED_INSTALL=str(tmp_path / "unm"))
    assert (tmp_path / "unm/uv").exists() and not (tmp_path / "unm/env").exists()


@pytest.mark.parametrize("dockerfile, stage", [
    ("FROM python:3.11-slim\nRUN curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n", 0),
    # a stage FROM an earlier one: its %files copy that stage's staged folder, then its own,
    # so its own has the stand-ins of both (the earlier stage's RUN step fetches 0.7.13)
    (("FROM python:3.11-slim AS tools\n"
      "RUN curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh\n"
      "FROM tools\nRUN curl -LsSf https://astral.sh/uv/0.7.12/install.sh | sh\n"), 1),
])
def test_the_apptainer_builder_stages_the_wrappers_where_its_files_section_copies(
        tmp_path, monkeypatch, dockerfile, stage):
    """`apptainer build` gets the wrappers, the table and the served installer in the staged
    /.tmax-build its %files copies, and the RUN step's PATH starts with them (a stand-in
    apptainer keeps a copy of what it was given; uv itself is not downloaded here)."""
    from tests.integration.test_images import TABLE
    from tests.unit.test_tasks import make_task
    from tmax.images import verifier_staging, verifier_tools
    from tmax.images.bases import BaseTable
    from tmax.images.builders import ApptainerBuilder
    from tmax.images.plan import task_definition

    monkeypatch.delenv(installers.MODE_ENV, raising=False)
    fake = tmp_path / "apptainer"
    fake.write_text('#!/bin/bash\ncat "${@: -1}" > "$RECORD.def"\ntouch "${@: -2:1}"\n'
                    'cp -r "$(dirname "${@: -1}")" "$RECORD.tmp"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("RECORD", str(tmp_path / "rec"))

    def stage_uv(version, cache_dir, log, timeout):  # type: ignore[no-untyped-def]
        tree = Path(cache_dir) / "uv-tree"
        (tree / verifier_tools.ROOT.lstrip("/") / "bin").mkdir(parents=True, exist_ok=True)
        for tool in ("uv", "uvx"):
            (tree / verifier_tools.ROOT.lstrip("/") / "bin" / tool).write_text(version)
        return tree

    monkeypatch.setattr(verifier_staging, "stage_uv", stage_uv)
    task = make_task(tmp_path, **{"environment/Dockerfile": dockerfile})
    tdef = task_definition(task / "environment", BaseTable.load(TABLE).resolve)
    out = tmp_path / "out" / "image.sif"
    out.parent.mkdir()
    ApptainerBuilder(apptainer=str(fake), fakeroot=False).build_task(
        tdef, task / "environment", Path("/store/bases/b.sif"), out, tmp_path / "log", 60)
    definition = (tmp_path / "rec.def").read_text()
    assert f"PATH={installer_scripts.SHIM_DIR}/bin:" in definition
    shim = tmp_path / "rec.tmp" / f"s{stage}" / installer_scripts.SHIM_DIR.lstrip("/")
    assert (shim / "bin" / "curl").stat().st_mode & 0o111
    row, *later = (shim / "table").read_text().splitlines()
    assert [r.split("\t")[0] for r in later] == \
        ([r"https://astral\.sh/uv/0\.7\.12/install\.sh"] if stage else [])
    pattern, served = row.split("\t")
    assert pattern == r"https://astral\.sh/uv/0\.7\.13/install\.sh"
    assert served.startswith(installer_scripts.SHIM_DIR + "/files/")
    assert "uv 0.7.13" in (shim / served[len(installer_scripts.SHIM_DIR) + 1:]).read_text()
    assert (shim / "uv-0.7.13" / "uvx").read_text() == "0.7.13"


def test_versions_from_arg_and_env_and_urls_in_heredocs_get_stand_ins(monkeypatch):
    monkeypatch.delenv(installers.MODE_ENV, raising=False)
    found = installers.find(_stages(
        "FROM debian:bookworm\nARG GO_VERSION=1.22.5\nENV UV_VERSION=0.6.3\n"
        'RUN curl -fsSLo go.tgz "https://go.dev/dl/go${GO_VERSION}.linux-amd64.tar.gz"\n'
        "RUN <<EOF\ncurl -LsSf https://astral.sh/uv/$UV_VERSION/install.sh | sh\nEOF\n"))
    assert [(s.kind, s.url, s.version) for s in found] == [
        ("go", "https://go.dev/dl/go1.22.5.linux-amd64.tar.gz", "1.22.5"),
        ("uv", "https://astral.sh/uv/0.6.3/install.sh", "0.6.3")]
