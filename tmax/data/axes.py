"""The nine sampling axes of task generation, and a pure seeded sampler over them.

Axes (value lists in configs/gen.yaml, ``axes:``): domain (uniform over the nine domains),
skill type (per domain), primitive skills (3-5 drawn from the domain's pool), persona /
scenario (per domain), language (weighted), task complexity, command complexity, verifier
kind, fixture kind; plus the difficulty bucket, sampled uniformly to calibrate difficulty.
``sample_axes(axes, seed)`` is a pure function of the config and the task's seed.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tmax.tasks.config_tables import DOMAINS

AXIS_NAMES: tuple[str, ...] = (
    "domain", "skill_type", "primitive_skills", "persona", "language", "task_complexity",
    "command_complexity", "verifier_kind", "fixture_kind")
"""The nine axes, in sampling order (``difficulty`` is sampled after them)."""
SKILL_SEP = "; "
"""How the primitive skills are joined in ``metadata.axes`` (a dict of strings)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DomainAxes(_Strict):
    """A domain's own value lists."""

    skill_types: tuple[str, ...] = Field(min_length=1)
    """Kinds of work in the domain (the paper: 4-7)."""
    skills: tuple[str, ...] = Field(min_length=1)
    """The pool the primitive skills are drawn from."""
    personas: tuple[str, ...] = Field(min_length=1)
    """Who asks and why (the paper: 6-18 per domain)."""


class SkillCount(_Strict):
    min: int = Field(default=3, ge=1)
    max: int = Field(default=5, ge=1)


class Axes(_Strict):
    """``axes:`` of configs/gen.yaml."""

    domains: dict[str, DomainAxes]
    """Domain name (one of the nine) -> its lists; sampled uniformly."""
    primitive_skills: SkillCount = Field(default_factory=SkillCount)
    """How many primitive skills a task draws (uniform in [min, max])."""
    languages: dict[str, float]
    """Language -> weight."""
    task_complexity: tuple[str, ...] = Field(min_length=1)
    command_complexity: tuple[str, ...] = Field(min_length=1)
    verifier_kind: tuple[str, ...] = Field(min_length=1)
    fixture_kind: tuple[str, ...] = Field(min_length=1)
    difficulty: tuple[str, ...] = ("easy", "medium", "hard")
    """Difficulty buckets, sampled uniformly."""

    @model_validator(mode="after")
    def _consistent(self):
        unknown = sorted(set(self.domains) - set(DOMAINS))
        if unknown:
            raise ValueError(f"unknown domains {unknown}; the nine are: {', '.join(DOMAINS)}")
        if not self.domains:
            raise ValueError("axes.domains is empty")
        if self.primitive_skills.min > self.primitive_skills.max:
            raise ValueError("primitive_skills.min is above primitive_skills.max")
        for name, d in self.domains.items():
            if len(d.skills) < self.primitive_skills.max:
                raise ValueError(f"domain {name}: {len(d.skills)} skills in its pool, fewer "
                                 f"than primitive_skills.max = {self.primitive_skills.max}")
        if not self.languages or any(w < 0 for w in self.languages.values()) or \
                sum(self.languages.values()) <= 0:
            raise ValueError("languages needs non-negative weights, not all zero")
        bad = sorted(set(self.difficulty) - {"easy", "medium", "hard"})
        if bad:
            raise ValueError(f"difficulty buckets {bad}: use easy, medium, hard")
        return self


def sample_axes(axes: Axes, seed: int) -> dict[str, str]:
    """The axes of the task with this seed: the same seed gives the same values."""
    rng = random.Random(seed)
    domain = rng.choice(sorted(axes.domains))
    d = axes.domains[domain]
    k = rng.randint(axes.primitive_skills.min, axes.primitive_skills.max)
    languages = sorted(axes.languages)
    return {
        "domain": domain,
        "skill_type": rng.choice(d.skill_types),
        "primitive_skills": SKILL_SEP.join(rng.sample(d.skills, k)),
        "persona": rng.choice(d.personas),
        "language": rng.choices(languages, [axes.languages[lang] for lang in languages])[0],
        "task_complexity": rng.choice(axes.task_complexity),
        "command_complexity": rng.choice(axes.command_complexity),
        "verifier_kind": rng.choice(axes.verifier_kind),
        "fixture_kind": rng.choice(axes.fixture_kind),
        "difficulty": rng.choice(axes.difficulty),
    }
