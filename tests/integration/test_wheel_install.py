"""The package as a cluster's shared install has it: a wheel of this checkout (its tracked and
new files, without tests/, benchmarks/ and docs/), installed into a fresh virtualenv outside
the checkout and run from a folder that is not the checkout. The installed copy is what
runs (the checkout is not on its sys.path; the dependencies come from the checkout's .venv
through a .pth of its site-packages, which holds no tmax), so every file read at run time
(configs, base definitions, Slurm templates, example tasks, tmax-apptainer) must ship in it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
NOT_BUILT = {"tests", "benchmarks", "docs"}
# Folders read at run time: the installed copy must hold the same files, modes included
# (their README.md files are for the checkout's readers).
SHIPPED = ["tmax/configs", "tmax/images/data", "tmax/examples/tasks", "tmax/train/templates",
           "sandfleet/templates"]


def source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout.decode()
    return sorted(p for p in set(out.split("\0")) - {""}
                  if p.split("/")[0] not in NOT_BUILT and os.path.lexists(REPO / p))


def copy_checkout(dest: Path) -> None:
    """The files a wheel is built from (links kept as links), so the build writes nothing
    into the checkout."""
    for rel in source_files():
        src, target = REPO / rel, dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        else:
            shutil.copy2(src, target)


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 300
        ) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(argv)} -> {out.returncode}\n{out.stdout[-3000:]}" \
                                f"\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, env, cwd, site): the wheel installed into a new venv; env and cwd keep the
    checkout out of reach."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels, venv, cwd = tmp / "src", tmp / "wheels", tmp / "venv", tmp / "work"
    copy_checkout(src)
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PATH"] = os.pathsep.join([str(venv / "bin")] + [
        p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(str(REPO))])
    env.update(HOME=str(tmp / "home"), SCRATCH=str(tmp / "scratch"),
               TMAX_IMAGE_STORE=str(tmp / "store"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(wheels), str(src)], env, cwd)
    (wheel,) = wheels.glob("tmax-*.whl")
    run([sys.executable, "-m", "venv", str(venv)], env, cwd)
    python = str(venv / "bin" / "python")
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    env, cwd).stdout.strip())
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "checkout_venv_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], env, cwd)
    return venv, env, cwd, site


def test_the_installed_copy_runs_not_the_checkout(installed):
    venv, env, cwd, site = installed
    code = ("import json, sys, tmax, sandfleet, tmax.package_data as d; print(json.dumps("
            "[tmax.__file__, sandfleet.__file__, str(d.CONFIGS), str(d.EXAMPLE_TASKS), "
            "sys.path]))")
    tmax_file, sandfleet_file, configs, tasks, path = json.loads(
        run([str(venv / "bin" / "python"), "-c", code], env, cwd).stdout)
    for p in (tmax_file, sandfleet_file, configs, tasks):
        assert Path(p).is_relative_to(site), p
    assert not [p for p in path if p and Path(p).resolve() == REPO]


def files_and_modes(folder: Path) -> dict[str, bool]:
    return {str(p.relative_to(folder)): os.access(p, os.X_OK) for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.name != "README.md"}


def test_the_data_files_ship_with_their_modes(installed):
    site = installed[3]
    for folder in SHIPPED:
        mine = {str(Path(p).relative_to(folder)): os.access(REPO / p, os.X_OK)
                for p in source_files()
                if p.startswith(folder + "/") and not p.endswith("/README.md")}
        assert mine, f"{folder}: nothing there in the checkout"
        assert files_and_modes(site / folder) == mine, folder
    assert os.access(site / "sandfleet" / "runtime" / "tmax-apptainer", os.X_OK)


def shipped_example_tasks(installed) -> Path:
    """example_tasks() of the install: pip compiled the shipped tasks' .py files, so a copy
    without their __pycache__ folders, in the user's cache."""
    venv, env, cwd, site = installed
    code = "from tmax.package_data import example_tasks; print(example_tasks())"
    tasks = Path(run([str(venv / "bin" / "python"), "-c", code], env, cwd).stdout.strip())
    raw = site / "tmax" / "examples" / "tasks"
    if any(raw.rglob("__pycache__")):
        assert tasks.is_relative_to(Path(env["HOME"]) / ".cache" / "tmax"), tasks
        assert not any(tasks.rglob("__pycache__"))
        assert files_and_modes(tasks) == files_and_modes(raw)
    else:
        assert tasks == raw
    return tasks


def test_the_commands_run_from_the_install(installed):
    venv, env, cwd, site = installed
    bin_dir = venv / "bin"
    assert "demo" in run([str(bin_dir / "tmax"), "--help"], env, cwd).stdout
    demo = run([str(bin_dir / "tmax"), "demo", "--help"], env, cwd).stdout
    assert "[default: (the shipped example tasks)]" in " ".join(demo.split())
    # sandfleet doctor needs nothing of root's to report; its apptainer is the shipped
    # wrapper where no apptainer is on PATH
    doctor = json.loads(run([str(bin_dir / "sandfleet"), "doctor", "-o", "json"], env,
                            cwd).stdout)
    if shutil.which("apptainer", path=env["PATH"]) is None:
        assert doctor["tools"]["apptainer"] == str(site / "sandfleet" / "runtime" /
                                                   "tmax-apptainer")
    worker = run([str(bin_dir / "sandfleet"), "up", "--provider", "slurm", "--dry-run",
                  "--state-dir", str(cwd / "fleet")], env, cwd).stdout
    assert "#SBATCH --job-name=sandfleet-" in worker and "sandfleet.cli" in worker
    # the cluster example ships in sandfleet: by name, and printed to copy
    cluster = run([str(bin_dir / "sandfleet"), "up", "--config", "fleet-slurm", "--dry-run",
                   "--state-dir", str(cwd / "fleet")], env, cwd).stdout
    assert '"runtime": "apptainer"' in cluster and "#SBATCH" in cluster
    shown = run([str(bin_dir / "sandfleet"), "config", "fleet-slurm"], env, cwd).stdout
    assert shown.startswith("# Sandfleet on a Slurm cluster") and "provider: slurm" in shown


def test_the_9b_slurm_launch_dry_run_from_the_install(installed):
    """The README's command, from a folder without configs/: the shipped config (also by
    name), rendered through the shipped templates."""
    venv, env, cwd, _ = installed
    train = str(venv / "bin" / "tmax-train")
    by_path = run([train, "--config", "configs/qwen3.5-9b.yaml", "--launcher", "slurm",
                   "--dry-run"], env, cwd).stdout
    by_name = run([train, "--config", "qwen3.5-9b", "--launcher", "slurm", "--dry-run"], env,
                  cwd).stdout
    assert by_path == by_name
    scripts = [line for line in by_path.splitlines() if line.startswith("# ===== ")]
    assert [s.rsplit("/", 1)[1] for s in scripts] == \
        [f"inference-{i}.sbatch" for i in range(6)] + ["trainer.sbatch"]
    assert by_path.count("#SBATCH --job-name=tmax-qwen3.5-9b-") == 7
    detached = run([train, "--config", "qwen3.5-9b", "--launcher", "slurm", "--detach",
                    "--dry-run"], env, cwd).stdout  # the orchestrator's template too
    assert detached.startswith("# ===== ") and \
        detached.splitlines()[0].endswith("/orchestrator.sbatch")
    missing = subprocess.run([train, "--config", "configs/no-such.yaml", "--dry-run"], env=env,
                             cwd=cwd, capture_output=True, text=True, check=False)
    assert missing.returncode != 0 and "qwen3.5-9b" in missing.stderr  # the names it knows


def test_the_tiny_config_finds_the_shipped_tasks_and_agent_config(installed):
    """Relative paths of a config (and the defaults' examples/tasks) fall back to the
    package's shipped files when the working folder has none."""
    venv, env, cwd, site = installed
    train = str(venv / "bin" / "tmax-train")
    tasks = str(shipped_example_tasks(installed))
    tiny = yaml.safe_load(run([train, "--config", "tiny-cpu", "--dry-run"], env, cwd).stdout)
    assert tiny["tasks"]["paths"] == [tasks]
    assert tiny["agent"]["config"] == str(site / "tmax" / "configs" / "agent-tiny.yaml")
    defaults = yaml.safe_load(run([train, "--dry-run"], env, cwd).stdout)
    assert defaults["tasks"]["paths"] == [tasks]


def test_the_example_tasks_and_base_table_from_the_install(installed):
    venv, env, cwd, site = installed
    tasks = shipped_example_tasks(installed)
    report = json.loads(run([str(venv / "bin" / "tmax"), "tasks", "validate", "-o", "json",
                             str(tasks)], env, cwd).stdout)
    expected = sorted(p.parent.name for p in (REPO / "tmax" / "examples" / "tasks")
                      .glob("*/task.toml"))
    assert report["ok"] and sorted(t["task"] for t in report["tasks"]) == expected
    code = ("from tmax.images.bases import BaseTable; t = BaseTable.load(); "
            "b = t.resolve('python:3.12-slim'); print(t.path); print(t.definition_path(b))")
    table, definition = run([str(venv / "bin" / "python"), "-c", code], env,
                            cwd).stdout.split()
    assert Path(table) == site / "tmax" / "configs" / "base-images.yaml"
    assert Path(definition).is_relative_to(site / "tmax" / "images" / "data")
    assert Path(definition).is_file()
