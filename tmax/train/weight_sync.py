"""Weights from the trainer to the vLLM servers by NCCL broadcast (``vllm.weight_transfer:
nccl``), vLLM's own protocol (``tmax.inference.nccl``), between two processes that meet
only in the run folder: the trainer (this module's ``NcclSender``, every rank) and the
orchestrator (``tmax.train.nccl_pool.NcclCoordinator``, which drives the servers' HTTP).

**What is sent.** The policy under its *checkpoint* names, the names vLLM's
``load_weights`` reads: the trainer's model may be loaded under other names (Qwen3.5's
``Qwen3_5ForConditionalGeneration`` checkpoint as the text-only ``Qwen3_5ForCausalLM``,
``model.language_model.*`` -> ``model.*``, fused projections split), so each layer's
parameters are mapped back with transformers' own ``revert_weight_conversion``, as
``save_pretrained`` does. Under ZeRO-3 every rank gathers one layer at a time
(``GatheredParameters``: a collective) and rank 0 alone broadcasts it; tied weights go
once. ``checkpoint_layout`` gives the same names, dtypes and shapes without gathering
(meta tensors), for ``update_info``.

**The group.** One NCCL group spans the trainer's rank 0 (group rank 0, the TCPStore
master) and every worker of every server, so one broadcast reaches all servers at once.
Trainer rank 0 says hello when it starts (``hello.json``: an id of this process); the
orchestrator asks for a group for it (``group.json``: generation G, the trainer's id,
world size, the packed wire parameters); rank 0 answers with its endpoint
(``endpoint-G.json``) and opens it with vLLM's ``stateless_init_process_group`` while the
orchestrator posts each server's ``/init_weight_transfer_engine``. A replaced server or a
restarted trainer (a new hello) means a new generation: the next publish joins it first.

**One version.** After step k, rank 0 offers version k (``offer-k.json``: the generation
and the ``update_info``), waits for the orchestrator's ``go-k`` (it has paused every
server, opened ``/start_weight_update`` and posted ``/update_weights``), broadcasts with
vLLM's ``packed_nccl_broadcast_producer``, and writes ``sent-k``; the orchestrator then
finishes the update (``/finish_weight_update`` with the version) and resumes the servers.

vLLM runs on the trainer's rank 0 for this (its NCCL communicator and packing, so the wire
format is vLLM's own): ``weight_transfer: nccl`` needs vllm importable in the trainer's
environment; ``folder`` does not.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from tmax.inference.nccl import nccl_update_info

log = logging.getLogger(__name__)

SYNC_DIR = "nccl"


class WeightSyncTimeout(RuntimeError):
    """The other side of the weight sync did not answer in time."""


# --------------------------------------------------------------------------- names


def layer_of(name: str) -> str:
    """The unit parameters are gathered and renamed by: up to the first numeric component
    (``model.layers.3``), else the owning module (``model.embed_tokens``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def unique_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Named parameters, a tied one once (its first name), in module order."""
    return list(model.named_parameters())  # named_parameters already drops duplicates


def _groups(params: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    groups: list[list[tuple[str, Any]]] = []
    for name, p in params:
        if groups and layer_of(groups[-1][0][0]) == layer_of(name):
            groups[-1].append((name, p))
        else:
            groups.append([(name, p)])
    return groups


def _to_checkpoint(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _shape(p: Any) -> tuple[int, ...]:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


def checkpoint_layout(model: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(checkpoint name, dtype, shape) of every tensor ``checkpoint_tensors`` yields, in
    its order; no gathering (meta tensors)."""
    out = []
    for group in _groups(unique_parameters(model)):
        meta = {n: torch.empty(_shape(p), dtype=p.dtype, device="meta") for n, p in group}
        out += [(n, t.dtype, tuple(t.shape)) for n, t in _to_checkpoint(model, meta).items()]
    return out


def checkpoint_tensors(model: Any, *, rank: int = 0,
                       gathered: Callable[[list[Any]], AbstractContextManager[Any]] | None
                       = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full tensor) of every parameter, a layer at a time. With
    ``gathered`` (ZeRO-3: ``GatheredParameters``) every rank must run the iteration to
    its end (each layer's gather is a collective); only rank 0 gets tensors."""
    for group in _groups(unique_parameters(model)):
        params = [p for _, p in group]
        with (gathered(params) if gathered is not None else nullcontext()):
            if rank != 0:
                continue
            # copies: a gathered parameter's storage is released when its context ends
            tensors = {n: p.detach().clone() for n, p in group}
        if rank == 0:
            yield from _to_checkpoint(model, tensors).items()


def update_info_of(model: Any) -> dict[str, Any]:
    """``/update_weights``'s ``update_info`` for this model's broadcast."""
    return nccl_update_info(checkpoint_layout(model))


# --------------------------------------------------------------------------- the files


class SyncFolder:
    """``RUN/nccl/``: the files the trainer and the orchestrator exchange (each written
    whole: a temporary name, then a rename)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / SYNC_DIR
        self.path.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, doc: dict[str, Any]) -> Path:
        final = self.path / name
        tmp = final.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, final)
        return final

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.path / name).read_text()))
        except (OSError, ValueError):
            return None

    def wait(self, name: str, *, timeout_s: float, alive: Callable[[], bool],
             poll_s: float = 0.05) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while (doc := self.read(name)) is None:
            if not alive():
                raise WeightSyncTimeout(f"{self.path / name}: its writer is gone")
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"{self.path / name}: nothing after {timeout_s:.0f} s")
            time.sleep(poll_s)
        return doc

    def group(self) -> dict[str, Any] | None:
        return self.read("group.json")

    def latest_offer(self) -> dict[str, Any] | None:
        offers = []
        for f in self.path.glob("offer-*.json"):
            try:
                offers.append((f.stat().st_mtime_ns, f.name))
            except OSError:
                continue  # pruned meanwhile
        return self.read(max(offers)[1]) if offers else None

    def wait_offer(self, timeout_s: float, alive: Callable[[], bool]) -> dict[str, Any]:
        """The newest offer, once there is one."""
        deadline = time.monotonic() + timeout_s
        while (offer := self.latest_offer()) is None:
            if not alive():
                raise WeightSyncTimeout(f"{self.path}: the trainer is gone before its "
                                        "first weights offer")
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"{self.path}: no weights offer after "
                                        f"{timeout_s:.0f} s")
            time.sleep(0.2)
        return offer

    def prune(self, below: int) -> None:
        """Drop the offer/go/sent files of versions below ``below``."""
        for f in self.path.iterdir():
            stem = f.name.split(".")[0]
            kind, _, num = stem.partition("-")
            if kind in ("offer", "go", "sent") and num.isdigit() and int(num) < below:
                f.unlink(missing_ok=True)


def offer_name(version: int) -> str:
    return f"offer-{version:08d}.json"


# --------------------------------------------------------------------------- the sender


def _vllm_nccl() -> tuple[Any, Any]:
    try:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
        from vllm.distributed.weight_transfer.packed_tensor import (
            packed_nccl_broadcast_producer,
        )
    except ImportError as e:
        raise ImportError(
            f"vllm.weight_transfer=nccl: the trainer's rank 0 opens vLLM's NCCL endpoint "
            f"and needs vllm importable in its environment ({e}); install the gpu extra "
            "there, or use vllm.weight_transfer=folder") from e
    return stateless_init_process_group, packed_nccl_broadcast_producer


class NcclSender:
    """The trainer's side (every rank constructs one; rank 0 holds the NCCL group)."""

    def __init__(self, run_dir: str | os.PathLike, *, rank: int, timeout_s: float,
                 orchestrator_alive: Callable[[], bool], host: str | None = None):
        self.files = SyncFolder(run_dir)
        self.rank, self.timeout_s, self.alive = rank, timeout_s, orchestrator_alive
        # rank 0 runs on the trainer's first node, whose address the job gives as
        # MASTER_ADDR (tmax/train/templates/tmax-trainer.sbatch; 127.0.0.1 for local processes)
        self.host = host or os.environ.get("TMAX_NCCL_HOST") \
            or os.environ.get("MASTER_ADDR") or socket.getfqdn()
        self.generation = 0
        self.group: Any = None
        self.wire: dict[str, Any] = {}
        self.hello = ""
        if rank == 0:  # a (re)started trainer: the orchestrator makes a group for it
            self.files.prune(1 << 62)  # a previous trainer's offers are void
            self.hello = f"{self.host}:{os.getpid()}:{time.time():.6f}"
            self.files.write("hello.json", {"id": self.hello})

    def _join(self, request: dict[str, Any]) -> None:
        """Open rank 0's endpoint of the group ``request`` asks for (the servers join it
        as the orchestrator posts their init infos)."""
        init_group, _ = _vllm_nccl()
        generation = int(request["generation"])
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        self.files.write(f"endpoint-{generation}.json",
                         {"generation": generation, "master_address": self.host,
                          "master_port": port})
        log.info("weight sync: opening NCCL group %d (%d ranks) at %s:%d", generation,
                 request["world_size"], self.host, port)
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.group = init_group(self.host, port, 0, int(request["world_size"]), device)
        self.generation = generation
        self.wire = {k: request[k] for k in ("packed_buffer_size_bytes",
                                              "packed_num_buffers")}

    def _my_group(self, at_least: int = 0) -> dict[str, Any]:
        """The newest group the orchestrator made for this trainer process (one made for
        a trainer that has since restarted waits for none of its ranks), of generation
        ``at_least`` or newer (the one the orchestrator said is current)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            request = self.files.wait("group.json", timeout_s=self.timeout_s,
                                      alive=self.alive)
            if request.get("trainer") == self.hello and \
                    int(request["generation"]) >= at_least:
                return request
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"{self.files.path}/group.json: no group "
                                        f"{at_least or ''} for this trainer ({self.hello}) "
                                        f"after {self.timeout_s:.0f} s")
            time.sleep(0.1)

    def publish(self, backend: Any, version: int) -> None:
        """Broadcast weights ``version`` to every server (collective over the trainer's
        ranks: ZeRO-3 gathers each layer on all of them)."""
        model = backend.model
        gathered = None
        ds = getattr(backend, "_ds", None)
        if ds is not None and getattr(backend.trainer_cfg, "zero_stage", 0) == 3:
            def gathered(params: list[Any]) -> Any:
                return ds.zero.GatheredParameters(params, modifier_rank=None)
        if self.rank != 0:
            for _ in checkpoint_tensors(model, rank=self.rank, gathered=gathered):
                pass
            return
        info, go = update_info_of(model), f"go-{version:08d}.json"
        current = 0
        while True:  # until the orchestrator says go for the group rank 0 is in
            request = self._my_group(current)
            if int(request["generation"]) != self.generation:
                self._join(request)
            self.files.write(offer_name(version), {"version": version,
                                                   "generation": self.generation,
                                                   "update_info": info})
            answer = self.files.wait(go, timeout_s=self.timeout_s, alive=self.alive)
            if int(answer["generation"]) == self.generation:
                break
            current = int(answer["generation"])  # a newer group: wait for it, join it first
            (self.files.path / go).unlink(missing_ok=True)
        _, producer = _vllm_nccl()
        t0 = time.monotonic()
        producer(iterator=checkpoint_tensors(model, rank=0, gathered=gathered),
                 group=self.group, src=0, post_iter_func=lambda item: item[1].contiguous(),
                 buffer_size_bytes=self.wire["packed_buffer_size_bytes"],
                 num_buffers=self.wire["packed_num_buffers"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.files.write(f"sent-{version:08d}.json",
                         {"version": version, "seconds": time.monotonic() - t0})
        self.files.prune(version)
