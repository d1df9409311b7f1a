"""Image builders, one small class each: ``apptainer`` (clusters) and ``local`` (no Apptainer).

Both execute a plan (``tmax.images.plan``: what to build is decided there) and turn the same
inputs into the same kind of file: a base from images/<base>.def, and a task image on top of
its base, from the task's Apptainer definition or its Dockerfile (built as Docker builds it:
one script per stage that both builders run). The local builder's SIF is a real one
(squashfs primary system partition, definition object), so it runs under Apptainer on a
cluster unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Protocol

from sandfleet import sif
from tmax.images import installer_staging, installers, layering, verifier_staging
from tmax.images.installer_scripts import SHIM_DIR
from tmax.images.plan import (
    dockerfile_over,
    stage_base,
    stage_chain,
    stage_script,
    step_error,
    task_definition_over,
)
from tmax.images.rootfs import (
    UBUNTU_KEYRING,
    apt_mirror,
    copy_tree,
    debootstrap_base,
    finish_rootfs,
    is_ubuntu,
    run_in_rootfs,
    run_logged,
    ubuntu_keyring,
)
from tmax.images.staging import stage_files
from tmax.images.store import remove_tree
from tmax.images.types import STAGING, BuildError, Definition, TaskDefinition, parse_definition
from tmax.images.verifier_tools import DEFAULT_UV, ROOT, VerifierTools, with_tools
from tmax.tasks.confine import Escape, expand_source


class Builder(Protocol):
    name: str

    def build_base(self, definition_text: str, out: Path, log: Path, timeout: float,
                   parent: Path | None = None) -> None:
        """Build a base image from images/<base>.def text (MIRROR not yet filled in);
        ``parent``: the SIF of the base a ``Bootstrap: localimage`` definition starts from."""

    def build_task(self, task: TaskDefinition, env_dir: Path, base_sif: Path, out: Path,
                   log: Path, timeout: float, network: bool = True,
                   verifier: VerifierTools | None = None,
                   stage_sifs: Mapping[str, Path] | None = None) -> None:
        """Build a task image from its definition and its base's SIF, then prepare the
        ``verifier`` tools in it (tmax.images.verifier_tools); ``stage_sifs``: the SIF of
        each of ``task.stage_bases`` (earlier Dockerfile stages on other bases)."""


def _suite(definition_text: str) -> str:
    return parse_definition(definition_text).header.get("osversion", "bookworm")


def _mirror_for(definition_text: str, mirror: str | None) -> str:
    """``mirror`` (--mirror) is Debian's; an Ubuntu base's comes from ``ubuntu_mirror``."""
    suite = _suite(definition_text)
    return apt_mirror(suite) if is_ubuntu(suite) or not mirror else mirror


def external_image(ref: str, cache_dir: Path, log: Path, timeout: float) -> Path:
    """A folder standing in for the root of registry image ``ref`` (COPY --from=image):
    ghcr.io/astral-sh/uv:<version> (uv and uvx, from PyPI's wheel of that version)."""
    name, _, tag = ref.partition("@")[0].rpartition(":") if ":" in ref.rsplit("/", 1)[-1] \
        else (ref, "", "latest")
    if name in ("ghcr.io/astral-sh/uv", "astral/uv"):
        version = DEFAULT_UV if tag == "latest" else tag
        if not all(p.isdigit() for p in version.split(".")) or version.count(".") != 2:
            raise BuildError(f"COPY --from={ref}", f"tag {tag!r}: only uv's x.y.z tags (or "
                             "latest) are supported")
        tree = verifier_staging.stage_uv(version, cache_dir, log, timeout)
        root = tree.parent / "image"
        if not (root / "uvx").exists():
            root.mkdir(exist_ok=True)
            for tool in ("uv", "uvx"):
                shutil.copy2(tree / ROOT.lstrip("/") / "bin" / tool, root / tool)
        return root
    raise BuildError(f"COPY --from={ref}", "copying out of a registry image is supported for "
                     "ghcr.io/astral-sh/uv only: vendor the files into the build context or "
                     "install them with RUN")


def _note(log: Path, task: TaskDefinition) -> None:
    if task.notes:
        with open(log, "a") as f:
            f.write("".join(f"note: {n}\n" for n in task.notes))


# --------------------------------------------------------------------------- apptainer


def apptainer_build_argv(out: Path, deffile: Path, *, apptainer: str = "apptainer",
                         fakeroot: bool = False, build_args: dict[str, str] | None = None
                         ) -> list[str]:
    argv = [apptainer, "build", "--force"]
    if fakeroot:
        argv.append("--fakeroot")
    for key, value in (build_args or {}).items():
        argv += ["--build-arg", f"{key}={value}"]
    return argv + [str(out), str(deffile)]


class ApptainerBuilder:
    """`apptainer build` from the definitions (as root, or --fakeroot otherwise)."""

    name = "apptainer"

    def __init__(self, apptainer: str = "apptainer", mirror: str | None = None,
                 fakeroot: bool | None = None):
        self.apptainer, self.mirror = apptainer, mirror
        self.fakeroot = os.geteuid() != 0 if fakeroot is None else fakeroot

    def build_base(self, definition_text: str, out: Path, log: Path, timeout: float,
                   parent: Path | None = None) -> None:
        with tempfile.TemporaryDirectory(prefix=".def-", dir=out.parent) as tmp:
            deffile = Path(tmp) / "base.def"
            if parent is not None:  # From: <base name> -> the parent's SIF
                definition = parse_definition(definition_text)
                definition.header["from"] = str(parent)
                definition_text = definition.render()
            if parent is None and is_ubuntu(_suite(definition_text)) and \
                    not UBUNTU_KEYRING.is_file():  # else debootstrap goes on unchecked
                raise BuildError("apptainer build (base)", f"an Ubuntu base needs Ubuntu's "
                                 f"archive keyring at {UBUNTU_KEYRING} on this host (package "
                                 "ubuntu-keyring), which Apptainer's debootstrap checks with",
                                 log)
            deffile.write_text(definition_text)
            argv = apptainer_build_argv(out, deffile, apptainer=self.apptainer,
                                        fakeroot=self.fakeroot,
                                        build_args={"MIRROR": _mirror_for(definition_text,
                                                                          self.mirror)})
            run_logged(argv, log, timeout, "apptainer build (base)")

    def build_task(self, task: TaskDefinition, env_dir: Path, base_sif: Path, out: Path,
                   log: Path, timeout: float, network: bool = True,
                   verifier: VerifierTools | None = None,
                   stage_sifs: Mapping[str, Path] | None = None) -> None:
        """(``network``: Apptainer's build steps always have the host's.)"""
        with tempfile.TemporaryDirectory(prefix=".def-", dir=out.parent) as tmp:
            deffile = Path(tmp) / "task.def"
            if task.stages:
                _note(log, task)
                text = self._dockerfile_text(task, env_dir, base_sif, Path(tmp), log, timeout,
                                             verifier, stage_sifs)
            else:
                definition = task_definition_over(base_sif, task, env_dir)
                if verifier:  # uv by %files, the preparation at the end of %post
                    staged = verifier_staging.stage(verifier, Path(tmp), log, timeout)
                    definition = with_tools(definition, verifier, staged)
                text = definition.render()
            deffile.write_text(text)
            argv = apptainer_build_argv(out, deffile, apptainer=self.apptainer,
                                        fakeroot=self.fakeroot)
            try:
                run_logged(argv, log, timeout, "apptainer build")
            except BuildError as e:
                raise step_error(log, e) from None

    def _dockerfile_text(self, task: TaskDefinition, env_dir: Path, base_sif: Path, tmp: Path,
                         log: Path, timeout: float,
                         verifier: VerifierTools | None,
                         stage_sifs: Mapping[str, Path] | None) -> str:
        for stage, _ in task.stages:
            stage_files(stage, env_dir, tmp / f"s{stage.index}" / STAGING.lstrip("/") /
                        f"s{stage.index}",
                        image_root=lambda ref: external_image(ref, tmp, log, timeout),
                        ca=verifier_staging.build_ca())
            # (the stand-ins of its whole chain: its staged folder is copied after theirs)
            installer_staging.prepare(installers.find(stage_chain(task, stage)),
                                      tmp / f"s{stage.index}" / SHIM_DIR.lstrip("/"), tmp, log,
                                      timeout)
        text = dockerfile_over(task, base_sif, tmp, stage_sifs)
        if not verifier:
            return text
        # the verifier tools' preparation goes at the end of the final stage
        head, _, last = text.rpartition("Bootstrap: localimage")
        final = parse_definition("Bootstrap: localimage" + last)
        staged = verifier_staging.stage(verifier, tmp, log, timeout)
        final = with_tools(final, verifier, staged)
        return head + final.render()


# --------------------------------------------------------------------------- local


class LocalBuilder:
    """debootstrap + bubblewrap chroot + mksquashfs + siftool; needs root (debootstrap,
    file ownership in the image)."""

    name = "local"

    def __init__(self, cache_dir: Path, mirror: str | None = None):
        self.cache_dir, self.mirror = Path(cache_dir), mirror

    def build_base(self, definition_text: str, out: Path, log: Path, timeout: float,
                   parent: Path | None = None) -> None:
        rootfs = self._scratch_root()
        try:
            if parent is None:
                mirror = _mirror_for(definition_text, self.mirror)
                definition = parse_definition(definition_text.replace("{{ MIRROR }}", mirror))
                keyring = ubuntu_keyring(self.cache_dir, mirror, log) \
                    if is_ubuntu(_suite(definition_text)) else None
                debootstrap_base(definition, rootfs, mirror, log, timeout, keyring)
            else:  # Bootstrap: localimage over another base: its %post, with the network
                definition = parse_definition(definition_text)
                rootfs.mkdir()
                copy_tree(self.base_rootfs(parent), rootfs)
                post = definition.sections.get("post", "")
                if post.strip():
                    run_in_rootfs(rootfs, ["/bin/sh", "-ec", post], log, timeout, "%post",
                                  network=True)
                finish_rootfs(rootfs, definition)
            pack(rootfs, out, log, definition.render(), timeout)
        finally:
            remove_tree(rootfs.parent)

    def _scratch_root(self) -> Path:
        """A fresh path for a root filesystem under construction, on the node-local cache
        (never on the shared store: only the finished SIF goes there)."""
        build = self.cache_dir / "build"
        build.mkdir(parents=True, exist_ok=True)
        for old in build.glob("rootfs-*"):  # left by killed builds: none runs for 6 h
            if time.time() - old.stat().st_mtime > 6 * 3600:
                remove_tree(old)
        return Path(tempfile.mkdtemp(prefix="rootfs-", dir=build)) / "root"

    def base_rootfs(self, base_sif: Path) -> Path:
        """The base's root filesystem, extracted once per base into the node-local cache."""
        return layering.base_root(base_sif, self.cache_dir)

    def build_task(self, task: TaskDefinition, env_dir: Path, base_sif: Path, out: Path,
                   log: Path, timeout: float, network: bool = True,
                   verifier: VerifierTools | None = None,
                   stage_sifs: Mapping[str, Path] | None = None) -> None:
        if task.stages:
            _note(log, task)
            return self._build_dockerfile(task, env_dir, base_sif, out, log, timeout, network,
                                          verifier, stage_sifs)
        rootfs = self._scratch_root()
        rootfs.mkdir()
        try:
            copy_tree(self.base_rootfs(base_sif), rootfs)
            for src, dest in task.definition.files:
                copy_into_rootfs(env_dir, src, rootfs, dest)
            post = task.definition.sections.get("post", "")
            if post.strip():
                run_in_rootfs(rootfs, ["/bin/sh", "-ec", post], log, timeout, "%post",
                              network=network)
            self._finish(rootfs, task, task_definition_over(base_sif, task, env_dir), out,
                         log, timeout, verifier)
        finally:
            remove_tree(rootfs.parent)

    def _finish(self, rootfs: Path, task: TaskDefinition, definition: Definition, out: Path,
                log: Path, timeout: float,
                verifier: VerifierTools | None) -> None:
        """The verifier tools (after the task's own steps, as ApptainerBuilder's %post
        ends), Apptainer's metadata, the SIF."""
        if verifier:
            staged = verifier_staging.prepare_rootfs(rootfs, verifier, self.cache_dir, log,
                                                   timeout)
            definition = with_tools(definition, verifier, staged)
        finish_rootfs(rootfs, task.definition)
        pack(rootfs, out, log, definition.render(), timeout)

    def _build_dockerfile(self, task: TaskDefinition, env_dir: Path, base_sif: Path, out: Path,
                          log: Path, timeout: float, network: bool,
                          verifier: VerifierTools | None,
                          stage_sifs: Mapping[str, Path] | None) -> None:
        """Each needed stage in its own root filesystem over its own base, in order: its
        files staged, its script run; the final one packed (see tmax.images.plan)."""
        roots: dict[int, Path] = {}
        try:
            for stage, _ in task.stages:
                rootfs = self._scratch_root()
                rootfs.mkdir()
                roots[stage.index] = rootfs
                copy_tree(roots[stage.parent] if stage.parent is not None else
                          self.base_rootfs(stage_base(task, stage, base_sif, stage_sifs)),
                          rootfs)  # (FROM <an earlier stage>: over what it built)
                stage_files(stage, env_dir, rootfs / STAGING.lstrip("/") / f"s{stage.index}",
                            image_root=lambda ref: external_image(ref, self.cache_dir, log,
                                                                  timeout),
                            stage_root=roots.__getitem__, ca=verifier_staging.build_ca())
                installer_staging.prepare(installers.find([stage]),
                                   rootfs / SHIM_DIR.lstrip("/"), self.cache_dir,
                                   log, timeout)
                try:
                    run_in_rootfs(rootfs, ["/bin/sh", "-c", stage_script(stage)], log, timeout,
                                  f"Dockerfile stage {stage.name or stage.index}",
                                  network=network)
                except BuildError as e:
                    raise step_error(log, e) from None
            self._finish(roots[task.stages[-1][0].index], task,
                         Definition({"bootstrap": "localimage", "from": str(base_sif)},
                                    dict(task.definition.sections)), out, log, timeout, verifier)
        finally:
            for rootfs in roots.values():
                remove_tree(rootfs.parent)


def pack(rootfs: Path, out: Path, log: Path, definition: str, timeout: float) -> None:
    """sif.pack, its failures as BuildError with the tool's message in the log."""
    try:
        sif.pack(rootfs, out, definition=definition, timeout=timeout)
    except (RuntimeError, sif.SifError) as e:
        with open(log, "a") as f:
            f.write(f"pack: {e}\n")
        raise BuildError("pack", str(e), log) from None
    except subprocess.TimeoutExpired:
        raise BuildError("pack", f"timed out after {timeout:g}s", log) from None


def inside(rootfs: Path, path: str) -> Path:
    """``path`` (absolute, in the image) under ``rootfs``, refusing '..' escapes."""
    parts = PurePosixPath("/", path).parts[1:]
    if ".." in parts:
        raise BuildError("%files", f"destination {path!r} leaves the image")
    return rootfs.joinpath(*parts)


def copy_into_rootfs(env_dir: Path, src: str, rootfs: Path, dest: str) -> None:
    """Docker COPY semantics: a directory's contents into dest; files into dest/ when dest
    ends with '/' or names a directory; globs allowed; sources must stay in env_dir (the
    rule of ``tmax.tasks.confine``)."""
    try:
        matches = expand_source(env_dir, src)
    except Escape as e:
        raise BuildError("%files", str(e)) from None
    if not matches:
        raise BuildError("%files", f"source {src!r} not found in {env_dir}")
    target = inside(rootfs, dest)
    for match in matches:
        if match.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copytree(match, target, symlinks=True, dirs_exist_ok=True)
        else:
            final = target / match.name if dest.endswith("/") or target.is_dir() or \
                len(matches) > 1 else target
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(match, final)


BUILDERS = {"apptainer": ApptainerBuilder, "local": LocalBuilder}


def default_builder(cache_dir: Path, mirror: str | None = None) -> Builder:
    """apptainer where it is on PATH, the local builder otherwise."""
    if shutil.which("apptainer"):
        return ApptainerBuilder(mirror=mirror)
    return LocalBuilder(cache_dir, mirror)
