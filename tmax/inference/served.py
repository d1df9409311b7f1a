"""``vllm:PATH``: a local model folder served by a vLLM server that TMax starts and stops
(``tmax eval --policy vllm:PATH``).

``VLLMPolicy`` owns a ``VLLMServer`` on a free loopback port (``tmax.inference.vllm``:
the Python of ``vllm.python``/``TMAX_VLLM_PYTHON`` or ``vllm`` from PATH; the checkpoint's
own dtype; the FP32 head; CPU settings where the machine has no NVIDIA GPU, or as
``TMAX_VLLM_DEVICE`` says) and answers through its ``HttpEngine`` (token ids and
log-probs included). ``start()`` brings the server up (the first ``complete`` does so
too); ``aclose()`` stops it. Nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tmax.agent.policy import Completion
from tmax.inference.process import free_port
from tmax.inference.vllm import VLLMConfig, VLLMServer

DEVICE_ENV = "TMAX_VLLM_DEVICE"


def default_device() -> str:
    """``$TMAX_VLLM_DEVICE``, else cuda where ``nvidia-smi`` is on PATH, else cpu."""
    device = os.environ.get(DEVICE_ENV)
    if device:
        return device
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


class VLLMPolicy:
    """A model folder behind a vLLM server this policy starts (see the module)."""

    supports_tools = False

    def __init__(self, path: str | Path, *, temperature: float = 1.0, max_tokens: int = 256,
                 python: str | None = None, device: str | None = None,
                 start_timeout_s: float = 900.0, log_dir: str | Path | None = None,
                 name: str | None = None):
        folder = Path(path).absolute()
        if not (folder / "config.json").is_file():
            raise ValueError(f"{folder}: not a transformers model folder (no config.json)")
        self.name = name or f"vllm:{path}"
        self.version = 0
        config = VLLMConfig(model=str(folder), served_model_name="policy", host="127.0.0.1",
                            port=free_port(), dtype="auto", weight_transfer=None,
                            python=python, device=device or default_device())  # type: ignore[arg-type]
        logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="tmax-vllm-"))
        self.log_path = logs / "vllm-server.log"
        self.server = VLLMServer(config, log_path=self.log_path, start_timeout_s=start_timeout_s,
                                 temperature=temperature, max_tokens=max_tokens,
                                 name=self.name)
        self._started: asyncio.Task | None = None

    async def start(self) -> None:
        """Start the server (once) and wait until it is healthy (``EngineStartError`` with
        the end of its log otherwise)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.server.start())
        await self._started

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        await self.start()
        completion = await self.server.engine.complete(messages, tools)
        self.version = completion.policy_version or 0
        return completion

    async def aclose(self) -> None:
        """Stop the server (its whole process group)."""
        await self.server.stop()
