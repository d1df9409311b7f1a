"""The batch scripts of ``tmax-train --launcher slurm``: each role's ``#SBATCH`` lines from
its ``slurm.<role>`` section (one keyword per sbatch option, sandfleet's ``sbatch_lines``)
and its template in ``tmax/train/templates/`` (package data), exactly as ``--dry-run`` prints them and Slurm runs them.

Resources per role: the trainer job asks for ``slurm.trainer_nodes`` nodes x (ranks /
nodes) tasks, ``--gpus-per-node``, ``--cpus-per-task`` (per rank) and ``--mem`` (per
node); each inference job one node, one task with the GPUs of its vLLM server
(TP x DP). A GPU role that asks for no GPUs, or for fewer than it runs on, is an error
here, before anything is submitted.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

from sandfleet import slurm
from tmax.train.commands import server_command, trainer_command
from tmax.train.config import SlurmRole, TrainConfig

sbatch_lines = slurm.sbatch_lines  # re-exported: tmax.train.slurm's API names it


def template(name: str) -> str:
    """Template ``name`` of ``tmax/train/templates/``."""
    return slurm.template_text("tmax.train", name)


def walltime_s(text: str) -> int:
    """Seconds of an sbatch walltime: minutes, minutes:seconds, hours:minutes:seconds,
    days-hours, days-hours:minutes or days-hours:minutes:seconds."""
    try:
        days, _, rest = text.rpartition("-")
        parts = [int(p) for p in rest.split(":")]
        if days:
            parts += [0] * (3 - len(parts))
            h, m, sec = parts
            total = int(days) * 86400 + h * 3600 + m * 60 + sec
        else:
            h, m, sec = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
            total = h * 3600 + m * 60 + sec
    except (ValueError, KeyError):
        raise ValueError(f"walltime {text!r}: not minutes, HH:MM:SS or D-HH:MM:SS") from None
    return total


def format_walltime(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    hms = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{hms}" if days else hms


def staggered(time: str | None, index: int, stagger_min: int, steps: int) -> str | None:
    """Server ``index``'s walltime: ``time`` less (index % steps) * stagger_min minutes, and
    never under half of it; ``time`` itself for server 0 (and when it is None)."""
    if time is None or not stagger_min or index % steps == 0:
        return time
    total = walltime_s(time)
    return format_walltime(max(total - (index % steps) * stagger_min * 60, total // 2))


def _role_options(role: SlurmRole) -> dict[str, Any]:
    return {"partition": role.partition, "account": role.account, "qos": role.qos,
            "constraint": role.constraint, "gres": role.gres, "time": role.time,
            "gpus_per_node": role.gpus_per_node, "cpus_per_task": role.cpus,
            "mem": role.mem}


def _gpus(role: SlurmRole) -> int | None:
    """GPUs per node the role asks for (``gpus_per_node``, else a ``gres`` of gpu[:type]:N);
    None when it asks for none."""
    if role.gpus_per_node is not None:
        return role.gpus_per_node
    m = re.fullmatch(r"gpu(?::[^:,]+)?:(\d+)", role.gres or "")
    return int(m.group(1)) if m else None


class LayoutError(ValueError):
    """A role's Slurm resources cannot hold what it runs; names the fields to change."""


def check_layout(config: TrainConfig) -> None:
    """Every GPU role asks for the GPUs it runs on: the trainer (``trainer.device`` cuda,
    or an engine=vllm run's trainer with device auto) one per rank of a node; each vLLM
    server TP x DP. Raises ``LayoutError``."""
    s = config.slurm
    for name, role in (("trainer", s.trainer), ("inference", s.inference)):
        if role.gpus_per_node is not None and (role.gres or "").startswith("gpu"):
            raise LayoutError(f"slurm.{name} sets both gpus_per_node and gres={role.gres} "
                              "(Slurm refuses the pair): keep gpus_per_node")
    per_node = config.distributed.trainer_ranks // s.trainer_nodes
    gpu_trainer = config.trainer.device == "cuda" or (
        config.trainer.backend == "deepspeed" and config.trainer.device == "auto"
        and config.engine == "vllm")
    got = _gpus(s.trainer)
    if gpu_trainer and got is None:
        raise LayoutError(
            f"the trainer trains on GPUs ({per_node} rank(s) per node) but its Slurm job "
            "asks for none: set slurm.trainer.gpus_per_node (or slurm.trainer.gres)")
    if got is not None and per_node > got:
        raise LayoutError(
            f"{per_node} trainer ranks per node (distributed.trainer_ranks="
            f"{config.distributed.trainer_ranks} / slurm.trainer_nodes={s.trainer_nodes}) "
            f"but {got} GPUs per node (slurm.trainer.gpus_per_node): raise "
            "slurm.trainer_nodes")
    if config.engine == "vllm":
        need = config.vllm.tensor_parallel_size * config.vllm.data_parallel_size
        have = _gpus(s.inference)
        if have is None or have < need:
            raise LayoutError(
                f"each vLLM server runs on {need} GPUs (vllm.tensor_parallel_size x "
                f"data_parallel_size) but its Slurm job asks for {have or 'none'}: set "
                f"slurm.inference.gpus_per_node: {need}")


def _exports(env: dict[str, str]) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())) \
        or "# (no added environment)"


def _python(config: TrainConfig) -> str:
    return config.slurm.python or sys.executable


def job_prefix(config: TrainConfig) -> str:
    return f"tmax-{config.name}"


def inference_script(config: TrainConfig, run_dir: Path, index: int) -> str:
    """The exact batch script of inference server ``index`` (what ``--dry-run`` prints)."""
    check_layout(config)
    role = config.slurm.inference
    run = Path(run_dir).absolute()
    options = _role_options(role) | {"time": staggered(
        role.time, index, config.slurm.stagger_min, config.slurm.stagger_steps)}
    lines = sbatch_lines(role.extra, job_name=f"{job_prefix(config)}-inference-{index}",
                         output=str(run / "logs" / f"slurm-inference-{index}-%j.out"),
                         nodes=1, ntasks_per_node=1, open_mode="append", **options)
    _, env = server_command(config, run, index, 0)  # the port is chosen on the node
    return slurm.render_template(template("tmax-inference.sbatch"), {
        "sbatch_options": "\n".join(lines),
        "setup": "\n".join(role.setup) if role.setup else "# (no setup lines)",
        "env": _exports(env), "index": str(index), "run_dir": shlex.quote(str(run)),
        "command": shlex.join([_python(config), "-m", "tmax.train.slurm", "server",
                               str(run), str(index)])})


def trainer_script(config: TrainConfig, run_dir: Path) -> str:
    """The exact batch script of the trainer job."""
    check_layout(config)
    s, role = config.slurm, config.slurm.trainer
    run = Path(run_dir).absolute()
    lines = sbatch_lines(role.extra, ("requeue",), job_name=f"{job_prefix(config)}-trainer",
                         output=str(run / "logs" / "slurm-trainer-%j.out"),
                         nodes=s.trainer_nodes,
                         ntasks_per_node=config.distributed.trainer_ranks // s.trainer_nodes,
                         signal=f"USR2@{s.preempt_signal_s}", open_mode="append",
                         **_role_options(role))
    env = {"OMP_NUM_THREADS": str(config.torch_threads)} if config.torch_threads else {}
    argv = trainer_command(run)
    argv[0] = _python(config)
    return slurm.render_template(template("tmax-trainer.sbatch"), {
        "sbatch_options": "\n".join(lines),
        "setup": "\n".join(role.setup) if role.setup else "# (no setup lines)",
        "env": _exports(env), "command": shlex.join(argv)})


def orchestrator_script(config: TrainConfig, run_dir: Path) -> str:
    """The batch script of ``--detach``: the launcher (``--launcher slurm`` on the run's
    saved config) in a one-node CPU job. SIGTERM (scancel, or 120 s before the time
    limit) makes it cancel the run's other jobs, as Ctrl-C does in a terminal."""
    role = config.slurm.orchestrator
    run = Path(run_dir).absolute()
    lines = sbatch_lines(role.extra, job_name=f"{job_prefix(config)}-orchestrator",
                         output=str(run / "logs" / "slurm-orchestrator-%j.out"),
                         nodes=1, ntasks_per_node=1, signal="B:TERM@120",
                         open_mode="append", **_role_options(role))
    return slurm.render_template(template("tmax-orchestrator.sbatch"), {
        "sbatch_options": "\n".join(lines),
        "setup": "\n".join(role.setup) if role.setup else "# (no setup lines)",
        "run_dir": shlex.quote(str(run)),
        "command": shlex.join([_python(config), "-m", "tmax.train.cli", "--config",
                               str(run / "config.yaml"), "--launcher", "slurm", "-q"])})


def slurm_plan(config: TrainConfig, *, detach: bool = False) -> dict[str, str]:
    """Every script a launch submits first, by file name (for ``--dry-run``)."""
    check_layout(config)
    run = config.run_dir
    plan = {"orchestrator.sbatch": orchestrator_script(config, run)} if detach else {}
    plan.update({f"inference-{i}.sbatch": inference_script(config, run, i)
                 for i in range(config.distributed.inference_servers)})
    plan["trainer.sbatch"] = trainer_script(config, run)
    return plan
