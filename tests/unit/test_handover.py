"""The file handover between the orchestrator and the trainer processes."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

from tmax.train.handover import Handover, HandoverError, HandoverTimeout, PeerGone
from tmax.train.trainer import Sample

SAMPLES = [Sample([5, 6, 7], [0.0, -0.5, -1.25], [0, 1, 1], 0.75),
           Sample([9], [0.0], [0], -0.25),
           Sample([1, 2, 3, 4, 5], [0.0, 0.0, -2.0, -0.125, -3.5], [0, 0, 1, 1, 1], 0.0)]


def test_a_batch_round_trips_exactly(tmp_path):
    h = Handover(tmp_path)
    path = h.put_batch(42, SAMPLES, [40, 41, 42], {"reward_mean": 0.5})
    assert path == tmp_path / "handover" / "batches" / "step-00000042.npz"
    batch = h.get_batch(42, timeout=0)
    assert (batch.step, batch.samples, batch.versions, batch.meta) == \
        (42, SAMPLES, [40, 41, 42], {"reward_mean": 0.5})
    assert sorted(p.name for p in h.batches.iterdir()) == ["step-00000042.npz"]
    h.put_batch(43, SAMPLES[:1], [43])
    h.drop_batches_before(43)
    assert sorted(p.name for p in h.batches.iterdir()) == ["step-00000043.npz"]


def test_bad_batches_are_refused_before_anything_is_written(tmp_path):
    h = Handover(tmp_path)
    with pytest.raises(ValueError, match="3 samples but 2 versions"):
        h.put_batch(0, SAMPLES, [0, 0])
    with pytest.raises(ValueError, match="sample 0: tokens, old_logp and mask"):
        h.put_batch(0, [Sample([1, 2], [0.0], [0, 1], 1.0)], [0])
    assert list(h.batches.iterdir()) == []


def test_an_unreadable_or_misnamed_batch_names_the_file(tmp_path):
    h = Handover(tmp_path)
    h.batch_path(3).write_bytes(b"not a batch")
    with pytest.raises(HandoverError, match=r"step-00000003.npz: not a readable batch"):
        h.read_batch(3)
    h.put_batch(4, SAMPLES, [0, 0, 0])
    h.batch_path(4).rename(h.batch_path(5))
    with pytest.raises(HandoverError, match="expected tmax-batch-v1 for step 5, found "
                       "'tmax-batch-v1' for step 4"):
        h.read_batch(5)


def test_waiting_is_bounded_and_stops_when_the_writer_is_gone(tmp_path):
    h = Handover(tmp_path)
    with pytest.raises(HandoverTimeout, match=r"step-00000001.npz: not there after 0 s"):
        h.get_batch(1, timeout=0.05, poll=0.01)
    with pytest.raises(PeerGone, match="the process that writes it is gone"):
        h.get_batch(1, timeout=60, poll=0.01, alive=lambda: False)
    with pytest.raises(HandoverTimeout, match="v00000003"):
        h.wait_weights(3, timeout=0.05, poll=0.01)


def test_a_batch_written_while_the_trainer_waits_arrives(tmp_path):
    h = Handover(tmp_path)
    writer = threading.Timer(0.1, h.put_batch, args=(7, SAMPLES, [7, 7, 7]))
    writer.start()
    assert h.get_batch(7, timeout=30, poll=0.01).samples == SAMPLES
    writer.join()


class Saves:
    """What ``write_weights_folder`` asks of a model: ``save_pretrained`` (this one writes
    ``data``, or dies halfway like a trainer killed mid-export)."""

    def __init__(self, data: bytes, die: bool = False):
        self.data, self.die = data, die

    def save_pretrained(self, folder, state_dict=None, safe_serialization=True):
        (folder / "model.safetensors").write_bytes(self.data)
        if self.die:
            raise RuntimeError("trainer died mid-export")


def test_weights_appear_whole_or_not_at_all(tmp_path):
    """The trainer's exporter writes v<N> whole (temporary name, then rename); LATEST
    names only complete folders, the newest one."""
    from tmax.train.backends import write_weights_folder

    h = Handover(tmp_path)

    def publish(version, model):
        h.set_latest(version, write_weights_folder(model, None, h.weights, version))

    assert h.latest_weights() is None
    publish(1, Saves(b"one"))
    with pytest.raises(RuntimeError, match="mid-export"):
        publish(2, Saves(b"half", die=True))
    assert h.latest_weights() == (1, h.weights_path(1))
    assert sorted(p.name for p in h.weights.iterdir()) == ["LATEST", "v00000001"]
    with pytest.raises(HandoverError, match="no such weights folder"):
        h.set_latest(2)
    publish(2, Saves(b"two"))
    publish(2, Saves(b"two again"))
    version, path = h.wait_weights(2, timeout=0)
    assert (version, (path / "model.safetensors").read_bytes()) == (2, b"two again")
    publish(3, Saves(b"three"))
    h.prune_weights(keep=2)
    assert sorted(p.name for p in h.weights.iterdir()) == ["LATEST", "v00000002", "v00000003"]
    assert h.wait_weights(2, timeout=0)[0] == 3  # the newest, not the one asked for


def _rewrite(run_dir, n):
    h = Handover(run_dir)
    rng = np.random.default_rng(0)
    for i in range(n):
        k = int(rng.integers(1, 400))
        h.put_batch(0, [Sample(list(range(k)), [0.0] * k, [1] * k, float(i))], [i])


def test_a_reader_never_sees_half_a_batch(tmp_path):
    """A writer process rewrites the same step's batch over and over (sizes vary); every
    read in the meantime is a whole, consistent batch."""
    h = Handover(tmp_path)
    h.put_batch(0, SAMPLES, [0, 0, 0])
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(target=_rewrite, args=(tmp_path, 300))
    writer.start()
    reads = 0
    while writer.is_alive() or reads == 0:
        batch = h.read_batch(0)
        for s in batch.samples:
            assert len(s.tokens) == len(s.old_logp) == len(s.mask)
        reads += 1
    writer.join()
    assert writer.exitcode == 0 and reads > 0
    assert [p.name for p in h.batches.iterdir()] == ["step-00000000.npz"]


def test_heartbeats_show_who_is_alive_and_done(tmp_path):
    from tmax.train.handover import Heartbeat, alive, is_done, mark_done

    h = Handover(tmp_path)
    assert not alive(h, "trainer-0")
    with Heartbeat(h, "trainer-0", every_s=0.01):
        assert alive(h, "trainer-0") and not alive(h, "orchestrator")
        path = h.root / "alive" / "trainer-0"
        os.utime(path, (0, 0))  # as if it stopped beating long ago ...
        assert not alive(h, "trainer-0", stale_s=60)
        deadline = time.monotonic() + 30
        while not alive(h, "trainer-0") and time.monotonic() < deadline:
            time.sleep(0.01)  # ... until the next beat
        assert alive(h, "trainer-0")
    assert not alive(h, "trainer-0")  # a clean exit removes it
    assert not is_done(h, "trainer")
    mark_done(h, "trainer")
    assert is_done(h, "trainer")


def test_concurrent_writers_of_one_file_in_one_process_never_collide(tmp_path):
    """The orchestrator's weight follower and its last step both write engines.json from
    threads of one process (asyncio.to_thread): each writer needs its own temporary file
    (one per process raced in CI: FileNotFoundError at os.replace)."""
    hand = Handover(tmp_path / "run")
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(150):
                hand.put_engines([{"engine": k, "version": i}])
        except BaseException as e:  # noqa: BLE001 (collected for the assertion)
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    (last,) = hand.engines()
    assert last["version"] == 149  # the file holds one writer's whole last write
    assert [p.name for p in (tmp_path / "run").rglob("*.tmp")] == []
