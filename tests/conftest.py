"""Shared fixtures. `local_slurm`: one real local Slurm cluster per test session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "tasks"
LOCAL_SLURM = REPO / "bin" / "tmax-local-slurm"
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol")


@dataclass(frozen=True)
class LocalSlurm:
    dir: Path
    conf: Path
    env: dict[str, str]  # os.environ plus SLURM_CONF, for subprocess calls


def local_slurm_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run bin/tmax-local-slurm; the caller checks returncode."""
    return subprocess.run(
        [str(LOCAL_SLURM), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


@pytest.fixture(scope="session")
def local_slurm():
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/local/sbin:/sbin"
    missing = [b for b in SLURM_BINARIES if shutil.which(b, path=path) is None]
    if missing:
        pytest.fail(
            f"Slurm/munge binaries missing: {', '.join(missing)}; run bin/tmax-setup "
            "(it installs slurm-wlm and munge)",
            pytrace=False,
        )
    # Not under pytest's tmp root (0700, and made so again by every pytest that starts):
    # like a real cluster's, its munge socket and slurm.conf serve other users' jobs too
    # (tests/integration/test_apptainer_slurm.py submits as an ordinary user).
    root = Path(tempfile.mkdtemp(prefix="tmax-local-slurm-", dir="/tmp"))
    root.chmod(0o755)
    up = local_slurm_cmd("up", "--dir", str(root), "--nodes", "3", "--cpus", "2")
    if up.returncode != 0:
        local_slurm_cmd("down", "--dir", str(root))
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"tmax-local-slurm up failed ({up.returncode}):\n{up.stderr}", pytrace=False)
    conf = root / "etc" / "slurm.conf"
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # for in-process clients such as submitit
    try:
        yield LocalSlurm(dir=root, conf=conf, env={**os.environ, "SLURM_CONF": str(conf)})
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        down = local_slurm_cmd("down", "--dir", str(root))
        assert down.returncode == 0, f"tmax-local-slurm down failed:\n{down.stderr}"
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def base_store():
    """A store holding the slim Debian base (images/debian-slim.def), built once per machine.

    Built by the local builder (debootstrap from this machine's apt mirror, mksquashfs,
    siftool) into ~/.cache/tmax/test-store (or $TMAX_TEST_CACHE), so later sessions reuse
    it; the first build takes one to two minutes.
    """
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.store import ImageStore

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    builds = ImageBuilds(ImageStore(cache / "test-store"), LocalBuilder(cache))
    builds.ensure_base("debian-slim")
    return builds.store


@pytest.fixture(scope="session")
def base_sif(base_store) -> Path:
    """The SIF of the slim Debian base (python3, bash, coreutils, sqlite3, jq, ...)."""
    return base_store.path(base_store.read().bases["debian-slim"].sif)


LAYER_MARK = "/etc/tmax-layer"
"""A file only ``layered_base``'s task layer has (the base's /etc/motd it removes)."""


@pytest.fixture(scope="session")
def layered_base(base_sif, tmp_path_factory) -> Path:
    """The slim Debian base as a layered image, as builds store a task's: a layers file
    naming a small task layer (``LAYER_MARK`` added, /etc/issue changed, /etc/motd
    removed by a whiteout) over the base's SIF."""
    from sandfleet import layers
    from tmax.images import layering

    root = tmp_path_factory.mktemp("layered-base")
    tree = root / "tree"
    (tree / "etc").mkdir(parents=True)
    for folder in (tree, tree / "etc"):
        folder.chmod(0o755)
    (tree / LAYER_MARK.lstrip("/")).write_text("layered\n")
    (tree / "etc/issue").write_text("TMax layered test image\n")
    layering.pack_layer(tree, ["etc/motd c 0 0 0 0 0"], root / "task.sqfs", timeout=120)
    layers.write(root / "image.layers", [root / "task.sqfs", base_sif])
    return root / "image.layers"


@pytest.fixture(scope="session")
def example_store(base_store):
    """A store with every example task's image, built with checks, kept between sessions
    next to the base (content-addressed: only changed tasks are rebuilt).

    The first build takes a few minutes; later sessions find them cached.
    """
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker
    from tmax.images.store import ImageStore
    from tmax.tasks import find_tasks
    from tmax.tasks.native import load_task

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    store = ImageStore(cache / "test-examples")
    link_base(store, base_store)
    builds = ImageBuilds(store, LocalBuilder(cache), checker=image_checker(cache, "local"))
    tasks = [load_task(p) for p in find_tasks(EXAMPLES)]
    results = builds.build_all(tasks, jobs=2, progress=False)
    failed = {r.task_id: r.error for r in results if r.status == "failed"}
    assert not failed, f"example images failed to build: {failed}"
    return store


@pytest.fixture(scope="session")
def example_fleet(tmp_path_factory):
    """A local fleet (one worker, 8 CPUs: four 2-CPU sandboxes at once) for rollout tests."""
    from tests.fleet_harness import Fleet

    root = tmp_path_factory.mktemp("example-fleet")
    with Fleet(root, root / "cache", min_nodes=1, cpus_per_node=8,
               memory_mb_per_node=16384).running() as fleet:
        yield fleet


@pytest.fixture(scope="module")
def fleet_cache(tmp_path_factory):
    """The image cache of the fleets a test module starts."""
    return tmp_path_factory.mktemp("fleet-cache")


@pytest.fixture
def make_fleet(tmp_path, fleet_cache):
    """``make_fleet(**config overrides)``: a local fleet up under tmp_path (tests/fleet_harness.py);
    each one made is taken down at the end and checked to leave nothing behind."""
    from tests.fleet_harness import Fleet

    fleets = []

    def make(**overrides) -> Fleet:
        fleet = Fleet(tmp_path / f"f{len(fleets)}", fleet_cache, **overrides)
        fleets.append(fleet)
        return fleet.up()

    yield make
    errors = []
    for fleet in fleets:
        try:
            fleet.down()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


def store_with_base(root: Path, base_store, base: str = "debian-slim"):
    """A fresh store at ``root`` holding ``base_store``'s ``base`` (hard-linked, no
    rebuild)."""
    from tmax.images.store import ImageStore

    store = ImageStore(root)
    link_base(store, base_store, base)
    return store


def link_base(store, base_store, base: str = "debian-slim") -> None:
    """``base_store``'s entry of ``base`` into ``store``, its SIF hard-linked (nothing to
    do where ``store`` holds that entry already)."""
    entry = base_store.read().bases[base]
    if store.read().bases.get(base) == entry:
        return
    target = store.path(entry.sif)
    target.unlink(missing_ok=True)
    os.link(base_store.path(entry.sif), target)
    store.update(lambda m: m.bases.__setitem__(base, entry))


def checked_local_builds(store):
    """ImageBuilds on ``store`` with the local builder and the local runtime's checks,
    caches in ~/.cache/tmax (or $TMAX_TEST_CACHE)."""
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker

    cache = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
    return ImageBuilds(store, LocalBuilder(cache), checker=image_checker(cache, "local"))


def checked_build(root: Path, base_store, make) -> tuple[Any, Any, Any]:
    """``(store, task, build result)``: the task ``make(tasks folder)`` writes, built with
    its checks into a fresh store at ``root`` holding ``base_store``'s Debian base."""
    from tmax.tasks import load_task

    store = store_with_base(root / "store", base_store)
    task = load_task(make(root / "tasks"))
    return store, task, checked_local_builds(store).build(task)


def passing_checks_log(store, task, result) -> str:
    """The log of a build whose checks passed (nop 0, oracle 1), asserted first."""
    assert result.status == "built", result.error
    log = store.path(store.read().tasks[task.task_id].checks.log).read_text()
    assert (result.checks["nop_reward"], result.checks["oracle_reward"]) == (0.0, 1.0), \
        log[-3000:]
    return log


@pytest.fixture
def image_store(tmp_path, base_store):
    """A fresh, empty store that already holds the base (hard-linked, no rebuild)."""
    return store_with_base(tmp_path / "store", base_store)


# A test says itself that it is slow: `@pytest.mark.slow` on the test, or
# `pytestmark = pytest.mark.slow` for a module whose tests all are. The full suite (CI) runs
# them; `bin/tmax-dev test --quick` (-m "not slow") leaves them out. Slow are the tests that
# build images, bring up a Slurm cluster or a fleet of several nodes, or train, and the
# longest of the rest (over ~2.5 s each on a 2-core machine: fault injection with real
# timeouts, SFT, sandboxes killed at their lifetime). A test that uses one of these fixtures
# (or is marked `slurm`) and is not marked slow fails the collection (the check below), so
# the quick tier cannot grow a slow test unnoticed.
SLOW_FIXTURES = frozenset({"local_slurm", "example_store", "example_fleet", "image_store",
                           "checked_builds", "builds", "harbor_store"})


def unmarked_slow_tests(items) -> list[str]:
    """Node ids of the tests that use a slow fixture or are marked `slurm`, unmarked slow."""
    return [item.nodeid for item in items
            if not item.get_closest_marker("slow")
            and (SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                 or item.get_closest_marker("slurm"))]


def pytest_collection_modifyitems(config, items):
    unmarked = unmarked_slow_tests(items)
    if unmarked:
        raise pytest.UsageError(
            "tests using a slow fixture (" + ", ".join(sorted(SLOW_FIXTURES)) + ") or marked "
            "slurm must be marked slow: add @pytest.mark.slow to\n  " + "\n  ".join(unmarked))


MYPY_TEST = "tests/unit/test_lint.py::test_mypy_finds_nothing"
early_mypy: dict[str, Any] = {}
"""The type check, started in the background when the session holds its test (it takes
about two minutes of one core on a fresh clone, much of it while other tests wait on
sandboxes and Slurm); the test collects its result."""


def pytest_collection_finish(session):
    import tempfile

    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: every worker
        return  # collects every test; the one that runs it runs mypy then
    if not any(item.nodeid == MYPY_TEST for item in session.items):
        return
    out = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "mypy", "sandfleet", "tmax"],
                            cwd=Path(__file__).resolve().parents[1], stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    early_mypy.update(proc=proc, out=out)


def pytest_sessionfinish(session):
    proc = early_mypy.get("proc")
    if proc is not None and proc.poll() is None:  # the session ended before its test ran
        proc.kill()
        proc.wait()
