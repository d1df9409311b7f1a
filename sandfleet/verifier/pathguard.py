"""The verifier's ``sitecustomize`` (``sandfleet.verifier.plan`` mounts this file's text as
``/.tmax/python/sitecustomize.py``, first on the verifier's PYTHONPATH). Imported under any
other name (as part of sandfleet) it does nothing.

Python puts the working directory first on ``sys.path`` for ``python -m`` and ``-c`` (and a
script's own folder for a script): in a verifier that runs ``python3 -m pytest`` in the
agent's workdir, an agent's ``pytest.py`` (or ``_pytest/``, ``pluggy/``, ``argparse.py``...)
would be imported instead of the image's. Here, at every top-level import,
that entry (and any other naming the working directory) moves to the end of ``sys.path``, as ``tmax-agent:<folder>``: its modules still
import (tests that import the agent's code from the workdir work), but only under names that
nothing before it has; and ``importlib.metadata`` cannot read it (no entry-point plugins from
the workdir). A script's folder stays where it is: /tests' scripts are the task's.

Then the image's own ``sitecustomize``, if it has one, is imported as it would have been, and
cmeel's package folder is put on ``sys.path`` (``_cmeel_paths``).
Written for any Python the image may have (no annotations or f-strings; inert where there is
no ``importlib.machinery``, as in Python 2).
"""

import os
import sys

MARK = "tmax-agent:"


def _agent_entries():
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = None
    return [e for e in sys.path if e == "" or (cwd is not None and e == cwd and
                                              not cwd.startswith("/tests"))]


class _Guard:
    """A meta path finder that, at each top-level import, moves the working directory's
    entries of sys.path (Python puts one in after start-up) last; it finds nothing."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is None:
            moved = _agent_entries()
            for entry in moved:
                sys.path.remove(entry)
            for entry in moved:
                entry = MARK + (os.getcwd() if entry == "" else entry)
                if entry not in sys.path:
                    sys.path.append(entry)
        return None

    @staticmethod
    def invalidate_caches():
        pass


def _hook(entry):
    if not (isinstance(entry, str) and entry.startswith(MARK)):
        raise ImportError
    import importlib.machinery as machinery
    finder = machinery.FileFinder(entry[len(MARK):], *_loaders())
    finder.path = entry[len(MARK):]
    return finder


def _loaders():
    import importlib.machinery as m
    return [(m.ExtensionFileLoader, m.EXTENSION_SUFFIXES),
            (m.SourceFileLoader, m.SOURCE_SUFFIXES),
            (m.SourcelessFileLoader, m.BYTECODE_SUFFIXES)]


def _chain():
    """Import the image's own sitecustomize, which this one hides (never one in the working
    directory, which a test.sh may have put on PYTHONPATH: ``PYTHONPATH=$PYTHONPATH:/app``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    agent = _agent_entries()
    sys.path[:] = [e for e in sys.path if os.path.abspath(e or ".") != here and e not in agent]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the image's, if any)
    except ImportError:
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    except Exception as e:  # noqa: BLE001 (as site.py reports a failing sitecustomize)
        sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                         + repr(e) + "\n")
    finally:
        sys.path[:] = [e for e in saved if os.path.abspath(e or ".") != here]


def _cmeel_paths():
    """cmeel's packages (eigenpy, pinocchio...) live under ``<site>/cmeel.prefix/lib/
    pythonX.Y/site-packages``, which their ``.pth`` line (``import cmeel_pth``) adds; the
    verifier does not run ``.pth`` code (``sandfleet.verifier.additions``), so the folder is
    added here, as a path, after everything else (it adds modules, never replaces one)."""
    version = str(sys.version_info[0]) + "." + str(sys.version_info[1])
    tail = os.path.join("cmeel.prefix", "lib", "python" + version, "site-packages")
    for entry in list(sys.path):
        if isinstance(entry, str) and entry.endswith(("site-packages", "dist-packages")):
            found = os.path.join(entry, tail)
            if os.path.isdir(found) and found not in sys.path:
                sys.path.append(found)


if __name__ == "sitecustomize":
    sys.path_hooks.insert(0, _hook)
    sys.meta_path.insert(0, _Guard)
    _chain()
    _cmeel_paths()
