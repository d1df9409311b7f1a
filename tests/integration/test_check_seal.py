"""The host check's seal: nothing in a task folder leads host tools outside it, and what the
check runs is root only inside its own user namespace, never host root."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.unit.test_tasks import make_task, run_cli
from tmax.tasks import check as check_mod
from tmax.tasks import load_task, validate_task
from tmax.tasks.check import WRITABLE, check_task

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap missing: run bin/tmax-setup")
DOCKERFILE = "FROM python:3.11-slim\nWORKDIR /app\n"


def verifier(condition: str) -> str:
    """A test.sh writing 1 when the shell ``condition`` holds, else 0."""
    return ("#!/bin/bash\nmkdir -p /logs/verifier\n"
            f"if {condition}; then r=1; else r=0; fi\necho $r > /logs/verifier/reward.txt\n")


# --------------------------------------------------------------------------- the folder rule

def link_out(tmp_path, where: str, target: str = "/etc/shadow", name: str = "t"):
    """A task with a symlink at ``where`` (relative to the task) pointing at ``target``."""
    root = make_task(tmp_path, name, **{
        "environment/Dockerfile": DOCKERFILE + "COPY data/ /app/data/\n",
        "environment/data/ok.txt": "fine\n"})
    link = root / where
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return root


def escape_copy(tmp_path, line: str, name: str = "t"):
    """A task whose Dockerfile's third line is ``line``; the folder above holds a 'host' file."""
    (tmp_path / "host-secret.txt").write_text("host data\n")
    return make_task(tmp_path, name, **{"environment/Dockerfile": DOCKERFILE + line + "\n",
                                        "environment/data/ok.txt": "fine\n"})


def errors(root):
    return [p for p in validate_task(root) if p.severity == "error"]


@pytest.mark.parametrize("where, target", [
    ("environment/data/secret", "/etc/shadow"),
    ("environment/secret", "../../host-secret.txt"),
    ("tests/shadow", "/etc/shadow"),
    ("solution/notes.txt", "../environment/data/ok.txt"),  # solution/ is copied on its own
    ("instruction.md.orig", "/etc/shadow"),
])
def test_validate_names_a_symlink_that_leaves_its_folder(tmp_path, where, target):
    (tmp_path / "host-secret.txt").write_text("host data\n")
    root = link_out(tmp_path, where, target)
    (problem,) = errors(root)
    assert problem.task == "t" and problem.file == where
    assert "symlink" in problem.message and "replace the link" in problem.fix


def test_validate_refuses_a_task_part_that_is_a_link_out(tmp_path):
    shared = tmp_path / "shared-tests"
    shared.mkdir()
    (shared / "test.sh").write_text(verifier("true"))
    root = make_task(tmp_path, "t", **{"tests/test.sh": None})
    (root / "tests").symlink_to(shared)
    assert [p.file for p in errors(root)] == ["tests"]


def test_links_that_stay_inside_are_allowed(tmp_path):
    root = link_out(tmp_path, "environment/data/latest", "ok.txt")
    (root / "environment" / "alias").symlink_to("data")
    (root / "environment" / "dangling").symlink_to("not-there-yet")
    assert errors(root) == []


@pytest.mark.parametrize("line", [
    "COPY ../../ /app/host/",
    "ADD ../task.toml /app/",
    "COPY data/../../../host-secret.txt /app/",
    "COPY ../../host-* /app/",
    'COPY ["../instruction.md", "/app/"]',
    "COPY --chown=root:root ../../ /app/host/",
])
def test_validate_names_a_copy_that_leaves_environment(tmp_path, line):
    (problem,) = errors(escape_copy(tmp_path, line))
    assert problem.file == "environment/Dockerfile" and problem.field == "line 3"
    assert "leaves environment/" in problem.message and problem.fix


@pytest.mark.parametrize("line", ["COPY . /app/", "COPY /data /app/data", "COPY data/* /app/",
                                  "COPY data/../data/ok.txt /app/", 'COPY ["data", "/app/"]',
                                  "COPY --from=build /out /app/"])
def test_copies_inside_environment_are_allowed(tmp_path, line):
    assert errors(escape_copy(tmp_path, line)) == []


@pytest.mark.parametrize("src", ["../../host-secret.txt", "/../host-secret.txt"])
def test_validate_names_a_files_source_that_leaves_environment(tmp_path, src):
    (tmp_path / "host-secret.txt").write_text("host data\n")
    root = make_task(tmp_path, "t", **{
        "environment/Dockerfile": None,
        "environment/container.def": f"Bootstrap: docker\nFrom: debian:bookworm-slim\n\n"
                                     f"%files\n    {src} /app/x\n"})
    (problem,) = errors(root)
    assert problem.file == "environment/container.def" and problem.field == "line 5"
    assert "leaves environment/" in problem.message


def test_cli_validate_fails_both_attacks_naming_the_file(tmp_path):
    link_out(tmp_path, "environment/data/secret", name="shadow-link")
    escape_copy(tmp_path, "COPY ../../ /app/host/", name="copy-up")
    res = run_cli("tasks", "validate", tmp_path, "-o", "json")
    assert res.exit_code == 1
    report = {r["task"]: r["problems"] for r in json.loads(res.output)["tasks"]}
    assert [p["file"] for p in report["shadow-link"]] == ["environment/data/secret"]
    assert [p["file"] for p in report["copy-up"]] == ["environment/Dockerfile"]


# --------------------------------------------------------------------------- the check refuses

@pytest.fixture
def no_sandbox(monkeypatch):
    """Fail the test if the check so much as creates its sandbox (where files are copied)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the check built a sandbox for a task it should refuse")
    monkeypatch.setattr(check_mod, "HostSandbox", refuse)


@pytest.mark.parametrize("attack", ["link", "copy"])
def test_check_refuses_before_copying_anything(tmp_path, no_sandbox, attack):
    # loaded while clean, changed afterwards: the check looks again itself
    root = escape_copy(tmp_path, "COPY data/ /app/data/")
    task = load_task(root)
    if attack == "link":
        (root / "environment" / "data" / "secret").symlink_to("/etc/shadow")
        file = "environment/data/secret"
    else:
        (root / "environment" / "Dockerfile").write_text(DOCKERFILE + "COPY ../../ /app/h/\n")
        file = "environment/Dockerfile"
    result = check_task(task, "oracle")
    assert result.reward is None and file in result.error and result.log == ""


def test_cli_check_refuses_both_attacks(tmp_path, no_sandbox):
    link_out(tmp_path, "environment/data/secret", name="shadow-link")
    escape_copy(tmp_path, "COPY ../../ /app/host/", name="copy-up")
    res = run_cli("tasks", "check", tmp_path)
    assert res.exit_code == 1
    assert "environment/data/secret" in res.output and "environment/Dockerfile" in res.output


def test_image_build_copy_applies_the_same_rule(tmp_path):
    from tmax.images.builders import copy_into_rootfs
    from tmax.images.types import BuildError

    root = escape_copy(tmp_path, "COPY data/ /app/data/")
    env, rootfs = root / "environment", tmp_path / "rootfs"
    (env / "data" / "latest").symlink_to("ok.txt")
    (env / "shadow").symlink_to("/etc/shadow")
    copy_into_rootfs(env, "/data", rootfs, "/app/data/")
    assert (rootfs / "app/data/latest").readlink() == Path("ok.txt")
    for src in ("../../", "data/../../../host-secret.txt", "shadow"):
        with pytest.raises(BuildError, match="leaves environment/"):
            copy_into_rootfs(env, src, rootfs, "/app/x")


def test_apptainer_files_sources_stay_in_environment(tmp_path):
    from tmax.images.plan import task_definition_over
    from tmax.images.types import TaskDefinition, parse_definition

    definition = parse_definition("Bootstrap: docker\nFrom: debian\n%files\n"
                                  "    /data/a.txt /app/a.txt\n")
    over = task_definition_over(Path("/base.sif"), TaskDefinition(definition, "b", "/"),
                                 tmp_path / "environment")
    assert over.files == [(str(tmp_path / "environment/data/a.txt"), "/app/a.txt")]


# --------------------------------------------------------------------------- unprivileged

def test_check_without_user_namespaces_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(check_mod, "_userns_refusal", lambda: "setting up uid map: denied")
    result = check_task(load_task(make_task(tmp_path)), "oracle")
    assert result.reward is None and "user namespace" in result.error
    assert "setting up uid map: denied" in result.error


@needs_bwrap
@pytest.mark.sandbox
def test_solution_cannot_read_host_shadow_and_the_check_says_so(tmp_path):
    task = load_task(make_task(tmp_path, **{
        "solution/solve.sh": "#!/bin/bash\ncat /etc/shadow > /app/leak\n",
        "tests/test.sh": verifier("[ -s /app/leak ]")}))
    result = check_task(task, "oracle")
    assert (result.reward, result.error) == (0.0, "")
    assert "/etc/shadow: Permission denied" in result.log


@needs_bwrap
@pytest.mark.sandbox
def test_check_processes_are_not_host_root(tmp_path):
    task = load_task(make_task(tmp_path, **{
        "solution/solve.sh": "#!/bin/bash\ncat /proc/self/uid_map > /app/uid_map\n"
                             "grep CapEff /proc/self/status > /app/caps\nid -u > /app/uid\n",
        "tests/test.sh": verifier(
            "read inside outside count < /app/uid_map && [ \"$outside\" != 0 ] && "
            "[ \"$(id -u)\" = 0 ] && grep -qx 0 /app/uid && "
            "grep -q 'CapEff:[[:space:]]*0*$' /app/caps && "
            "v=$(cat /proc/sys/kernel/printk_ratelimit) && "
            "! echo $v > /proc/sys/kernel/printk_ratelimit")}))
    result = check_task(task, "oracle")
    assert result.reward == 1.0, result.log


@needs_bwrap
@pytest.mark.sandbox
def test_writable_dirs_and_copied_files_stay_writable(tmp_path):
    dirs = [d for d in WRITABLE if d not in ("/logs", "/tests", "/solution")]
    writes = "".join(f"echo hi > {d}/probe\n" for d in dirs)
    root = make_task(tmp_path, **{
        "environment/Dockerfile": DOCKERFILE + "COPY data/ /app/data/\nCOPY run.sh /opt/\n"
                                  "RUN chmod 600 /app/data/ok.txt && mkdir -p /srv/x\n",
        "environment/data/ok.txt": "fine\n",
        "environment/run.sh": "#!/bin/sh\necho ran\n",
        "solution/solve.sh": "#!/bin/bash\nset -e\n" + writes
                             + "echo changed >> /app/data/ok.txt\nsh /opt/run.sh > /srv/x/out\n"
                             "readlink /app/data/latest > /app/link\n",
        "tests/test.sh": verifier(" && ".join(f"[ -f {d}/probe ]" for d in dirs)
                                  + " && grep -q changed /app/data/ok.txt"
                                  + " && grep -qx ran /srv/x/out && grep -qx ok.txt /app/link")})
    (root / "environment" / "data" / "latest").symlink_to("ok.txt")
    result = check_task(load_task(root), "oracle")
    assert result.reward == 1.0, result.log


@needs_bwrap
@pytest.mark.sandbox
def test_copying_tests_in_writes_nothing_through_a_link_the_solution_made(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    task = load_task(make_task(tmp_path, **{
        "solution/solve.sh": f"#!/bin/bash\nln -s {outside} /tests/probe\n",
        "tests/probe/x.txt": "written through a link\n"}))
    result = check_task(task, "oracle")
    assert list(outside.iterdir()) == []
    assert result.reward is None and "/tests" in result.error, result.log


@needs_bwrap
@pytest.mark.sandbox
def test_the_reward_is_read_only_from_the_verifiers_own_dir(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "reward.txt").write_text("1\n")
    task = load_task(make_task(tmp_path, **{
        "tests/test.sh": f"#!/bin/bash\n# reward.txt\nrm -rf /logs/verifier\n"
                         f"ln -s {outside} /logs/verifier\n"}))
    result = check_task(task, "nop")
    assert result.reward is None and "/logs/verifier" in result.error, result.log


@needs_bwrap
@pytest.mark.sandbox
def test_a_reward_file_linked_to_a_host_file_is_not_read(tmp_path):
    task = load_task(make_task(tmp_path, **{
        "tests/test.sh": "#!/bin/bash\nmkdir -p /logs/verifier\n"
                         "ln -s /etc/shadow /logs/verifier/reward.txt\n"}))
    result = check_task(task, "nop")
    assert result.reward is None and "not a regular file" in result.error
    assert "root:" not in result.error
