"""The run's private fleet: local by default, or on a Slurm CPU partition (fleet.config)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from tests.fleet_harness import FAST
from tmax.fleet import open_fleet, private_fleet_config
from tmax.train.config import FleetSection


def test_fleet_config_is_checked_when_the_run_config_loads(tmp_path):
    with pytest.raises(ValueError, match=r"(?s)fleet.config: .*max_nodez.*Extra inputs"):
        FleetSection(config={"provider": "slurm", "max_nodez": 2})
    with pytest.raises(ValueError, match="set one of them"):
        FleetSection(state_dir="/x", config={"provider": "slurm"})
    yaml_file = tmp_path / "fleet.yaml"
    yaml_file.write_text("provider: slurm\nslurm:\n  partition: cpu\n")
    section = FleetSection(config=str(yaml_file))
    assert section.private_provider() == "slurm"
    assert FleetSection().private_provider() == "local"
    assert FleetSection(state_dir="/x").private_provider() is None
    yaml_file.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="not a mapping of sandfleet config fields"):
        FleetSection(config=str(yaml_file))


def test_a_private_slurm_fleet_keeps_its_own_sizes_and_needs_a_shared_folder():
    data = private_fleet_config(8, cpus=2, config={"provider": "slurm", "max_nodes": 3,
                                                   "cpus_per_node": 16})
    assert (data["max_nodes"], data["cpus_per_node"], data["min_nodes"]) == (3, 16, 0)
    assert data["owner_pid"] > 0  # it goes down with its owner
    local = private_fleet_config(3, cpus=2, memory_mb=1024)
    assert (local["cpus_per_node"], local["memory_mb_per_node"]) == (6, 3072)

    async def go():
        async with open_fleet(None, config={"provider": "slurm"}):
            pass

    with pytest.raises(ValueError, match="needs a state folder its worker jobs can read"):
        asyncio.run(go())


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.slurm
def test_a_private_fleet_on_the_slurm_partition_serves_leases_and_leaves_no_job(
        local_slurm, base_sif, tmp_path):
    config = {**FAST, "provider": "slurm", "cpus_per_node": 2, "memory_mb_per_node": 1024,
              "max_nodes": 1, "idle_s": 3, "work_dir": str(tmp_path / "work"),
              "cache_dir": str(tmp_path / "cache"),
              "slurm": {"time_min": 10, "poll_min_s": 0.5, "poll_max_s": 2.0,
                        "drain_before_s": 0}}
    root = tmp_path / "run" / "fleet"

    def jobs() -> list[str]:
        out = subprocess.run(["squeue", "--me", "-h", "-o", "%i %j"], env=local_slurm.env,
                             capture_output=True, text=True, timeout=30, check=True)
        return [line for line in out.stdout.splitlines() if "sandfleet-" in line]

    before = jobs()

    async def go():
        async with open_fleet(None, config=config, root=root) as fleet, \
                fleet.lease(base_sif, cpus=1, memory_mb=512, wait_s=90) as lease:
            ran = await lease.run("echo from the partition")
            return ran.output, (await fleet.status())["jobs"]

    output, fleet_jobs = asyncio.run(go())
    assert output == "from the partition\n"
    assert len(fleet_jobs) == 1  # its worker was a Slurm job
    deadline = time.monotonic() + 60  # and is gone with the fleet (cancelled, then ends)
    while jobs() != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert jobs() == before
    assert (root / "state").is_dir() and not (root / "state" / "controller.json").exists()


@pytest.mark.sandbox
def test_status_shows_the_runs_own_fleet_and_stop_takes_it_down(tmp_path):
    from tests.fleet_harness import Fleet
    from tmax.train.cli import format_status
    from tmax.train.config import load_train_config, save_config
    from tmax.train.slurm import run_status, stop_run

    run = tmp_path / "run"
    run.mkdir()
    save_config(load_train_config(None, [f"out_dir={tmp_path}"]), run / "config.yaml")
    fleet = Fleet(run / "fleet", tmp_path / "cache", min_nodes=1)
    fleet.up()
    try:
        fleet.wait_for(lambda: fleet.status()["nodes"], 30, "the worker to register")
        (run / "fleet.json").write_text(json.dumps({"state_dir": str(fleet.state),
                                                    "private": True}))
        report = run_status(run)
        assert report["fleet"]["up"] is True and report["fleet"]["nodes"] == 1
        assert "fleet (private)   1 nodes, 0 leases held" in format_status(report)
        said = stop_run(run)
        assert any(line.startswith("fleet down") for line in said), said
        assert run_status(run)["fleet"]["up"] is False
    finally:
        fleet.cli("down", check=False)
