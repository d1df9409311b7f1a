"""Harbor's task.toml, schema versions 1.0 to 1.4, read as Harbor reads it; TMax's own keys
strict; every key kept when a task is written back; ``convert --to harbor`` and back.

The task.toml texts below follow real ones from public Harbor datasets (Terminal-Bench 2's
registry export, Harbor's task template, TB-2.1-style tasks) and Harbor's models
(harbor/models/task/config.py in the harbor 0.1.45 ... 0.26.0 packages).
"""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest
import tomli_w
import yaml
from click.testing import CliRunner

from tmax.cli import main
from tmax.tasks import TaskError, load_task, read_any, validate_task, write_task
from tmax.tasks.check import run_solution
from tmax.tasks.config import TaskConfig
from tmax.tasks.config_tables import SCHEMA_VERSIONS, size_to_mb
from tmax.tasks.model import MissingSolution

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
EXAMPLES = REPO / "examples" / "tasks"

TEST_SH = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
           "grep -qx 42 /app/answer.txt && r=1 || r=0\necho $r > /logs/verifier/reward.txt\n")

# One task.toml per published schema version, shaped like the ones in the wild.
HARBOR_TOML = {
    # Terminal-Bench 2 as first published: `version`, size strings, a prebuilt image.
    "1.0": '''\
version = "1.0"

[metadata]
author_name = "Jane Doe"
author_email = "jane@example.org"
difficulty = "medium"
category = "data-processing"
tags = ["regex", "string-parsing", "log-analysis"]
expert_time_estimate_min = 45.0
junior_time_estimate_min = 180.0

[verifier]
timeout_sec = 900.0

[agent]
timeout_sec = 900.0

[environment]
build_timeout_sec = 600.0
docker_image = "example/regex-log:20251031"
cpus = 1
memory = "4G"
storage = "10G"
''',
    # Harbor's registry export of Terminal-Bench 2 tasks.
    "1.1": '''\
schema_version = "1.1"
artifacts = []

[task]
name = "terminal-bench/regex-log"
description = "Build a regex that matches dates in log lines with a valid IPv4 address."
keywords = ["regex", "data-processing"]
[[task.authors]]
name = "Jane Doe"
email = "jane@example.org"

[metadata]
author_name = "Jane Doe"
author_email = "jane@example.org"
difficulty = "medium"
category = "data-processing"
tags = ["regex"]
expert_time_estimate_min = 45.0
junior_time_estimate_min = 180.0

[verifier]
timeout_sec = 900.0

[agent]
timeout_sec = 900.0

[environment]
build_timeout_sec = 600.0
docker_image = "example/regex-log:20251031"
cpus = 1
memory_mb = 2048
storage_mb = 10240
gpus = 0
allow_internet = true
mcp_servers = []

[verifier.env]

[environment.env]

[solution.env]
''',
    # 1.2 adds os; healthcheck and workdir came in 1.1; free metadata as in TB-2.1 tasks.
    "1.2": '''\
schema_version = "1.2"

[metadata]
difficulty = "hard"
category = "security"
category_subdomain = "authentication"
languages = ["bash", "python"]
reward_type = "binary"
codebase_size = "small"
number_of_milestones = 0
subcategories = []

[verifier]
timeout_sec = 600
env = { PYTHONDONTWRITEBYTECODE = "1" }

[agent]
timeout_sec = 1800

[environment]
os = "linux"
cpus = 2
memory = "512M"
storage = "2G"
workdir = "/app"
allow_internet = false

[environment.healthcheck]
command = "test -d /app"
interval_sec = 2.0
retries = 5
''',
    # 1.3: network_mode and allowed_hosts, per-phase users.
    "1.3": '''\
schema_version = "1.3"

[metadata]
difficulty = "easy"
domain = "software-engineering"
skills = ["pip"]

[verifier]
timeout_sec = 300.0
user = "root"

[agent]
timeout_sec = 600.0
user = "agent"

[solution.env]
PIP_INDEX_URL = "https://pypi.org/simple"

[environment]
network_mode = "allowlist"
allowed_hosts = ["pypi.org", "*.pythonhosted.org", "10.0.0.0/8"]
memory_mb = 4096
''',
    # 1.4: [task] version, MCP servers with headers; Harbor's template omits the rest.
    "1.4": '''\
schema_version = "1.4"

[task]
name = "example-org/hello-mcp"
version = "1.0.0"
description = "Answer with the help of a search server."
authors = [{ name = "A. Author" }]

[metadata]

[verifier]
timeout_sec = 900.0

[agent]
timeout_sec = 900.0

[environment]
build_timeout_sec = 600.0
network_mode = "no-network"
env = { API_BASE = "${API_BASE:-http://localhost:8080}" }

[[environment.mcp_servers]]
name = "search"
transport = "streamable-http"
url = "http://localhost:8080/mcp"
headers = { Authorization = "Bearer ${SEARCH_TOKEN}" }
''',
}

# A TB-2.1-style file in the wild declares a version Harbor never published.
WILD_V2 = '''\
version = "2.0"

[metadata]
author_name = "anonymous"
difficulty = "hard"
category = "security"
languages = ["go", "bash"]
expert_time_estimate_min = 360
junior_time_estimate_min = 720

[agent]
timeout_sec = 1800

[verifier]
timeout_sec = 900

[environment]
allow_internet = false
build_timeout_sec = 900.0
cpus = 2
memory_mb = 4096
storage_mb = 10240
workdir = "/app"
'''


def make_task(root: Path, toml: str, name: str = "demo", **overrides) -> Path:
    files = {
        "instruction.md": "Write 42 to /app/answer.txt.\n",
        "task.toml": toml,
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n",
        "tests/test.sh": TEST_SH,
        "solution/solve.sh": "#!/bin/bash\necho 42 > /app/answer.txt\n",
    } | overrides
    task = root / name
    for rel, text in files.items():
        if text is not None:
            (task / rel).parent.mkdir(parents=True, exist_ok=True)
            (task / rel).write_text(text)
    return task


def errors(path: Path):
    return [p for p in validate_task(path) if p.severity == "error"]


def warnings(path: Path):
    return [p for p in validate_task(path) if p.severity == "warning"]


def env_toml(body: str, head: str = 'schema_version = "1.4"\n') -> str:
    return f"{head}\n[environment]\n{body}\n"


def config(tmp_path, toml: str) -> TaskConfig:
    return load_task(make_task(tmp_path, toml)).config


# --------------------------------------------------------------------------- every version


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_each_schema_version_validates_and_loads(tmp_path, version):
    path = make_task(tmp_path, HARBOR_TOML[version])
    assert errors(path) == []
    task = load_task(path)
    assert task.config.harbor_schema == version
    raw = tomllib.loads(HARBOR_TOML[version])
    assert task.config.agent.timeout_sec == raw["agent"]["timeout_sec"]
    assert task.config.verifier.timeout_sec == raw["verifier"]["timeout_sec"]


def test_versions_map_as_harbor_reads_them(tmp_path):
    v10 = config(tmp_path / "a", HARBOR_TOML["1.0"])
    assert (v10.environment.memory_mb, v10.environment.storage_mb) == (4096, 10240)
    assert v10.environment.cpus == 1 and v10.environment.docker_image
    assert v10.metadata.free == {"expert_time_estimate_min": 45.0,
                                 "junior_time_estimate_min": 180.0}

    v11 = config(tmp_path / "b", HARBOR_TOML["1.1"])
    assert v11.task.name == "terminal-bench/regex-log"
    assert v11.task.authors[0].email == "jane@example.org"
    assert v11.environment.network is True  # allow_internet = true
    assert v11.environment.memory_mb == 2048

    v12 = config(tmp_path / "c", HARBOR_TOML["1.2"])
    assert v12.environment.network is False  # allow_internet = false
    assert (v12.environment.memory_mb, v12.environment.storage_mb) == (512, 2048)
    assert v12.environment.workdir == "/app"
    assert v12.environment.healthcheck.command == "test -d /app"
    assert v12.environment.healthcheck.retries == 5
    assert v12.verifier.env == {"PYTHONDONTWRITEBYTECODE": "1"}
    assert v12.metadata.free["languages"] == ["bash", "python"]
    assert v12.metadata.free["reward_type"] == "binary"

    v13 = config(tmp_path / "d", HARBOR_TOML["1.3"])
    assert v13.environment.network is True  # allowlist with hosts: network on, hosts kept
    assert v13.environment.allowed_hosts == ("pypi.org", "*.pythonhosted.org", "10.0.0.0/8")
    assert (v13.agent.user, v13.verifier.user) == ("agent", "root")
    assert v13.solution.env == {"PIP_INDEX_URL": "https://pypi.org/simple"}
    assert v13.metadata.domain == "software-engineering"

    v14 = config(tmp_path / "e", HARBOR_TOML["1.4"])
    assert v14.task.version == "1.0.0"
    assert v14.environment.network is False  # network_mode = "no-network"
    assert v14.environment.mcp_servers[0].headers == {"Authorization": "Bearer ${SEARCH_TOKEN}"}
    assert v14.environment.env == {"API_BASE": "${API_BASE:-http://localhost:8080}"}


@pytest.mark.parametrize("body, field, value", [
    ('memory = "4G"', "memory_mb", 4096),
    ('memory = "0.5G"', "memory_mb", 512),
    ('memory = "512M"', "memory_mb", 512),
    ('memory = " 2g "', "memory_mb", 2048),
    ('storage = "10G"', "storage_mb", 10240),
    ('storage = "65536K"', "storage_mb", 64),
    ('memory = "4G"\nmemory_mb = 4096', "memory_mb", 4096),  # agreeing: fine
    ("allow_internet = true", "network", True),
    ("allow_internet = false", "network", False),
    ('network_mode = "public"', "network", True),
    ('network_mode = "no-network"', "network", False),
    ('network_mode = "allowlist"\nallowed_hosts = ["pypi.org"]', "network", True),
    ('network_mode = "allowlist"\nallowed_hosts = []', "network", False),  # nothing reachable
    ('network_mode = "no-network"\nallow_internet = true', "network", False),  # mode wins
    ("network = true\nallow_internet = true", "network", True),
    ("cpus = 4", "cpus", 4),
    ("cpus = 2.0", "cpus", 2),
    ("gpus = 1", "gpus", 1),
    ("build_timeout_sec = 1200", "build_timeout_sec", 1200.0),
    ('docker_image = "ghcr.io/example/img:1"', "docker_image", "ghcr.io/example/img:1"),
    ('workdir = "/srv"', "workdir", "/srv"),
    ('env = { A = "1" }', "env", {"A": "1"}),
])
def test_each_harbor_environment_key_maps(tmp_path, body, field, value):
    assert getattr(config(tmp_path, env_toml(body)).environment, field) == value


def test_allow_internet_keeps_a_network_task_online(tmp_path):
    """The old advice for allow_internet was "remove it", which turned the task offline."""
    path = make_task(tmp_path, env_toml("allow_internet = true", 'version = "1.0"\n'))
    assert errors(path) == []
    assert load_task(path).config.environment.network is True
    assert not any("remove" in p.fix and "allow_internet" in p.message
                   for p in validate_task(path))


def test_agent_network_override_decides_the_sandbox(tmp_path):
    toml = ('schema_version = "1.3"\n[agent]\nnetwork_mode = "public"\n'
            '[environment]\nnetwork_mode = "no-network"\n')
    assert config(tmp_path, toml).environment.network is True


def test_verifier_network_override_is_a_warning(tmp_path):
    path = make_task(tmp_path, 'schema_version = "1.3"\n[verifier]\nnetwork_mode = "public"\n'
                               '[environment]\nnetwork_mode = "no-network"\n')
    assert errors(path) == []
    assert "verifier.network_mode" in {w.field for w in warnings(path)}


def test_an_allowlist_is_the_agents_lease_network_and_needs_no_warning(tmp_path):
    path = make_task(tmp_path, HARBOR_TOML["1.3"])
    assert "environment.allowed_hosts" not in {w.field for w in warnings(path)}
    hosts = ("pypi.org", "*.pythonhosted.org", "10.0.0.0/8")
    assert load_task(path).config.agent_network() == (False, hosts)
    assert load_task(path).config.agent_network("registries") == (False, hosts)


def test_the_agent_network_of_each_policy(tmp_path):
    from sandfleet.netproxy import REGISTRY_HOSTS

    def net(toml: str, unsaid: str = "registries"):
        return config(tmp_path, toml).agent_network(unsaid)

    assert net('schema_version = "1.4"\n') == (False, REGISTRY_HOSTS)  # Harbor: says nothing
    assert net('schema_version = "1.4"\n', "offline") == (False, ())
    assert net('schema_version = "1.3"\n[environment]\nnetwork_mode = "no-network"\n') == \
        (False, ())
    assert net('schema_version = "1.3"\n[environment]\nnetwork_mode = "public"\n') == (True, ())
    assert net('schema_version = "1.3"\n[agent]\nnetwork_mode = "allowlist"\n'
               'allowed_hosts = ["a.example"]\n[environment]\nnetwork_mode = "public"\n') == \
        (False, ("a.example",))
    assert net('[metadata]\ndomain = "x"\n') == (False, ())  # TMax's own: off unless said


def test_no_network_policy_in_a_harbor_file_says_the_defaults_differ(tmp_path):
    path = make_task(tmp_path, 'schema_version = "1.4"\n[metadata]\n')
    (w,) = [w for w in warnings(path) if w.field == "environment.network_mode"]
    assert "public" in w.message and "off" in w.message
    assert load_task(path).config.environment.network is False


def test_keys_tmax_keeps_but_does_not_act_on_are_warnings(tmp_path):
    fields = {w.field for w in warnings(make_task(tmp_path, HARBOR_TOML["1.2"]))}
    assert {"environment.workdir", "environment.healthcheck"} <= fields
    fields = {w.field for w in warnings(make_task(tmp_path / "b", HARBOR_TOML["1.4"]))}
    assert {"environment.mcp_servers", "environment.env"} <= fields
    # empty tables and lists (as Harbor's export writes them) are not worth a word
    fields = {w.field for w in warnings(make_task(tmp_path / "c", HARBOR_TOML["1.1"]))}
    assert not fields & {"environment.env", "environment.mcp_servers", "artifacts"}


def test_docker_image_is_noted_or_an_error_without_a_definition(tmp_path):
    path = make_task(tmp_path, HARBOR_TOML["1.1"])
    assert "environment.docker_image" in {w.field for w in warnings(path)}
    path = make_task(tmp_path / "b", HARBOR_TOML["1.1"], **{"environment/Dockerfile": None})
    (e,) = errors(path)
    assert e.file == "environment" and "docker_image" in e.message and "Dockerfile" in e.fix


def test_a_bare_task_name_runs_with_a_warning(tmp_path):
    """Harbor runs a task folder whose [task] name has no org (org/name is the registry's
    form for publishing): a warning that says how to publish, not a refusal."""
    path = make_task(tmp_path, 'schema_version = "1.1"\n[task]\nname = "my-task"\n')
    assert errors(path) == []
    (w,) = [w for w in warnings(path) if w.field == "task.name"]
    assert "'my-task'" in w.message and "<org>/my-task" in w.fix
    assert load_task(path).config.task.name == "my-task"
    path = make_task(tmp_path / "b", 'schema_version = "1.1"\n[task]\nname = "org/my-task"\n')
    assert "task.name" not in {w.field for w in warnings(path)}


def test_unpublished_schema_version_is_read_with_a_warning(tmp_path):
    path = make_task(tmp_path, WILD_V2)
    assert errors(path) == []
    (w,) = [w for w in warnings(path) if w.field == "schema_version"]
    assert "'2.0'" in w.message and "1.4" in w.message
    assert load_task(path).config.metadata.free["languages"] == ["go", "bash"]


@pytest.mark.parametrize("toml, field", [
    # a step with no steps/one/instruction.md (tests/test_multi_step.py runs real ones)
    ('schema_version = "1.4"\n[[steps]]\nname = "one"\n', "steps[0].name"),
    ('schema_version = "1.4"\n[environment]\nos = "Windows"\n', "environment.os"),
])
def test_what_tmax_cannot_run_is_an_error(tmp_path, toml, field):
    assert field in {p.field for p in errors(make_task(tmp_path, toml))}


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("version, toml, field", [
    ("1.2", 'schema_version = "1.2"\n[environment]\ncolour = "red"\n', "environment.colour"),
    ("1.0", 'version = "1.0"\n[agent]\nmodel_hint = "mcp"\n', "agent.model_hint"),
    ("1.1", 'schema_version = "1.1"\nfavourite = 3\n', "favourite"),
    ("1.3", 'schema_version = "1.3"\n[extras]\na = 1\n', "extras"),
    ("1.1", 'schema_version = "1.1"\n[task]\nname = "a/b"\nformat = "single_turn"\n',
     "task.format"),
    ("1.4", ('schema_version = "1.4"\n[[environment.mcp_servers]]\nname = "s"\n'
             'url = "http://x"\nport = 1\n'), "environment.mcp_servers.0.port"),
    ("1.4, none declared", "[solution]\nenvironment = {}\n", "solution.environment"),
])
def test_a_key_neither_defines_is_kept_with_a_warning(tmp_path, version, toml, field):
    """Harbor ignores keys it does not define (real datasets carry their own, e.g. [task]
    format): TMax loads the task, warns naming key, file and schema, and writes the key
    back as it was; --strict refuses it."""
    path = make_task(tmp_path, toml)
    assert errors(path) == []
    (p,) = [p for p in validate_task(path) if p.field == field]
    assert (p.task, p.file, p.severity) == ("demo", "task.toml", "warning")
    key = field.rsplit(".", 1)[-1]
    assert f"unknown key '{key}'" in p.message
    assert f"schema {version}" in p.message and "kept as written" in p.message
    written = tomllib.loads(tomli_w.dumps(load_task(path).config.to_toml_dict()))
    assert written == tomllib.loads(toml)
    runner = CliRunner()
    assert runner.invoke(main, ["tasks", "validate", str(path)]).exit_code == 0
    strict = runner.invoke(main, ["tasks", "validate", "--strict", str(path)])
    assert strict.exit_code != 0 and f"unknown key '{key}'" in strict.output


def test_a_key_that_names_another_thing_is_only_a_warning(tmp_path):
    """terminus-bench-tasks' debian_production_task has a top-level `task_id` (Harbor
    ignores it): `task` plus `_id` is another key, not a misspelling of [task]."""
    path = make_task(tmp_path, 'version = "1.0"\nname = "x"\ntask_id = "3c62f37c"\n')
    assert errors(path) == []
    said = {p.field: p for p in validate_task(path) if p.severity == "warning"}
    assert "unknown key 'task_id' at the top level" in said["task_id"].message
    assert load_task(path).config.to_toml_dict()["task_id"] == "3c62f37c"  # kept as written


@pytest.mark.parametrize("toml, field, meant", [
    ('schema_version = "1.3"\n[environment]\nallow_internt = false\n',
     "environment.allow_internt", "allow_internet"),
    ('schema_version = "1.3"\n[environment]\nnetwork-mode = "public"\n',
     "environment.network-mode", "network_mode"),
    ('schema_version = "1.3"\n[agent]\ntimeout = 30\n', "agent.timeout", "timeout_sec"),
    ('schema_version = "1.3"\n[verifier]\ntimout_sec = 30\n', "verifier.timout_sec",
     "timeout_sec"),
    ('schema_version = "1.1"\n[task]\nname = "a/b"\ndescripton = "x"\n',
     "task.descripton", "description"),
    ('schema_version = "1.3"\n[environment]\nstorage_gb = 10\n', "environment.storage_gb",
     "storage"),
])
def test_a_misspelt_key_is_an_error_naming_the_key_meant(tmp_path, toml, field, meant):
    """A near-miss of a defined key is a typo that would silently change the task (e.g.
    network on, Harbor's default), so it is refused."""
    path = make_task(tmp_path, toml)
    (p,) = errors(path)
    assert (p.task, p.file, p.field) == ("demo", "task.toml", field)
    assert f"did you mean '{meant}'?" in p.message and "schema 1." in p.message
    with pytest.raises(TaskError, match=re.escape(f"demo: task.toml [{field}]")):
        load_task(path)


@pytest.mark.parametrize("toml, field", [
    ("[metadata]\ndifficulty = 'mediun'\n", "metadata.difficulty"),
    ("[metadata]\ndomain = 'securiti'\n", "metadata.domain"),
    ("[metadata]\nskills = 'grep'\n", "metadata.skills"),
    ("[metadata]\naxes = { level = 3 }\n", "metadata.axes.level"),
    ("[metadata]\ntags = [1]\n", "metadata.tags.0"),
    ("[verifier]\ntimeout_sec = -1\n", "verifier.timeout_sec"),
    ("[verifier]\nagent_system = 1\n", "verifier.agent_system"),
    ("[agent]\ntimeout_sec = 0\n", "agent.timeout_sec"),
    ("[environment]\ncpus = 0\n", "environment.cpus"),
    ("[environment]\ncpus = 1.5\n", "environment.cpus"),
    ("[environment]\nmemory_mb = 8\n", "environment.memory_mb"),
    ("[environment]\nnetwork = 'yes'\n", "environment.network"),
    ("[environment]\nmemory = '4GB'\n", "environment.memory"),
    ("[environment]\nmemory = 4096\n", "environment.memory"),
    ("[environment]\nstorage = 'lots'\n", "environment.storage"),
    ("[environment]\nmemory = '1K'\n", "environment.memory"),
    ("[environment]\nmemory = '4G'\nmemory_mb = 2048\n", "environment.memory"),
    ("[environment]\nnetwork = false\nallow_internet = true\n", "environment.network"),
    ("[environment]\nnetwork_mode = 'open'\n", "environment.network_mode"),
    ("[environment]\nallow_internet = 'yes'\n", "environment.allow_internet"),
    ("[task]\nname = 'two/../up'\n", "task.name"),
    ("[task]\nname = 'has space'\n", "task.name"),
])
def test_a_bad_value_is_an_error_naming_the_field(tmp_path, toml, field):
    (p,) = errors(make_task(tmp_path, toml))
    assert (p.file, p.field) == ("task.toml", field), p
    assert p.fix


def test_a_network_table_names_harbors_spelling(tmp_path):
    """Some datasets write [environment.network] mode = ...: not Harbor's schema, and not
    TMax's boolean; the message says what to write instead."""
    (p,) = errors(make_task(tmp_path, '[environment.network]\nmode = "public"\n'))
    assert p.field == "environment.network" and "no network table" in p.message
    assert 'network_mode = "public"' in p.fix


def test_allowed_hosts_follow_harbor_rules(tmp_path):
    bad = env_toml('network_mode = "public"\nallowed_hosts = ["pypi.org"]')
    (p,) = errors(make_task(tmp_path, bad))
    assert "allowlist" in p.message and p.field == "environment"
    url = env_toml('network_mode = "allowlist"\nallowed_hosts = ["https://pypi.org/simple"]')
    (p,) = errors(make_task(tmp_path / "b", url))
    assert p.field == "environment.allowed_hosts" and "URL" in p.message


def test_size_strings_as_harbor_parses_them():
    assert [size_to_mb(s) for s in ("4G", "1.5G", "512M", "2048K", "1g")] == \
        [4096, 1536, 512, 2, 1024]
    for bad in ("4GB", "4Gi", "4", "G", ""):
        with pytest.raises(ValueError):
            size_to_mb(bad)


# --------------------------------------------------------------------------- writing back


def native_dict(task_dir: Path) -> dict:
    return tomllib.loads((task_dir / "task.toml").read_text())


@pytest.mark.parametrize("toml", [*HARBOR_TOML.values(), WILD_V2], ids=[*HARBOR_TOML, "2.0"])
def test_writing_a_task_back_keeps_every_key(tmp_path, toml):
    src = make_task(tmp_path / "src", toml)
    out = write_task(read_any(src), tmp_path / "out")
    assert native_dict(out.root) == tomllib.loads(toml)
    assert load_task(out.root).config == load_task(src).config


def test_writing_back_a_tmax_file_keeps_every_key(tmp_path):
    for example in sorted(EXAMPLES.iterdir())[:4]:
        out = write_task(read_any(example), tmp_path)
        assert native_dict(out.root) == native_dict(example)


def harbor_problems(task_dir: Path) -> list[str]:
    """Harbor's rules for a task directory, as read in its source (harbor 0.26.0:
    harbor/models/task/config.py ``TaskConfig`` and harbor/models/task/task.py
    ``Task.is_valid_dir``), checked here without Harbor installed:

    1. task.toml is TOML and every key is one Harbor defines (Harbor's models ignore other
       keys silently, so an export must not lean on them): the top level, [task] and
       [[task.authors]], [verifier], [agent], [solution], [environment] with
       [environment.healthcheck] and [[environment.mcp_servers]]; [metadata] is free.
    2. Values have Harbor's types: timeouts are numbers; cpus a number; memory_mb,
       storage_mb, gpus integers; env tables map strings to strings; user a string or an
       integer; allow_internet a boolean; network_mode is no-network, public or allowlist;
       allowed_hosts only with allowlist; memory / storage are sizes with a G, M or K
       suffix; [task] name is "org/name" and each author has a name; an MCP server has a url
       (sse, streamable-http) or a command (stdio); os is linux or windows.
    3. A single-step task has instruction.md and tests/test.sh; environment/ is a folder
       unless docker_image is set. solution/ is optional.
    """
    found: list[str] = []
    try:
        doc = tomllib.loads((task_dir / "task.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        return [f"task.toml: {e}"]
    phase = {"network_mode", "allowed_hosts"}
    keys = {
        "": {"schema_version", "version", "task", "metadata", "verifier", "agent",
             "environment", "solution", "source", "multi_step_reward_strategy", "steps",
             "artifacts"},
        "task": {"name", "version", "description", "authors", "keywords"},
        "verifier": {"timeout_sec", "env", "user", "environment_mode", "environment",
                     "collect"} | phase,
        "agent": {"timeout_sec", "user"} | phase,
        "solution": {"env"},
        "environment": {"build_timeout_sec", "docker_image", "os", "cpus", "memory_mb",
                        "storage_mb", "gpus", "gpu_types", "tpu", "mcp_servers", "env",
                        "skills_dir", "healthcheck", "workdir", "allow_internet", "memory",
                        "storage"} | phase,
    }
    for section, allowed in keys.items():
        table = doc.get(section, {}) if section else doc
        for key in set(table) - allowed:
            found.append(f"[{section}] {key}: not a Harbor key (Harbor would ignore it)")
    env, agent, verifier = (doc.get(s, {}) for s in ("environment", "agent", "verifier"))
    number = (int, float)
    for table, name in ((verifier, "verifier"), (agent, "agent"), (env, "environment")):
        for key in ("timeout_sec", "build_timeout_sec", "cpus"):
            if key in table and (not isinstance(table[key], number) or
                                 isinstance(table[key], bool)):
                found.append(f"{name}.{key}: not a number")
        if "user" in table and not isinstance(table["user"], (str, int)):
            found.append(f"{name}.user: not a string or integer")
        if table.get("network_mode", "public") not in ("no-network", "public", "allowlist"):
            found.append(f"{name}.network_mode: {table['network_mode']!r}")
        if "allowed_hosts" in table and table.get("network_mode") != "allowlist":
            found.append(f"{name}.allowed_hosts without network_mode = 'allowlist'")
    for table, name in ((verifier, "verifier"), (env, "environment"),
                        (doc.get("solution", {}), "solution")):
        if not all(isinstance(v, str) for v in table.get("env", {}).values()):
            found.append(f"{name}.env: values must be strings")
    for key in ("memory_mb", "storage_mb", "gpus"):
        if key in env and (not isinstance(env[key], int) or isinstance(env[key], bool)):
            found.append(f"environment.{key}: not an integer")
    for key in ("memory", "storage"):
        if key in env and not re.fullmatch(r"\s*[0-9.]+\s*[GgMmKk]\s*", str(env[key])):
            found.append(f"environment.{key}: not a size like '4G'")
    if "allow_internet" in env and not isinstance(env["allow_internet"], bool):
        found.append("environment.allow_internet: not a boolean")
    if str(env.get("os", "linux")).lower() not in ("linux", "windows"):
        found.append("environment.os")
    for server in env.get("mcp_servers", []):
        transport = server.get("transport", "sse")
        if (transport == "stdio" and not server.get("command")) or \
                (transport != "stdio" and not server.get("url")):
            found.append(f"mcp server {server.get('name')}: url or command missing")
    task = doc.get("task")
    if task is not None:
        if not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*",
                            str(task.get("name", ""))):
            found.append("task.name: not org/name")
        if not all(isinstance(a, dict) and "name" in a for a in task.get("authors", [])):
            found.append("task.authors: each needs a name")
    if not doc.get("steps"):
        for rel in ("instruction.md", "tests/test.sh"):
            if not (task_dir / rel).is_file():
                found.append(f"{rel} missing")
    if not env.get("docker_image") and not (task_dir / "environment").is_dir():
        found.append("environment/ missing and no docker_image")
    return found


def harbor_network(doc: dict) -> bool:
    """Whether Harbor gives the agent a network (its resolution: [agent] network_mode, else
    [environment] network_mode, else allow_internet, else public)."""
    env, agent = doc.get("environment", {}), doc.get("agent", {})
    mode = agent.get("network_mode") or env.get("network_mode")
    if mode is None and "allowed_hosts" not in env and "allow_internet" in env:
        mode = "public" if env["allow_internet"] else "no-network"
    mode = mode or "public"
    return mode == "public" or (mode == "allowlist" and bool(
        agent.get("allowed_hosts") or env.get("allowed_hosts")))


def files_of(task_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(task_dir).as_posix(): p.read_bytes()
            for p in sorted(task_dir.rglob("*")) if p.is_file() and p.name != "task.toml"}


def tmax_native_task(root: Path) -> Path:
    """A native task with TMax's own keys everywhere and Harbor keys beside them."""
    return make_task(root, '''\
[metadata]
difficulty = "hard"
domain = "debugging"
skills = ["gdb"]
axes = { scenario = "crash" }
extra = { seed = 7 }
expert_time_estimate_min = 20

[verifier]
agent_system = true
env = { MODE = "strict" }

[environment]
network = true
memory = "3G"
''', name="tmax-native")


@pytest.mark.parametrize("make", [
    tmax_native_task,
    lambda root: EXAMPLES / "hello-world-file",
    lambda root: make_task(root, HARBOR_TOML["1.0"], name="harbor-10"),
    lambda root: make_task(root, HARBOR_TOML["1.3"], name="harbor-13"),
    lambda root: make_task(root, "[metadata]\n", name="bare"),
], ids=["tmax-keys", "example", "harbor-1.0", "harbor-1.3", "bare"])
def test_native_to_harbor_to_native_is_lossless(tmp_path, make):
    src = make(tmp_path / "src")
    original = load_task(src)
    harbor = write_task(read_any(src), tmp_path / "harbor", layout="harbor")
    doc = native_dict(harbor.root)
    assert harbor_problems(harbor.root) == []
    assert harbor_network(doc) == original.config.environment.network
    assert harbor.config == original.config  # TMax reads the export as the original
    back = write_task(read_any(harbor.root), tmp_path / "back")
    assert native_dict(back.root) == native_dict(src)
    assert back.config == original.config
    assert files_of(back.root) == files_of(src) == files_of(harbor.root)


def test_harbor_export_moves_tmax_keys_under_metadata_tmax(tmp_path):
    harbor = write_task(read_any(tmax_native_task(tmp_path)), tmp_path / "h", layout="harbor")
    doc = native_dict(harbor.root)
    stash = doc["metadata"]["tmax"]
    assert stash["environment"] == {"network": True}
    assert stash["verifier"] == {"agent_system": True}
    assert "network" not in doc["environment"] and "agent_system" not in doc["verifier"]
    # TMax's defaults that Harbor's differ from are written out
    assert doc["verifier"]["timeout_sec"] == 120.0 and doc["agent"]["timeout_sec"] == 900.0
    assert doc["environment"]["network_mode"] == "public" and doc["environment"]["cpus"] == 2
    assert "memory_mb" not in doc["environment"]  # memory = "3G" says it for Harbor already
    assert set(stash["added"]) >= {"schema_version", "verifier.timeout_sec",
                                   "environment.network_mode"}
    # TMax's [metadata] keys are free-form data for Harbor and stay where they are
    assert doc["metadata"]["domain"] == "debugging" and doc["metadata"]["skills"] == ["gdb"]
    assert harbor.config.verifier.agent_system is True


def test_a_complete_harbor_task_exports_unchanged(tmp_path):
    src = make_task(tmp_path, HARBOR_TOML["1.1"], name="tb2")
    harbor = write_task(read_any(src), tmp_path / "h", layout="harbor")
    assert native_dict(harbor.root) == tomllib.loads(HARBOR_TOML["1.1"])


def test_harbor_export_refuses_an_apptainer_definition(tmp_path):
    draft = read_any(DATA / "tmax-v1" / "config-port")
    with pytest.raises(TaskError, match="Harbor builds environment/Dockerfile"):
        write_task(draft, tmp_path, layout="harbor")
    assert list(tmp_path.iterdir()) == []


def test_a_malformed_metadata_tmax_is_an_error(tmp_path):
    path = make_task(tmp_path, "[metadata.tmax.environment]\ncpus = 3\n")
    (p,) = errors(path)
    assert p.field == "metadata.tmax" and "environment" in p.message
    path = make_task(tmp_path / "b", "[environment]\nnetwork = false\n"
                                     "[metadata.tmax.environment]\nnetwork = true\n")
    (p,) = errors(path)
    assert "twice" in p.message


def test_cli_convert_to_harbor_and_back(tmp_path):
    runner = CliRunner()
    src = tmax_native_task(tmp_path / "src")
    res = runner.invoke(main, ["tasks", "convert", str(src), "-d", str(tmp_path / "h"),
                               "--to", "harbor"])
    assert res.exit_code == 0, res.output
    assert "(native -> harbor)" in res.output
    exported = tmp_path / "h" / "tmax-native"
    assert harbor_problems(exported) == []
    res = runner.invoke(main, ["tasks", "validate", str(exported)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["tasks", "convert", str(exported), "-d", str(tmp_path / "n")])
    assert res.exit_code == 0, res.output
    assert native_dict(tmp_path / "n" / "tmax-native") == native_dict(src)


def test_converted_tb1_tasks_export_for_harbor(tmp_path):
    for src in (DATA / "tb1" / "hello-file", DATA / "tb1" / "word-count"):
        harbor = write_task(read_any(src), tmp_path, layout="harbor")
        assert harbor_problems(harbor.root) == []
        assert harbor_network(native_dict(harbor.root)) is False


# --------------------------------------------------------------------------- TB1 keys


def test_tb1_unknown_keys_are_kept_in_metadata(tmp_path):
    src = tmp_path / "legacy-task"
    shutil.copytree(DATA / "tb1" / "hello-file", src)
    meta = yaml.safe_load((src / "task.yaml").read_text())
    meta |= {"author": "Jane Doe", "env_name": "python-3-13", "language": "python",
             "parser_name": "pytest", "run_tests_in_same_shell": False,
             "expert_time_estimate_min": 10, "skills": ["touch"], "notes": None,
             "difficulty": "extreme"}
    (src / "task.yaml").write_text(yaml.safe_dump(meta))
    draft = read_any(src)
    free = draft.config.metadata.free
    assert free["author"] == "Jane Doe"
    assert free["env_name"] == "python-3-13"
    assert free["language"] == "python"
    assert free["parser_name"] == "pytest" and free["run_tests_in_same_shell"] is False
    assert free["expert_time_estimate_min"] == 10
    assert free["tb1_skills"] == ["touch"]  # a name TMax types in [metadata]
    assert free["tb1_difficulty"] == "extreme"  # read as medium, the original kept
    assert "notes" not in free
    assert {w.field for w in draft.warnings} >= {"notes", "difficulty"}
    task = write_task(draft, tmp_path / "out")
    assert native_dict(task.root)["metadata"]["env_name"] == "python-3-13"
    assert errors(task.root) == []


def test_tb1_description_variants_are_kept(tmp_path):
    src = tmp_path / "variants"
    shutil.copytree(DATA / "tb1" / "hello-file", src)
    (src / "task.yaml").write_text(yaml.safe_dump({"descriptions": [
        {"key": "base", "description": "Make the file."},
        {"key": "hard", "description": "Make the file, no hints."}]}))
    draft = read_any(src)
    assert draft.instruction == "Make the file."
    assert draft.config.metadata.free["descriptions"][1]["key"] == "hard"


# --------------------------------------------------------------------------- no solution


def test_missing_solution_is_a_clear_message(tmp_path):
    path = make_task(tmp_path, HARBOR_TOML["1.4"], **{"solution/solve.sh": None})
    (w,) = [w for w in warnings(path) if w.file == "solution/solve.sh"]
    assert "no reference solution" in w.message and "optional in Harbor" in w.fix
    task = load_task(path)
    with pytest.raises(MissingSolution, match="no reference solution") as exc:
        run_solution(object(), task)  # raises before touching the sandbox
    assert isinstance(exc.value, RuntimeError)  # what the image build and check report
    assert str(tmp_path) not in str(exc.value)  # a sentence, not a bare path


def test_export_sets_harbor_baseline_when_only_the_agent_has_a_policy(tmp_path):
    src = make_task(tmp_path, "[agent]\nnetwork_mode = \"no-network\"\n", name="agent-only")
    harbor = write_task(read_any(src), tmp_path / "h", layout="harbor")
    doc = native_dict(harbor.root)
    assert doc["environment"]["network_mode"] == "no-network"  # the verifier's phase too
    back = write_task(read_any(harbor.root), tmp_path / "n")
    assert native_dict(back.root) == native_dict(src)
