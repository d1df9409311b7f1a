"""Reading what a verifier wrote: /logs/verifier/reward.txt or reward.json."""

from __future__ import annotations

import json
import math
from pathlib import Path


class VerifierError(Exception):
    """The verifier ran but left no usable reward (missing, malformed, out of range)."""

    def __init__(self, task: str, reason: str):
        self.task, self.reason = task, reason
        super().__init__(f"{task}: verifier: {reason}")


def read_reward(verifier_dir: Path, task: str) -> float:
    """The reward in [0,1] from ``reward.txt`` (one float) or ``reward.json``.

    reward.json is a flat dict of numbers; its ``reward`` key is the reward (other keys are
    metrics). reward.txt wins when both exist.
    """
    txt, js = verifier_dir / "reward.txt", verifier_dir / "reward.json"
    if txt.is_file():
        text = txt.read_text().strip()
        try:
            value = float(text)
        except ValueError:
            raise VerifierError(task, f"reward.txt holds {text[:40]!r}, not a number") from None
    elif js.is_file():
        try:
            data = json.loads(js.read_text())
        except json.JSONDecodeError as e:
            raise VerifierError(task, f"reward.json is not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("reward"), (int, float)):
            raise VerifierError(task, "reward.json needs a numeric 'reward' key")
        value = float(data["reward"])
    else:
        raise VerifierError(task, "wrote no reward.txt or reward.json")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise VerifierError(task, f"reward {value} is outside [0, 1]")
    return value
