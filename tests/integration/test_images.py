"""Task images: definitions, the base table, builders, the store, and the CLI."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sandfleet.errors import ImageMissing
from sandfleet.runtime.sif import SifError, read_partition
from tests.unit.test_tasks import EXAMPLES, make_task, run_cli
from tmax.images.bases import BaseTable
from tmax.images.build import ImageBuilds
from tmax.images.builders import (
    ApptainerBuilder,
    LocalBuilder,
    apptainer_build_argv,
)
from tmax.images.plan import task_definition
from tmax.images.rootfs import apt_mirror
from tmax.images.types import parse_definition
from tmax.tasks import load_task

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "configs" / "base-images.yaml"


_ENTRY = re.compile(r"^\S{10} \S+ +\S+(?:, +\S+)? \S+ \S+ (.*)$")


def list_sif(sif: Path, option: str = "-l") -> str:
    """`unsquashfs -l` (or ``option``: -lln) of the image's root: a SIF's, or a layered
    image's as a sandbox sees it (each path from the topmost layer that has it, none that
    a layer above removes)."""
    from sandfleet import layers

    seen: dict[str, str] = {}
    hidden: list[str] = []
    for layer in layers.read(sif):
        out = subprocess.run(["unsquashfs", option, "-o", str(layer.offset), str(layer.path)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        gone = [f"squashfs-root/{w}" for w in layers.whiteouts(layer)]
        for line in out.splitlines():
            m = _ENTRY.match(line) if option != "-l" else None
            path = (m.group(1).split(" -> ")[0] if m else line)
            if path in seen or path in gone or \
                    any(path == h or path.startswith(h + "/") for h in hidden):
                continue
            seen[path] = line
        hidden += gone
    return "\n".join(seen[p] for p in sorted(seen)) + "\n"


def cat_sif(sif: Path, path: str, tmp: Path) -> str:
    """The text of file ``path`` of the image as built (a SIF, or a layered image)."""
    from sandfleet import layers

    text = layers.cat(sif, path.lstrip("/"))
    assert text is not None, f"{path} is not a file of {sif}"
    return text


# --------------------------------------------------------------------------- definitions


def test_dockerfile_becomes_definition_with_mapped_base(tmp_path):
    task = make_task(tmp_path, **{
        "environment/Dockerfile": "FROM python:3.11-slim\nENV GREETING=hi MODE=test\n"
                                  "WORKDIR /app\nCOPY data.txt /app/\nRUN echo built > /app/b\n",
        "environment/data.txt": "x\n"})
    tdef = task_definition(task / "environment", BaseTable.load(TABLE).resolve)
    assert tdef.base == "debian-slim" and tdef.workdir == "/app"
    d = tdef.definition
    assert d.files == [(".tmax-build", "/.tmax-build")]  # staged COPY sources, see tmax.images.plan
    post = d.sections["post"]
    copy, run = post.index("tmax_copy /.tmax-build/s0/c4 /app/ 1"), post.index("echo built")
    assert post.index("mkdir -p /app") < copy < run  # in the Dockerfile's order
    (run_line,) = [line for line in post.splitlines() if "env -i" in line]
    assert "GREETING=hi MODE=test" in run_line and "cd /app" in run_line  # ENV, WORKDIR
    assert "export GREETING=hi" in d.sections["environment"]
    assert parse_definition(d.render()).files == d.files  # renders back


# the base table (registry images -> local bases): tests/integration/test_bases.py


def test_apt_mirror_from_deb822_and_list(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://sec.example/debian-security\n"
        "Suites: bookworm-security\n")
    assert apt_mirror("bookworm", tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d" / "debian.sources").unlink()
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://other.example/debian trixie main\n")
    assert apt_mirror("trixie", tmp_path) == "http://other.example/debian"
    # an unlisted suite: the mirror of a listed Debian release (tests/integration/test_bases.py has more)
    assert apt_mirror("bookworm", tmp_path) == "http://other.example/debian"


# --------------------------------------------------------------------------- apptainer builder


def test_apptainer_build_argv_exact():
    assert apptainer_build_argv(Path("/s/out.sif"), Path("/t/task.def")) == \
        ["apptainer", "build", "--force", "/s/out.sif", "/t/task.def"]
    assert apptainer_build_argv(Path("o.sif"), Path("b.def"), apptainer="/opt/apptainer",
                                fakeroot=True, build_args={"MIRROR": "http://m/debian"}) == \
        ["/opt/apptainer", "build", "--force", "--fakeroot", "--build-arg",
         "MIRROR=http://m/debian", "o.sif", "b.def"]


def test_apptainer_builder_runs_the_commands(tmp_path, monkeypatch):
    """A stand-in `apptainer` records its argv and the definition it was given."""
    fake = tmp_path / "apptainer"
    fake.write_text("#!/bin/bash\nprintf '%s\\n' \"$@\" > \"$RECORD\"\n"
                    "cat \"${@: -1}\" > \"$RECORD.def\"\ntouch \"${@: -2:1}\"\n"
                    "cp -r \"$(dirname \"${@: -1}\")\" \"$RECORD.tmp\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("RECORD", str(tmp_path / "argv"))
    task = make_task(tmp_path, **{"environment/Dockerfile":
                                  "FROM python:3.11-slim\nCOPY data.txt /app/data.txt\n",
                                  "environment/data.txt": "x"})
    tdef = task_definition(task / "environment", BaseTable.load(TABLE).resolve)
    builder = ApptainerBuilder(apptainer=str(fake), fakeroot=False)
    out = tmp_path / "out" / "image.sif"
    out.parent.mkdir()
    builder.build_task(tdef, task / "environment", Path("/store/bases/b.sif"), out,
                       tmp_path / "log", 60)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:3] == ["build", "--force", str(out)]
    definition = (tmp_path / "argv.def").read_text()
    assert "Bootstrap: localimage\nFrom: /store/bases/b.sif\nStage: s0" in definition
    tmp = Path(definition.split("%files\n")[1].split()[0]).parent.parent
    assert f"%files\n    {tmp}/s0/.tmax-build /\n" in definition  # staged, laid out as /
    staged = tmp_path / "argv.tmp" / "s0" / ".tmax-build" / "s0" / "c2" / "0" / "data.txt"
    assert staged.read_text() == "x"
    assert "tmax_copy /.tmax-build/s0/c2 /app/data.txt 0" in definition
    builder.build_base("Bootstrap: debootstrap\nOSVersion: bookworm\nMirrorURL: {{ MIRROR }}\n",
                       out, tmp_path / "log", 60)
    argv = (tmp_path / "argv").read_text().split()
    assert argv[2:4] == ["--build-arg", f"MIRROR={apt_mirror()}"]


# --------------------------------------------------------------------------- local builder


@pytest.fixture
def builds(image_store, tmp_path):
    return ImageBuilds(image_store, LocalBuilder(Path.home() / ".cache" / "tmax"))


@pytest.mark.slow
def test_local_build_makes_a_real_sif_with_the_task_layer(builds, tmp_path):
    """With --single-file (``layered=False``): one whole SIF per task."""
    builds.layered = False
    task = load_task(EXAMPLES / "log-rotation-script")
    result = builds.build(task, check=False)
    assert result.status == "built", result.error
    entry = builds.store.read().tasks["log-rotation-script"]
    sif = builds.store.path(entry.sif)
    assert entry.sif == f"sif/{result.digest}.sif" and entry.size == sif.stat().st_size
    assert (entry.base, entry.builder, entry.workdir) == ("debian-slim", "local", "/app")
    listing = list_sif(sif)
    assert "squashfs-root/app/var/log/web access.log" in listing  # RUN ran in the chroot
    assert "squashfs-root/usr/bin/python3" in listing              # on top of the base
    assert "squashfs-root/.singularity.d/env/90-environment.sh" in listing
    # the SIF carries its definition object, like `apptainer build` makes
    dump = subprocess.run(["siftool", "list", str(sif)], capture_output=True, text=True,
                          check=True).stdout
    assert "Def.FILE" in dump and "Squashfs/*System" in dump


@pytest.mark.slow
def test_rebuild_only_when_inputs_change(builds, tmp_path):
    src = tmp_path / "tasks" / "t"
    shutil.copytree(EXAMPLES / "hello-world-file", src)
    first = builds.build(load_task(src), check=False)
    assert first.status == "built"
    assert builds.build(load_task(src), check=False).status == "cached"
    (src / "tests" / "extra.txt").write_text("tests are not part of the image")
    assert builds.build(load_task(src), check=False).status == "cached"
    (src / "environment" / "note.txt").write_text("new input")
    third = builds.build(load_task(src), check=False)
    assert third.status == "built" and third.digest != first.digest
    assert builds.store.read().tasks["t"].digest == third.digest


@pytest.mark.slow
def test_failed_build_leaves_no_entry_and_keeps_the_old_one(builds, tmp_path):
    src = make_task(tmp_path / "tasks", "t", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nRUN echo one > /one\n"})
    good = builds.build(load_task(src), check=False)
    assert good.status == "built"
    (src / "environment/Dockerfile").write_text(
        "FROM python:3.11-slim\nRUN echo about to fail && exit 3\n")
    bad = builds.build(load_task(src), check=False)
    assert bad.status == "failed" and "exit 3" in bad.error
    assert "about to fail" in Path(builds.store.path(bad.log)).read_text()
    assert builds.store.read().tasks["t"].digest == good.digest
    assert list((builds.store.root / "tmp").iterdir()) == []
    assert not builds.store.path(f"sif/{bad.digest}.sif").exists()


@pytest.mark.slow
def test_hanging_build_times_out(builds, tmp_path):
    src = make_task(tmp_path / "tasks", "t", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nRUN sleep 600\n",
        "task.toml": "[environment]\nbuild_timeout_sec = 2\n"})
    result = builds.build(load_task(src), check=False)
    assert result.status == "failed" and "timed out after 2s" in result.error
    assert builds.store.read().tasks == {}


@pytest.mark.slow
def test_unmapped_base_fails_the_task_only(builds, tmp_path):
    src = make_task(tmp_path / "tasks", "t", **{"environment/Dockerfile": "FROM alpine:3\n"})
    result = builds.build(load_task(src), check=False)
    assert result.status == "failed" and "no local base for image 'alpine:3'" in result.error


def _build_in_process(store_root: str, task_dir: str, queue) -> None:
    from tmax.images.store import ImageStore

    b = ImageBuilds(ImageStore(store_root), LocalBuilder(Path.home() / ".cache" / "tmax"))
    queue.put(b.build(load_task(task_dir), check=False).status)


@pytest.mark.slow
def test_two_concurrent_builders_build_once(builds, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process,
                         args=(str(builds.store.root), str(EXAMPLES / "hello-world-file"), queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert sorted(queue.get(timeout=5) for _ in procs) == ["built", "cached"]
    assert len(list((builds.store.root / "sif").iterdir())) == 1
    assert builds.store.verify() == []


@pytest.mark.slow
def test_verify_catches_corruption_and_truncation(builds, tmp_path):
    """Of a single-file image (a layer's: test_layered_images)."""
    builds.layered = False
    builds.build(load_task(EXAMPLES / "hello-world-file"), check=False)
    entry = builds.store.read().tasks["hello-world-file"]
    sif = builds.store.path(entry.sif)
    assert builds.store.verify() == []
    with open(sif, "r+b") as f:  # flip one byte deep inside the squashfs
        f.seek(entry.size // 2)
        byte = f.read(1)
        f.seek(entry.size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    (problem,) = builds.store.verify()
    assert problem["image"] == "task hello-world-file" and "sha256" in problem["reason"]
    os.truncate(sif, entry.size // 3)
    (problem,) = builds.store.verify(deep=False)
    assert "truncated" in problem["reason"]
    with pytest.raises(SifError, match="truncated"):
        read_partition(sif)
    with pytest.raises(ImageMissing, match="hello-world-file"):
        builds.store.task_image("hello-world-file", entry.digest)


@pytest.mark.slow
def test_missing_or_stale_image_at_run_time_is_image_missing(builds, tmp_path):
    with pytest.raises(ImageMissing, match="no image"):
        builds.store.task_image("nope", "0" * 32)
    result = builds.build(load_task(EXAMPLES / "hello-world-file"), check=False)
    assert builds.store.task_image("hello-world-file", result.digest).digest == result.digest
    with pytest.raises(ImageMissing, match="out of date"):
        builds.store.task_image("hello-world-file", "f" * 32)
    os.unlink(builds.store.path(builds.store.read().tasks["hello-world-file"].sif))
    with pytest.raises(ImageMissing, match="no such file"):
        builds.store.task_image("hello-world-file", result.digest)


@pytest.mark.slow
def test_gc_removes_only_unreferenced(builds, tmp_path):
    builds.build(load_task(EXAMPLES / "hello-world-file"), check=False)
    stray = builds.store.path("sif/deadbeef.sif")
    stray.write_bytes(b"old")
    leftover = builds.store.root / "tmp" / "crashed-build"
    leftover.mkdir()
    os.utime(leftover, (0, 0))
    removed = builds.store.gc()
    assert set(removed) == {stray, leftover}
    assert builds.store.verify() == []
    removed = builds.store.gc(keep_tasks=set())
    assert builds.store.read().tasks == {}
    assert any(p.parent.name == "sif" for p in removed)
    assert builds.store.read().bases  # bases stay


@pytest.mark.slow
def test_cli_build_ls_verify(image_store, tmp_path, monkeypatch):
    monkeypatch.setenv("TMAX_CACHE", str(Path.home() / ".cache" / "tmax"))
    store = str(image_store.root)
    res = run_cli("images", "build", EXAMPLES / "hello-world-file", "--store", store,
                  "--builder", "local", "--no-check", "-o", "json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["results"][0]["status"] == "built"
    res = run_cli("images", "ls", "--store", store, "-o", "json")
    assert set(json.loads(res.output)["tasks"]) == {"hello-world-file"}
    assert run_cli("images", "verify", "--store", store).exit_code == 0
    sif = image_store.path(image_store.read().tasks["hello-world-file"].sif)
    os.truncate(sif, 1000)
    res = run_cli("images", "verify", "--store", store)
    assert res.exit_code == 1 and "BAD  task hello-world-file" in res.output


def _build_and_hang(store_root: str, task_dir: str, cache: str) -> None:
    from tmax.images.store import ImageStore

    b = ImageBuilds(ImageStore(store_root), LocalBuilder(Path(cache)))
    b.build(load_task(task_dir), check=False)


@pytest.mark.slow
def test_killed_build_leaves_no_entry_and_releases_its_lock(builds, tmp_path):
    src = make_task(tmp_path / "tasks", "t", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nRUN touch /started && sleep 60\n"})
    ctx = multiprocessing.get_context("spawn")
    # its own node cache: the half-built root it leaves behind goes with tmp_path
    proc = ctx.Process(target=_build_and_hang,
                       args=(str(builds.store.root), str(src), str(tmp_path / "cache")))
    proc.start()
    logs = builds.store.root / "logs"
    for _ in range(600):  # wait until the RUN step is running
        if any("touch /started" in p.read_text() for p in logs.glob("t-*.log")):
            break
        proc.join(0.1)
    proc.kill()  # SIGKILL: no finally blocks run
    proc.join(30)
    assert builds.store.read().tasks == {}
    assert list((builds.store.root / "sif").iterdir()) == []
    # the lock died with the process: a new build of other inputs goes ahead
    (src / "environment/Dockerfile").write_text("FROM python:3.11-slim\nRUN touch /done\n")
    assert builds.build(load_task(src), check=False).status == "built"
    leftovers = list((builds.store.root / "tmp").iterdir())
    assert leftovers, "SIGKILL skipped the cleanup: the killed build's temp folder remains"
    assert set(builds.store.gc(tmp_age_s=0)) >= set(leftovers)  # gc takes them
    assert list((builds.store.root / "tmp").iterdir()) == []


@pytest.mark.slow
def test_full_disk_fails_the_build_cleanly(base_store, tmp_path):
    from tmax.images.store import ImageStore

    mnt = tmp_path / "small"
    mnt.mkdir()
    entry = base_store.read().bases["debian-slim"]
    size_mb = entry.size // 2**20 + 40  # the base fits, a task image does not
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        store = ImageStore(mnt)
        shutil.copy(base_store.path(entry.sif), store.path(entry.sif))
        store.update(lambda m: m.bases.__setitem__("debian-slim", entry))
        b = ImageBuilds(store, LocalBuilder(Path.home() / ".cache" / "tmax"))
        result = b.build(load_task(EXAMPLES / "hello-world-file"), check=False)
        assert result.status == "failed"
        assert "No space left" in result.error or "disk full" in result.error
        assert store.read().tasks == {}
        assert list((mnt / "tmp").iterdir()) == [] and list((mnt / "sif").iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# --------------------------------------------------------------------------- build-time checks


@pytest.fixture
def checked_builds(image_store):
    from tmax.images.checks import image_checker

    cache = Path.home() / ".cache" / "tmax"
    return ImageBuilds(image_store, LocalBuilder(cache), checker=image_checker(cache, "local"))


@pytest.mark.slow
@pytest.mark.sandbox
def test_checks_recorded_in_manifest(checked_builds):
    result = checked_builds.build(load_task(EXAMPLES / "count-log-lines"))
    assert result.status == "built"
    checks = checked_builds.store.read().tasks["count-log-lines"].checks
    assert (checks.runtime, checks.starts, checks.nop_reward, checks.oracle_reward, checks.ok) \
        == ("local", True, 0.0, 1.0, True)
    log = checked_builds.store.path(checks.log).read_text()
    assert "## nop" in log and "## oracle" in log and "bash /tests/test.sh" in log


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("override, reason", [
    ({"tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                       "echo 1 > /logs/verifier/reward.txt\n"},
     "the untouched environment already scores 1.0"),
    ({"solution/solve.sh": "#!/bin/bash\necho 41 > /app/answer.txt\n"},
     "the reference solution scores 0.0, not 1"),
    ({"tests/test.sh": "#!/bin/bash\n# reward.txt never written\ntrue\n"},
     "verifier: wrote no reward.txt or reward.json"),
    ({"tests/test.sh": "#!/bin/bash\nsleep 60  # then: reward.txt\n",
      "task.toml": '[verifier]\ntimeout_sec = 2\n[metadata]\ndifficulty = "easy"\n'},
     ("the reference solution scores 0.0, not 1 (its verifier timed out after 2 s "
      "([verifier] timeout_sec))")),
])
def test_checks_report_broken_tasks(checked_builds, tmp_path, override, reason):
    src = make_task(tmp_path / "tasks", "t", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n", **override})
    result = checked_builds.build(load_task(src))
    assert result.status == "built" and result.checks["ok"] is False
    assert result.checks["reason"] == reason
    res = run_cli("images", "ls", "--store", str(checked_builds.store.root))
    assert "checks=FAILED" in res.output


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_verifier_that_hangs_on_the_untouched_environment_scores_it_0(
        checked_builds, tmp_path):
    """A real task's tests hung until the timeout when the agent's program was missing
    (gordonyang-tbench/database-seeding): that is a 0, as in rollouts, where an agent could
    hang the tests on purpose; the reference solution is still checked."""
    src = make_task(tmp_path / "tasks", "hangs", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n",
        "tests/test.sh": "#!/bin/bash\n[ -f /app/answer.txt ] || sleep 60\n"
                         "mkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n",
        "task.toml": '[verifier]\ntimeout_sec = 2\n[metadata]\ndifficulty = "easy"\n'})
    checks = checked_builds.build(load_task(src)).checks
    assert (checks["ok"], checks["nop_reward"], checks["oracle_reward"]) == (True, 0.0, 1.0)
    log = checked_builds.store.path(checks["log"]).read_text()
    assert "verifier timed out after 2 s ([verifier] timeout_sec): scores 0" in log


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_cached_image_is_checked_again_when_its_tests_or_solution_change(checked_builds,
                                                                          tmp_path):
    """The image digest covers only what builds the image; checks also read tests/ and
    solution/: new ones are checked on the same image, unchanged ones are not."""
    runs = []
    checker = checked_builds.checker
    checked_builds.checker = lambda *a: runs.append(a[0].task_id) or checker(*a)
    src = make_task(tmp_path / "tasks", "t", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n"})
    assert checked_builds.build(load_task(src)).checks["ok"] is True
    again = checked_builds.build(load_task(src))
    assert again.status == "cached" and again.checks["ok"] is True and runs == ["t"]
    (src / "tests" / "test.sh").write_text("#!/bin/bash\nmkdir -p /logs/verifier\n"
                                           "echo 1 > /logs/verifier/reward.txt\n")
    weak = checked_builds.build(load_task(src))
    assert weak.status == "cached" and runs == ["t", "t"]
    assert weak.checks["reason"] == "the untouched environment already scores 1.0"
    entry = checked_builds.store.read().tasks["t"]
    assert entry.checks.ok is False and entry.digest == again.digest  # same image


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_task_without_a_solution_builds_with_its_oracle_not_checked(checked_builds, tmp_path):
    """solution/ is optional in Harbor: the image is built and usable, the untouched
    environment is still checked, and the entry says the oracle was not."""
    src = make_task(tmp_path / "tasks", "no-solution", **{"solution/solve.sh": None})
    result = checked_builds.build(load_task(src))
    assert result.status == "built", result.error
    checks = checked_builds.store.read().tasks["no-solution"].checks
    assert (checks.ok, checks.nop_reward, checks.oracle_reward, checks.reason) == \
        (True, 0.0, None, "")
    assert checks.note == "no reference solution (solution/solve.sh): oracle not checked"
    log = checked_builds.store.path(checks.log).read_text()
    assert "## nop" in log and "## oracle in sandbox" not in log
    res = run_cli("images", "ls", "--store", str(checked_builds.store.root))
    assert "checks=ok, oracle not checked" in res.output


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_checks_run_the_verifier_on_the_images_own_path(checked_builds, tmp_path):
    """A tool the image puts on its ENV PATH (e.g. a venv with pytest, as real TB1 tasks
    do) is the verifier's too, in the checks as in rollouts; before, the checks ran it on
    the default PATH and scored the reference solution 0."""
    src = make_task(tmp_path / "tasks", "venv-path", **{
        "environment/Dockerfile": (
            "FROM python:3.11-slim\nWORKDIR /app\n"
            "RUN mkdir -p /opt/tool/bin && printf '#!/bin/sh\\ngrep -qx 42 /app/answer.txt'"
            " > /opt/tool/bin/grade-answer && chmod +x /opt/tool/bin/grade-answer\n"
            'ENV PATH="/opt/tool/bin:${PATH}"\n'),
        "tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                         "grade-answer && r=1 || r=0\necho $r > /logs/verifier/reward.txt\n"})
    result = checked_builds.build(load_task(src))
    assert result.status == "built", result.error
    assert (result.checks["ok"], result.checks["nop_reward"],
            result.checks["oracle_reward"]) == (True, 0.0, 1.0), result.checks


@pytest.mark.slow
@pytest.mark.sandbox
def test_every_example_builds_and_passes_checks(example_store):
    """All example tasks (built with checks by the session fixture): oracle 1, untouched < 1."""
    from tmax.tasks import find_tasks

    manifest = example_store.read()
    assert set(manifest.tasks) >= {p.name for p in find_tasks(EXAMPLES)}
    bad = {k: e.checks for k, e in manifest.tasks.items()
           if not (e.checks and e.checks.ok and e.checks.oracle_reward == 1.0
                   and e.checks.nop_reward < 1.0)}
    assert bad == {}
    assert example_store.verify(deep=False) == []
    # the checks mount each image in place: nothing unpacked accumulates on the node
    assert not (Path.home() / ".cache" / "tmax" / "check-roots").exists()


@pytest.mark.slow
def test_identical_environments_share_one_image(builds, tmp_path):
    for name in ("a", "b"):
        shutil.copytree(EXAMPLES / "hello-world-file", tmp_path / "tasks" / name)
    a = builds.build(load_task(tmp_path / "tasks" / "a"), check=False)
    b = builds.build(load_task(tmp_path / "tasks" / "b"), check=False)
    assert (a.status, b.status) == ("built", "reused") and a.digest == b.digest
    tasks = builds.store.read().tasks
    assert tasks["a"].sif == tasks["b"].sif
    assert len(list((builds.store.root / "sif").iterdir())) == 1
    # forcing a rebuild rewrites the shared file; both entries follow it
    assert builds.build(load_task(tmp_path / "tasks" / "a"), force=True, check=False).status \
        == "built"
    assert builds.store.verify() == []


@pytest.mark.slow
@pytest.mark.sandbox
def test_task_image_holds_neither_tests_nor_solution(builds, tmp_path):
    """The verifier and the reference solution reach a sandbox only when copied in."""
    from sandfleet.runtime.base import SandboxSpec
    from sandfleet.runtime.local import LocalRuntime

    src = make_task(tmp_path / "tasks", "t", **{
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\nCOPY data.txt /app/\n",
        "environment/data.txt": "visible input\n",
        "tests/test.sh": "#!/bin/bash\n# SECRET-VERIFIER-7f3a\nmkdir -p /logs/verifier\n"
                         "echo 0 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\n# SECRET-SOLUTION-91c2\necho 42 > /app/answer.txt\n"})
    result = builds.build(load_task(src), check=False)
    sif = builds.store.path(builds.store.read().tasks["t"].sif)
    runtime = LocalRuntime(tmp_path / "state", tmp_path / "cache")
    runtime.start("leakcheck", SandboxSpec(image=sif, workdir="/app"))
    try:
        probe = ("find /tests /solution -mindepth 1; cat /app/data.txt; "
                 "grep -rl -e SECRET-VERIFIER-7f3a -e SECRET-SOLUTION-91c2 / "
                 "--exclude-dir=proc --exclude-dir=sys --exclude-dir=dev 2>/dev/null; true")
        out = runtime.exec("leakcheck", probe, timeout=120).output
    finally:
        runtime.stop("leakcheck")
    assert result.status == "built"
    assert out.strip() == "visible input"


@pytest.mark.slow
def test_a_builder_crash_fails_that_task_only(image_store, tmp_path):
    """Unexpected tool failures (unsquashfs, cp) fail the task's result, not the whole run."""

    class Crashing(LocalBuilder):
        def build_task(self, task, env_dir, base_sif, out, log, timeout, network=True,
                       verifier=None, stage_sifs=None):
            if "boom" in str(env_dir):
                raise RuntimeError("unsquashfs failed (1): corrupt fragment")
            return super().build_task(task, env_dir, base_sif, out, log, timeout, network,
                                      verifier, stage_sifs)

    builds = ImageBuilds(image_store, Crashing(Path.home() / ".cache" / "tmax"))
    boom = make_task(tmp_path / "tasks", "boom")
    fine = make_task(tmp_path / "tasks", "fine", **{"environment/x.txt": "x"})
    results = {r.task_id: r for r in builds.build_all([load_task(boom), load_task(fine)],
                                                       check=False, progress=False)}
    assert results["boom"].status == "failed" and "corrupt fragment" in results["boom"].error
    assert results["fine"].status == "built"
    assert set(image_store.read().tasks) == {"fine"}
    assert list((image_store.root / "tmp").iterdir()) == []


def test_definitions_parse_correctly_from_many_threads():
    """Concurrent builds never read another task's Dockerfile (a process-wide chdir once
    made them)."""
    from concurrent.futures import ThreadPoolExecutor

    from tmax.tasks import find_tasks

    table = BaseTable.load(TABLE).resolve
    envs = [p / "environment" for p in find_tasks(EXAMPLES)] * 4
    expected = {e: task_definition(e, table).definition.render() for e in envs}
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda e: (e, task_definition(e, table).definition.render()),
                            envs))
    assert all(files == expected[e] for e, files in got)
