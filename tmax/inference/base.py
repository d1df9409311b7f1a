"""The inference-engine seam: what training and rollouts ask of a generation engine.

An engine answers chat completions with the sampled token ids and their log-probs, stamped
with the weights version that produced them (``Completion.policy_version``); it reports
health, pauses and resumes generation, and loads new weights from a versioned folder of
Hugging Face safetensors on shared scratch (``update_weights_from_path``).

Failures, sorted by whose they are:

- the engine's transport failed or its server died: ``PolicyUnavailable`` (from
  ``complete``) or ``EngineUnavailable`` (a ``PolicyUnavailable``, from control calls):
  rollouts record an infrastructure failure, never a reward;
- a weight update failed (bad folder, server refused, timed out): ``WeightSyncError`` with
  the engine, the version and the reason; the trainer retries it with a bound and then
  stops (it never trains on against a stale engine silently);
- anything else the engine reports: ``EngineError``.

Weights folders (``write_weights`` / ``read_weights``): ``<root>/v<version:08d>/`` holds
``model.safetensors`` (and the config), and ``tmax-weights.json`` written last, after an
fsync, as the marker that the folder is complete; the folder is written under a temporary
name and renamed into place. Readers refuse a folder without the marker. The trainer
backends export through ``write_weights`` too. A model whose LM head is tied to its
embeddings also gets the head under its own name (``tied-head.safetensors``): vLLM serves
such a model untied (``tmax.inference.vllm.serving_dir``; its in-place reload cannot
refill a tied head) and reloads the head from there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tmax.agent.policy import Completion, PolicyUnavailable

MARKER = "tmax-weights.json"


class EngineError(Exception):
    """The engine reported a failure that is not a transport failure."""

    def __init__(self, engine: str, reason: str):
        self.engine, self.reason = engine, reason
        super().__init__(f"engine {engine}: {reason}")


class WeightSyncError(EngineError):
    """Loading weights ``version`` into ``engine`` failed."""

    def __init__(self, engine: str, version: int, reason: str):
        self.version = version
        super().__init__(engine, f"weight sync to version {version} failed: {reason}")


class EngineStartError(EngineError):
    """A server process did not come up (``log_tail``: the end of its log)."""

    def __init__(self, engine: str, reason: str, log_tail: str = ""):
        self.log_tail = log_tail
        super().__init__(engine, reason + (f"\n--- log tail ---\n{log_tail}" if log_tail else ""))


class EngineUnavailable(PolicyUnavailable):
    """A control call (health, pause, resume, weights) could not reach the engine: an
    infrastructure failure, like ``PolicyUnavailable`` from ``complete``."""


@runtime_checkable
class InferenceEngine(Protocol):
    """One generation engine (a server behind a client, or a model in this process)."""

    name: str
    supports_tools: bool

    @property
    def version(self) -> int:
        """The weights version the engine serves now."""
        ...

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        """The next assistant turn with ``prompt_ids``, ``completion_ids``, ``logprobs``
        and ``policy_version`` filled in."""
        ...

    async def health(self) -> bool:
        """True when the engine answers; False (never an exception) when it does not."""
        ...

    async def pause(self) -> None:
        """Stop starting new generations (the ones in flight finish); new requests wait."""
        ...

    async def resume(self) -> None:
        """Release the requests that waited while paused."""
        ...

    async def update_weights_from_path(self, path: str | Path, version: int) -> None:
        """Load the weights folder ``path`` (see ``write_weights``) as ``version``; raises
        ``WeightSyncError``. Generations after it returns use the new weights."""
        ...

    async def aclose(self) -> None:
        """Release the client side (connections); a server process is owned elsewhere."""
        ...


def weights_dir(root: str | Path, version: int) -> Path:
    """The folder of weights ``version`` under ``root``."""
    return Path(root) / f"v{version:08d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_weights(model: Any, root: str | Path, version: int,
                  state_dict: dict[str, Any] | None = None) -> Path:
    """Save ``model`` (a transformers model; its weights, or ``state_dict`` when given) as
    ``weights_dir(root, version)``: written into a temporary sibling (safetensors fsynced,
    then the marker), then renamed into place, so a reader never sees a partial folder. An
    existing folder of that version is replaced."""
    final = weights_dir(root, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        write_tied_head(model, tmp, state_dict)
        for f in tmp.glob("*.safetensors"):
            _fsync(f)
        marker = tmp / MARKER
        marker.write_text(json.dumps({"version": version}))
        _fsync(marker)
        os.chmod(tmp, 0o755)
        if final.exists():
            old = final.with_name(f".{final.name}.{os.getpid()}.old")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


TIED_HEAD_FILE = "tied-head.safetensors"


def tied_head_name(model: Any) -> str | None:
    """The state-dict name of ``model``'s LM head weight when it is tied to the input
    embeddings (the same tensor), else None (also for a model without transformers'
    embedding accessors: nothing of it can be tied)."""
    if not (hasattr(model, "get_output_embeddings") and hasattr(model, "get_input_embeddings")):
        return None
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return None
    for name, param in model.named_parameters(remove_duplicate=False):
        if param is head.weight and name != _param_name(model, embed.weight):
            return name
    return None


def _param_name(model: Any, tensor: Any) -> str | None:
    return next((n for n, p in model.named_parameters() if p is tensor), None)


def write_tied_head(model: Any, folder: Path, state_dict: dict[str, Any] | None = None
                    ) -> None:
    """Add a tied LM head to the saved folder under its own name (``TIED_HEAD_FILE``, and
    in the shard index where there is one); nothing for an untied model."""
    from safetensors.torch import save_file

    head = tied_head_name(model)
    if head is None:
        return
    source = state_dict if state_dict is not None else model.state_dict()
    embed = _param_name(model, model.get_input_embeddings().weight)
    tensor = source.get(head, source.get(embed)) if embed else source.get(head)
    if tensor is None:
        return
    save_file({head: tensor.detach().to("cpu").contiguous().clone()},
              str(folder / TIED_HEAD_FILE), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {})[head] = TIED_HEAD_FILE
        index.write_text(json.dumps(data, indent=2))


def check_weights_dir(path: str | Path, *, engine: str = "?", version: int = -1) -> Path:
    """``path`` as an absolute folder that ``write_weights`` finished (its marker is there
    and names ``version`` when one is given); WeightSyncError otherwise."""
    folder = Path(path).absolute()
    marker = folder / MARKER
    if not marker.is_file():
        raise WeightSyncError(engine, version, f"{folder} has no {MARKER} (incomplete or "
                              "not a weights folder)")
    try:
        written = json.loads(marker.read_text()).get("version")
    except (OSError, ValueError, AttributeError) as e:
        raise WeightSyncError(engine, version, f"{marker} unreadable: {e}") from None
    if version >= 0 and written != version:
        raise WeightSyncError(engine, version, f"{folder} holds version {written}")
    return folder


def read_weights(path: str | Path, *, engine: str = "?", version: int = -1,
                 require_marker: bool = True) -> dict[str, Any]:
    """The state dict saved in the weights folder ``path`` (CPU tensors); WeightSyncError
    when the folder is incomplete (no marker, unless ``require_marker`` is off), is for
    another version, or has no safetensors files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if require_marker:
        check_weights_dir(folder, engine=engine, version=version)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightSyncError(engine, version, f"{folder} has no safetensors files")
    state: dict[str, Any] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            raise WeightSyncError(engine, version, f"{f}: {e}") from None
    return state


def full_state(model: Any, state: dict[str, Any], *, engine: str, version: int
               ) -> dict[str, Any]:
    """``state`` completed for a strict ``load_state_dict`` into ``model``: a tied weight
    the file leaves out (``lm_head.weight`` tied to the embeddings) takes the tensor of
    the key it is tied to. WeightSyncError on missing or unexpected keys or shapes."""
    own = model.state_dict()
    by_storage: dict[int, list[str]] = {}
    for key, tensor in own.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(key)
    full = dict(state)
    for key in set(own) - set(state):
        source = [k for k in by_storage[own[key].data_ptr()] if k in state]
        if source:
            full[key] = state[source[0]]
    missing, unexpected = set(own) - set(full), set(full) - set(own)
    if missing or unexpected:
        raise WeightSyncError(engine, version, f"weights do not fit the model: missing "
                              f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    wrong = [k for k in own if tuple(full[k].shape) != tuple(own[k].shape)]
    if wrong:
        raise WeightSyncError(engine, version, f"shape mismatch in {wrong[:5]}")
    return full
