"""Harbor's task.toml, schema versions 1.0 to 1.4, read as Harbor reads it; TMax's own keys
strict; bad keys and values are errors or warnings naming the field. The task.toml texts and
Harbor's rules are in harbor_cases.py; writing back and ``convert --to harbor`` in
test_harbor_export.py."""

from __future__ import annotations

import re
import tomllib

import pytest
import tomli_w
from click.testing import CliRunner

from tests.harbor_cases import (
    HARBOR_TOML,
    WILD_V2,
    config,
    env_toml,
    errors,
    make_task,
    warnings,
)
from tmax.cli import main
from tmax.tasks import TaskError, load_task, validate_task
from tmax.tasks.config_tables import SCHEMA_VERSIONS, size_to_mb

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
    # a step with no steps/one/instruction.md (tests/integration/test_multi_step.py runs real ones)
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

