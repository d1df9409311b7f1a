"""The audit's probe sandboxes get the agent's network as the build-time checks and rollouts
do: a Harbor task that says nothing gets the package registries (TB 2.0's kv-store-grpc and
largest-eigenval install with pip at agent time; offline the audit called their reference
solutions broken)."""

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
