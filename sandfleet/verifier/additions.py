"""What the agent installed in the system folders, for the verifier: the image's files win,
the agent's new ones are seen, except those that would change what an image program runs.

Harbor runs a task's tests in the agent's own container, so a task whose work is installing
software (``apt-get install nginx``, ``pip install grpcio`` into the system Python, R's
packages under /usr/lib/R) is graded on what the agent installed. TMax's verifier gets the
image's own system folders (``sandfleet.verifier.plan.PRISTINE``) so that an agent cannot
swap the interpreter, the test runner or a library under it; this module lets it see the
agent's *additions* too: paths the image has not, copied once, with the agent frozen, and
stacked below the image's folder (the image's entry wins wherever both have one). Hidden
from the verifier (``Additions.hidden``, with why), because each would run the agent's code
where the image's ran before:

- a program on the verifier's PATH with the name of one the image (or its verifier tools)
  has on that PATH (/usr/local/bin/python3 before the image's /usr/bin/python3), or of a
  package the verifier's own shell scripts install with apt (Harbor's ``apt-get install
  curl`` then ``curl ... | sh`` on an image without curl: the agent's curl would run as the
  verifier, before its tests, and could rewrite them; the programs the tests exercise, the
  agent's nginx or git, stay seen);
- a link where a PATH folder or a Python site folder (or a folder above one) is, which would
  put the agent's own folder there;
- Python's start-up hooks: ``sitecustomize``/``usercustomize`` modules and ``.pth`` files
  with an ``import`` line (run at every start of the image's Python: an ``atexit`` there
  rewrites the reward of any verifier written in Python), and pytest plugins declared in an
  ``entry_points.txt`` (``[pytest11]``, loaded by every pytest). The one common package
  layout that needs such a line, cmeel's (eigenpy, pinocchio: ``import cmeel_pth`` puts
  ``cmeel.prefix/lib/pythonX.Y/site-packages`` on ``sys.path``), the verifier's
  ``sitecustomize`` (``pathguard``) adds as a path instead, at the end;
- a module, package or distribution in a site folder with the name of one the image has in
  any of its site folders (an earlier site folder's copy shadows it), and anything new in
  the standard library's folders or a ``pythonXY.zip`` (both come before every site
  folder on ``sys.path``, a venv's too: a ``pytest.py`` there would be the pytest of
  ``uvx ... pytest``) but the parts Debian packages apart (``STDLIB_PARTS``).

What stays possible, as on Harbor: tests that run a program the agent installed (nginx,
``git``) run the agent's program, and tests that import a package the agent installed run
its code; a task graded that way can be passed by that code (``tmax audit``'s exploit
probes plant such code where the tests import it).

``plan_additions(image, upper, folders, path)`` is pure: it reads two trees (the image as
built, the agent's own layer: only what it changed) and returns ``Additions``; the runtime
copies ``Additions.copy`` (``sandfleet.runtime.verify_local``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from sandfleet.verifier.tree import Tree

MERGED_ETC = ("/etc/alternatives",)
"""Entries of /etc the image's copy of which the verifier gets, with the agent's additions."""
HOOK_MODULES = ("sitecustomize", "usercustomize")
SITE_FOLDER = re.compile(r"/(?:usr|usr/local|opt/[^/]+)/lib(?:32|64)?/python[0-9.]*/"
                         r"(?:site|dist)-packages")
"""Python site folders (Debian's dist-packages, the image's site-packages)."""
PYTHON_LIBS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/lib64")
STDLIB_FOLDER = re.compile(r"/usr(?:/local)?/lib(?:32|64)?/python[0-9.]+(?:/lib-dynload)?")
STDLIB_ZIP = re.compile(r"python[0-9]+\.zip")
STDLIB_PARTS = frozenset({"ensurepip", "tkinter", "_tkinter", "idlelib", "turtledemo",
                          "turtle", "distutils", "lib2to3", "pydoc_data", "test"})
"""The standard library's folders and zip come before every site folder on ``sys.path``
(a venv's too): what the agent adds there is not the verifier's (pip never installs there),
but the parts Debian ships in packages of their own (python3-venv's ``ensurepip``,
python3-tk, python3-distutils, python3-lib2to3, idle, the test suite)."""
READ_LIMIT = 1 << 20
"""What is read of a ``.pth`` or ``entry_points.txt``; a longer one is hidden whole (Python
reads all of it: a hook after the part read would run)."""
WORD = re.compile(r"[a-z0-9][a-z0-9+.:=~-]*")
APT_INSTALL = re.compile(r"\bapt(?:-get)?\s+(?:-\S+\s+)*install\b([^;&|\n]*)")
DIST_INFO = re.compile(r"(.+?)-[0-9][^/]*\.(?:dist-info|egg-info)$")


@dataclass
class Additions:
    copy: list[tuple[str, str]] = field(default_factory=list)
    """(path, kind: "dir" | "file" | "link"), parents before children: what the verifier
    gets of the agent's layer."""
    hidden: list[tuple[str, str]] = field(default_factory=list)
    """(path, why) of what it does not."""


def plan_additions(image: Tree, upper: Tree, folders: list[str], path: str,
                   fetched: Iterable[str] = ()) -> Additions:
    """The agent's additions below ``folders`` (absolute, the image's real folders: /usr,
    /etc/alternatives...) in ``upper`` (its layer), against ``image``; ``path``: the
    verifier's PATH; ``fetched``: what the verifier's scripts install (``apt_packages``)."""
    rules = _Rules(image, path, set(fetched))
    out = Additions()
    for folder in folders:
        if image.kind(folder) == "dir" and upper.kind(folder) == "dir":
            _walk(image, upper, folder, rules, out, added=False)
    return out


def apt_packages(texts: Iterable[str]) -> set[str]:
    """The packages the verifier's shell scripts install with apt (``apt-get install -y
    curl``), read as program names: what the verifier fetches for itself is never the
    agent's (the image's, where the build prepared it)."""
    return {re.split(r"[=:]", w)[0] for text in texts for m in APT_INSTALL.finditer(text)
            for w in m.group(1).split() if not w.startswith("-") and WORD.fullmatch(w)}


class _Rules:
    def __init__(self, image: Tree, path: str, fetched: frozenset[str] | set[str] = frozenset()):
        self.fetched = fetched
        self.path_dirs = [p for p in dict.fromkeys(path.split(":")) if p.startswith("/")]
        self.resolved = {d: _resolve(image, d) for d in self.path_dirs}
        self.programs = {n for d in self.resolved.values() for n in image.names(d)}
        self.sites = [d for lib in PYTHON_LIBS for py in image.names(lib)
                      if py.startswith("python")
                      for d in (f"{lib}/{py}/site-packages", f"{lib}/{py}/dist-packages")
                      if image.kind(d) == "dir"]
        self.modules = {_module(n) for d in self.sites for n in image.names(d)} - {""}
        self.guarded = set(self.path_dirs) | set(self.resolved.values()) | set(self.sites)

    def hidden(self, upper: Tree, path: str, kind: str) -> str:
        folder, name = posixpath.split(path)
        if kind == "link" and any(g == path or g.startswith(path + "/") for g in self.guarded):
            return "a link where the verifier looks for programs or modules"
        on_path = folder in self.path_dirs or folder in self.resolved.values()
        if on_path and name in self.programs:
            return f"shadows the image's program {name}"
        if on_path and name in self.fetched:
            return f"a package the verifier's script installs ({name})"
        if name.split(".")[0] in HOOK_MODULES:
            return "a Python start-up hook"
        if kind == "file" and name.endswith(".pth"):
            text = upper.read(path, READ_LIMIT)  # (all of it: Python reads it whole)
            if len(text.encode()) >= READ_LIMIT or any(
                    line.startswith(("import ", "import\t")) for line in text.splitlines()):
                return "a .pth file that runs code at every Python start-up (or too long to read)"
        if kind == "file" and name == "entry_points.txt":
            text = upper.read(path, READ_LIMIT)
            if len(text.encode()) >= READ_LIMIT or "[pytest11]" in text.replace(" ", ""):
                return "declares a pytest plugin (or too long to read)"
        if SITE_FOLDER.fullmatch(folder) and _module(name) in self.modules:
            return f"shadows the image's Python module {_module(name)}"
        if (STDLIB_FOLDER.fullmatch(folder) and _module(name) not in STDLIB_PARTS) or \
                (STDLIB_ZIP.fullmatch(name) and folder in PYTHON_LIBS):
            return "in the Python standard library's place (before every site folder)"
        return ""


def _walk(image: Tree, upper: Tree, folder: str, rules: _Rules, out: Additions,
          added: bool) -> None:
    for name in upper.names(folder):
        path = f"{folder.rstrip('/')}/{name}"
        kind = upper.kind(path)
        if kind not in ("dir", "file", "link"):
            continue  # overlay whiteouts (the image's entry stays), devices, pipes
        mine = kind == "dir" and image.kind(path) == "dir" and not added
        if not mine and not added and image.kind(path):
            continue  # the image's entry wins (a file over the agent's folder too)
        why = "" if mine else rules.hidden(upper, path, kind)
        if why:
            out.hidden.append((path, why))
            continue
        if not mine:
            out.copy.append((path, kind))
        if kind == "dir":
            _walk(image, upper, path, rules, out, added=not mine)


def _module(name: str) -> str:
    """The import (or distribution) name an entry of a site folder provides ("" none)."""
    m = DIST_INFO.fullmatch(name)
    if m:
        return "dist:" + re.sub(r"[-_.]+", "-", m.group(1)).lower()
    if name == "__pycache__" or name.endswith((".pth", ".txt")) or name.startswith("."):
        return ""
    return name.split(".")[0]


def _resolve(image: Tree, folder: str, depth: int = 8) -> str:
    """``folder`` with the image's links along it followed (merged-/usr's /bin: /usr/bin)."""
    parts = folder.strip("/").split("/")
    done = ""
    while parts and depth:
        step = f"{done}/{parts.pop(0)}"
        if image.kind(step) == "link":
            depth -= 1
            target = image.link(step)
            step = posixpath.normpath(target if target.startswith("/")
                                      else f"{done or '/'}/{target}")
            parts = step.strip("/").split("/") + parts
            done = ""
            continue
        done = step
    return posixpath.normpath(done or "/")
