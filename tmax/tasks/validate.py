"""Validation of a native task: task.toml against the schema (``validate_config``), then the
folder (``check_task_dir``): every problem found, errors and warnings, each naming its file,
its field and what to do. ``tmax.tasks.native`` loads, finds and writes tasks through it."""

from __future__ import annotations

import re
import shlex
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from tmax.tasks.config import TaskConfig, from_harbor_dict, unknown_keys
from tmax.tasks.config_tables import (
    CURRENT_SCHEMA,
    DIFFICULTIES,
    DOMAINS,
    SCHEMA_VERSIONS,
    STASH,
    near_miss,
    phase_network,
)
from tmax.tasks.confine import Escape, expand_source, link_problems
from tmax.tasks.dockerfile import DockerfileError
from tmax.tasks.dockerfile import parse as parse_dockerfile
from tmax.tasks.model import (
    DEFINITION_FILES,
    ENV_DIR,
    INSTRUCTION,
    SOLVE_SCRIPT,
    TASK_ID_RE,
    TASK_TOML,
    TEST_SCRIPT,
    TESTS_DIR,
    Problem,
    Task,
    TaskError,
)
from tmax.tasks.steps import KNOWN_KEYS as KNOWN_STEP_KEYS
from tmax.tasks.steps import STEPS_DIR, StepError, parse_steps

Severity = Literal["error", "warning"]


def parse_task_toml(text: str, task_id: str, file: str = TASK_TOML) -> TaskConfig:
    """Parse and check task.toml text; raise ``TaskError`` naming each bad field."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TaskError([Problem(task_id, file, f"not valid TOML: {e}",
                                 "fix the syntax at the position given")]) from None
    return validate_config(raw, task_id, file)


def validate_config(raw: dict, task_id: str, file: str = TASK_TOML) -> TaskConfig:
    """A ``TaskConfig`` from a task.toml dict (a Harbor export's [metadata.tmax] put back);
    ``TaskError`` naming the file, each bad field and the schema version otherwise."""
    schema = declared_schema(raw)
    try:
        raw = from_harbor_dict(raw)
    except ValueError as e:
        raise TaskError([Problem(task_id, file, str(e), "fix or remove [metadata.tmax]",
                                 f"metadata.{STASH}")]) from None
    try:
        return TaskConfig.model_validate(raw)
    except ValidationError as e:
        raise TaskError([_problem_from_pydantic(task_id, file, err, schema)
                         for err in e.errors()]) from None


def declared_schema(raw: dict) -> str:
    """The schema version a task.toml dict declares, for messages."""
    declared = raw.get("schema_version", raw.get("version"))
    return str(declared) if declared is not None else f"{CURRENT_SCHEMA}, none declared"


def _problem_from_pydantic(task_id: str, file: str, err: Any,
                           schema: str = CURRENT_SCHEMA) -> Problem:
    loc = tuple(str(x) for x in err["loc"])
    dotted = ".".join(loc)
    if err["type"] == "extra_forbidden":
        model = _model_at(TaskConfig, loc[:-1])
        known = sorted(model.model_fields)
        section = f"in [{'.'.join(p for p in loc[:-1] if not p.isdigit())}]" if loc[:-1] \
            else "at the top level"
        return Problem(task_id, file,
                       f"unknown key '{loc[-1]}' {section}: neither Harbor's task.toml "
                       f"(schema {schema}) nor TMax defines it",
                       f"remove or rename it (keys here: {', '.join(known)}; free-form data "
                       "goes under [metadata])", dotted)
    if err["type"] == "tmax_field":
        return Problem(task_id, file, err["ctx"]["message"], "correct the value",
                       err["ctx"]["field"])
    if dotted == "environment.network" and isinstance(err.get("input"), (dict, str)):
        return Problem(task_id, file, f"network = {err['input']!r}: TMax's [environment] "
                       "network is true or false, and Harbor's schema has no network table",
                       'write the policy as Harbor does: network_mode = "public" | '
                       '"no-network" | "allowlist" (with allowed_hosts) in [environment]',
                       dotted)
    if loc and loc[-1] == "domain":
        message = err["msg"].removeprefix("Value error, ")
        return Problem(task_id, file, f"invalid domain {err.get('input')!r}: {message}",
                       f"use one of: {', '.join(DOMAINS)}", dotted)
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and isinstance(err.get("input"), dict):  # a whole table
        return Problem(task_id, file, message, "correct the value", dotted)
    return Problem(task_id, file, f"{message} (got {err.get('input')!r})", "correct the value",
                   dotted)


def _model_at(model: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel]:
    """The model that holds the key at ``loc`` (list indexes skipped)."""
    for key in loc:
        if key.isdigit() or key not in model.model_fields:
            continue
        inner = _inner_model(model.model_fields[key].annotation)
        if inner is None:
            return model
        model = inner
    return model


def _inner_model(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _inner_model(arg)) is not None:
            return found
    return None


def check_task_dir(root: Path, task_id: str) -> tuple[list[Problem], TaskConfig | None]:
    def problem(file: str, message: str, fix: str = "", field: str = "",
                severity: Severity = "error") -> None:
        problems.append(Problem(task_id, file, message, fix, field, severity))

    problems: list[Problem] = []
    if not root.is_dir():
        problem("", f"not a directory: {root}", "point at a task directory")
        return problems, None
    foreign = {"task.yaml": "a Terminal-Bench 1 task", "task.json": "a TMax v1.0 task"}
    if not (root / INSTRUCTION).exists() and not (root / TASK_TOML).exists():
        for marker, what in foreign.items():
            if (root / marker).is_file():
                problem(marker, f"{what}, not the native layout",
                        f"convert it first: tmax tasks convert {root} -d DEST")
                return problems, None
    if not TASK_ID_RE.match(task_id):
        problem("", f"task id {task_id!r} is not lowercase [a-z0-9._-]",
                "rename the directory (e.g. kebab-case)", severity="warning")

    instruction = root / INSTRUCTION
    multi_step = (root / STEPS_DIR).is_dir()  # (its steps hold the instructions)
    if not instruction.is_file() and not multi_step:
        problem(INSTRUCTION, "missing instruction", "write the task prompt to instruction.md")
    elif instruction.is_file() and not instruction.read_text(errors="replace").strip():
        problem(INSTRUCTION, "instruction is empty", "write the task prompt to instruction.md")

    config = None
    if not (root / TASK_TOML).is_file():
        problem(TASK_TOML, "missing task.toml", "add one (see examples/tasks/*/task.toml)")
    else:
        try:
            config = parse_task_toml((root / TASK_TOML).read_text(), task_id)
        except TaskError as e:
            problems.extend(e.problems)
        else:
            domain = config.metadata.domain
            if domain is None:
                problem(TASK_TOML, "no domain", f"set one of: {', '.join(DOMAINS)}",
                        "metadata.domain", "warning")
            elif domain not in DOMAINS:
                problem(TASK_TOML, f"domain {domain!r} is not one of TMax's nine; kept as "
                        "written (eval and stats group by it, generation never samples it)",
                        f"nothing to do for another dataset's domain; TMax's are: "
                        f"{', '.join(DOMAINS)}", "metadata.domain", "warning")
            difficulty = config.metadata.difficulty
            if difficulty not in DIFFICULTIES:
                problem(TASK_TOML, f"difficulty {difficulty!r} is not one of TMax's three; "
                        "kept as written (eval groups by it; a training run that filters by "
                        "difficulty leaves it out)",
                        f"nothing to do for another dataset's level; TMax's are: "
                        f"{', '.join(DIFFICULTIES)}", "metadata.difficulty", "warning")
            problems.extend(config_problems(task_id, config))
            problems.extend(unknown_key_problems(task_id, config))

    problems.extend(link_problems(root, task_id))
    _check_environment(root, task_id, problems, config)
    if config is not None and config.steps:
        _check_steps(root, task_id, problems, config)
        return problems, config
    if config is not None and multi_step and not instruction.is_file():
        problem(INSTRUCTION, "missing instruction (steps/ is there, but task.toml has no "
                "[[steps]])", "write the task prompt to instruction.md, or list the steps")
    _check_verifier(root, task_id, problems)
    if not (root / SOLVE_SCRIPT).is_file():
        problem(SOLVE_SCRIPT, "the task has no reference solution (solution/solve.sh)",
                "add one (it is optional in Harbor, but without it `tmax tasks check` and "
                "the image build checks cannot show that the task is solvable)",
                severity="warning")
    return problems, config


def unknown_key_problems(task_id: str, config: TaskConfig) -> list[Problem]:
    """Keys neither Harbor nor TMax defines: a warning each (kept as written, as Harbor
    ignores them), or an error where the key looks like a misspelt key of its table."""
    out = []
    schema = config.schema_version or config.version or f"{CURRENT_SCHEMA}, none declared"
    for dotted, known in unknown_keys(config):
        section, _, key = dotted.rpartition(".")
        where = f"in [{'.'.join(p for p in section.split('.') if not p.isdigit())}]" \
            if section else "at the top level"
        said = (f"unknown key '{key}' {where}: neither Harbor's task.toml "
                f"(schema {schema}) nor TMax defines it")
        if (near := _near_miss(key, known)) is not None:
            out.append(Problem(task_id, TASK_TOML, f"{said}; did you mean '{near}'?",
                               f"rename it to '{near}' (keys here: {', '.join(known)})",
                               dotted))
        else:
            out.append(Problem(task_id, TASK_TOML, f"{said}; kept as written and not acted "
                               "on (Harbor ignores it too)", "nothing to do unless the task "
                               "depends on it (free-form data belongs under [metadata])",
                               dotted, "warning"))
    return out


UNIT_SUFFIXES = frozenset({"s", "sec", "secs", "second", "seconds", "ms", "min", "mins",
                           "minute", "minutes", "h", "hours", "b", "k", "kb", "kib", "m", "mb",
                           "mib", "g", "gb", "gib"})
"""What a key may add to or drop from a defined one and still mean it (``timeout`` for
``timeout_sec``, ``memory_gb`` for ``memory``), unlike a suffix that names another thing
(``task_id`` is not ``task``)."""


def _near_miss(key: str, known: tuple[str, ...]) -> str | None:
    """The defined key ``key`` is probably a misspelling of (close spelling, or one is the
    other with a unit suffix such as ``_sec`` or ``_mb``)."""
    k = key.lower().replace("-", "_")
    if k in known:
        return k
    for name in known:
        longer, shorter = (name, k) if len(name) > len(k) else (k, name)
        if longer.startswith(shorter + "_") and longer[len(shorter) + 1:] in UNIT_SUFFIXES:
            return name
    return near_miss(k, known)


_NOT_APPLIED = {
    "environment.env": "the sandbox starts with the image's environment",
    "environment.workdir": "commands start in the image's WORKDIR",
    "environment.healthcheck": "no readiness check runs before the agent starts",
    "environment.skills_dir": "no skills are copied for the agent",
    "environment.mcp_servers": "TMax's agents get no MCP servers",
    "environment.gpu_types": "any GPU the fleet has is used",
    "environment.tpu": "TMax's fleet has no TPUs",
    "verifier.collect": "no collect hooks run",
}
"""Harbor keys TMax reads and keeps but does not act on yet, and what happens instead."""


USER_FORM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?")
"""[agent] and [verifier] user: Docker's USER, ``name|uid[:group|gid]``."""


def config_problems(task_id: str, config: TaskConfig) -> list[Problem]:
    """What a valid task.toml asks for that TMax does not do (warnings), or cannot run at all
    (errors)."""
    out: list[Problem] = []

    def note(field: str, message: str, fix: str, severity: Severity = "warning") -> None:
        out.append(Problem(task_id, TASK_TOML, message, fix, field, severity))

    if config.harbor_schema not in SCHEMA_VERSIONS:
        note("schema_version", f"schema version {config.harbor_schema!r} is not one Harbor "
             f"published ({', '.join(SCHEMA_VERSIONS)}); read as {CURRENT_SCHEMA}",
             f'declare schema_version = "{CURRENT_SCHEMA}"')
    verifier = config.verifier
    separate = verifier.environment_mode == "separate" or \
        (verifier.environment_mode is None and verifier.environment is not None)
    if config.steps and separate:
        note("verifier.environment_mode", "a multi-step task with a separate verifier is not "
             "supported: its steps' verifiers run in the agent's sandbox",
             "use the shared mode for a multi-step task", "error")
    if separate and verifier.environment is not None and verifier.environment.docker_image:
        note("verifier.environment.docker_image", "TMax builds the separate verifier's image "
             "from tests/Dockerfile (else uses the task's own), it pulls no image",
             "add a tests/Dockerfile FROM that image", "warning")
    if config.task is not None and "/" not in config.task.name:
        note("task.name", f"task name {config.task.name!r} is not 'org/name': it runs, but "
             "Harbor's registry publishes only org/name", f'write it as "<org>/{config.task.name}" '
             "before publishing")
    for i, item in enumerate(config.artifacts):
        path = item.get("source") if isinstance(item, dict) else item
        if not (isinstance(path, str) and path.startswith("/")):
            note(f"artifacts[{i}]", f"artifact {item!r} is not an absolute path in the "
                 "sandbox", 'write it as "/abs/path" or {source = "/abs/path"}', "error")
    for i, step in enumerate(config.steps or ()):
        for key in sorted(set(step) - KNOWN_STEP_KEYS):
            note(f"steps[{i}].{key}", f"unknown key '{key}' in [[steps]]: kept, not acted on",
                 "nothing to do unless the task depends on it")
        if (step.get("verifier") or {}).get("environment_mode") == "separate" or \
                (step.get("verifier") or {}).get("environment"):
            note(f"steps[{i}].verifier.environment_mode", "a separate verifier per step is "
                 "not supported: the step's verifier runs in the sandbox",
                 "nothing to do unless the task depends on it")
    for section in ("agent", "verifier"):
        who = getattr(config, section).user
        if who is not None and not USER_FORM.fullmatch(str(who)):
            note(f"{section}.user", f"user {who!r} is not a user name or uid, optionally "
                 "with :group (Docker's USER)", 'write it as "name", "1000" or "name:group"',
                 "error")
    if config.environment.os.lower() != "linux":
        note("environment.os", f"os {config.environment.os!r}: TMax runs Linux sandboxes only",
             "use a Linux image", "error")
    if config.verifier.allowed_hosts:  # the agent's allowlist is enforced (fleet's proxy)
        note("verifier.allowed_hosts", "the verifier runs offline: its allowed_hosts are "
             "not applied", "prepare what test.sh needs when the image is built")
    env = config.environment
    verifier_net = phase_network(config.verifier.network_mode, config.verifier.allowed_hosts)
    if verifier_net is not None and verifier_net != env.network:
        note("verifier.network_mode", "a network policy of the verifier's own is not "
             f"supported: tests/test.sh runs with the sandbox's network "
             f"({'on' if env.network else 'off'})", "set the policy in [environment]")
    if config.network_unsaid:
        note("environment.network_mode", "no network policy given: Harbor's default is "
             "network on (public); TMax's agent gets the package registries only "
             "(--agent-network registries, the default) or none (offline)", 'say what the '
             'task needs: network_mode = "no-network", "allowlist" or "public"')
    dumped = config.model_dump(exclude_unset=True)
    for field, instead in _NOT_APPLIED.items():
        section, _, key = field.rpartition(".")
        value = (dumped.get(section, {}) if section else dumped).get(key)
        if value not in (None, {}, [], ()):
            note(field, f"{field} is kept but not acted on yet: {instead}",
                 "nothing to do unless the task depends on it")
    return out


def _check_steps(root: Path, task_id: str, problems: list[Problem],
                 config: TaskConfig) -> None:
    """A multi-step task: each step parses and has a test.sh (its own or the task's)."""
    try:
        steps = parse_steps(Task(task_id, root, "", config))
    except StepError as e:
        problems.append(Problem(task_id, TASK_TOML, str(e), "see tmax/tasks/steps.py for what "
                                "a step holds", e.field))
        return
    for step in steps:
        own = step.tests_dir / "test.sh"
        _check_verifier(root, task_id, problems, own if own.is_file() else root / TEST_SCRIPT,
                        f"{STEPS_DIR}/{step.name}/tests/test.sh",
                        (root / TESTS_DIR, step.tests_dir))
        if not step.solve_script.is_file():
            problems.append(Problem(
                task_id, f"{STEPS_DIR}/{step.name}/solution/solve.sh",
                f"step {step.name!r} has no reference solution", "add one (the oracle runs "
                "each step's in order)", severity="warning"))


TESTS_MOVED = re.compile(
    r"""^[^#\n]*?\b(?:mv|cp|rsync)\b(?:[ \t]+-[^\s]*)*[ \t]+["']?/tests(?:/[^\s"';&|]*)?["']?"""
    r"""[ \t]+["']?(/(?!tests\b|logs/verifier\b)[^\s"';&|]*)""", re.MULTILINE)
"""A command of test.sh that moves or copies /tests (or a file of it) out of the verifier's
own folders; group 1 is where to."""


def _check_verifier(root: Path, task_id: str, problems: list[Problem],
                    test_sh: Path | None = None, shown: str = TEST_SCRIPT,
                    helpers: tuple[Path, ...] = ()) -> None:
    """test.sh is there and writes a reward (itself, or a helper of ``helpers``, the folders
    its /tests is made of, that it may source or run)."""
    test_sh = test_sh or root / TEST_SCRIPT
    if not test_sh.is_file():
        problems.append(Problem(task_id, shown, "no verifier",
                                f"add {shown} writing /logs/verifier/reward.txt"))
        return
    texts = [test_sh.read_text(errors="replace")]
    texts += [f.read_text(errors="replace") for d in helpers if d.is_dir()
              for f in sorted(d.rglob("*.sh")) if f.is_file() and f.stat().st_size < 1 << 20]
    if not any("reward.txt" in text or "reward.json" in text for text in texts):
        problems.append(Problem(
            task_id, shown, "the test script writes no reward",
            "write one float in [0,1] to /logs/verifier/reward.txt (or a flat JSON dict "
            "of numbers to /logs/verifier/reward.json), whatever the outcome"))
    moved = TESTS_MOVED.search(texts[0])
    if moved:
        problems.append(Problem(
            task_id, shown, f"moves or copies its tests out of /tests (to {moved[1]}), "
            "where the agent's processes, running on while the verifier runs, can read or "
            "change them (in Docker as in TMax)",
            "leave them in /tests, which no agent process can see in TMax (there is no "
            "need to hide it while the agent's program runs)", severity="warning"))


def _check_environment(root: Path, task_id: str, problems: list[Problem],
                       config: TaskConfig | None = None) -> None:
    env = root / ENV_DIR
    found = [n for n in DEFINITION_FILES if (env / n).is_file()]
    image = config.environment.docker_image if config else None
    if not found:
        if image:
            problems.append(Problem(
                task_id, ENV_DIR, f"no environment definition, only the prebuilt image "
                f"environment.docker_image = {image!r}, which TMax does not pull",
                f"add environment/Dockerfile (e.g. FROM {image}, or the Dockerfile the "
                "image was built from)"))
            return
        problems.append(Problem(task_id, ENV_DIR, "no environment definition",
                                "add environment/Dockerfile or environment/container.def"))
        return
    if image:
        problems.append(Problem(task_id, TASK_TOML, f"environment.docker_image {image!r} is "
                                f"not used: TMax builds environment/{found[0]}",
                                "nothing to do unless the image differs from what "
                                f"environment/{found[0]} builds", "environment.docker_image",
                                "warning"))
    if len(found) > 1:
        problems.append(Problem(task_id, ENV_DIR, "both a Dockerfile and a container.def",
                                "keep one of them"))
        return
    if (env / "docker-compose.yaml").exists() or (env / "docker-compose.yml").exists():
        problems.append(Problem(task_id, f"{ENV_DIR}/docker-compose.yaml",
                                "multi-container tasks are not supported; the file is ignored",
                                "fold the services into one image", severity="warning"))
    if found[0] == "Dockerfile":
        problems.extend(_check_dockerfile(env / "Dockerfile", task_id))
    else:
        problems.extend(_check_definition(env / "container.def", task_id))


def _source_problem(task_id: str, file: str, field: str, word: str, env: Path,
                    src: str) -> Problem | None:
    if "://" in src:
        return Problem(task_id, file, f"{word} fetches {src} at build time",
                       "vendor the file into environment/", field, "warning")
    try:
        found = expand_source(env, src)
    except Escape as e:
        return Problem(task_id, file, f"{word} {e}",
                       f"copy only files under {ENV_DIR}/ (the build context): move the "
                       "file there and name it relative to it", field)
    if not found:
        return Problem(task_id, file, f"{word} source {src!r} not found in environment/",
                       "add the file or fix the path", field)
    return None


def _check_dockerfile(path: Path, task_id: str) -> list[Problem]:
    file = f"{ENV_DIR}/Dockerfile"
    try:
        parsed = parse_dockerfile(path.read_text(errors="replace"))
    except DockerfileError as e:
        return [Problem(task_id, file, e.message, "see the Dockerfile reference; TMax builds "
                        "what Docker builds (docs/images.md)",
                        f"line {e.line}" if e.line else "")]
    problems: list[Problem] = []
    for line, word, src in parsed.copy_sources():
        if problem := _source_problem(task_id, file, f"line {line}", word, path.parent, src):
            problems.append(problem)
    return problems


def _check_definition(path: Path, task_id: str) -> list[Problem]:
    file = f"{ENV_DIR}/container.def"
    text = path.read_text(errors="replace")
    header = {}
    section = None
    problems: list[Problem] = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("%"):
            section = s.split()[0][1:].lower()
            continue
        if section is None and ":" in s and not s.startswith("#"):
            key, _, value = s.partition(":")
            header[key.strip().lower()] = value.strip()
        elif section == "files" and s and not s.startswith("#"):
            src = shlex.split(s)[0]
            if problem := _source_problem(task_id, file, f"line {n}", "%files", path.parent,
                                          src):
                problems.append(problem)
    if "bootstrap" not in header:
        problems.append(Problem(task_id, file, "no 'Bootstrap:' header",
                                "start the definition with Bootstrap: and From: lines"))
    return problems
