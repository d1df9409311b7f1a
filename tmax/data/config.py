"""configs/gen.yaml: the teacher, the generation loop, the axes, the prompts (strict)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tmax.data.axes import Axes
from tmax.llm import TeacherConfig
from tmax.package_data import CONFIGS

DEFAULT_CONFIG = CONFIGS / "gen.yaml"


class GenConfigError(ValueError):
    """A generation config that does not load (names the file and each bad field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Generation(_Strict):
    repair_rounds: int = Field(default=3, ge=0)
    """Build/check failures sent back to the teacher before the task is dropped."""
    error_tail_chars: int = Field(default=3000, ge=100)
    """How much of a failure's error and log goes back to the teacher."""
    agent_timeout_sec: float = Field(default=900.0, gt=0)
    """[agent] timeout_sec of the generated tasks."""
    verifier_timeout_sec: float = Field(default=180.0, gt=0)
    """[verifier] timeout_sec of the generated tasks."""
    id_prefix: str = Field(default="gen", pattern=r"^[a-z0-9][a-z0-9-]{0,40}$")
    """Task ids are ``<id_prefix>-<seed:06d>``: give each run that shares an image store
    its own (images are keyed by task id there)."""


class Prompts(_Strict):
    system: str
    task: str
    """Formatted with the sampled axes and ``seed``."""
    repair: str
    """Formatted with ``stage`` and ``error`` (the tail of the failure)."""


class GenConfig(_Strict):
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    generation: Generation = Field(default_factory=Generation)
    axes: Axes
    prompts: Prompts


def load_gen_config(path: str | Path = DEFAULT_CONFIG) -> GenConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
        return GenConfig.model_validate(raw or {})
    except (OSError, yaml.YAMLError) as e:
        raise GenConfigError(f"{path}: {e}") from None
    except ValidationError as e:
        lines = [f"{path}: {e.error_count()} errors"]
        lines += [f"  {'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
                  for err in e.errors()]
        raise GenConfigError("\n".join(lines)) from None
