"""Docker-faithful builds: a Dockerfile stage as one build script plus the files it copies.

Both builders run the same script (the local builder in its chroot, Apptainer as %post), so
both build what Docker builds, in Docker's order:

- each RUN is its own ``/bin/sh -c`` (or SHELL, or exec form) with exactly the ENV and ARG
  values in force there, in its WORKDIR, as its USER; its failure stops the build, and the
  log says which line failed (``tmax-build: line N failed with exit C``, read back by
  ``step_error``);
- COPY/ADD happen where they stand: their sources are staged first under
  ``/.tmax-build/s<stage>/c<line>/<n>/<name>`` (``stage_files``) and copied into place by the
  script when it gets there, owned by root (or ``--chown``), modes kept (or ``--chmod``),
  with Docker's rule for files versus directories;
- RUN steps that download a vendor's installer (astral.sh's uv, Go, NodeSource, rustup)
  get a stand-in from the package registries (tmax.images.installers);
- RUN steps trust the certificates the build machine trusts (``CA_VARIABLES`` pointing at a
  copy staged as ``ca.crt``, unless the Dockerfile sets them; with a Node.js stand-in,
  ``NODE_OPTIONS=--use-openssl-ca`` too, so that Node reads ``SSL_CERT_FILE``): a machine
  that reaches the package registries only through a proxy with its own authority builds as
  one that does not;
- the staging folder is removed at the end, so the image holds only what Docker's would.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from tmax.images import installers
from tmax.images.rootfs import DEFAULT_PATH, BuildError
from tmax.tasks.confine import Escape, expand_source
from tmax.tasks.dockerfile import Copy, Run, Stage, Workdir

STAGING = "/.tmax-build"
FAIL = re.compile(r"^tmax-build: line (\d+) failed with exit (\d+)$", re.MULTILINE)
START = re.compile(r"^tmax-build: line (\d+): (.*)$", re.MULTILINE)

# Shell helpers at the top of every stage script (POSIX sh: the image may have no bash).
PRELUDE = r"""tmax_fail() { echo "tmax-build: line $1 failed with exit $2"; exit 1; }
tmax_home() { h=$(getent passwd "${1%%:*}" 2>/dev/null | cut -d: -f6); echo "${h:-/}"; }
tmax_as() {  # USER for one RUN: user[:group], by name or number
    u=${1%%:*}; g=${1#*:}; [ "$g" = "$1" ] && g=$(id -g "$u" 2>/dev/null || echo "$u")
    shift
    if getent passwd "$u" >/dev/null 2>&1; then
        exec setpriv --reuid="$u" --regid="$g" --init-groups "$@"
    fi
    exec setpriv --reuid="$u" --regid="$g" --clear-groups "$@"
}
tmax_copy() {  # staged dest into_dir owner mode
    [ -n "$5" ] && chmod -R "$5" "$1"/*/*
    chown -hR "${4:-0:0}" "$1" || return 1
    for m in "$1"/*; do
        for e in "$m"/* "$m"/.[!.]* "$m"/..?*; do
            [ -e "$e" ] || [ -L "$e" ] || continue
            if [ -d "$e" ] && [ ! -L "$e" ]; then
                mkdir -p "$2" && cp -a "$e"/. "$2"/ || return 1
            elif [ "$3" = 1 ] || [ -d "$2" ]; then
                mkdir -p "$2" && cp -a "$e" "$2"/ || return 1
            else
                mkdir -p "$(dirname "$2")" && cp -a "$e" "$2" || return 1
            fi
        done
    done
}
"""


CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT",
                "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO")


def _q(value: str) -> str:
    return shlex.quote(value)


def _where(stage: Stage) -> str:
    return f"{STAGING}/s{stage.index}"


def stage_script(stage: Stage, clean: bool = True) -> str:
    """The build script of one stage (see the module doc); ``clean``: it ends by removing
    the staged files (not when another stage's script follows it in the same build)."""
    ca = f"{_where(stage)}/ca.crt"
    out = [PRELUDE.rstrip(), f"export PATH={_q(stage.env.get('PATH', '') or os.defpath)}",
           f"TMAX_CA=; [ -f {ca} ] && TMAX_CA=\"" + " ".join(f"{v}={ca}" for v in CA_VARIABLES)
           + '"']
    stand_ins = installers.find([stage])
    if stand_ins:  # (the format and URLs: in the digest of the image, as the script is)
        out.append(f"# {installers.stamp(stand_ins)}")
    if any(s.kind in ("node", "node-image") for s in stand_ins):
        # the official Node.js builds these serve trust their own list, not SSL_CERT_FILE,
        # unless told to use OpenSSL's (as Debian's nodejs does)
        out.append('[ -n "$TMAX_CA" ] && TMAX_CA="$TMAX_CA NODE_OPTIONS=--use-openssl-ca"')
    for n, stand in enumerate(stand_ins):
        if stand.kind in installers.IMAGE_TOOLS:
            tool = {"go-image": "Go", "node-image": "Node.js"}[stand.kind]
            out.append(f"echo {_q(f'tmax-build: line {stage.line}: FROM {stand.url}: its {tool}')}")
            out.append(installers.image_tool_line(
                stand.kind, _q(f"{installers.SHIM_DIR}/files/{n}-{stand.kind}"), stage.line))
    for step in stage.steps:
        if isinstance(step, Workdir):
            out.append(f"# line {step.line}: WORKDIR {step.path}")
            out.append(f"mkdir -p {_q(step.path)} || tmax_fail {step.line} $?")
        elif isinstance(step, Copy):
            word = "ADD" if step.add else "COPY"
            out.append(f"echo {_q(f'tmax-build: line {step.line}: {word} -> {step.dest}')}")
            staged = f"{_where(stage)}/c{step.line}"
            out.append(f"tmax_copy {_q(staged)} {_q(step.dest)} {int(step.into_dir)} "
                       f"{_q(step.chown)} {_q(step.chmod)} || tmax_fail {step.line} $?")
        elif isinstance(step, Run):
            out.append(f"echo {_q(f'tmax-build: line {step.line}: RUN {_shown(step.text)}')}")
            out.append(_run_line(step, shims=bool(stand_ins)))
    if clean:
        out.append(f"rm -rf {_q(STAGING)}")
    return "\n".join(out) + "\n"


def _shown(text: str, width: int = 100) -> str:
    one = " ".join(text.split())
    return one if len(one) <= width else one[:width - 3] + "..."


def _run_line(step: Run, shims: bool = False) -> str:
    env = dict(step.env)
    if shims:  # curl and wget that serve the installer stand-ins (tmax.images.installers)
        env["PATH"] = f"{installers.SHIM_DIR}/bin:" + (env.get("PATH") or DEFAULT_PATH)
    home = f'HOME="$(tmax_home {_q(step.user)})"' if step.user else "HOME=/root"
    env_args = " ".join(_q(f"{k}={v}") for k, v in env.items() if k != "HOME")
    home = _q(f"HOME={env['HOME']}") if "HOME" in env else home
    command = " ".join(_q(a) for a in step.argv)
    runner = f"(tmax_as {_q(step.user)} env -i" if step.user else "(env -i"
    return (f"(cd {_q(step.workdir)} && {runner} {home} $TMAX_CA {env_args} {command})) "
            f"</dev/null || tmax_fail {step.line} $?")


def environment_section(stage: Stage) -> str:
    """%environment: the stage's ENV, as the image's environment."""
    return "\n".join(f"    export {k}={_q(v)}" for k, v in stage.env.items())


def step_error(log: Path, fallback: BuildError) -> BuildError:
    """The failed step named from the log's markers (the last step that started, its
    output), or ``fallback`` when the log has none."""
    text = log.read_text(errors="replace")
    failed = list(FAIL.finditer(text))
    if not failed:
        return fallback
    line, code = failed[-1].group(1), failed[-1].group(2)
    starts = [m for m in START.finditer(text, 0, failed[-1].start()) if m.group(1) == line]
    what = f"Dockerfile line {line}" + (f": {starts[-1].group(2)}" if starts else "")
    begin = starts[-1].end() if starts else failed[-1].start()
    output = text[begin:failed[-1].start()].strip().splitlines()[-15:]
    return BuildError(what, f"exit {code}:\n" + "\n".join(output), fallback.log)


# --------------------------------------------------------------------------- staging


ImageRoot = Callable[[str], Path]
"""An image reference -> a folder standing in for that image's root (COPY --from=image)."""


def stage_files(stage: Stage, context: Path, dest: Path, *, image_root: ImageRoot,
                stage_root: Callable[[int], Path] | None = None, ca: Path | None = None
                ) -> None:
    """Stage every COPY/ADD of ``stage`` under ``dest`` (the image's /.tmax-build/s<n>):
    from the build context, heredocs, URLs, other stages (``stage_root``: the root
    filesystem a stage built) and images (``image_root``); ``ca``: the certificates RUN
    steps trust."""
    dest.mkdir(parents=True, exist_ok=True)
    if ca is not None:
        shutil.copyfile(ca, dest / "ca.crt")
        (dest / "ca.crt").chmod(0o644)
    for step in stage.steps:
        if not isinstance(step, Copy) or (step.from_stage is not None and stage_root is None):
            continue  # (the Apptainer builder copies from stages with "%files from")
        folder = dest / f"c{step.line}"
        folder.mkdir(parents=True)
        n = 0
        for name, body in step.inline:
            entry = folder / str(n)
            entry.mkdir()
            (entry / name).write_text(body)
            n += 1
        for src in step.sources:
            for match in _matches(step, src, context, image_root, stage_root):
                entry = folder / str(n)
                entry.mkdir()
                n += _stage_one(step, match, entry, src)
        if n > 1 and not step.into_dir:
            raise BuildError(f"Dockerfile line {step.line}",
                             f"{len(step.sources)} source(s) match {n} files: the destination "
                             f"{step.dest!r} must end with '/'")


def _matches(step: Copy, src: str, context: Path, image_root: ImageRoot,
             stage_root: Callable[[int], Path] | None) -> list[Path]:
    where = f"Dockerfile line {step.line}"
    if step.add and re.match(r"https?://", src):
        return [Path(src)]  # fetched by _stage_one
    if step.from_stage is not None or step.from_image:
        if step.from_stage is not None and stage_root is not None:
            root = stage_root(step.from_stage)
        else:
            root = image_root(step.from_image)
        matches = _in_root(root, src)
        if not matches:
            raise BuildError(where, f"COPY --from={step.from_image or step.from_stage}: "
                             f"{src!r} not found")
        return matches
    try:
        matches = expand_source(context, src)
    except Escape as e:
        raise BuildError(where, str(e)) from None
    if not matches:
        raise BuildError(where, f"source {src!r} not found in the build context {context}")
    return matches


def _in_root(root: Path, src: str) -> list[Path]:
    """Matches of absolute ``src`` in another image's root, never leaving it."""
    import glob

    parts = PurePosixPath("/", src).parts[1:]
    if ".." in parts:
        return []
    base = os.path.realpath(root)
    found = sorted(glob.glob(os.path.join(glob.escape(base), *parts)))
    return [Path(m) for m in found
            if os.path.realpath(os.path.dirname(m)).startswith(base)]


def _stage_one(step: Copy, match: Path, entry: Path, src: str) -> int:
    """Put one match into ``entry``; 1 (one thing staged)."""
    if step.add and re.match(r"https?://", src):
        name = PurePosixPath(urllib.parse.urlparse(src).path).name or "index.html"
        try:
            with urllib.request.urlopen(src, timeout=300) as r, open(entry / name, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise BuildError(f"Dockerfile line {step.line}", f"ADD {src}: {e}") from None
        (entry / name).chmod(0o600)
        return 1
    if step.add and match.is_file() and _is_archive(match):
        target = entry / match.name
        target.mkdir()
        with tarfile.open(match) as archive:
            archive.extractall(target, filter="tar")  # no links or paths leaving target
        return 1
    if match.is_dir() and not match.is_symlink():
        shutil.copytree(match, entry / match.name, symlinks=True)
    else:
        shutil.copy2(match, entry / match.name, follow_symlinks=False)
    return 1


def _is_archive(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def staging_dir(parent: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix="stage-", dir=parent))
