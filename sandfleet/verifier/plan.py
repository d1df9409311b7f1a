"""The verifier's view of a sandbox, planned purely: what a runtime must change in the
agent's final tree and mount over it before a task's verifier runs, and the verifier's
environment. No mounts, no root, no processes: ``plan_view`` reads two trees (``Tree``)
and returns a ``VerifierPlan``; each runtime applies it its own way (the local runtime:
``sandfleet.runtime.verify_local``).

Threat: the agent is root in its sandbox and knows the verifier's script. Whatever it
leaves in its tree, the verifier runs the image's programs, libraries, interpreter
configuration and test runner, over the agent's files:

- ``PRISTINE`` top-level folders (/usr, /bin, /lib*...) and the ``PRISTINE_ETC`` entries of
  /etc are the image's, read-only; loader files the image lacks (``LOADER_ETC``) are empty.
- Files and links at / that the image has not (a /conftest.py, a /pytest.ini) are set aside.
- Every PATH folder of the image is the image's (``path_roots``): a tool's home outside the
  system folders (/opt/venv, /root/.cargo), and a venv at the top level (/venv, where the
  image's /venv has a ``pyvenv.cfg``), each under a writable overlay of the verifier's own;
  a folder that holds the workdir, and other top-level folders (/app, /go), stay the
  agent's, behind the image's on PATH (``trusted_first``).
- The image's prepared verifier tools (``VERIFIER_TOOLS``) are mounted for the verifier
  only; where they hold uv, the offline stand-in for uv's installer leaves what the real
  one leaves in ``$HOME/.local/bin`` (uv, uvx, env), over whatever the agent put there
  (``INSTALLER_FILES``), so ``source $HOME/.local/bin/env`` reads TMax's file.
- ``HOME_CONFIG`` files in ``$HOME`` (curl's) are the image's, or empty.
- uv's installed Pythons (``UV_PYTHONS`` in ``$HOME``, which uv tries before PATH) are the
  image's copy, or none (``UV_PYTHON_INSTALL_DIR``): never an interpreter the agent left.
- Python imports the image's modules before the agent's: ``PYTHONPATH`` names
  ``PYTHON_DIR``, whose ``sitecustomize`` moves the working directory (``python -m pytest``
  in /app) to the end of ``sys.path``, where it can add modules but never replace one the
  image has (pytest, its plugins, the standard library), and never adds package metadata
  (no entry-point plugins from the workdir). Tests that import the agent's modules from
  the workdir still do.

API (runtime-neutral):

``plan_view(image, agent, *, path, workdir, cwd, home, agent_system, nonce)`` ->
``VerifierPlan`` with, in order of use:

- ``fixes``: ``Fix(op, path, target)`` on the agent's tree, applied in order, with the
  agent frozen, never following a link at ``path`` (the plan made every folder above it a
  real one first). ``op``: "set_aside" (rename ``path`` to ``target`` in its folder),
  "mkdir" (a folder, mode 0755, owned by the sandbox's root), "symlink" (to ``target``),
  "touch" (an empty regular file, 0644).
- ``mounts``: ``Mount(source, dest, writable)`` in mount order. ``source``:
  ``image:<path>`` (the image's entry, read-only), ``overlay:<path>`` (the image's folder
  under a writable layer that only the verifier sees and that ends with it),
  ``tools`` (``VERIFIER_TOOLS`` of the image, under such a layer), ``tools:<path>`` (a
  file in that tools view), ``file:<name>`` (``files[name]``), ``dir:<name>``
  (``dirs[name]``: file name -> text), ``empty`` (an empty file), ``logs`` (the
  verifier's own empty /logs/verifier, writable by all). Each ``dest`` exists in the
  agent's tree once the fixes ran (a folder for a folder, a file for a file), but one whose
  top-level folder the agent has not (``PYTHON_DIR`` where there is no /.tmax; root
  "entries" only): the runtime makes that folder in the verifier's own root.
- ``root``: "entries" (the verifier's / is a folder of its own holding ``entries``: the
  agent's top-level ``(name, kind, target)`` after the fixes, "dir"/"file" bound, "link"
  made anew; /tests is the verifier's plain folder there) or "whole" (more than
  ``TOP_LEVEL_MAX`` entries: the agent's root itself, /tests mounted over its /tests; the
  agent must then stay frozen until the verifier ends).
- ``guarded``: paths below the top level that the agent must not remove or rename while the
  verifier runs (mount points and the folders above them), top down.
- ``env(base)``: the verifier's environment from ``base`` (the runtime's defaults, the
  user's HOME, the task's verifier env): the tools' settings on top, the image's folders
  first on PATH, ``PYTHONPATH`` led by ``PYTHON_DIR``.
- ``tools_uv``, ``installer``: whether the tools hold uv, and where the stand-in leaves its
  files (for a runtime's report).

With ``agent_system`` (a task that grades the agent's own system) only the verifier's own
mounts are planned: tests, logs, tools.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet.verifier.tree import Tree

VERIFIER_TOOLS = "/.tmax/verifier"
"""The image's prepared verifier tools (``tmax.images.verifier_tools``), hidden from the
agent by every runtime; must match ``sandfleet.runtime.helper.VERIFIER_TOOLS``."""
PYTHON_DIR = "/.tmax/python"
"""The verifier's ``PYTHONPATH`` folder: a ``sitecustomize`` of TMax's (``pathguard``)."""
PRISTINE = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""Top-level entries the verifier gets from the image as built, not from the agent."""
PRISTINE_ETC = ("alternatives", "ld.so.preload", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
                "python3", "perl", "bash.bashrc", "environment", "profile", "profile.d",
                "apt", "dpkg")
PRISTINE_ETC_PREFIXES = ("python3.", "ld-musl-")
"""Entries of /etc that decide which program or library runs (the loader's cache and
preload list, the alternatives' links, interpreters' site customisation, the commands
apt and dpkg run as hooks: Harbor's test.sh runs ``apt-get update`` as root): the image's."""
LOADER_ETC = ("ld.so.preload", "ld.so.cache")
"""Files in /etc glibc's dynamic loader reads on its own: where the image has none, the
verifier gets an empty one, so one the agent writes while it runs is never read. (Not
musl's ld-musl-<arch>.path: an empty one there means no library path at all; one the
agent made before the verifier started is set aside, as ``PRISTINE_ETC_PREFIXES`` says.)"""
PATH_KEEP = ("tmp", "dev", "proc", "sys", "run", "logs", "tests")
"""Top-level folders whose PATH entries the verifier takes from the agent's tree (scratch
space, kernel file systems, the verifier's own mounts): see ``path_roots``."""
OVERLAY_SAFE = re.compile(r"[A-Za-z0-9._/+@-]+")
"""PATH folders the verifier gets the image's copy of must read as one overlay option
(no ',', ':' or spaces); any other stays the agent's, behind the image's on its PATH."""
VENV_MARKERS = ("pyvenv.cfg", "conda-meta")
"""What makes a top-level folder on PATH a tool installation (a venv, a conda prefix), not
the agent's work: the image's copy of it is the verifier's."""
TOP_LEVEL_MAX = 512
"""An agent root with more top-level entries than this is the verifier's root whole (one
mount, not one per entry on a command line, which the kernel bounds)."""
VERIFIER_ENV = {"UV_NO_CONFIG": "1", "PIP_CONFIG_FILE": os.devnull, "PYTHONNOUSERSITE": "1"}
"""The verifier's defaults (a task's verifier env may override): uv and pip read none of
the agent-writable configuration files (uv.toml, pip.conf, ~/.config/...), which could
point them at packages of the agent's even offline (``find-links``); no user site."""
INSTALLER_FILES = ("uv", "uvx", "env")
"""What uv's install script leaves in ``$HOME/.local/bin`` (besides shell start-up lines,
which a non-interactive test.sh never reads)."""
INSTALLER_ENV = """\
#!/bin/sh
# Left by TMax's offline stand-in for uv's installer (sandfleet.verifier.plan): uv and uvx
# are in this folder and on PATH already. Unlike the real one it adds this folder at the
# end of PATH: a program the agent left here never runs instead of the image's.
case ":${PATH}:" in
    *:"$HOME/.local/bin":*)
        ;;
    *)
        export PATH="$PATH:$HOME/.local/bin"
        ;;
esac
"""
UV_PYTHONS = ".local/share/uv/python"
"""Where uv finds the Pythons it installed, below ``$HOME`` (unless ``UV_PYTHON_INSTALL_DIR``
says otherwise), and tries before any on PATH, even offline with downloads off: an agent's
copy of the image's interpreter there, with a ``sitecustomize`` of its own in its standard
library, would run ``uvx ... pytest`` and choose its exit status. The verifier's uv reads
the image's folder (its copy, as a PATH folder's) or ``NO_UV_PYTHONS``."""
HOME_CONFIG = (".curlrc",)
"""Files in the verifier's ``$HOME`` whose settings make an image's program run the agent's
code: curl's can add a ``file://`` URL, so Harbor's ``curl -LsSf .../install.sh | sh``
would pipe the agent's script to the verifier's shell, offline too. The image's copy, or an
empty file (held: the agent, thawed, cannot add one while the verifier runs)."""
NO_UV_PYTHONS = f"{PYTHON_DIR}/no-uv-pythons"
"""A folder nobody can make (in TMax's read-only ``PYTHON_DIR``): uv finds no Python there."""
SET_ASIDE = ".tmax-set-aside-"


@dataclass(frozen=True)
class Fix:
    op: str
    """"set_aside", "mkdir", "symlink" or "touch" (see the module doc)."""
    path: str
    target: str = ""
    """set_aside: the new name's full path; symlink: the link's target."""
    user: bool = False
    """mkdir, touch: owned by the verifier's user (its own home's folders), not root."""


@dataclass(frozen=True)
class Mount:
    source: str
    """image:<path>, overlay:<path>, tools, tools:<path>, file:<name>, dir:<name>, empty,
    logs (see the module doc)."""
    dest: str
    writable: bool = False


@dataclass
class VerifierPlan:
    fixes: list[Fix] = field(default_factory=list)
    mounts: list[Mount] = field(default_factory=list)
    root: str = "entries"
    entries: list[tuple[str, str, str]] = field(default_factory=list)
    """(name, "dir" | "file" | "link", link target or "") of the agent's root."""
    guarded: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    dirs: dict[str, dict[str, str]] = field(default_factory=dict)
    tools_env: dict[str, str] = field(default_factory=dict)
    """KEY=VALUE lines of the image's tools' env file ($PATH: the verifier's PATH)."""
    tools_uv: bool = False
    installer: str = ""
    """``$HOME/.local/bin`` where the installer stand-in leaves its files ("" none)."""
    agent_system: bool = False
    uv_pythons: str = ""
    """``UV_PYTHON_INSTALL_DIR`` for the verifier where neither base nor tools set one."""

    def mount_dests(self) -> list[str]:
        return [m.dest for m in self.mounts]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The verifier's environment: ``base`` (defaults, HOME, the task's env), the
        tools' settings on top ($PATH in their PATH standing for base's), then, unless
        ``agent_system``, PATH with the image's folders first (``trusted_first``) and
        ``PYTHON_DIR`` first on PYTHONPATH."""
        env = dict(base)
        for key, value in self.tools_env.items():
            env[key] = value.replace("$PATH", env.get(key, "")) if key == "PATH" else value
        if not self.agent_system:
            env["PATH"] = trusted_first(env.get("PATH", ""), [f"/{n}" for n in PRISTINE] +
                                        [m.dest for m in self.mounts])
            if any(m.dest == PYTHON_DIR for m in self.mounts):
                env["PYTHONPATH"] = ":".join(
                    [PYTHON_DIR] + [p for p in env.get("PYTHONPATH", "").split(":") if p])
            if self.uv_pythons:
                env.setdefault("UV_PYTHON_INSTALL_DIR", self.uv_pythons)
        return env


class _Edited:
    """The agent's tree as it will be once ``fixes`` have run (the plan reads its own
    changes back), over the real ``base``."""

    def __init__(self, base: Tree, nonce: str):
        self.base, self.nonce = base, nonce
        self.fixes: list[Fix] = []
        self.over: dict[str, str] = {}  # path -> kind ("" removed); link targets apart
        self.targets: dict[str, str] = {}

    def kind(self, path: str) -> str:
        for prefix in _prefixes(path):  # a removed folder removes what was in it
            if prefix != path and self.over.get(prefix, "dir") != "dir":
                return ""
        return self.over[path] if path in self.over else self.base.kind(path)

    def names(self, path: str) -> list[str]:
        if self.kind(path) != "dir":
            return []
        names = set() if path in self.over else set(self.base.names(path))  # (made anew)
        prefix = path.rstrip("/") + "/"
        for p, kind in self.over.items():
            if p.startswith(prefix) and "/" not in p[len(prefix):]:
                (names.add if kind else names.discard)(p[len(prefix):])
        return sorted(names)

    def link(self, path: str) -> str:
        return self.targets[path] if path in self.targets else self.base.link(path)

    def set_aside(self, path: str) -> None:
        kind = self.kind(path)
        if not kind:
            return
        parent, name = os.path.split(path)
        new = f"{parent.rstrip('/')}/{SET_ASIDE}{name}-{self.nonce}{len(self.fixes)}"
        if kind == "link":
            self.targets[new] = self.link(path)
        self.fixes.append(Fix("set_aside", path, new))
        self.over[path] = ""
        self.over[new] = kind  # (nothing below it is read)

    def real_dir(self, path: str, user: bool = False) -> None:
        if self.kind(path) != "dir":
            self.set_aside(path)
            self.fixes.append(Fix("mkdir", path, user=user))
            self.over[path] = "dir"

    def empty_file(self, path: str) -> None:
        self.set_aside(path)
        self.fixes.append(Fix("touch", path))
        self.over[path] = "file"

    def like(self, image: Tree, path: str) -> str:
        """Make ``path`` a mount point for the image's entry there ("bind"), or the same
        link ("link"); set it aside where the image has none ("absent")."""
        kind = image.kind(path)
        if not kind:
            self.set_aside(path)
            return "absent"
        if kind == "link":
            target = image.link(path)
            if self.kind(path) != "link" or self.link(path) != target:
                self.set_aside(path)
                self.fixes.append(Fix("symlink", path, target))
                self.over[path], self.targets[path] = "link", target
            return "link"
        if kind == "dir":
            self.real_dir(path)
        elif self.kind(path) != "file":
            self.empty_file(path)
        return "bind"

    def real_dirs(self, path: str, user_below: str | None = None) -> None:
        """Every component of ``path`` a real folder, top down (those below ``user_below``
        made for the verifier's user)."""
        for step in _prefixes(path):
            self.real_dir(step, user=user_below is not None and _within(step, user_below))


def plan_view(image: Tree, agent: Tree, *, path: str | None, workdir: str,
              cwd: str | None = None, home: str | None = None, agent_system: bool = False,
              nonce: str = "0") -> VerifierPlan:
    """The verifier's view (see the module doc). ``image``: the image as built;
    ``agent``: the agent's final tree; ``path``: the verifier's PATH before the tools'
    settings; ``home``: its HOME (None: no installer stand-in); ``nonce``: random text
    that makes the set-aside names unguessable to the agent."""
    fix = _Edited(agent, nonce)
    plan = VerifierPlan(agent_system=agent_system)
    has_tools = image.kind(VERIFIER_TOOLS) == "dir"
    if has_tools:
        plan.tools_env = tools_env(image.read(f"{VERIFIER_TOOLS}/env"))
        plan.tools_uv = all(image.kind(f"{VERIFIER_TOOLS}/bin/{n}") == "file"
                            for n in ("uv", "uvx"))
    if not agent_system:
        _system(plan, image, fix)
        keep = [workdir] + ([cwd] if cwd else [])
        tools_path = plan.tools_env.get("PATH", "")
        for found in path_roots(f"{path or ''}:{tools_path}", keep=keep,
                                top_level=lambda r: any(image.kind(f"{r}/{m}")
                                                        for m in VENV_MARKERS)):
            # every component in the image is checked before the next is looked at
            if OVERLAY_SAFE.fullmatch(found) and \
                    all(image.kind(step) == "dir" for step in _prefixes(found)):
                fix.real_dirs(found)  # top down: only the last component is the agent's
                # the image's copy, writable: a pip install into the venv, cargo's lock in
                # ~/.cargo, go's module cache work; what is written stays the verifier's
                plan.mounts.append(Mount(f"overlay:{found}", found, writable=True))
        plan.dirs["python"] = {"sitecustomize.py": pathguard_source()}
        plan.mounts.append(Mount("dir:python", PYTHON_DIR))
        _uv_pythons(plan, image, fix, home)
        _home_config(plan, image, fix, home)
        if plan.tools_uv and home:
            _installer(plan, fix, home)
    for sub in ("/dev", "/proc", "/tests", "/logs", "/logs/verifier"):  # the verifier's
        fix.real_dir(sub)                                               # mounts cover them
    own = _top(PYTHON_DIR)  # made in the verifier's own / where the agent has none there
    if not agent_system and (fix.kind(own) or len(fix.names("/")) > TOP_LEVEL_MAX):
        fix.real_dirs(PYTHON_DIR)
    names = fix.names("/")
    if len(names) <= TOP_LEVEL_MAX:  # its own /, the agent's entries in it
        covered = {m.dest for m in plan.mounts}  # (the image's own)
        for name in names:
            if name in ("tests", "dev", "proc") or f"/{name}" in covered:
                continue
            kind = fix.kind(f"/{name}")
            if kind in ("dir", "file", "link"):
                plan.entries.append((name, kind, fix.link(f"/{name}") if kind == "link"
                                     else ""))
    else:
        plan.root = "whole"
    plan.mounts.append(Mount("logs", "/logs/verifier", writable=True))
    if has_tools:
        plan.mounts.append(Mount("tools", VERIFIER_TOOLS, writable=True))
        for name in INSTALLER_FILES if plan.installer else ():
            source = "file:installer-env" if name == "env" else f"tools:/bin/{name}"
            plan.mounts.append(Mount(source, f"{plan.installer}/{name}"))
    plan.fixes = fix.fixes
    if plan.root == "entries":  # below the top level: the agent's own entries
        for dest in plan.mount_dests():
            parts = dest.strip("/").split("/")
            if dest != VERIFIER_TOOLS and fix.kind(_top(dest)):  # (tools: a mount point in
                # the agent's namespace already; an entry the agent has not: the verifier's)
                plan.guarded += [p for p in ("/" + "/".join(parts[:k])
                                             for k in range(2, len(parts) + 1))
                                 if p not in plan.guarded]
    return plan


def _system(plan: VerifierPlan, image: Tree, fix: _Edited) -> None:
    """The image's system folders, /etc entries and loader files over the agent's."""
    image_top = set(image.names("/"))
    for name in fix.names("/"):  # files and links the image has not at / go
        if name not in image_top and fix.kind(f"/{name}") != "dir":
            fix.set_aside(f"/{name}")
    for name in PRISTINE:
        if fix.like(image, f"/{name}") == "bind":
            plan.mounts.append(Mount(f"image:/{name}", f"/{name}"))
    if fix.kind("/etc") != "dir":  # the agent replaced /etc: the image's whole
        fix.like(image, "/etc")
        plan.mounts.append(Mount("image:/etc", "/etc"))
    elif fix.like(image, "/etc") == "bind":
        image_etc = set(image.names("/etc"))
        for name in fix.names("/etc"):
            if pristine_etc(name) and name not in image_etc:
                fix.set_aside(f"/etc/{name}")
        for name in sorted(image_etc):
            if pristine_etc(name) and fix.like(image, f"/etc/{name}") == "bind":
                plan.mounts.append(Mount(f"image:/etc/{name}", f"/etc/{name}"))
        for name in LOADER_ETC:  # none in the image: an empty one, held
            if name not in image_etc:
                fix.empty_file(f"/etc/{name}")
                plan.mounts.append(Mount("empty", f"/etc/{name}"))


def _installer(plan: VerifierPlan, fix: _Edited, home: str) -> None:
    """uv's installer's files in ``home``/.local/bin (mounted after the tools)."""
    parts = [p for p in home.split("/") if p not in ("", ".")]
    if not home.startswith("/") or ".." in parts or not OVERLAY_SAFE.fullmatch(home) or \
            (parts and (parts[0] in PRISTINE or parts[0] in ("tests", "logs", "proc",
                                                             "dev", "sys", ".tmax"))):
        return
    folder = "/" + "/".join(parts + [".local", "bin"])
    if any(_within(folder, m.dest) for m in plan.mounts):
        return  # (an image folder already: its own files are the image's)
    # what is made from the home down is the user's (at /, only .local and below)
    fix.real_dirs(folder, user_below="/" + "/".join(parts or [".local"]))
    for name in INSTALLER_FILES:
        fix.empty_file(f"{folder}/{name}")
    plan.installer = folder
    plan.files["installer-env"] = INSTALLER_ENV


def _uv_pythons(plan: VerifierPlan, image: Tree, fix: _Edited, home: str | None) -> None:
    """uv's installed Pythons for the verifier: the image's ``home``/``UV_PYTHONS`` (its copy,
    under a writable layer of the verifier's), else none (``NO_UV_PYTHONS``)."""
    plan.uv_pythons = NO_UV_PYTHONS
    parts = [p for p in (home or "").split("/") if p not in ("", ".")] + UV_PYTHONS.split("/")
    folder = "/" + "/".join(parts)
    if not (home or "").startswith("/") or ".." in parts or \
            not OVERLAY_SAFE.fullmatch(folder) or parts[0] in PATH_KEEP + (".tmax",) or \
            not all(image.kind(step) == "dir" for step in _prefixes(folder)):
        return
    plan.uv_pythons = folder
    if not any(_within(folder, m.dest) for m in plan.mounts):  # (else the image's already)
        fix.real_dirs(folder)
        plan.mounts.append(Mount(f"overlay:{folder}", folder, writable=True))


def _home_config(plan: VerifierPlan, image: Tree, fix: _Edited, home: str | None) -> None:
    """``HOME_CONFIG`` in ``home``: the image's files, else empty ones."""
    parts = [p for p in (home or "").split("/") if p not in ("", ".")]
    if not parts or not (home or "").startswith("/") or ".." in parts or \
            not OVERLAY_SAFE.fullmatch(home or "") or \
            parts[0] in PRISTINE + PATH_KEEP + (".tmax",):
        return
    folder = "/" + "/".join(parts)
    for name in HOME_CONFIG:
        path = f"{folder}/{name}"
        if any(_within(path, m.dest) for m in plan.mounts):
            continue  # (an image folder already)
        fix.real_dirs(folder, user_below=folder)
        if image.kind(path) == "file" and all(image.kind(s) == "dir" for s in _prefixes(folder)):
            fix.like(image, path)
            plan.mounts.append(Mount(f"image:{path}", path))
        else:
            fix.empty_file(path)
            plan.mounts.append(Mount("empty", path))


def trusted_first(path: str, trusted: Iterable[str]) -> str:
    """``path`` with its entries in the ``trusted`` folders (the verifier's mounts of the
    image's own folders) first, in their order, then the others (the agent's: a top-level
    /go/bin, a folder the image has not, the workdir's), in theirs: a program the agent
    plants there runs only where the image has none of that name, never instead of the
    image's (e.g. an agent's /go/bin/go over the image's /usr/local/go/bin/go)."""
    folders = [t for t in trusted if t.startswith("/")]
    entries = path.split(":")

    def is_trusted(entry: str) -> bool:
        parts = [p for p in entry.split("/") if p not in ("", ".")]
        norm = "/" + "/".join(parts)
        return entry.startswith("/") and ".." not in parts and \
            any(_within(norm, f) for f in folders)

    return ":".join([e for e in entries if is_trusted(e)] +
                    [e for e in entries if not is_trusted(e)])


def path_roots(path: str | None, keep: Iterable[str] = (), top_level=None) -> list[str]:
    """The folders of a PATH value that the verifier gets from the image (lexically; the
    view also needs them to be real directories there): for each absolute entry, its
    parent when its last component is ``bin`` or ``sbin`` (/opt/venv/bin: /opt/venv, the
    venv's libraries with its programs), else the entry itself. Left out: relative
    entries and entries with a ``..``; a root at the top level (/app, /opt, /root: that
    would hide the agent's work) unless ``top_level(root)`` says it is a tool's (a venv
    at /venv); one in a ``PRISTINE`` folder (bound whole already; with a merged /usr,
    /bin is the image's link to usr/bin); one under ``PATH_KEEP``; the verifier tools'
    folder, what is in it and what holds it; one of ``keep`` (the workdir, the
    verifier's cwd) or a folder holding one (the agent's work). Sorted,
    without duplicates, the outermost of nested roots only."""
    kept = [os.path.normpath(k) for k in keep if k and k.startswith("/")]
    roots = set()
    for entry in (path or "").split(":"):
        parts = [p for p in entry.split("/") if p not in ("", ".")]
        if not entry.startswith("/") or ".." in parts:
            continue
        if parts and parts[-1] in ("bin", "sbin"):
            parts.pop()
        if not parts or parts[0] in PRISTINE or parts[0] in PATH_KEEP:
            continue
        found = "/" + "/".join(parts)
        if len(parts) < 2 and not (top_level and top_level(found)):
            continue
        if _within(found, VERIFIER_TOOLS) or _within(VERIFIER_TOOLS, found) or \
                _within(found, PYTHON_DIR) or \
                any(_within(k, found) for k in kept):
            continue
        roots.add(found)
    return [r for r in sorted(roots) if not any(o != r and _within(r, o) for o in roots)]


def tools_env(text: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of an image's verifier-tools env file (``$PATH`` in a PATH value
    stands for the verifier's PATH); other lines are ignored."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.isidentifier():
            env[key] = value
    return env


def pristine_etc(name: str) -> bool:
    return name in PRISTINE_ETC or name.startswith(PRISTINE_ETC_PREFIXES)


def pathguard_source() -> str:
    """The text of the verifier's ``sitecustomize`` (``sandfleet/verifier/pathguard.py``)."""
    return Path(__file__).with_name("pathguard.py").read_text()


def _top(path: str) -> str:
    return "/" + path.strip("/").split("/")[0]


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _prefixes(path: str) -> list[str]:
    """/a, /a/b, /a/b/c for /a/b/c."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]
