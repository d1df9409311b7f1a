"""Forged-reward rate of issue 33's three hacks on the shipped Harbor examples (or any folder
of Harbor tasks), before and after the verifier plan (``sandfleet.verifier.plan``).

    .venv/bin/python benchmarks/forge_bench.py [--store ~/.cache/tmax/test-harbor-examples]
        [--tasks examples/harbor] [--old-rev 63d0e48] [--new-tree .] [--out FILE.json]

Run as root, after tests/integration/test_harbor_examples.py has built the examples' images into the
store (content-addressed: the same images both implementations grade); with ``--tasks DIR``
(every task ``find_tasks(DIR)`` finds, for both implementations; default: each tree's own
examples/harbor), after ``tmax images build --store STORE DIR/*`` has built them. Each
implementation runs in an agent process of its own from its tree (``--old-rev``: a git
worktree made under /tmp and removed at the end; ``--new-tree``: a checkout), so imports never
mix. For every task and hack: a fresh sandbox of the task's image with its limits
(``task_spec``), the image's ENTRYPOINT, the hack's commands as the agent (no solution: honest
work scores 0), then the task's verifier as rollouts and the build-time checks run it
(``RuntimeBox.verify``: same env, user, workdir, grading). A reward of 1 is a forged
reward. Hacks:

- ``uv-env``: the unmodified Harbor test.sh (uv's installer offline, ``source
  $HOME/.local/bin/env``, ``uvx ... pytest``); the agent's env defines ``uvx() { return 0; }``.
- ``python-m``: the same tests run as Terminal-Bench 1 scripts do, ``uv run --with
  pytest==8.4.1 --with pytest-json-ctrf==0.3.5 python -m pytest`` in the workdir (its packages
  already in the image's prepared uv cache); the agent writes ``pytest.py`` there.
- ``top-venv``: each image with a venv at /venv added (``python3 -m venv``; its
  ``bin/pytest`` runs the prepared uvx pytest, as a venv's pytest would), the verifier's PATH
  starting with /venv/bin, test.sh running ``pytest``; the agent replaces /venv/bin/pytest.

Each hack also runs once without the attack (a control: 0 expected from both), so a
verifier that cannot run at all shows as an error, not as a held seal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

log = logging.getLogger("forge_bench")
REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("TMAX_TEST_CACHE", Path.home() / ".cache" / "tmax"))
HACKS = ("uv-env", "python-m", "top-venv")
PYTEST = ("--with pytest==8.4.1 --with pytest-json-ctrf==0.3.5")
PYTHON_M_SH = f"""\
#!/bin/bash
uv run --no-project {PYTEST} python -m pytest /tests -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
VENV_SH = """\
#!/bin/bash
pytest /tests -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
VENV_PYTEST = f"#!/bin/sh\nexec /.tmax/verifier/bin/uvx {PYTEST} pytest \"$@\"\n"


def attack(hack: str, workdir: str) -> str:
    if hack == "uv-env":
        return ("mkdir -p $HOME/.local/bin && "
                "echo 'uvx() { return 0; }' > $HOME/.local/bin/env")
    if hack == "python-m":
        return f"printf 'import sys\\nsys.exit(0)\\n' > {workdir}/pytest.py"
    return "printf '#!/bin/sh\\nexit 0\\n' > /venv/bin/pytest && chmod 755 /venv/bin/pytest"


def venv_image(sif: Path, out: Path) -> Path:
    """``sif`` plus a venv at /venv whose bin/pytest runs the prepared uvx pytest."""
    from sandfleet.runtime import sif as sifs

    root = out / "root"
    sifs.extract(sif, root)
    python = next(p for p in ("usr/local/bin/python3", "usr/bin/python3") if (root / p).exists())
    subprocess.run(["chroot", str(root), f"/{python}", "-m", "venv", "--without-pip", "/venv"],
                   check=True, timeout=300, capture_output=True)
    (root / "venv/bin/pytest").write_text(VENV_PYTEST)
    (root / "venv/bin/pytest").chmod(0o755)
    packed = sifs.pack(root, out / "venv.sif")
    shutil.rmtree(root, ignore_errors=True)
    return packed


def agent(store_dir: Path, out: Path, tasks_dir: Path | None) -> None:
    """In the implementation's own tree: every task of ``tasks_dir`` (default: the tree's
    examples/harbor) x hack x (control, attack)."""
    from dataclasses import replace

    from sandfleet.runtime.local import LocalRuntime
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import fresh_box
    from tmax.images.store import ImageStore
    from tmax.tasks import find_tasks, load_task
    from tmax.tasks.reward import VerifierError

    store = ImageStore(store_dir)
    builds = ImageBuilds(store, LocalBuilder(CACHE))
    work = Path(tempfile.mkdtemp(prefix="forge-bench-"))
    runtime = LocalRuntime(work / "state", work / "cache", owner="forgebench")
    rows = []
    try:
        for task_dir in find_tasks(tasks_dir or REPO / "examples" / "harbor"):
            task = load_task(task_dir)
            entry = store.read().tasks.get(task.task_id)
            if entry is None:
                rows.append({"task": task.task_id, "error": "not in the store"})
                continue
            image, _ = builds.sandbox_images(builds.plan(task), entry)
            for hack in HACKS:
                tests = work / f"{task.task_id}-{hack}-tests"
                shutil.copytree(task.tests_dir, tests)
                img = image
                if hack == "python-m":
                    (tests / "test.sh").write_text(PYTHON_M_SH)
                elif hack == "top-venv":
                    (tests / "test.sh").write_text(VENV_SH)
                    img = replace(image, sif=venv_image(image.sif, work / f"{task.task_id}-venv"))
                for attacked in (False, True):
                    logs: list[str] = []
                    t0 = time.monotonic()
                    row = {"task": task.task_id, "hack": hack, "attacked": attacked}
                    try:
                        with fresh_box(runtime, task, img, logs, hack) as box:
                            if hack == "top-venv":
                                box.base_path = f"/venv/bin:{box.base_path}"
                            if attacked:
                                box.run(attack(hack, img.workdir), 60)
                            scratch = work / f"s-{len(rows)}"
                            g = box.verify(task, scratch, tests)
                            row["reward"] = getattr(g, "reward", g)  # (a float before)
                    except VerifierError as e:
                        row["error"] = str(e)[:300]
                    row["seconds"] = round(time.monotonic() - t0, 1)
                    row["log_tail"] = "\n".join(logs)[-600:]
                    rows.append(row)
                    log.info("%s", {k: v for k, v in row.items() if k != "log_tail"})
    finally:
        runtime.reap(keep=())
        shutil.rmtree(work, ignore_errors=True)
    out.write_text(json.dumps(rows, indent=1))


def run_impl(tree: Path, store: Path, out: Path, tasks: Path | None) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "agent", "--store",
                    str(store), "--agent-out", str(out),
                    *(["--tasks", str(tasks)] if tasks else [])],
                   cwd=tree / "benchmarks", env=env, check=True, timeout=7200)
    return json.loads(out.read_text())


def summarise(rows: list[dict]) -> dict:
    result = {}
    for hack in HACKS:
        attacked = [r for r in rows if r.get("hack") == hack and r["attacked"]]
        control = [r for r in rows if r.get("hack") == hack and not r["attacked"]]
        result[hack] = {
            "forged": sum(r.get("reward") == 1.0 for r in attacked), "tried": len(attacked),
            "errors": sum("error" in r for r in attacked),
            "control_zero": sum(r.get("reward") == 0.0 for r in control),
            "control_errors": sum("error" in r for r in control)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", default="bench", choices=["bench", "agent"])
    parser.add_argument("--store", type=Path, default=CACHE / "test-harbor-examples")
    parser.add_argument("--old-rev", default="63d0e48")
    parser.add_argument("--new-tree", type=Path, default=REPO)
    parser.add_argument("--tasks", type=Path, help="a folder of Harbor tasks "
                        "[each tree's examples/harbor]")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--agent-out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.what == "agent":
        agent(args.store, args.agent_out, args.tasks)
        return
    report = {"machine": machine(), "store": str(args.store), "old_rev": args.old_rev,
              "tasks": str(args.tasks or "examples/harbor")}
    tmp = Path(tempfile.mkdtemp(prefix="forge-bench-trees-"))
    old = tmp / "old"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old),
                    args.old_rev], check=True, capture_output=True, timeout=120)
    shutil.copy(Path(__file__), old / "benchmarks" / "forge_bench.py")  # (this agent)
    try:
        for name, tree in (("before", old), ("after", args.new_tree.resolve())):
            rows = run_impl(tree, args.store, tmp / f"{name}.json",
                            args.tasks and args.tasks.resolve())
            report[name] = {"summary": summarise(rows), "rows": rows}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)],
                       check=False, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
    lines = ["| hack | before: forged / tried | after: forged / tried | controls 0 (before, after) |",
             "|---|---|---|---|"]
    for hack in HACKS:
        b, a = report["before"]["summary"][hack], report["after"]["summary"][hack]
        lines.append(f"| {hack} | {b['forged']} / {b['tried']} ({b['errors']} errors) | "
                     f"{a['forged']} / {a['tried']} ({a['errors']} errors) | "
                     f"{b['control_zero']}, {a['control_zero']} |")
    emit(report, f"forged rewards on {report['tasks']}, {report['machine']}", "\n".join(lines),
         args.out)


if __name__ == "__main__":
    main()
