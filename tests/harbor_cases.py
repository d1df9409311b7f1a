"""Harbor task.toml texts and helpers for the Harbor tests (test_harbor_schema.py,
test_harbor_export.py, test_harbor_examples.py): one file per published schema version,
tasks made from them, and Harbor's own rules for a task directory (``harbor_problems``) and
for the agent's network (``harbor_network``), checked without Harbor installed.

The task.toml texts follow real ones from public Harbor datasets (Terminal-Bench 2's
registry export, Harbor's task template, TB-2.1-style tasks) and Harbor's models
(harbor/models/task/config.py in the harbor 0.1.45 ... 0.26.0 packages).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tmax.tasks import load_task, validate_task
from tmax.tasks.config import TaskConfig

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


def native_dict(task_dir: Path) -> dict:
    return tomllib.loads((task_dir / "task.toml").read_text())


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

