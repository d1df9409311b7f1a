"""Run tracking: TensorBoard and W&B (offline) for real, provenance in run.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tmax.train.tracking import (
    TrackingError,
    TrackingSection,
    open_trackers,
    scalars,
    wandb_run_id,
    write_run_info,
)

REPO = Path(__file__).resolve().parents[2]


def test_only_numbers_are_tracked_and_sections_are_strict():
    assert scalars({"reward_mean": 0.5, "step": 3, "ok": True, "name": "x"}) == \
        {"reward_mean": 0.5, "step": 3.0}
    with pytest.raises(ValueError, match="tensorbord"):
        TrackingSection.model_validate({"tensorbord": True})
    assert open_trackers(TrackingSection(), Path("/nonexistent"), {}).trackers == []


def test_run_json_records_the_commit_and_each_launch(tmp_path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    write_run_info(tmp_path, "embedded")
    write_run_info(tmp_path, "slurm")
    launches = json.loads((tmp_path / "run.json").read_text())["launches"]
    assert [launch["launcher"] for launch in launches] == ["embedded", "slurm"]
    assert launches[0]["git"]["commit"] == head
    assert isinstance(launches[0]["git"]["dirty"], bool)
    assert launches[0]["python"] == ".".join(map(str, sys.version_info[:3]))


def test_a_missing_tracker_package_is_named_before_the_run(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(TrackingError, match="tracking.wandb needs the wandb package"):
        open_trackers(TrackingSection.model_validate({"wandb": {"enabled": True}}), tmp_path,
                      {})


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path, caplog):
    from tmax.train.tracking import Trackers

    class Broken:
        def log(self, metrics, step):
            raise OSError("disk full")

        def close(self):
            pass

    class Keep:
        def __init__(self):
            self.seen = []

        def log(self, metrics, step):
            self.seen.append(step)

        def close(self):
            pass

    keep = Keep()
    trackers = Trackers([("broken", Broken()), ("keep", keep)])
    trackers.log({"a": 1}, 1)
    trackers.log({"a": 2}, 2)
    assert keep.seen == [1, 2] and [n for n, _ in trackers.trackers] == ["keep"]
    assert "tracking: broken failed (disk full)" in caplog.text


def test_tensorboard_gets_the_step_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = open_trackers(TrackingSection(tensorboard=True), tmp_path, {})
    trackers.log({"reward_mean": 0.25, "note": "x"}, 1)
    trackers.log({"reward_mean": 0.75}, 2)
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]


def test_wandb_offline_logs_without_a_network_and_a_resume_keeps_the_run(tmp_path,
                                                                        monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    section = TrackingSection.model_validate({"wandb": {"enabled": True, "project": "t"}})
    for step in (1, 2):  # two launches of the same run folder
        trackers = open_trackers(section, tmp_path, {"steps": 2})
        trackers.log({"reward_mean": step / 4}, step)
        trackers.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.endswith(wandb_run_id(tmp_path)) for r in runs)
    assert all(list(r.glob("*.wandb")) for r in runs)
