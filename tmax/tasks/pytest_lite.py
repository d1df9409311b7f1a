#!/usr/bin/env python3
"""Run a pytest-style test file with pytest if the image has it, else with the stdlib.

Shipped into converted tasks (tests/tmax_pytest_lite.py) so that their verifiers run in
images without pytest and without a network. The fallback runner collects module-level
``test_*`` functions and ``Test*`` classes' ``test_*`` methods, gives a fresh directory to a
``tmp_path`` argument, and fails a test that asks for any other fixture. Exit status 0 iff
at least one test ran and all passed.

Usage: python3 tmax_pytest_lite.py FILE.py [FILE.py ...]
"""

import importlib.util
import inspect
import pathlib
import subprocess
import sys
import tempfile
import traceback


def _has_pytest() -> bool:
    return importlib.util.find_spec("pytest") is not None


def _collect(module):
    for name, obj in vars(module).items():
        if name.startswith("test") and inspect.isfunction(obj):
            yield name, obj
        elif name.startswith("Test") and inspect.isclass(obj):
            for meth in sorted(n for n in dir(obj) if n.startswith("test")):
                yield f"{name}.{meth}", _bind(obj, meth)


def _bind(cls, meth):
    def call(**kwargs):
        return getattr(cls(), meth)(**kwargs)

    call.__signature__ = inspect.signature(getattr(cls, meth)).replace(
        parameters=list(inspect.signature(getattr(cls, meth)).parameters.values())[1:])
    return call


def _run_file(path: str) -> tuple[int, int]:
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a Python module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(pathlib.Path(path).parent))
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - a module that fails to import is a failed test file
        traceback.print_exc()
        print(f"ERROR collecting {path}")
        return 0, 1
    passed = total = 0
    for name, fn in _collect(module):
        total += 1
        try:
            kwargs = {}
            for param in inspect.signature(fn).parameters:
                if param != "tmp_path":
                    raise TypeError(f"fixture {param!r} is not available without pytest")
                kwargs[param] = pathlib.Path(tempfile.mkdtemp())
            fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - a test's failure is data here
            print(f"FAILED {path}::{name} - {type(e).__name__}: {e}")
        else:
            passed += 1
            print(f"PASSED {path}::{name}")
    return passed, total


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    if _has_pytest():
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-rA", *argv])
    passed = total = 0
    for path in argv:
        p, t = _run_file(path)
        passed, total = passed + p, total + t
    print(f"{passed} passed, {total - passed} failed")
    return 0 if total and passed == total else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
