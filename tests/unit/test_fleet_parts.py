"""Sandfleet's pure parts, without processes: frames, messages, the fleet config, the
scaling arithmetic, the controller's journal and the Slurm dry run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest
import yaml

from sandfleet.config import FleetConfig, config_file, load_config
from sandfleet.errors import (
    BadRequest,
    NodeLost,
    ProtocolError,
    error_from_dict,
)
from sandfleet.wire.frames import PREFIX, encode_frame, read_frame
from sandfleet.wire.messages import Acquire
from tests.conftest import REPO
from tests.fleet_harness import SANDFLEET


def _frames(*chunks: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    return reader


def test_frames_roundtrip_and_limits_are_checked_before_reading():
    async def go():
        frame = encode_frame({"a": 1}, b"\x00payload")
        assert await read_frame(_frames(frame)) == ({"a": 1}, b"\x00payload")
        assert await read_frame(_frames(b"")) is None
        with pytest.raises(ProtocolError, match="header length"):  # 4 GiB claimed: no read
            await read_frame(_frames(PREFIX.pack(0xFFFFFFFF, 0)))
        with pytest.raises(ProtocolError, match="payload length"):
            await read_frame(_frames(PREFIX.pack(10, 0xFFFFFFFF)), max_payload=1 << 20)
        with pytest.raises(ProtocolError, match="not JSON"):
            await read_frame(_frames(PREFIX.pack(3, 0) + b"{{{"))
        with pytest.raises(ProtocolError, match="object"):
            await read_frame(_frames(PREFIX.pack(2, 0) + b"[]"))
        with pytest.raises(ProtocolError, match="truncated"):
            await read_frame(_frames(PREFIX.pack(50, 0) + b"{}"))

    asyncio.run(go())


def test_messages_are_strict_and_errors_survive_the_wire():
    with pytest.raises(ValueError, match="colour"):
        Acquire(id="x", image="/i.sif", colour="red")
    with pytest.raises(ValueError):
        Acquire(id="", image="/i.sif")
    err = error_from_dict(NodeLost("n1", "gone").to_dict())
    assert isinstance(err, NodeLost) and err.node == "n1" and err.cause == "node_lost"
    assert isinstance(error_from_dict({"error": "BadRequest", "message": "m"}), BadRequest)
    assert isinstance(error_from_dict({"error": "FileNotFoundError", "message": "m"}),
                      FileNotFoundError)
    odd = error_from_dict({"error": "SystemExit", "message": "m"})  # not on any allow-list
    assert type(odd).__name__ == "RemoteError" and "SystemExit" in str(odd)


def test_every_fleet_config_parses_and_unknown_keys_fail(tmp_path):
    config = load_config(REPO / "configs" / "fleet.yaml")
    assert config.provider == "local" and config.max_nodes >= 1
    cluster = load_config(REPO / "configs" / "fleet-slurm.yaml")  # the cluster example
    assert (cluster.provider, cluster.runtime, cluster.host) == ("slurm", "apptainer", "0.0.0.0")
    assert cluster.slurm.partition and cluster.slurm.setup
    for name, field in FleetConfig.model_fields.items():
        assert field.description, f"field {name} has no docstring"
    # shipped configs by name (an installed wheel has no configs/ folder), paths as given
    assert config_file("fleet-slurm") == config_file("fleet-slurm.yaml") == \
        (REPO / "configs" / "fleet-slurm.yaml").resolve()
    assert config_file("fleet-slurm").read_text() == (REPO / "configs" / "fleet-slurm.yaml"
                                                      ).read_text()
    with pytest.raises(FileNotFoundError, match="shipped: fleet, fleet-slurm"):
        config_file("fleet-slurmm")
    bad = tmp_path / "bad.yaml"
    bad.write_text("provider: local\nmax_nodez: 3\n")
    assert config_file(bad) == bad
    with pytest.raises(ValueError, match="max_nodez"):
        load_config(bad)


def test_scaling_arithmetic_and_sbatch_options_are_strict():
    from sandfleet.controller import desired_nodes
    from sandfleet.providers import sbatch_lines, staggered_minutes

    config = FleetConfig(cpus_per_node=8, min_nodes=1, max_nodes=4)
    assert [desired_nodes(q, h, config) for q, h in [(0, 0), (2, 0), (8, 2), (30, 40)]] == \
        [1, 1, 2, 4]
    minutes = [staggered_minutes(config, k) for k in range(5)]
    assert minutes == [240, 235, 230, 225, 240]
    assert sbatch_lines(["--constraint=cpu"], time=10, partition=None) == \
        ["#SBATCH --time=10", "#SBATCH --constraint=cpu"]
    with pytest.raises(ValueError, match="valid: job_name"):
        sbatch_lines(walltime=10)
    with pytest.raises(ValueError):
        sbatch_lines(["--x=1\n#SBATCH --uid=0"])


def test_journal_recovery_skips_a_torn_line_and_compacts(tmp_path):
    from sandfleet.controller import JOURNAL, Controller

    state = tmp_path / "state"
    state.mkdir()
    spec = {"image": "/i.sif", "cpus": 2, "memory_mb": 512, "network": False,
            "max_lifetime_s": 3600.0, "env": {}, "workdir": "/", "hostname": "sandbox"}

    def grant(lease_id: str, worker: str) -> dict:
        return {"e": "grant", "lease_id": lease_id, "request_id": f"a-{lease_id}",
                "client": "c", "worker_id": worker, "node": "n1", "address": "127.0.0.1:1",
                "spec": spec, "cpus": 2, "memory_mb": 512, "ttl_s": 60.0,
                "granted_at": time.time(), "queued_s": 0.1}

    events = [{"e": "job", "job_id": "11", "name": "w4", "index": 4},
              {"e": "node", "worker_id": "w4-x", "name": "w4", "address": "127.0.0.1:1",
               "node": "n1", "slots": 8, "memory_mb": 4096, "job_id": "11", "ends_at": None,
               "registered_at": time.time()},
              grant("L1", "w4-x"), grant("L2", "w4-x"), grant("L3", "gone-worker"),
              {"e": "end", "lease_id": "L2", "cause": "released", "request_id": "a-L2",
               "error": {"error": "LeaseClosed", "message": "lease released"}}]
    text = "".join(json.dumps(e) + "\n" for e in events) + '{"e": "gra'  # torn by a crash
    (state / JOURNAL).write_text(text)
    for _ in range(2):  # recover, then recover again from the compacted journal
        controller = Controller(state, FleetConfig())
        controller.recover()
        reg = controller.reg
        assert set(reg.leases) == {"L1"}
        assert reg.leases["L1"].state == "held"
        assert reg.by_request["a-L1"] == "L1"
        assert reg.ended["L2"]["cause"] == "released"
        assert reg.ended["L3"]["cause"] == "node_lost"  # its worker is unknown
        node = reg.nodes["w4-x"]
        assert (node.used_cpus, node.leases, node.bucket) == (2, {"L1"}, 6)
        assert list(reg.jobs) == ["11"] and reg.next_index == 5
        lines = (state / JOURNAL).read_text().splitlines()
        assert all(json.loads(line) for line in lines)  # the torn line is gone


def test_slurm_dry_run_prints_the_exact_script(tmp_path):
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(yaml.safe_dump({"provider": "slurm", "cpus_per_node": 4,
                                   "slurm": {"partition": "cpu", "account": "proj",
                                             "setup": ["module load apptainer"]}}))
    out = subprocess.run([*SANDFLEET, "up", "--config", str(cfg), "--state-dir",
                          str(tmp_path / "s"), "--dry-run"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    script = out.split("# worker job script (worker w0)\n", 1)[1]
    assert script.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --partition=cpu", "#SBATCH --account=proj",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --time=240", "set -euo pipefail",
                 "module load apptainer", "-m sandfleet.cli -v worker --state-dir"):
        assert line in script, line
    assert not (tmp_path / "s" / "controller.json").exists()  # nothing started




def test_a_worker_registering_stops_only_the_unknown_leases_it_reported(tmp_path):
    """The controller grants leases to a worker as soon as it has registered it; their
    creates can reach the worker before the Register reply, whose ``keep`` names only
    leases the worker reported. Those granted meanwhile are kept (they were stopped as
    unknown: two leases of a fleet lost in CI); a reported one the controller does not
    know is stopped."""
    from sandfleet.wire.messages import LeaseActivity
    from sandfleet.worker import Worker

    class Held:
        def activity(self):
            return LeaseActivity(idle_s=0.0)

    worker = Worker(tmp_path / "state", "w0",
                    FleetConfig(work_dir=str(tmp_path / "work")), runtime=object())
    worker.leases = {"Lknown": Held(), "Lstale": Held()}
    stopped = []

    async def stop(lease_id, reason):
        stopped.append((lease_id, reason))

    worker._stop = stop

    class Conn:
        async def request(self, req, timeout):
            assert set(req.leases) == {"Lknown", "Lstale"}
            worker.leases["Lgranted"] = Held()  # a grant's create, before the reply
            return {"known": True, "keep": ["Lknown"]}, None

    async def go():
        await worker._register(Conn())
        await asyncio.gather(*worker._tasks)

    asyncio.run(go())
    assert stopped == [("Lstale", "the controller does not know its lease")]
    assert set(worker.leases) == {"Lknown", "Lstale", "Lgranted"}  # (stop is the fake)
