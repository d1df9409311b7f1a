"""The build plan: a task's Dockerfile (or container.def) as a ``TaskDefinition``, whose
script builds what Docker builds; and that plan as one Apptainer definition. Pure: the
files a script copies are staged by ``tmax.images.staging``, the plan run by
``tmax.images.builders``.

A Dockerfile stage is one build script plus the files it copies.

Both builders run the same script (the local builder in its chroot, Apptainer as %post), so
both build what Docker builds, in Docker's order:

- each RUN is its own ``/bin/sh -c`` (or SHELL, or exec form) with exactly the ENV and ARG
  values in force there, in its WORKDIR, as its USER; its failure stops the build, and the
  log says which line failed (``tmax-build: line N failed with exit C``, read back by
  ``step_error``);
- COPY/ADD happen where they stand: their sources are staged first under
  ``/.tmax-build/s<stage>/c<line>/<n>/<name>`` (``tmax.images.staging``) and copied into
  place by the script when it gets there, owned by root (or ``--chown``), modes kept (or
  ``--chmod``), with Docker's rule for files versus directories;
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
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from tmax.images import installers
from tmax.images.installer_scripts import SHIM_DIR
from tmax.images.types import (
    DEFAULT_PATH,
    STAGING,
    BuildError,
    Definition,
    TaskDefinition,
    parse_definition,
)
from tmax.tasks.dockerfile import Copy, Run, Stage, Workdir
from tmax.tasks.dockerfile import parse as parse_dockerfile

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
                stand.kind, _q(f"{SHIM_DIR}/files/{n}-{stand.kind}"), stage.line))
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
        env["PATH"] = f"{SHIM_DIR}/bin:" + (env.get("PATH") or DEFAULT_PATH)
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


def task_definition(env_dir: Path, resolve: Callable[[str], str],
                    base_workdir: Callable[[str], str] = lambda base: "/",
                    base_path: Callable[[str], str] | None = None) -> TaskDefinition:
    """The task's Apptainer definition and its base (``base_workdir``: a base's WORKDIR,
    where a Dockerfile's relative paths start; ``base_path``: its PATH)."""
    if (env_dir / "Dockerfile").is_file():
        return dockerfile_definition((env_dir / "Dockerfile").read_text(errors="replace"),
                                     resolve, base_workdir, base_path)
    definition = parse_definition((env_dir / "container.def").read_text())
    bootstrap = definition.header.get("bootstrap", "").lower()
    if bootstrap not in ("docker", "localimage", "library", "oras", "shub"):
        raise ValueError(f"{env_dir}: unsupported Bootstrap {bootstrap!r} (use docker)")
    base = resolve(definition.header.get("from", ""))
    return TaskDefinition(definition, base, "/root")


def dockerfile_definition(text: str, resolve: Callable[[str], str],
                          base_workdir: Callable[[str], str] = lambda base: "/",
                          base_path: Callable[[str], str] | None = None) -> TaskDefinition:
    """A Dockerfile as a TaskDefinition (``DockerfileError`` for what cannot be built)."""
    bases: dict[str, str] = {}

    def base_of(image: str) -> str:
        if image not in bases:
            bases[image] = resolve(image)
        return bases[image]

    def workdir_of(image: str) -> str:
        return base_workdir(base_of(image))

    def path_of(image: str) -> str:
        return base_path(base_of(image)) if base_path else DEFAULT_PATH

    parsed = parse_dockerfile(text, workdir_of, path_of)
    needed = parsed.needed()
    final = parsed.final
    sections = {"files": f"    {STAGING.lstrip('/')} {STAGING}", "post": _indent(stage_script(final))}
    if final.env:
        sections["environment"] = environment_section(final)
    definition = Definition({"bootstrap": "docker", "from": final.image}, sections)
    notes = [n for stage in needed for n in stage.notes]
    if final.user:
        notes.append(f"USER {final.user} at the end ignored: sandboxes start a root shell")
    return TaskDefinition(definition, bases[final.image], final.workdir,
                          tuple((s, bases[s.image]) for s in needed), tuple(notes))


def _indent(script: str) -> str:
    return "\n".join(f"    {line}" if line else "" for line in script.splitlines())


# --------------------------------------------------------------------------- as Apptainer


def task_definition_over(base_sif: Path, task: TaskDefinition, env_dir: Path) -> Definition:
    """The task's definition bootstrapped from the local base, with absolute %files sources
    (a leading '/' is environment/'s root, as everywhere else)."""
    sections = dict(task.definition.sections)
    if task.definition.files:
        sections["files"] = "\n".join(
            f"    {shlex.quote(str(env_dir / src.lstrip('/')))} {shlex.quote(dest)}"
            for src, dest in task.definition.files)
    return Definition({"bootstrap": "localimage", "from": str(base_sif)}, sections)


def stage_base(task: TaskDefinition, stage: Stage, base_sif: Path,
                stage_sifs: Mapping[str, Path] | None) -> Path:
    """The SIF a stage starts from: the task's base, or its own (``stage_sifs``)."""
    base = {s.index: b for s, b in task.stages}[stage.index]
    if base == task.base:
        return base_sif
    if stage_sifs is None or base not in stage_sifs:
        raise BuildError(f"Dockerfile line {stage.line}",
                         f"stage {stage.name or stage.index} starts from base {base!r}, "
                         "whose image the build was not given")
    return stage_sifs[base]


def stage_chain(task: TaskDefinition, stage: Stage) -> list[Stage]:
    """``stage`` after the stages it continues (FROM <an earlier stage>), first the one on a
    base: what an Apptainer stage of it runs."""
    by_index = {s.index: s for s, _ in task.stages}
    chain = [stage]
    while chain[0].parent is not None:
        chain.insert(0, by_index[chain[0].parent])
    return chain


def dockerfile_over(task: TaskDefinition, base_sif: Path, staged: Path | None,
                    stage_sifs: Mapping[str, Path] | None = None) -> str:
    """The Apptainer definition of a Dockerfile task: one stage per needed Dockerfile stage
    (``Stage: s<n>``), each bootstrapped from its base (``base_sif``, or its own in
    ``stage_sifs``), its staged files (``staged``/s<n>, laid out as the image's
    /.tmax-build) by %files, COPY --from a stage by ``%files from``, its script as %post;
    the final stage's ENV as %environment. Apptainer cannot bootstrap from another stage, so
    a stage ``FROM <an earlier stage>`` repeats that stage's files and script before its own
    (the chain from the stage on a base); one that only such stages start from is not built
    on its own."""
    copied = {step.from_stage for stage, _ in task.stages for step in stage.steps
              if isinstance(step, Copy) and step.from_stage is not None}
    final = task.stages[-1][0]
    parts = []
    for stage, _ in task.stages:
        if stage is not final and stage.index not in copied:
            continue
        chain = stage_chain(task, stage)
        sections: dict[str, str] = {}
        froms: dict[int, list[str]] = {}
        for member in chain:
            for step in member.steps:
                if isinstance(step, Copy) and step.from_stage is not None:
                    for k, src in enumerate(step.sources):
                        dest = f"{STAGING}/s{member.index}/c{step.line}/f{k}/" + \
                            (PurePosixPath(src).name or "root")
                        froms.setdefault(step.from_stage, []).append(
                            f"    {shlex.quote(src)} {shlex.quote(dest)}")
        for index, lines in froms.items():
            sections[f"files from s{index}"] = "\n".join(lines)
        if staged is not None:
            sections["files"] = "\n".join(
                f"    {shlex.quote(str(staged / f's{m.index}' / STAGING.lstrip('/')))} /"
                for m in chain)
        script = "".join(stage_script(m, clean=m is stage) for m in chain)
        sections["post"] = "\n".join(f"    {line}" if line else ""
                                      for line in script.splitlines())
        if stage is final:
            sections.update({k: v for k, v in task.definition.sections.items()
                             if k == "environment"})
        header = {"bootstrap": "localimage",
                  "from": str(stage_base(task, chain[0], base_sif, stage_sifs)),
                  "stage": f"s{stage.index}"}
        parts.append(Definition(header, sections).render())
    return "\n".join(parts)
