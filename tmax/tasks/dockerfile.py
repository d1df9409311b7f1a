"""Dockerfiles read as Docker (BuildKit) reads them: instructions in order, stages, variables.

``parse(text)`` gives the build stages, each an ordered list of steps (``Run``, ``Copy``,
``Workdir``) with the environment, working directory, user and shell in force at that step,
every ``$VAR`` that Docker substitutes already substituted. The image builders turn the
steps into one build script (tmax.images.plan); validation reads the COPY sources.

Supported: line continuations and the ``escape`` directive; comments; JSON and shell forms;
``ARG`` before ``FROM`` (global, usable in FROM lines) and in stages, the automatic platform
ARGs; ``ENV`` (both forms) and ``${VAR}``, ``${VAR:-default}``, ``${VAR:+alt}``; ``FROM
--platform=... image[@digest] AS name``; ``RUN`` (flags such as ``--mount`` dropped) and
heredocs; ``COPY``/``ADD`` with ``--chown``, ``--chmod``, ``--from`` (a stage or an image);
``WORKDIR``; ``USER``; ``SHELL``; ``ENTRYPOINT`` (the final stage's is what a sandbox of the
image starts with, as Harbor's containers run it: with ``sh -c "sleep infinity"`` as its
arguments, see ``entrypoint_command``). Noted and ignored: ``CMD`` (Harbor replaces it), ``EXPOSE``,
``LABEL``, ``VOLUME``, ``HEALTHCHECK``, ``STOPSIGNAL``, ``MAINTAINER``, ``ONBUILD``.
"""

from __future__ import annotations

import json
import platform
import posixpath
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HARBOR_COMMAND = ("sh", "-c", "sleep infinity")
"""The command Harbor's compose file gives every task's main container (its CMD's place)."""
IGNORED = frozenset({"CMD", "EXPOSE", "LABEL", "VOLUME", "HEALTHCHECK",
                     "STOPSIGNAL", "MAINTAINER", "ONBUILD"})
HEREDOC = re.compile(r"(?<!<)<<(-?)([ \t]*)([\"']?)([A-Za-z_][A-Za-z0-9_]*)\3")
"""A heredoc opener: ``<<EOF``, ``<<-'EOF'``, ``<< "EOF"``. Groups: 1 ``-``, 4 the delimiter;
``openers`` keeps those BuildKit reads as heredocs."""
SPACED_HEREDOC = re.compile(r"<<-[ \t]+[\"']?[A-Za-z_][A-Za-z0-9_]*[\"']?")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
         "s390x": "s390x"}


class DockerfileError(ValueError):
    """A Dockerfile TMax cannot build: ``line`` (1-based, 0 for the whole file) and why."""

    def __init__(self, line: int, message: str):
        self.line, self.message = line, message
        super().__init__(f"line {line}: {message}" if line else message)


@dataclass(frozen=True)
class Run:
    line: int
    argv: tuple[str, ...]
    """What runs: the shell plus the command (shell form), or the exec form's argv."""
    text: str
    """The instruction's command as written (for messages)."""
    env: tuple[tuple[str, str], ...]
    """ENV and ARG values in force, in order."""
    workdir: str
    user: str
    network: bool = True
    """False for ``RUN --network=none``."""


@dataclass(frozen=True)
class Copy:
    line: int
    sources: tuple[str, ...]
    dest: str
    """Absolute, in the image; a trailing '/' kept (it means "into this directory")."""
    add: bool = False
    from_stage: int | None = None
    from_image: str = ""
    chown: str = ""
    chmod: str = ""
    inline: tuple[tuple[str, str], ...] = ()
    """Heredoc files (``COPY <<EOF dest``): (name, content)."""

    @property
    def into_dir(self) -> bool:
        """Docker copies into ``dest`` (not as it) when it ends in '/' or there are several
        sources; otherwise it depends on whether ``dest`` is a directory in the image."""
        return self.dest.endswith("/") or len(self.sources) + len(self.inline) > 1


@dataclass(frozen=True)
class Workdir:
    line: int
    path: str


Step = Run | Copy | Workdir


@dataclass
class Stage:
    index: int
    name: str
    image: str
    """The FROM image reference, variables substituted, ``--platform`` dropped."""
    line: int
    steps: list[Step] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """ENV at the end of the stage: the image's environment."""
    workdir: str = "/"
    user: str = ""
    notes: list[str] = field(default_factory=list)
    entrypoint: tuple[str, ...] = ()
    """ENTRYPOINT's argv (the shell form through the SHELL in force); () when none."""
    shell: tuple[str, ...] = ("/bin/sh", "-c")
    """The SHELL in force at the end of the stage."""
    parent: int | None = None
    """``FROM <an earlier stage>``: the index of the stage it continues (its files, ENV,
    WORKDIR, USER, SHELL and ENTRYPOINT, as Docker starts it); ``image`` is then that
    stage's image."""


# After starting an ENTRYPOINT: wait (5 s at most) until it has reached Harbor's command
# (``exec "$@"`` ran ``sleep infinity``), then a second more for the services it started in
# the background to listen. Under Harbor the agent's own setup gives them that time; here
# the agent's first command (or the oracle) would come at once. /proc and tr only: no pgrep.
ENTRYPOINT_SETTLE = (
    "i=0; while [ $i -lt 50 ]; do for c in /proc/[0-9]*/cmdline; do "
    "[ \"$(tr '\\0' ' ' < \"$c\" 2>/dev/null)\" = 'sleep infinity ' ] && break 2; done; "
    "sleep 0.1; i=$((i + 1)); done; sleep 1")


def entrypoint_command(entrypoint: tuple[str, ...] | list[str], workdir: str = "/") -> str:
    """The shell command that starts an image's ENTRYPOINT in a sandbox as Harbor's
    containers run it (with ``sh -c "sleep infinity"``, its compose command, as the
    arguments), in its own session in the background, from ``workdir``, then waits for it to
    settle (``ENTRYPOINT_SETTLE``): a script that starts services and ends with
    ``exec "$@"`` leaves them running and listening. "" when there is none."""
    if not entrypoint:
        return ""
    argv = " ".join(shlex.quote(a) for a in (*entrypoint, *HARBOR_COMMAND))
    return (f"(cd {shlex.quote(workdir)} && exec setsid {argv}) </dev/null >/dev/null 2>&1 "
            f"& {ENTRYPOINT_SETTLE}")


@dataclass
class Dockerfile:
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def needed(self) -> list[Stage]:
        """The stages the final one depends on (through COPY --from and FROM <stage>),
        itself last."""
        want = {self.final.index}
        for stage in reversed(self.stages):
            if stage.index in want:
                want |= {s.from_stage for s in stage.steps
                         if isinstance(s, Copy) and s.from_stage is not None}
                if stage.parent is not None:
                    want.add(stage.parent)
        return [s for s in self.stages if s.index in want]

    def copy_sources(self) -> list[tuple[int, str, str]]:
        """(line, COPY or ADD, source) of every COPY/ADD that reads the build context."""
        return [(s.line, "ADD" if s.add else "COPY", src) for stage in self.stages
                for s in stage.steps
                if isinstance(s, Copy) and s.from_stage is None and not s.from_image
                for src in s.sources]


# --------------------------------------------------------------------------- lexing


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str
    heredocs: tuple[tuple[str, str], ...] = ()
    """(delimiter, body) of each heredoc the instruction opens, in order."""


def instructions(text: str) -> list[Instruction]:
    """Instructions with continuations joined, comments dropped, heredoc bodies attached."""
    lines = text.splitlines()
    escape = "\\"
    for line in lines:  # parser directives: only at the very top
        m = re.match(r"\s*#\s*(\w+)\s*=\s*(\S+)\s*$", line)
        if not m:
            break
        if m.group(1).lower() == "escape" and m.group(2) in ("\\", "`"):
            escape = m.group(2)
    out: list[Instruction] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        start, buf = i + 1, ""
        while True:
            stripped = lines[i].rstrip()
            if stripped.endswith(escape) and not stripped.endswith(escape * 2):
                buf += stripped[:-1]
                i += 1
                while i < len(lines) and (lines[i].strip().startswith("#")
                                          or not lines[i].strip()):
                    i += 1  # comment and empty lines inside a continuation are dropped
                if i >= len(lines):
                    break
                continue
            buf += stripped
            i += 1
            break
        keyword, _, args = buf.strip().partition(" ")
        keyword, args = keyword.upper(), args.strip()
        docs = []
        if keyword in ("RUN", "COPY", "ADD") and not args.startswith("["):
            for m in openers(args):
                chomp, name = bool(m.group(1)), m.group(4)
                body = []
                while i < len(lines) and lines[i].strip("\t" if chomp else "") != name:
                    body.append(lines[i].lstrip("\t") if chomp else lines[i])
                    i += 1
                if i >= len(lines):
                    raise DockerfileError(start, f"heredoc {name} is never closed")
                i += 1
                docs.append((name, "\n".join(body) + "\n"))
        out.append(Instruction(start, keyword, args, tuple(docs)))
    return out


def openers(text: str) -> list[re.Match[str]]:
    """The heredocs ``text`` (a RUN/COPY/ADD's arguments) opens, as BuildKit reads them: not
    ``<<<`` (a here-string); ``<< 'EOF'`` too, as BuildKit's lexer keeps the blanks after
    ``<<`` in the word, but only as a word of its own and without ``-`` (``<<- EOF`` and
    ``$((x << y))`` are not heredocs there)."""
    return [m for m in HEREDOC.finditer(text) if not m.group(2) or
            (not m.group(1) and re.match(r"[\s;&|>]|$", text[m.end():]))]


def _plain_openers(text: str) -> str:
    """``text`` with each heredoc opener written as one word, ``<<NAME`` or ``<<-NAME``."""
    pieces, at = [], 0
    for m in openers(text):
        pieces += [text[at:m.start()], f"<<{m.group(1)}{m.group(4)}"]
        at = m.end()
    return "".join([*pieces, text[at:]])


def _words(text: str, env: dict[str, str] | None, line: int) -> list[str]:
    """Docker's word splitting: quotes group and are removed, backslash escapes, ``$``
    substituted from ``env`` (except in single quotes); None leaves ``$`` as written."""
    words: list[str] = []
    cur, have, i, quote = [], False, 0, ""
    while i < len(text):
        c = text[i]
        if quote == "'":
            if c == "'":
                quote = ""
            else:
                cur.append(c)
            i += 1
        elif c == "\\" and i + 1 < len(text) and (not quote or text[i + 1] in '"\\$'):
            cur.append(text[i + 1])
            have, i = True, i + 2
        elif c in "'\"" and (not quote or c == quote):
            quote = "" if quote else c
            have, i = True, i + 1
        elif c == "$" and env is not None:
            value, i = _variable(text, i, env, line)
            cur.append(value)
            have = True
        elif c.isspace() and not quote:
            if cur or have:
                words.append("".join(cur))
            cur, have, i = [], False, i + 1
        else:
            cur.append(c)
            have, i = True, i + 1
    if quote:
        raise DockerfileError(line, f"unterminated {quote} quote")
    if cur or have:
        words.append("".join(cur))
    return words


def _variable(text: str, i: int, env: dict[str, str], line: int) -> tuple[str, int]:
    """The value of the ``$NAME`` / ``${NAME...}`` at ``text[i]``, and where it ends."""
    if text.startswith("${", i):
        end = text.find("}", i)
        if end < 0:
            raise DockerfileError(line, f"unterminated ${{ in {text!r}")
        inner = text[i + 2:end]
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+])(.*))?", inner, re.DOTALL)
        if not m:
            raise DockerfileError(line, f"unsupported substitution ${{{inner}}}")
        name, op, word = m.groups()
        value = env.get(name)
        if op in (":-", "-"):
            use_default = value is None or (op == ":-" and value == "")
            return (_substitute(word, env, line) if use_default else value or ""), end + 1
        if op in (":+", "+"):
            present = value is not None and (op == "+" or value != "")
            return (_substitute(word, env, line) if present else ""), end + 1
        return value or "", end + 1
    m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", text[i + 1:])
    if not m:
        return "$", i + 1
    return env.get(m.group(0), ""), i + 1 + m.end()


def _substitute(text: str, env: dict[str, str], line: int) -> str:
    """``$`` substitution only (no word splitting, quotes kept)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i] == "$":
            value, i = _variable(text, i, env, line)
            out.append(value)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _json_form(args: str) -> list[str] | None:
    if not args.startswith("["):
        return None
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None  # Docker then reads it as the shell form
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _flags(words: list[str]) -> tuple[dict[str, str], list[str]]:
    flags: dict[str, str] = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


def _split_flags(args: str) -> tuple[dict[str, str], str]:
    """Leading ``--flag=value`` words of a RUN (its command stays as written)."""
    flags: dict[str, str] = {}
    while (m := re.match(r"--([A-Za-z-]+)(?:=(\"[^\"]*\"|\S*))?\s*", args)):
        flags[m.group(1)] = (m.group(2) or "").strip('"')
        args = args[m.end():]
    return flags, args


# --------------------------------------------------------------------------- parsing


def platform_args() -> dict[str, str]:
    """BuildKit's automatic platform ARGs, for this machine."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    plat = f"linux/{arch}"
    return {"TARGETPLATFORM": plat, "TARGETOS": "linux", "TARGETARCH": arch,
            "TARGETVARIANT": "", "BUILDPLATFORM": plat, "BUILDOS": "linux",
            "BUILDARCH": arch, "BUILDVARIANT": ""}


class _Parser:
    def __init__(self, workdir_of: Callable[[str], str],
                 path_of: Callable[[str], str] = lambda image: DEFAULT_PATH) -> None:
        self.workdir_of, self.path_of = workdir_of, path_of
        self.stages: list[Stage] = []
        self.global_args: dict[str, str] = {}
        self.args: dict[str, str] = {}  # the current stage's ARGs
        self.env: dict[str, str] = {}
        self.shell: list[str] = ["/bin/sh", "-c"]

    @property
    def stage(self) -> Stage:
        return self.stages[-1]

    def scope(self) -> dict[str, str]:
        """What ``$VAR`` means here: ENV wins over ARG (Docker's rule)."""
        return {**self.args, **self.env}

    def instruction(self, ins: Instruction) -> None:
        if ins.keyword == "FROM":
            return self.from_(ins)
        if ins.keyword == "ARG":
            return self.arg(ins)
        if not self.stages:
            raise DockerfileError(ins.line, f"{ins.keyword} before the first FROM")
        handlers: dict[str, Callable[[Instruction], None]] = {
            "ENV": self.env_, "RUN": self.run, "COPY": self.copy, "ADD": self.add,
            "WORKDIR": self.workdir, "USER": self.user, "SHELL": self.shell_}
        handler = handlers.get(ins.keyword)
        if ins.keyword in IGNORED:
            self.stage.notes.append(f"line {ins.line}: {ins.keyword} ignored (a sandbox "
                                    "starts a shell, not the image's command)")
        elif ins.keyword == "ENTRYPOINT":
            self.stage.notes.append(f"line {ins.line}: ENTRYPOINT runs when a sandbox starts, "
                                    "with `sh -c 'sleep infinity'` as its arguments (as in "
                                    "Harbor)")
            self.entrypoint(ins)
        elif handler is None:
            raise DockerfileError(ins.line, f"unknown instruction {ins.keyword}")
        else:
            handler(ins)

    def from_(self, ins: Instruction) -> None:
        words = _words(ins.args, {**platform_args(), **self.global_args}, ins.line)
        flags, words = _flags(words)
        if len(words) == 3 and words[1].lower() == "as":
            image, name = words[0], words[2]
        elif len(words) == 1:
            image, name = words[0], ""
        else:
            raise DockerfileError(ins.line, f"FROM {ins.args!r}: expected 'image [AS name]'")
        if image == "scratch":
            raise DockerfileError(ins.line, "FROM scratch is not supported: start from a "
                                  "base image")
        parent = next((s for s in self.stages if s.name and s.name == image.lower()), None)
        if parent is not None:  # an earlier stage by name (Docker looks there first)
            stage = Stage(len(self.stages), name.lower(), parent.image, ins.line,
                          env=dict(parent.env), workdir=parent.workdir, user=parent.user,
                          entrypoint=parent.entrypoint, shell=parent.shell,
                          parent=parent.index)
            stage.notes.append(f"line {ins.line}: FROM {image} continues stage {parent.name} "
                               "(built over its result, as in Docker)")
        else:
            path = self.path_of(image) or DEFAULT_PATH  # (the image's ENV PATH: ${PATH})
            stage = Stage(len(self.stages), name.lower(), image, ins.line,
                          env={"PATH": path}, workdir=self.workdir_of(image))
        if "platform" in flags:
            stage.notes.append(f"line {ins.line}: --platform={flags['platform']} ignored "
                               "(images are built for this machine)")
        self.stages.append(stage)
        self.args, self.env = {}, dict(stage.env)
        self.shell = list(stage.shell)

    def arg(self, ins: Instruction) -> None:
        for word in _words(ins.args, None, ins.line):
            name, eq, default = word.partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise DockerfileError(ins.line, f"ARG {word!r}: not a variable name")
            scope = self.scope() if self.stages else {**platform_args(), **self.global_args}
            value = _substitute(_words(default, None, ins.line)[0] if default else "", scope,
                                ins.line) if eq else None
            if not self.stages:
                self.global_args[name] = value or ""
                continue
            if value is None:  # declared: the global value, or an automatic one
                value = self.global_args.get(name, platform_args().get(name))
            if value is not None:
                self.args[name] = value

    def env_(self, ins: Instruction) -> None:
        words = _words(ins.args, self.scope(), ins.line)
        if words and "=" not in words[0]:  # legacy "ENV KEY value with spaces"
            key, _, rest = ins.args.partition(" ")
            pairs = [(key, " ".join(_words(rest, self.scope(), ins.line)))]
        else:
            pairs = [(k, v) for k, _, v in (w.partition("=") for w in words if "=" in w)]
            if len(pairs) != len(words):
                raise DockerfileError(ins.line, f"ENV {ins.args!r}: expected KEY=value pairs")
        for key, value in pairs:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise DockerfileError(ins.line, f"ENV {key!r}: not a variable name a shell "
                                      "can export (letters, digits, _)")
            self.env[key] = value
        self.stage.env = dict(self.env)

    def run(self, ins: Instruction) -> None:
        flags, command = _split_flags(ins.args)
        exec_form = _json_form(command)
        if exec_form is not None:
            argv = tuple(exec_form)
        elif len(ins.heredocs) == 1 and [m.span() for m in openers(command.strip())] == \
                [(0, len(command.strip()))]:
            body = ins.heredocs[0][1]  # RUN <<EOF: the body is the script
            argv = (*self.shell, body)
            command = body
        else:
            script = command + "".join(f"\n{body}{name}" for name, body in ins.heredocs)
            argv = (*self.shell, script)
        self.stage.steps.append(Run(ins.line, argv, command.strip(), tuple(self.scope().items()),
                                    self.stage.workdir, self.stage.user,
                                    flags.get("network", "default") != "none"))

    def copy(self, ins: Instruction, add: bool = False) -> None:
        exec_form = _json_form(ins.args)
        args = ins.args if not ins.heredocs else \
            _plain_openers(ins.args)  # "<< 'EOF'" is one word to Docker: "<<EOF"
        words = exec_form if exec_form is not None else _words(args, self.scope(), ins.line)
        if exec_form is not None:
            words = [_substitute(w, self.scope(), ins.line) for w in words]
        flags, words = _flags(list(words))
        word = "ADD" if add else "COPY"
        inline = tuple((name, body) for name, body in ins.heredocs)
        names = {f"<<{n}" for n, _ in inline} | {f"<<-{n}" for n, _ in inline}
        words = [w for w in words if w not in names]
        if len(words) < (1 if inline else 2):
            raise DockerfileError(ins.line, f"{word} needs a source and a destination")
        *sources, dest = words
        from_stage, from_image = None, ""
        if "from" in flags:
            from_stage = self._stage_index(flags["from"])
            if from_stage is None:
                from_image = flags["from"]
        if add and any(s.startswith("git@") or s.endswith(".git") for s in sources):
            raise DockerfileError(ins.line, "ADD of a git repository is not supported: "
                                  "vendor it into the build context")
        for key in set(flags) - {"from", "chown", "chmod", "link", "checksum", "keep-git-dir"}:
            raise DockerfileError(ins.line, f"{word} --{key} is not supported")
        absolute = posixpath.normpath(posixpath.join(self.stage.workdir, dest))
        if (dest.endswith(("/", "/.")) or dest == ".") and not absolute.endswith("/"):
            absolute += "/"  # "into this directory"
        self.stage.steps.append(Copy(ins.line, tuple(sources), absolute, add, from_stage,
                                     from_image, flags.get("chown", ""), flags.get("chmod", ""),
                                     inline))

    def add(self, ins: Instruction) -> None:
        self.copy(ins, add=True)

    def workdir(self, ins: Instruction) -> None:
        words = _words(ins.args, self.scope(), ins.line)
        if len(words) != 1:
            raise DockerfileError(ins.line, f"WORKDIR {ins.args!r}: expected one path")
        path = posixpath.normpath(posixpath.join(self.stage.workdir, words[0]))
        self.stage.workdir = path
        self.stage.steps.append(Workdir(ins.line, path))

    def user(self, ins: Instruction) -> None:
        words = _words(ins.args, self.scope(), ins.line)
        if len(words) != 1:
            raise DockerfileError(ins.line, f"USER {ins.args!r}: expected user[:group]")
        self.stage.user = "" if words[0] in ("root", "0", "root:root", "0:0") else words[0]

    def entrypoint(self, ins: Instruction) -> None:
        exec_form = _json_form(ins.args)
        if exec_form is not None:
            self.stage.entrypoint = tuple(exec_form)  # ENTRYPOINT [] clears it
        else:
            text = ins.args.strip()
            self.stage.entrypoint = (*self.shell, text) if text else ()

    def shell_(self, ins: Instruction) -> None:
        value = _json_form(ins.args)
        if not value:
            raise DockerfileError(ins.line, 'SHELL needs the JSON form, e.g. ["/bin/bash", "-c"]')
        self.shell = value
        self.stage.shell = tuple(value)

    def _stage_index(self, ref: str) -> int | None:
        for stage in self.stages:
            if stage.name and stage.name == ref.lower():
                return stage.index
        if ref.isdigit() and int(ref) < len(self.stages):
            return int(ref)
        return None


def parse(text: str, workdir_of: Callable[[str], str] = lambda image: "/",
          path_of: Callable[[str], str] = lambda image: DEFAULT_PATH) -> Dockerfile:
    """The stages of a Dockerfile; ``DockerfileError`` (with its line) for what TMax cannot
    build. ``workdir_of``: a FROM image's WORKDIR (where relative paths start); ``path_of``:
    its PATH (what ``${PATH}`` is until the Dockerfile sets it, and what RUN steps get)."""
    parser = _Parser(workdir_of, path_of)
    previous: Instruction | None = None
    for ins in instructions(text):
        try:
            parser.instruction(ins)
        except DockerfileError as e:
            spaced = SPACED_HEREDOC.search(previous.args) if previous is not None and \
                previous.keyword in ("RUN", "COPY", "ADD") else None
            if previous is None or spaced is None:
                raise
            raise DockerfileError(e.line, (
                f"{e.message}: line {previous.line} opens a shell heredoc with a space after "
                f"<<- ({spaced.group(0)!r}), which Docker does not read as a Dockerfile "
                "heredoc (it does read << 'PY'), so the lines after it are read as "
                "instructions (docker build fails the same way); write it without the space, "
                "e.g. <<-'PY'")) from None
        previous = ins
    if not parser.stages:
        raise DockerfileError(0, "no FROM line: start the Dockerfile with FROM <image>")
    return Dockerfile(parser.stages)
