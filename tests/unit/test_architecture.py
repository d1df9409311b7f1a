"""The architecture: no import cycle among tmax's and sandfleet's modules.

The graph is read from the source (the AST), not from what one run happens to import: an
import inside a function counts like one at the top of the module, because it is the same
dependency, only hidden. Only imports of the optional heavy dependencies may hide in
functions, and those never make an edge here (they are outside tmax and sandfleet)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("tmax", "sandfleet")

# Optional heavy dependencies: optional (vllm, deepspeed, wandb, tensorboard) or slow to
# import (torch, transformers, submitit, matplotlib). Importing them at the top of a module
# would make every `import tmax` pay for them (or fail where they are not installed), so
# they are imported inside the functions that use them. They are not tmax or sandfleet
# modules, so they never make an edge of the graph. (That sandfleet never imports tmax is
# tests/unit/test_package.py's check.)
HEAVY_DEPS = frozenset({"torch", "transformers", "tokenizers", "vllm", "deepspeed",
                        "accelerate", "peft", "safetensors", "submitit", "matplotlib", "wandb",
                        "tensorboard"})

# Cycles that exist on HEAD outside the image build and are being broken elsewhere: each
# entry is one strongly connected component (its modules). The list is strict: a cycle
# not in it fails, and so does an entry that no longer exists (remove it when it is fixed).
KNOWN_CYCLES: list[frozenset[str]] = []


def module_files() -> dict[str, Path]:
    """Module name -> file, for the packages' modules (folders with an ``__init__.py`` all
    the way down: the Python files shipped as data, such as example tasks, are not)."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            folders = path.relative_to(REPO).parents
            if not all((REPO / f / "__init__.py").is_file() for f in folders if f != Path(".")):
                continue
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(path: Path, package: str, modules: dict[str, Path]) -> list[str]:
    """Every module name an import statement anywhere in the file names (absolute), but
    those under ``if TYPE_CHECKING:`` (annotations only: they never run)."""
    names = []
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and _is_type_checking(block.test) for stmt in block.body
                   for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # `if TYPE_CHECKING:` never runs
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names]
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the tmax and sandfleet modules importing it runs.

    ``from a import b`` names module ``a.b`` when that is a module, else ``a``; an attribute
    path resolves to the module holding it. Importing ``a.b.c`` from outside package
    ``a.b`` also runs the ``__init__`` of ``a.b`` (and of ``a``), so those count too."""
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target in imported_names(path, package, modules):
            if target.split(".")[0] not in PACKAGES:
                continue
            while target not in modules:
                target = target.rpartition(".")[0]
            edges = [target]
            parent = target.rpartition(".")[0]
            while parent and not (name == parent or name.startswith(parent + ".")):
                edges.append(parent)
                parent = parent.rpartition(".")[0]
            graph[name] |= {e for e in edges if e != name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(frozenset(component))
    return components


def one_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A shortest cycle through the component's first module, for the message."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not a cycle")


def describe(graph: dict[str, set[str]], components: list[frozenset[str]]) -> str:
    return "\n".join(f"  {' -> '.join(one_cycle(graph, c))}   (component: {sorted(c)})"
                     for c in components)


def test_graph_sees_imports_inside_functions_and_package_inits(tmp_path):
    modules = {"p": tmp_path / "p/__init__.py", "p.a": tmp_path / "p/a.py",
               "p.b": tmp_path / "p/b.py", "q.c": tmp_path / "q/c.py"}
    (tmp_path / "p").mkdir()
    (tmp_path / "p/a.py").write_text("def f():\n    from . import b\n    import torch\n")
    assert imported_names(modules["p.a"], "p", modules) == ["p.b", "torch"]
    (tmp_path / "p/b.py").write_text("from .a import f as g\nfrom p.a import something\n")
    assert imported_names(modules["p.b"], "p", modules) == ["p.a", "p.a"]
    (tmp_path / "p/b.py").write_text("import typing\nif typing.TYPE_CHECKING:\n"
                                     "    from p import a\nelse:\n    from q import c\n")
    assert imported_names(modules["p.b"], "p", modules) == ["typing", "q.c"]  # never runs


def test_cycle_finder_finds_a_hidden_cycle_and_names_its_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert strongly_connected(graph) == [frozenset("abc")]
    assert one_cycle(graph, frozenset("abc")) == ["a", "b", "c", "a"]


def test_the_graph_reads_the_real_packages():
    graph = import_graph()
    assert "sandfleet" in graph["tmax.fleet"]
    assert "tmax.tasks.dockerfile" in graph["tmax.images.plan"]
    assert "tmax.tasks" in graph["tmax.images.plan"]  # the package's __init__ runs too
    # an import inside a function is an edge like any other
    modules = module_files()
    hidden = [(name, target) for name, path in sorted(modules.items())
              for function in ast.walk(ast.parse(path.read_text()))
              if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
              for node in function.body if isinstance(node, ast.ImportFrom)
              and (target := node.module or "") in modules
              and not (name == target or name.startswith(target + "."))]
    assert hidden, "no import inside a function left in tmax or sandfleet to check with"
    assert all(target in graph[name] for name, target in hidden)


def test_no_import_cycle_in_tmax_or_sandfleet():
    graph = import_graph()
    components = strongly_connected(graph)
    new = [c for c in components if c not in KNOWN_CYCLES]
    fixed = [c for c in KNOWN_CYCLES if c not in components]
    message = ""
    if new:
        message += f"import cycles:\n{describe(graph, new)}\n"
    if fixed:
        message += ("cycles in KNOWN_CYCLES that no longer exist (remove them from the list):\n"
                    + "\n".join(f"  {sorted(c)}" for c in fixed) + "\n")
    if KNOWN_CYCLES and not message:
        print(f"known cycles still to break:\n{describe(graph, KNOWN_CYCLES)}")
    assert not message, message


# The image build's layers: what is pure (a task's files -> a build plan; what a build adds;
# the base table) never imports what executes a plan (commands, downloads, the store).
PURE_IMAGE_MODULES = ("types", "plan", "installers", "installer_scripts", "verifier_tools",
                      "verifier_scripts", "bases")
EXECUTING_IMAGE_MODULES = ("rootfs", "staging", "installer_staging", "verifier_staging",
                           "builders", "build", "checks", "store", "cli", "base_packages")
# (os stays allowed: os.environ and os.path are read by pure code too)
EXECUTING_STDLIB = frozenset({"subprocess", "urllib", "socket", "shutil", "tempfile",
                              "filelock", "sandfleet"})


def test_the_task_model_never_imports_the_image_build():
    """tmax.tasks reads what a task declares (task.toml, its Dockerfile and container.def);
    tmax.images builds it: the dependency goes one way."""
    graph = import_graph()
    offenders = [f"{m} -> {t}" for m in sorted(graph) if m.startswith("tmax.tasks")
                 for t in sorted(graph[m]) if t.startswith("tmax.images")]
    assert offenders == []


def test_pure_image_modules_import_nothing_that_executes():
    modules = module_files()
    assert all(f"tmax.images.{m}" in modules
               for m in PURE_IMAGE_MODULES + EXECUTING_IMAGE_MODULES)
    graph = import_graph()
    executing = {f"tmax.images.{m}" for m in EXECUTING_IMAGE_MODULES}
    offenders = []
    for name in PURE_IMAGE_MODULES:
        module = f"tmax.images.{name}"
        offenders += [f"{module} -> {t}" for t in sorted(graph[module] & executing)]
        offenders += [f"{module} -> {n}" for n in imported_names(modules[module], "tmax.images",
                                                                 modules)
                      if n.split(".")[0] in EXECUTING_STDLIB]
    assert offenders == []


@pytest.mark.parametrize("package", ["tmax/images", "tmax/tasks"])
def test_only_heavy_dependencies_are_imported_inside_functions(package):
    """In the image build and the task model, an import inside a function is only one of an
    optional heavy dependency: any other would be a dependency hidden from the reader."""
    offenders = []
    for path in sorted((REPO / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or "."] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names
                              if n.split(".")[0] not in HEAVY_DEPS]
    assert offenders == [], "\n".join(offenders)
