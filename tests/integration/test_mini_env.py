"""mini-swe-agent 2.x runs its own agent in fleet sandboxes through ``SandfleetEnvironment``.

Everything mini-side is mini's own: its ``DefaultAgent`` and prompts (the builtin
``mini_textbased.yaml``), its ``DeterministicModel`` replaying replies whose bash actions are
fenced the way mini's text-based models expect (parsed by mini's ``parse_regex_actions``),
its ``get_environment`` loading the class by import path, and the real ``mini`` console
script. The fleet side is real too: ``example_fleet`` is a local fleet with bubblewrap
sandboxes from the slim Debian SIF.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output
from minisweagent.models.utils.actions_text import parse_regex_actions

from sandfleet.client import FleetClient
from sandfleet.errors import SandboxLost
from sandfleet.runtime.base import proc_start_time
from tmax.agent.mini import SandfleetEnvironment, SandfleetEnvironmentConfig

pytestmark = pytest.mark.sandbox

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "mini" / "sandfleet.yaml"
MINI = Path(sys.executable).parent / "mini"
ENV_CLASS = "tmax.agent.mini.SandfleetEnvironment"
ACTION_REGEX = r"```mswea_bash_command\s*\n(.*?)\n```"  # LitellmTextbasedModelConfig's
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def reply(command: str) -> dict:
    """A model reply as a text-based mini model gets it, with its action parsed by mini."""
    content = f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"
    actions = parse_regex_actions(content, action_regex=ACTION_REGEX,
                                  format_error_template="{{error}}")
    return make_output(content, actions, cost=0.0)


def scripted(*commands: str) -> DeterministicModel:
    return DeterministicModel(outputs=[reply(c) for c in commands], cost_per_call=0.0)


def mini_agent(model, env, tmp_path: Path) -> DefaultAgent:
    """mini's DefaultAgent with mini's own text-based prompts (they need the env's uname)."""
    config = get_config_from_spec("mini_textbased.yaml")["agent"]
    config.pop("mode", None)  # InteractiveAgent's key
    return DefaultAgent(model, env, **config, output_path=tmp_path / "traj.json")


def observations(agent: DefaultAgent) -> list[dict]:
    """The extras of the observation messages (mini copies execute()'s dict into them)."""
    return [m["extra"] for m in agent.messages
            if m["role"] == "user" and "returncode" in m.get("extra", {})]


def held(state: Path) -> int:
    with FleetClient(state) as client:
        return client.status()["leases"]["held"]


@pytest.fixture
def make_env(example_fleet, base_sif):
    """Environments built by mini's ``get_environment`` from an import path; closed after."""
    made: list[SandfleetEnvironment] = []

    def make(**overrides):
        config = {"environment_class": ENV_CLASS, "state_dir": str(example_fleet.state),
                  "image": str(base_sif), **overrides}
        made.append(get_environment(config))
        return made[-1]

    yield make
    for env in made:
        env.close()


@pytest.mark.slow
def test_state_persists_and_the_submission_is_what_mini_reports(make_env, tmp_path):
    note = f"/tmp/note-{uuid.uuid4().hex}"
    env = make_env(cwd="/tmp", env={"GREETING": "hello from the fleet"})
    model = scripted(f'echo "$GREETING" > {note}; cd /root', f"cat {note}; pwd",
                     f"{SUBMIT} && cat {note}")
    agent = mini_agent(model, env, tmp_path)

    result = agent.run("write a note, read it back, submit it")

    assert result == {"exit_status": "Submitted", "submission": "hello from the fleet\n"}
    first, second = observations(agent)
    assert first["returncode"] == 0
    assert second["raw_output"] == "hello from the fleet\n/root\n"  # file and cd persisted
    assert not Path(note).exists()  # it was written in the sandbox, not here
    saved = json.loads((tmp_path / "traj.json").read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    assert saved["info"]["submission"] == "hello from the fleet\n"
    assert saved["info"]["config"]["environment_type"] == ENV_CLASS
    assert saved["info"]["sandfleet"]["lease_id"] == env.lease.lease_id


@pytest.mark.slow
def test_a_timeout_is_reported_as_mini_does_and_the_shell_survives(make_env, tmp_path):
    env = make_env(timeout=2)
    model = scripted("export MARK=kept; cd /tmp", "echo started; sleep 60",
                     'echo "$MARK $(pwd)"', SUBMIT)
    agent = mini_agent(model, env, tmp_path)

    start = time.monotonic()
    result = agent.run("time out once")
    elapsed = time.monotonic() - start

    assert result["exit_status"] == "Submitted"
    _, timed_out, after = observations(agent)
    assert timed_out["returncode"] == -1
    assert timed_out["exception_type"] == "TimeoutExpired"
    assert timed_out["exception_info"] == ("An error occurred while executing the command: "
                                           "Command 'echo started; sleep 60' timed out after "
                                           "2 seconds")
    assert timed_out["raw_output"].startswith("started\n")  # the output so far
    shown = next(m["content"] for m in agent.messages if "timed out after" in m["content"])
    assert "<exception>" in shown  # mini_textbased.yaml's observation template shows it
    assert after["returncode"] == 0 and after["raw_output"] == "kept /tmp\n"
    assert elapsed < 20, f"the timed-out command held the agent for {elapsed:.1f}s"


@pytest.mark.slow
def test_get_environment_builds_it_from_the_import_path(make_env, example_fleet, base_sif):
    env = make_env(cpus=1, memory_mb=512, lease_ttl_s=20)
    assert type(env) is SandfleetEnvironment
    assert env.config == SandfleetEnvironmentConfig(
        state_dir=str(example_fleet.state), image=str(base_sif), cpus=1, memory_mb=512,
        lease_ttl_s=20)
    assert env.lease.ttl_s == 20  # the deadline if this process dies
    assert env.execute({"command": "nproc"})["output"] == "1\n"
    assert env.execute({"command": "pwd"}, cwd="/usr")["output"] == "/usr\n"
    assert env.execute({"command": "echo no"}, cwd="/nowhere")["returncode"] != 0
    assert env.execute("pwd")["output"] == "/usr\n"  # the shell stays where it was moved
    assert env.execute("sleep 30", timeout=1)["exception_info"].endswith("after 1 seconds")
    template_vars = env.get_template_vars(task="t")
    assert template_vars["system"] == "Linux" and template_vars["task"] == "t"
    assert template_vars["image"] == str(base_sif)
    with pytest.raises(ValueError, match="Unknown environment type"):
        get_environment({"environment_class": "tmax.agent.mini.NoSuchEnvironment"})
    with pytest.raises(ValueError, match="extra_forbidden|Extra inputs"):
        make_env(timout=5)  # a typo is an error, not a default


@pytest.mark.slow
def test_the_lease_is_released_after_the_run(make_env, example_fleet, tmp_path):
    before = held(example_fleet.state)
    env = make_env()
    assert held(example_fleet.state) == before + 1
    assert mini_agent(scripted(SUBMIT), env, tmp_path).run("submit")["exit_status"] == \
        "Submitted"
    env.close()
    assert held(example_fleet.state) == before
    env.close()  # idempotent
    with SandfleetEnvironment(state_dir=str(example_fleet.state),
                              image=env.config.image) as scoped:
        assert held(example_fleet.state) == before + 1
        assert scoped.execute("echo in")["output"] == "in\n"
    assert held(example_fleet.state) == before


@pytest.mark.slow
def test_an_infra_failure_ends_the_run_instead_of_becoming_an_observation(
        make_env, example_fleet, tmp_path):
    env = make_env()
    env.get_template_vars()  # uname asked while the sandbox lives
    record = next(example_fleet.work.glob(f"*/*/runtime/sandboxes/*-{env.lease.lease_id}"))
    init_pid = json.loads((record / "sandbox.json").read_text())["init"][0]
    os.kill(init_pid, signal.SIGKILL)  # the sandbox this test leased dies under its lease
    deadline = time.monotonic() + 10
    while proc_start_time(init_pid) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    agent = mini_agent(scripted("echo never", SUBMIT), env, tmp_path)

    with pytest.raises(SandboxLost):
        agent.run("this episode is the fleet's failure, not the agent's")

    assert observations(agent) == []  # the model never saw the failure as output
    assert agent.messages[-1]["extra"]["exit_status"] == "SandboxLost"
    saved = json.loads((tmp_path / "traj.json").read_text())
    assert saved["info"]["exit_status"] == "SandboxLost"


def test_the_shipped_example_config_selects_this_environment():
    environment = get_config_from_spec(str(EXAMPLE))["environment"]
    assert environment.pop("environment_class") == ENV_CLASS
    SandfleetEnvironmentConfig(**environment)  # every key is a known field


@pytest.mark.slow
def test_the_mini_cli_runs_offline_in_the_fleet(example_fleet, base_sif, tmp_path):
    """The real ``mini`` script: the shipped example config, a scripted model from a config
    file, yolo mode, no exit prompt; the lease is released when ``mini`` exits."""
    before = held(example_fleet.state)
    model = {"model": {"model_class": "deterministic", "model_name": "scripted",
                       "cost_per_call": 0.0,
                       "outputs": [reply("echo sandboxed > /tmp/cli; uname -s"),
                                   reply("cat /tmp/cli"), reply(SUBMIT)]}}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    traj = tmp_path / "mini.traj.json"
    env = {**os.environ, "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1",
           "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mini-config"), "MSWEA_MODEL_NAME": ""}
    run = subprocess.run(
        [str(MINI), "-c", "mini.yaml", "-c", str(EXAMPLE),
         "-c", f"environment.state_dir={example_fleet.state}",
         "-c", f"environment.image={base_sif}", "-c", str(tmp_path / "model.yaml"),
         "-y", "--exit-immediately", "-t", "say where you are", "-o", str(traj)],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
        cwd=tmp_path, check=False)

    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    saved = json.loads(traj.read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    assert saved["info"]["config"]["environment_type"] == ENV_CLASS
    outputs = [m["extra"]["raw_output"] for m in saved["messages"]
               if m["role"] == "user" and "raw_output" in m.get("extra", {})]
    assert outputs == ["Linux\n", "sandboxed\n"]
    assert held(example_fleet.state) == before  # released at exit, not left to the TTL
