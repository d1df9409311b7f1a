"""EnginePool: several real inference servers (hf-server, in-thread) as one policy."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.unit.test_tasks import EXAMPLES
from tmax.agent.policies.hf import HFPolicy
from tmax.agent.policy import PolicyUnavailable
from tmax.inference.base import WeightSyncError, write_weights
from tmax.inference.hf_server import HFServer
from tmax.inference.http import HttpEngine
from tmax.models.tiny import build_tiny_model, build_tokenizer, corpus_texts, save_pretrained_dir
from tmax.tasks import find_tasks
from tmax.train.engines import EnginePool

CHAT = [{"role": "user", "content": "List /app."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(corpus_texts(find_tasks(EXAMPLES)))
    model = build_tiny_model(tokenizer, n_layers=1, d_model=32, n_heads=2, seed=0)
    return save_pretrained_dir(model, tokenizer, tmp_path_factory.mktemp("m") / "tiny")


class Served:
    """Real hf-servers in threads, each stopped exactly once."""

    def __init__(self, model_dir, n: int):
        self.servers = [HFServer(HFPolicy.from_pretrained(
            model_dir, max_new_tokens=4, temperature=1.0, seed=1), model_name="tiny").start()
            for _ in range(n)]
        self.stopped: set[int] = set()

    def stop(self, i: int) -> None:
        if i not in self.stopped:
            self.stopped.add(i)
            self.servers[i].stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for i in range(len(self.servers)):
            self.stop(i)


def engine(server) -> HttpEngine:
    return HttpEngine(server.url, "tiny", max_retries=1, backoff_s=0.01, name=server.url)


def test_turns_spread_over_engines_and_a_dead_one_is_an_infra_failure(model_dir):
    lost = []
    with Served(model_dir, 2) as served:
        ea, eb = (engine(s) for s in served.servers)
        pool = EnginePool([ea, eb], on_lost=lost.append)

        async def go():
            done = await asyncio.gather(*(pool.complete(CHAT) for _ in range(6)))
            assert all(c.completion_ids and c.policy_version == 0 for c in done)
            assert pool.served[id(ea)] > 0 and pool.served[id(eb)] > 0
            served.stop(1)  # the server is gone
            pool.in_flight[id(ea)] = 1     # route the next turn to the dead one
            with pytest.raises(PolicyUnavailable):
                await pool.complete(CHAT)
            pool.in_flight[id(ea)] = 0
            assert (pool.live, pool.lost, lost) == ([ea], [eb], [eb])
            described = pool.describe()  # what `tmax-train status` shows of each engine
            assert [(d["name"], d["version"], d["live"]) for d in described] == [
                (ea.name, 0, True), (eb.name, 0, False)]
            assert [d["served"] for d in described] == [pool.served[id(ea)],
                                                        pool.served[id(eb)]]
            after = await asyncio.gather(*(pool.complete(CHAT) for _ in range(3)))
            assert all(c.completion_ids for c in after)
            served.stop(0)
            with pytest.raises(PolicyUnavailable):
                await pool.complete(CHAT)
            with pytest.raises(PolicyUnavailable, match="no inference engine is up"):
                await pool.complete(CHAT)
            # with a replacement on its way, a new turn waits for it instead of failing
            pool.wait_for_engine_s = 60
            with Served(model_dir, 1) as again:
                waiting = asyncio.ensure_future(pool.complete(CHAT))
                await asyncio.sleep(0.3)
                assert not waiting.done()
                pool.add(engine(again.servers[0]))
                assert (await waiting).completion_ids
            await ea.aclose()
            await eb.aclose()

        asyncio.run(go())


def test_a_sync_reaches_every_engine_and_a_refused_one_stops_the_run(model_dir, tmp_path):
    from tmax.models.tiny import load_pretrained_dir

    model, _ = load_pretrained_dir(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    good = write_weights(model, tmp_path / "w", 1)
    with Served(model_dir, 2) as served:
        ea, eb = (engine(s) for s in served.servers)
        a = served.servers[0]
        pool = EnginePool([ea, eb], sync_attempts=2, sync_backoff_s=0.01)

        async def go():
            await pool.sync(good, 1)
            assert (pool.version, ea.version, eb.version) == (1, 1, 1)
            assert {(await pool.complete(CHAT)).policy_version for _ in range(2)} == {1}
            (tmp_path / "bad" / "v00000002").mkdir(parents=True)  # no marker: incomplete
            with pytest.raises(WeightSyncError, match="2 attempts failed"):
                await pool.sync(tmp_path / "bad" / "v00000002", 2)
            assert (pool.version, pool.target) == (1, 1) and len(pool.live) == 2
            with pytest.raises(WeightSyncError, match="sync it before adding it"):
                pool.add(HttpEngine(a.url, "tiny"))  # it knows version 0 only
            await ea.aclose()
            await eb.aclose()

        asyncio.run(go())
