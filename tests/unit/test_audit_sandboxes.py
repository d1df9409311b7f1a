"""The audit's probe sandboxes: the agent's network as the build-time checks and rollouts
give it (a Harbor task that says nothing gets the package registries: TB 2.0's kv-store-grpc
and largest-eigenval install with pip at agent time; offline the audit called their
reference solutions broken), and files written in commands the wire takes."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from sandfleet.netproxy import REGISTRY_HOSTS
from tests.unit.test_tasks import make_task
from tmax.audit.probes import ProbeReport, _Probes
from tmax.tasks import load_task


class _Stop(Exception):
    pass


class _Fleet:
    def __init__(self):
        self.kwargs = {}

    @contextlib.asynccontextmanager
    async def lease(self, sif, **kwargs):
        self.kwargs = kwargs
        raise _Stop
        yield


class _Images:
    def user(self, task):
        return ""

    def verifier_user(self, task):
        return ""

    def start_command(self, task):
        return ""


class _Prober:
    settings = None
    images = _Images()

    def __init__(self):
        self.fleet = _Fleet()


@pytest.mark.parametrize("toml, network, hosts", [
    ('version = "1.0"\n', False, REGISTRY_HOSTS),  # Harbor, says nothing: the registries
    ('version = "1.0"\n[environment]\nallow_internet = false\n', False, ()),
    ('[metadata]\ndifficulty = "easy"\ndomain = "file-operations"\n', False, ()),  # native
])
def test_probe_sandboxes_get_the_agents_network_as_the_checks_do(tmp_path, toml, network, hosts):
    task = load_task(make_task(tmp_path, "t", **{"task.toml": toml}))
    prober = _Prober()
    probes = _Probes(prober, task, ProbeReport(task.task_id), tmp_path)

    async def go():
        async with probes.sandbox():
            pass

    with pytest.raises(_Stop):
        asyncio.run(go())
    assert (prober.fleet.kwargs["network"], tuple(prober.fleet.kwargs["allowed_hosts"])) == \
        (network, tuple(hosts))


def test_files_are_written_in_commands_the_wire_takes():
    """The replay and exit-on-import probes write a solution's outputs back; for a solution
    that pip-installs a package (TB 2.0's largest-eigenval: thousands of files) one command
    was over the wire's 1 MiB and the probe crashed."""
    from tmax.audit.probes import WRITE_COMMAND_BYTES, command_chunks

    lines = [f"cat /s/{i} > /app/site/f{i}.py" for i in range(40000)]
    chunks = command_chunks(lines, WRITE_COMMAND_BYTES)
    assert len(" && ".join(lines)) > 1 << 20 and len(chunks) > 4
    assert all(len(c) <= WRITE_COMMAND_BYTES for c in chunks)
    assert " && ".join(chunks) == " && ".join(lines)  # all of them, in order
    assert command_chunks(["x" * 20, "y"], 10) == ["x" * 20, "y"]
    assert command_chunks([], 10) == []
