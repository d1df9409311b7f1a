"""The reader of a task's verifier scripts: which of their command lines fetch at grade
time, as a ``VerifierTools`` plan (``tmax.images.verifier_tools``). Pure: it reads files
and runs nothing. ``commands`` splits shell text into command lines of words."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tmax.images.verifier_tools import (
    DEFAULT_UV,
    UV_VALUE_OPTIONS,
    Step,
    VerifierTools,
    option_pairs,
    positionals,
)

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
APT_VALUE_OPTIONS = frozenset({"-o", "-t", "-c", "--option", "--target-release", "--config-file"})
APT_KEPT_FLAGS = ("--no-install-recommends", "--no-install-suggests", "--install-recommends")
APT_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.:-]*(?:=[A-Za-z0-9.+:~-]+)?")
"""A Debian package name (an :arch suffix, a =version pin): anything else is not read."""
KEYWORDS = frozenset(["if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "time", "exec", "command", "nohup", "sudo", "builtin"])


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
    apt: list[str] = field(default_factory=list)
    apt_where: list[str] = field(default_factory=list)
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
            if name in ("apt-get", "apt"):
                return self.apt_command(shown, words[2:])
            self.unprepared.append(shown)

    def apt_command(self, shown: str, words: list[Word]) -> None:
        """``apt-get install``: its packages installed in the image at build time (the
        boilerplate's curl alone, for uv's installer, is not needed)."""
        args = tuple(w.text for w in words)
        names = positionals(args, APT_VALUE_OPTIONS)
        if set(names) <= {"curl"}:
            return
        if any(w.dynamic for w in words) or not all(APT_PACKAGE.fullmatch(n) for n in names):
            return self.unprepared.append(f"{shown} (packages not read)")
        flags = [a for a in args if a in APT_KEPT_FLAGS]
        self.apt.append(" ".join(dict.fromkeys(flags + names)))
        self.apt_where.append(shown.partition(": ")[0])

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
        for opt, value in option_pairs(tuple(head)):
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
        for opt, value in option_pairs(tuple(rest)):
            if opt in PYTHON_OPTIONS:
                self.python(value)
        if kind == "run":
            head, _command = _split_positional(rest)
            if not any(o in WITH_OPTIONS + PYTHON_OPTIONS for o, _ in option_pairs(tuple(head))):
                return  # runs in an environment made before: nothing of its own to fetch
            rest = self.inline(head, "--with-requirements", "--with", where)
        elif kind == "venv":
            rest = self.venv_args(rest)
        elif kind in ("pip", "add"):
            if "--system" in rest:
                return self.unprepared.append(f"{shown} (the system Python is read-only "
                                              "for the verifier)")
            local = [p for p in positionals(tuple(rest), UV_VALUE_OPTIONS) if _is_path(p)]
            if local or "-e" in rest or "--editable" in rest:
                return self.unprepared.append(f"{shown} (local paths)")
            rest = self.inline(rest, ("-r", "--requirement", "--requirements"), None, where)
        if rest is None:
            return
        self.steps.append(Step(kind, tuple(rest), where, tuple(env)))

    def venv_args(self, args: list[str]) -> list[str]:
        """A venv's path as the scratch folder will have it (absolute ones made relative)."""
        positional = positionals(tuple(args), UV_VALUE_OPTIONS)
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
        apt=tuple(dict.fromkeys(reader.apt)), apt_where=tuple(dict.fromkeys(reader.apt_where)),
        pythons=tuple(reader.pythons) if steps else (),
        unprepared=tuple(reader.unprepared), sources=tuple(reader.seen))
