"""A Dockerfile's ENTRYPOINT runs when a sandbox of its image starts, as in Harbor (whose
containers run it with ``sh -c "sleep infinity"`` as the command): services it starts in the
background serve the agent and the verifier, and what it writes (/etc/hosts) is there.
test.sh gets the image's ENV, as ``docker exec`` gives it (here the service's URL)."""

from __future__ import annotations

import asyncio

import pytest

from sandfleet.client import AsyncFleetClient
from tests.conftest import checked_build, passing_checks_log
from tests.unit.test_tasks import make_task
from tmax.tasks import load_task

ENTRYPOINT_SH = """\
#!/bin/bash
set -euo pipefail
echo "127.0.0.1 service.test" >> /etc/hosts
mkdir -p /srv/www && echo "$RANDOM$RANDOM" > /srv/www/token.txt
python3 -m http.server 8123 --bind 127.0.0.1 --directory /srv/www >/dev/null 2>&1 &
exec "$@"
"""
DOCKERFILE = """\
FROM python:3.11-slim
COPY entrypoint.sh /entrypoint.sh
RUN chmod +x /entrypoint.sh
WORKDIR /app
ENV TOKEN_URL=http://service.test:8123/token.txt
ENTRYPOINT ["/entrypoint.sh"]
CMD ["bash"]
"""
FETCH = ("import os, sys, time, urllib.request\n"
         "for _ in range(50):\n"
         "    try:\n"
         "        print(urllib.request.urlopen(os.environ['TOKEN_URL'], timeout=2)"
         ".read().decode().strip()); sys.exit(0)\n"
         "    except (OSError, KeyError):\n"
         "        time.sleep(0.2)\n"
         "sys.exit(1)\n")
TEST_SH = f"""\
#!/bin/bash
mkdir -p /logs/verifier
token=$(python3 - <<'PY'
{FETCH}PY
)
[ -n "$token" ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "$token" ] && r=1 || r=0
echo $r > /logs/verifier/reward.txt
"""
SOLVE_COMMAND = f"python3 - > /app/answer.txt <<'PY'\n{FETCH}PY"


@pytest.fixture(scope="module")
def service_store(tmp_path_factory, base_store):
    return checked_build(tmp_path_factory.mktemp("entrypoint"), base_store,
                         lambda tasks: make_task(tasks, "service", **{
                             "environment/Dockerfile": DOCKERFILE,
                             "environment/entrypoint.sh": ENTRYPOINT_SH,
                             "tests/test.sh": TEST_SH,
                             "solution/solve.sh": f"#!/bin/bash\n{SOLVE_COMMAND}\n"}))


@pytest.mark.sandbox
def test_the_checks_start_the_entrypoints_service(service_store):
    log = passing_checks_log(*service_store)
    assert "exec setsid /entrypoint.sh sh -c 'sleep infinity'" in log


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_rollouts_sandbox_runs_the_entrypoint_before_the_agent(service_store,
                                                                 example_fleet):
    from tmax.agent.config import AgentConfig
    from tmax.agent.policies.simple import ScriptedPolicy
    from tmax.rollout.run import TaskImages, rollout

    store, task, result = service_store
    assert result.status == "built", result.error

    async def go():
        async with AsyncFleetClient(example_fleet.state) as client:
            return await rollout(task, ScriptedPolicy([SOLVE_COMMAND]), client,
                                 TaskImages(store.root), AgentConfig())

    traj = asyncio.run(go())
    assert (traj.reward, traj.verifier_error, traj.infra_failure) == (1.0, None, None), \
        traj.verifier_output


def test_the_environment_probe_is_read_as_data():
    import base64

    from tmax.tasks.environment import parse_probe

    raw = b"A=1\0PWD=/x\0LD_PRELOAD=/app/evil.so\0B=x=y\0MULTI=line1\nline2\0"
    assert parse_probe(base64.b64encode(raw).decode()) == {
        "A": "1", "B": "x=y", "MULTI": "line1\nline2"}
    assert parse_probe("bash: base64: command not found") == {}


def test_the_verifier_env_adds_gits_trust_after_the_images_own_settings():
    from tmax.tasks.environment import verifier_env

    env = verifier_env({"A": "1", "PATH": "/image", "GIT_CONFIG_COUNT": "1",
                        "GIT_CONFIG_KEY_0": "core.pager", "GIT_CONFIG_VALUE_0": "cat"},
                       "/usr/bin", {"A": "task"})
    assert env == {"A": "task", "PATH": "/usr/bin", "GIT_CONFIG_COUNT": "2",
                   "GIT_CONFIG_KEY_0": "core.pager", "GIT_CONFIG_VALUE_0": "cat",
                   "GIT_CONFIG_KEY_1": "safe.directory", "GIT_CONFIG_VALUE_1": "*"}
    assert verifier_env({}, "/bin", {})["GIT_CONFIG_KEY_0"] == "safe.directory"


def test_a_tasks_environment_never_runs_on_the_host(tmp_path):
    """An ENV name that is shell code is refused; a container.def's %environment is
    evaluated in the host check's sandbox, not on the host."""
    from tmax.tasks.check import check_task
    from tmax.tasks.dockerfile import DockerfileError, parse

    marker = tmp_path / "ran-on-the-host"
    with pytest.raises(DockerfileError, match="not a variable name"):
        parse(f'FROM d\nENV "x;touch {marker};y"=1\n')
    task = make_task(tmp_path, "def-env", **{
        "environment/Dockerfile": None,
        "environment/container.def": "Bootstrap: docker\nFrom: python:3.11-slim\n\n"
                                     f"%environment\n    touch {marker}\n"
                                     "    export ANSWER=42\n",
        "solution/solve.sh": "#!/bin/bash\necho $ANSWER > /app/answer.txt\n"})
    result = check_task(load_task(task))
    assert not marker.exists()
    assert result.reward == 1.0, result.error or result.log[-2000:]
