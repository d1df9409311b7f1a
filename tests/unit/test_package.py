"""Packaging contracts: the console scripts, the import rules, silence on import."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def modules(package: str) -> list[Path]:
    """The package's Python modules: files in folders with an ``__init__.py`` all the way
    down (the Python files shipped as data, the example tasks', are not modules)."""
    return [p for p in (REPO / package).rglob("*.py")
            if all((f / "__init__.py").is_file() for f in p.parents if f.is_relative_to(
                REPO / package))]


def test_sandfleet_never_imports_tmax():
    offenders = []
    for path in (REPO / "sandfleet").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "tmax"]
    assert offenders == []


@pytest.mark.parametrize("module", ["tmax", "tmax.cli", "tmax.tasks", "sandfleet",
                                    "sandfleet.cli", "tmax.train.cli"])
def test_silent_on_import_and_no_heavy_imports(module):
    code = (f"import sys, {module}; "
            "heavy = [m for m in ('torch', 'transformers', 'vllm', 'deepspeed', 'submitit') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]" and out.stderr == ""


@pytest.mark.parametrize("script, expected", [("tmax", "Commands:"),
                                              ("tmax-train", "--config"),
                                              ("sandfleet", "Commands:")])
def test_console_scripts_answer_help(script, expected):
    out = subprocess.run([str(BIN / script), "--help"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and expected in out.stdout


def test_sandfleet_doctor_reports_runtimes():
    out = subprocess.run([str(BIN / "sandfleet"), "doctor", "-o", "json"], capture_output=True,
                         text=True, timeout=60, check=True)
    report = json.loads(out.stdout)
    assert set(report["runtimes"]) == {"local", "apptainer"}
    # bwrap and squashfs tools are installed by bin/tmax-setup, so the local runtime is usable
    assert report["runtimes"]["local"] is True
    assert report["providers"]["slurm"] is True


def test_tmax_train_env_reports_torch_and_lazy_gpu_extras():
    out = subprocess.run([str(BIN / "tmax-train"), "env", "-o", "json"], capture_output=True,
                         text=True, timeout=120, check=True)
    report = json.loads(out.stdout)
    import torch

    assert report["torch"] == torch.__version__
    assert report["cuda_available"] == torch.cuda.is_available()


def sandfleet_import_graph() -> dict[str, set[str]]:
    """Module -> the sandfleet modules it imports (anywhere in it, function bodies too).
    ``from a import b`` names module ``a.b`` when that is a module; importing ``a.b.c``
    from outside package ``a.b`` also runs ``a.b``'s ``__init__``, so that counts too."""
    root = REPO / "sandfleet"
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                            for a in node.names]
        for target in targets:
            if not target.startswith("sandfleet"):
                continue
            while target not in modules:  # an attribute of a module
                target = target.rpartition(".")[0]
            edges = [target]
            parent = target.rpartition(".")[0]
            while parent and not (name == parent or name.startswith(parent + ".")):
                edges.append(parent)
                parent = parent.rpartition(".")[0]
            graph[name] |= {e for e in edges if e != name}
    return graph


def test_sandfleet_has_no_import_cycle():
    graph = sandfleet_import_graph()
    assert "sandfleet.controller.core" in graph and "sandfleet.providers.slurm" in graph
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):]
                                                                 + [module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_controller_providers_and_worker_import_in_one_direction():
    graph = sandfleet_import_graph()
    below = {m: {t for t in graph if t == m or t.startswith(m + ".")}
             for m in ("sandfleet.controller", "sandfleet.providers", "sandfleet.worker")}
    imports = {m: set().union(*(graph[t] for t in below[m])) for m in below}
    assert not imports["sandfleet.providers"] & (below["sandfleet.controller"]
                                                 | below["sandfleet.worker"])
    assert not imports["sandfleet.worker"] & (below["sandfleet.controller"]
                                              | below["sandfleet.providers"])
    assert not imports["sandfleet.controller"] & below["sandfleet.worker"]
    scaler = graph["sandfleet.controller.scaler"]
    assert "sandfleet.providers.base" in scaler and "sandfleet.controller.core" not in scaler


def test_tmax_uses_only_sandfleets_public_api():
    """tmax imports sandfleet's names from the package itself (sandfleet/__init__.py lists
    them), never from its modules; and every public name resolves."""
    import sandfleet

    offenders = []
    for path in modules("tmax"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names
                          if n.startswith("sandfleet.")]
            if isinstance(node, ast.ImportFrom) and node.module == "sandfleet":
                offenders += [f"{path.relative_to(REPO)}: sandfleet.{a.name} is not public"
                              for a in node.names if a.name not in sandfleet.__all__]
    assert offenders == []
    assert all(getattr(sandfleet, name) is not None for name in sandfleet.__all__)


def test_library_modules_never_import_cli_modules():
    """Only command-line modules (cli.py, and tmax/cli.py) import other CLI modules."""
    offenders = []
    for path in modules("tmax") + modules("sandfleet"):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names
                          if n.split(".")[-1] == "cli"]
    assert offenders == []
