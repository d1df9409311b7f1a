"""The Dockerfile's final USER (or Harbor's ``[agent] user``): the agent's commands and the
reference solution run as that user, as in Docker, without root's powers over the image's
root-only files; so does the verifier (or as Harbor's ``[verifier] user``), as Harbor runs
it, and git trusts the repositories the user owns. A root agent could read what such a task
guards (a real task: purple29th-tbench-2's git-bisect-flaky-test keeps its answers in a
root-only folder, which its verifier reads through a set-user-ID helper of the image: such
a helper works for the verifier, as under Docker). Unlike Docker, a setuid program does not
raise the agent's privileges: the sandbox's mounts are nosuid (bubblewrap's).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sandfleet.client import AsyncFleetClient
from tests.conftest import checked_build, passing_checks_log
from tests.unit.test_tasks import make_task
from tmax.tasks import TaskError, load_task

DOCKERFILE = """\
FROM python:3.11-slim
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends git >/dev/null
RUN useradd -m -u 1000 agent && mkdir -p /app /var/lib/answers \\
    && echo 42 > /var/lib/answers/secret && chmod 700 /var/lib/answers \\
    && chown agent:agent /app
WORKDIR /app
USER agent
RUN git init -q /app/repo && git -C /app/repo -c user.name=a -c user.email=a@example.org \\
    commit -q --allow-empty -m first
"""
SOLVE = """\
#!/bin/bash
id -un > /app/who
cat /var/lib/answers/secret > /app/direct 2>/dev/null || echo denied > /app/direct
echo 42 > /app/answer.txt
"""
TEST_SH = """\
#!/bin/bash
mkdir -p /logs/verifier
ok=1
[ "$(id -un)" = agent ] || ok=0  # the verifier too runs as the image's USER
cat /var/lib/answers/secret >/dev/null 2>&1 && ok=0  # with that user's powers
[ "$(cat /app/who 2>/dev/null)" = agent ] || ok=0
[ "$(stat -c %U /app/answer.txt 2>/dev/null)" = agent ] || ok=0
[ "$(cat /app/direct 2>/dev/null)" = denied ] || ok=0
[ "$(cat /app/answer.txt 2>/dev/null)" = 42 ] || ok=0
git -C /app/repo rev-parse HEAD || ok=0  # the agent's repository: git trusts it
echo $ok > /logs/verifier/reward.txt
"""


def user_task(root: Path, name: str = "as-agent", **overrides) -> Path:
    return make_task(root, name, **{"environment/Dockerfile": DOCKERFILE,
                                    "tests/test.sh": TEST_SH, "solution/solve.sh": SOLVE}
                     | overrides)


def test_the_user_is_the_dockerfiles_final_user_unless_the_agent_section_names_one(tmp_path):
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.store import ImageStore

    builds = ImageBuilds(ImageStore(tmp_path / "store"), LocalBuilder(tmp_path / "cache"))
    assert builds.plan(load_task(user_task(tmp_path))).user == "agent"
    toml = '[metadata]\ndifficulty = "easy"\n[agent]\nuser = {}\n'
    for given, user in (('"nobody"', "nobody"), ("1000", "1000"), ('"root"', "")):
        task = load_task(user_task(tmp_path, f"given-{user or 'root'}",
                                   **{"task.toml": toml.format(given)}))
        assert builds.plan(task).user == user
        assert "agent.user" not in {w.field for w in task.warnings}
    plain = load_task(make_task(tmp_path, "plain"))
    assert builds.plan(plain).user == ""


def test_the_verifier_runs_as_the_final_user_unless_the_verifier_section_names_one(tmp_path):
    """As Harbor: [verifier] user, else the image's USER (``docker exec`` without -u); the
    [agent] user does not count. Checks made for another verifier user are not reused."""
    from tmax.images.build import ImageBuilds, checks_inputs
    from tmax.images.builders import LocalBuilder
    from tmax.images.store import ImageStore

    builds = ImageBuilds(ImageStore(tmp_path / "store"), LocalBuilder(tmp_path / "cache"))
    task = load_task(user_task(tmp_path))
    assert builds.plan(task).verifier_user() == "agent"
    toml = '[metadata]\ndifficulty = "easy"\n[verifier]\nuser = {}\n[agent]\nuser = "root"\n'
    for given, user in (('"nobody"', "nobody"), ("1000", "1000"), ('"root"', ""),
                        ('"0:0"', "")):
        named = load_task(user_task(tmp_path, f"v-{given.strip(chr(34))}",
                                    **{"task.toml": toml.format(given)}))
        assert (builds.plan(named).verifier_user(), builds.plan(named).user) == (user, "")
        assert "verifier.user" not in {w.field for w in named.warnings}
    assert builds.plan(load_task(make_task(tmp_path, "plain"))).verifier_user() == ""
    for section in ("agent", "verifier"):
        bad = user_task(tmp_path, f"bad-{section}", **{"task.toml": (
            f'[metadata]\ndifficulty = "easy"\n[{section}]\nuser = "the grader"\n')})
        with pytest.raises(TaskError, match=f"{section}.user.*Docker's USER"):
            load_task(bad)
    assert checks_inputs(task, "agent") != checks_inputs(task) == checks_inputs(task, "")


@pytest.fixture(scope="module")
def user_store(tmp_path_factory, base_store):
    return checked_build(tmp_path_factory.mktemp("user"), base_store, user_task)


@pytest.mark.sandbox
def test_the_checks_run_the_solution_and_the_verifier_as_the_user(user_store):
    passing_checks_log(*user_store)  # the oracle's files say who wrote them (TEST_SH)


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_rollouts_agent_runs_as_the_user(user_store, example_fleet):
    from tmax.agent.config import AgentConfig
    from tmax.agent.policies.simple import ScriptedPolicy
    from tmax.rollout.run import TaskImages, rollout

    store, task, result = user_store
    assert result.status == "built", result.error

    def run(commands: list[str]):
        async def go():
            async with AsyncFleetClient(example_fleet.state) as client:
                return await rollout(task, ScriptedPolicy(commands), client,
                                     TaskImages(store.root), AgentConfig())
        return asyncio.run(go())

    solved = run(SOLVE.splitlines()[1:])
    assert (solved.reward, solved.verifier_error, solved.infra_failure) == (1.0, None, None), \
        solved.verifier_output
    # as the user, the agent can neither read the root-only answer nor open its folder up
    tried = run([("cat /var/lib/answers/secret > /app/answer.txt; echo agent > /app/who; "
                  "echo denied > /app/direct; chmod 777 /var/lib/answers")])
    assert (tried.reward, tried.verifier_error) == (0.0, None), tried.verifier_output
    said = "\n".join(str(m.get("content", "")) for m in tried.messages)
    assert "Permission denied" in said or "Operation not permitted" in said, said[-2000:]
