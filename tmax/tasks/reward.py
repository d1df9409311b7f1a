"""Reading what a verifier wrote: /logs/verifier/reward.txt or reward.json."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path

MAX_REWARD_BYTES = 1 << 20


class VerifierError(Exception):
    """The verifier ran but left no usable reward (missing, malformed, out of range)."""

    def __init__(self, task: str, reason: str):
        self.task, self.reason = task, reason
        super().__init__(f"{task}: verifier: {reason}")


def read_reward(verifier_dir: Path, task: str) -> float:
    """The reward in [0,1] from ``reward.txt`` (one float) or ``reward.json``.

    reward.json is a flat dict of numbers; its ``reward`` key is the reward (other keys are
    metrics). Without one, as Harbor's multi-reward tasks write it (``{"correctness": 1,
    "performance": 0}``: named rewards, no total), the reward is their mean. reward.txt wins
    when both exist.
    """
    txt = _read_regular(verifier_dir / "reward.txt", task)
    js = None if txt is not None else _read_regular(verifier_dir / "reward.json", task)
    if txt is not None:
        text = txt.strip()
        try:
            value = float(text)
        except ValueError:
            raise VerifierError(task, f"reward.txt holds {text[:40]!r}, not a number") from None
    elif js is not None:
        try:
            data = json.loads(js)
        except json.JSONDecodeError as e:
            raise VerifierError(task, f"reward.json is not JSON: {e}") from None
        if not isinstance(data, dict) or not data:
            raise VerifierError(task, "reward.json needs a flat dict of numbers")
        if isinstance(data.get("reward"), (int, float)):
            value = float(data["reward"])
        elif all(isinstance(v, (int, float)) for v in data.values()) and "reward" not in data:
            value = sum(float(v) for v in data.values()) / len(data)
        else:
            raise VerifierError(task, "reward.json needs a numeric 'reward' key, or only "
                                "numeric values (their mean is the reward)")
    else:
        raise VerifierError(task, "wrote no reward.txt or reward.json")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise VerifierError(task, f"reward {value} is outside [0, 1]")
    return value


def read_metrics(verifier_dir: Path, task: str = "") -> dict[str, float]:
    """reward.json's numbers (named rewards, metrics), {} without a usable one; read as
    ``read_reward`` reads it (never through a link)."""
    try:
        text = _read_regular(verifier_dir / "reward.json", task)
        data = json.loads(text) if text is not None else None
    except (VerifierError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _read_regular(path: Path, task: str, limit: int = MAX_REWARD_BYTES) -> str | None:
    """The text of ``path``, None when it is absent. A symlink, fifo, device or directory is
    a ``VerifierError``, never followed or opened for reading (the reader may be root on the
    host, and the verifier untrusted); so is a file over ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise VerifierError(task, f"{path.name} is a symlink, not a regular file") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise VerifierError(task, f"{path.name} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise VerifierError(task, f"{path.name} is over {limit} bytes")
    return data.decode(errors="replace")
