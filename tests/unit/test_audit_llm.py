"""tmax.audit.llm: the LLM auditor and repairer against the scripted OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import os
import string
from pathlib import Path

import pytest
from pydantic import ValidationError

from tmax.agent.scripted_server import ScriptedServer
from tmax.audit.labels import LABELS
from tmax.audit.llm import (
    DEFAULT_CONFIG,
    PROMPT_FIELDS,
    AuditConfig,
    AuditConfigError,
    AuditorReply,
    RepairRejected,
    RepairReply,
    apply_repair,
    audit_task,
    load_audit_config,
    repair_task,
    task_context,
)
from tmax.llm import StructuredOutputError, Teacher
from tmax.tasks.native import load_task

TASK_TOML = """\
version = "1.0"

[metadata]
author_name = "TMax"
author_email = "tmax@example.org"
difficulty = "easy"
category = "file-operations"
domain = "file-operations"

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 300.0

[environment]
cpus = 1
memory_mb = 1024
network = false
"""
INSTRUCTION = "Write `hello world` to `/app/hello.txt`.\n"
TEST_SH = "#!/bin/bash\nmkdir -p /logs/verifier\ntest -f /app/hello.txt && echo 1 > " \
          "/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
HARDENED = "#!/bin/bash\nmkdir -p /logs/verifier\necho 0 > /logs/verifier/reward.txt\n" \
           "grep -qx 'hello world' /app/hello.txt && echo 1 > /logs/verifier/reward.txt\n"
EVIDENCE = {"nop": {"reward": 1.0}, "oracle": {"reward": 1.0}, "probe_marker": "nop-passes-42"}


def make_task(root: Path, env_files: dict[str, str | bytes] | None = None) -> Path:
    files: dict[str, str | bytes] = {
        "instruction.md": INSTRUCTION, "task.toml": TASK_TOML,
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n",
        "tests/test.sh": TEST_SH,
        "solution/solve.sh": "#!/bin/bash\necho 'hello world' > /app/hello.txt\n",
        **(env_files or {})}
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
    for script in ("tests/test.sh", "solution/solve.sh"):
        (root / script).chmod(0o755)
    return root


@pytest.fixture
def task(tmp_path):
    return load_task(make_task(tmp_path / "hello-task"))


def audit_config(server: ScriptedServer, **teacher) -> AuditConfig:
    shipped = load_audit_config()
    return shipped.model_copy(update={"teacher": shipped.teacher.model_copy(update={
        "base_url": server.url, "api_key_env": None, "backoff_s": 0.0, **teacher})})


def reply(data: dict) -> dict:
    return {"content": json.dumps(data)}


async def _audit(config: AuditConfig, task, cache_dir=None):
    async with Teacher(config.teacher, cache_dir=cache_dir) as teacher:
        return await audit_task(teacher, config, task, EVIDENCE), teacher


def user_text(request: dict) -> str:
    return "\n".join(m["content"] for m in request["messages"] if m["role"] == "user")


# ---- config


def test_the_shipped_config_loads_and_its_prompts_format_with_the_documented_fields():
    config = load_audit_config(DEFAULT_CONFIG)
    prompts = config.prompts.model_dump()
    must = {"auditor_system": {"labels"}, "auditor_user": {"task", "evidence"},
            "repairer_user": {"task", "evidence", "feedback"}, "repair_feedback": {"feedback"}}
    for name, fields in PROMPT_FIELDS.items():
        if name == "repair_goal":
            continue
        used = {f for _, f, _, _ in string.Formatter().parse(prompts[name]) if f}
        assert must.get(name, set()) <= used <= set(fields), name
        text = prompts[name].format(**{f: f"<{f}>" for f in fields})
        assert all(f"<{f}>" in text for f in used)
    system = config.prompts.auditor_system.format(labels="<labels>")
    assert "<labels>" in system and '{"label"' in system
    for goal in config.prompts.repair_goals.values():
        assert goal.format() == goal
    assert config.probes.max_candidates == 4 and config.max_context_chars == 60000


def test_an_unknown_key_or_prompt_field_fails_naming_the_file_and_the_field(tmp_path):
    raw = DEFAULT_CONFIG.read_text()
    bad = tmp_path / "audit.yaml"
    assert "  max_candidates: 4" in raw
    bad.write_text(raw.replace("  max_candidates: 4", "  max_canddates: 3"))
    with pytest.raises(AuditConfigError) as e:
        load_audit_config(bad)
    assert str(bad) in str(e.value) and "probes.max_canddates" in str(e.value)
    bad.write_text(raw.replace("Label this task.", "Label {taks} now."))
    with pytest.raises(AuditConfigError) as e:
        load_audit_config(bad)
    assert "prompts.auditor_user" in str(e.value) and "{taks}" in str(e.value)
    with pytest.raises(AuditConfigError, match="missing.yaml"):
        load_audit_config(tmp_path / "missing.yaml")


# ---- auditor


def test_audit_returns_the_label_and_the_request_carries_evidence_and_instruction(task):
    with ScriptedServer([reply({"label": "verifier_too_strict", "rationale": "rounding"})]) \
            as server:
        config = audit_config(server)
        answer, _ = asyncio.run(_audit(config, task))
        requests = server.requests
    assert answer == AuditorReply(label="verifier_too_strict", rationale="rounding")
    assert len(requests) == 1
    sent = user_text(requests[0])
    assert "nop-passes-42" in sent and '"reward": 1.0' in sent  # the evidence, as JSON
    assert INSTRUCTION.strip() in sent and "=== tests/test.sh ===" in sent
    system = requests[0]["messages"][0]["content"]
    assert all(f"- {label}: {meaning}" in system for label, meaning in LABELS.items())


def test_an_unparsable_reply_goes_back_with_its_error_and_a_later_one_is_used(task):
    script = [{"content": "I think the task is fine."},
              reply({"label": "underspecified_instruction", "rationale": "no format given"})]
    with ScriptedServer(script) as server:
        answer, teacher = asyncio.run(_audit(audit_config(server), task))
        requests = server.requests
    assert answer.label == "underspecified_instruction"
    assert len(requests) == 2 and teacher.usage.parse_failures == 1
    last = requests[1]["messages"]
    assert last[-2] == {"role": "assistant", "content": "I think the task is fine."}
    assert "could not be used" in last[-1]["content"] and "JSON" in last[-1]["content"]


def test_a_label_outside_the_eight_is_sent_back_and_then_dropped(task):
    script = [reply({"label": "mostly_fine", "rationale": "eh"}),
              reply({"label": "clean", "rationale": "   "}),
              reply({"label": "clean", "rationale": "all agree"})]
    with ScriptedServer(script) as server:
        answer, _ = asyncio.run(_audit(audit_config(server, parse_retries=2), task))
        requests = server.requests
    assert answer.label == "clean" and len(requests) == 3
    assert "label" in requests[1]["messages"][-1]["content"]
    assert "rationale" in requests[2]["messages"][-1]["content"]
    with ScriptedServer([reply({"label": "mostly_fine", "rationale": "eh"})] * 2) as server, \
            pytest.raises(StructuredOutputError):
        asyncio.run(_audit(audit_config(server, parse_retries=1), task))


def test_replies_are_cached_so_a_rerun_makes_no_request(task, tmp_path):
    with ScriptedServer([reply({"label": "clean", "rationale": "fine"})]) as server:
        config = audit_config(server)
        first, _ = asyncio.run(_audit(config, task, tmp_path / "cache"))
    with ScriptedServer([]) as empty:  # would answer with a shell command: unparsable
        again, teacher = asyncio.run(_audit(audit_config(empty), task, tmp_path / "cache"))
        assert empty.requests == []
    assert again == first and teacher.usage.cache_hits == 1 and teacher.usage.requests == 0


# ---- task context


def test_task_context_cuts_with_a_marker_and_keeps_tests_and_solution(tmp_path):
    big = "".join(f"line {i} of a big fixture\n" for i in range(300))  # 7.6k chars
    root = make_task(tmp_path / "big", {"environment/data/big.txt": big,
                                        "environment/blob.bin": b"\x00\x01" * 300,
                                        "tests/cases/in1.txt": "3 4\n"})
    context = task_context(load_task(root), 3000)
    assert len(context) <= 3000
    assert "=== environment/data/big.txt ===" in context and "line 0 of" in context
    assert "line 299 of" in context  # head and tail kept
    cut = context.split("chars cut]")[0].rsplit("[... ", 1)[1]
    assert int(cut) > len(big) - 3000
    assert "=== environment/blob.bin (binary, 600 bytes) ===" in context
    assert "\x00" not in context
    for whole in (TEST_SH, "3 4", "echo 'hello world' > /app/hello.txt", INSTRUCTION.strip(),
                  "FROM python:3.11-slim"):
        assert whole in context
    order = [context.index(f"=== {rel}") for rel in (
        "instruction.md", "task.toml", "environment/Dockerfile", "environment/blob.bin",
        "tests/test.sh", "tests/cases/in1.txt", "solution/solve.sh")]
    assert order == sorted(order)
    full = task_context(load_task(root), 200_000)
    assert "chars cut" not in full and big in full


def test_task_context_reads_a_huge_file_only_as_far_as_it_shows(tmp_path):
    huge = "x" * 100_000 + "THE-END"
    root = make_task(tmp_path / "huge", {"environment/huge.txt": huge})
    context = task_context(load_task(root), 2000)
    assert len(context) <= 2000 and "THE-END" not in context and TEST_SH in context
    body = context.split("=== environment/huge.txt ===\n")[1].split("\n[... ")[0]
    cut = int(context.split("[... ")[1].split(" chars cut]")[0])
    assert set(body) == {"x"} and cut == len(huge) - len(body)


# ---- repair


def test_repair_then_apply_writes_test_sh_with_mode_0755(task, tmp_path):
    script = [reply({"files": {"tests/test.sh": HARDENED, "tests/cases/a.txt": "x\n"},
                     "rationale": "checks the content"})]
    with ScriptedServer(script) as server:
        config = audit_config(server)

        async def go():
            async with Teacher(config.teacher) as teacher:
                return await repair_task(teacher, config, task, "verifier_too_weak", EVIDENCE)
        answer = asyncio.run(go())
        sent = user_text(server.requests[0])
    assert "nop-passes-42" in sent and "rejected" not in sent
    assert "hardened verifier" in server.requests[0]["messages"][0]["content"]
    (task.root / "tests" / "test.sh").chmod(0o644)  # a copy that lost its mode gets it back
    written = apply_repair(task.root, answer, "verifier_too_weak")
    assert written == ["tests/test.sh", "tests/cases/a.txt"]
    script_path = task.root / "tests" / "test.sh"
    assert script_path.read_text() == HARDENED
    assert script_path.stat().st_mode & 0o777 == 0o755
    assert (task.root / "tests/cases/a.txt").stat().st_mode & 0o777 == 0o644
    assert not list((task.root / "tests").rglob("*.tmp"))


def test_a_repair_with_feedback_sends_it_and_a_bad_path_goes_back(task):
    feedback = "the rebuilt task still passes the replay probe (marker-77)"
    script = [reply({"files": {"solution/solve.sh": "true"}, "rationale": "simpler"}),
              reply({"files": {"tests/test.sh": "exit 0"}, "rationale": "no reward"}),
              reply({"files": {"instruction.md": "Write it.\n", "tests/test.sh": HARDENED},
                     "rationale": "same path in both"})]
    with ScriptedServer(script) as server:
        config = audit_config(server)

        async def go():
            async with Teacher(config.teacher) as teacher:
                return await repair_task(teacher, config, task, "instruction_verifier_mismatch",
                                         EVIDENCE, feedback=feedback)
        answer = asyncio.run(go())
        requests = server.requests
    assert feedback in user_text(requests[0]) and "rejected" in user_text(requests[0])
    assert "solution/solve.sh" in requests[1]["messages"][-1]["content"]
    assert "reward.txt" in requests[2]["messages"][-1]["content"]
    assert set(answer.files) == {"instruction.md", "tests/test.sh"}
    assert type(answer) is RepairReply
    assert apply_repair(task.root, answer, "instruction_verifier_mismatch") == [
        "instruction.md", "tests/test.sh"]
    assert (task.root / "instruction.md").read_text() == "Write it.\n"


def test_repair_is_only_for_the_two_teacher_labels(task):
    config = load_audit_config()
    with pytest.raises(ValueError, match="answer_leak"):
        asyncio.run(repair_task(None, config, task, "answer_leak", {}))
    ok = RepairReply(files={"tests/test.sh": HARDENED}, rationale="r")
    with pytest.raises(ValueError, match="clean"):
        apply_repair(task.root, ok, "clean")


@pytest.mark.parametrize(("path", "label", "reason"), [
    ("solution/solve.sh", "verifier_too_weak", "may only write tests/"),
    ("environment/Dockerfile", "instruction_verifier_mismatch", "may only write tests/"),
    ("task.toml", "verifier_too_weak", "may only write"),
    ("../x", "verifier_too_weak", "'..'"),
    ("tests/../../x", "instruction_verifier_mismatch", "'..'"),
    ("/etc/passwd", "verifier_too_weak", "absolute"),
    ("instruction.md", "verifier_too_weak", "instruction_verifier_mismatch"),
    ("tests", "verifier_too_weak", "may only write"),
])
def test_apply_repair_refuses_paths_outside_its_label_and_writes_nothing(
        task, path, label, reason):
    before = {p: p.read_bytes() for p in task.root.rglob("*") if p.is_file()}
    reply_ = RepairReply(files={"tests/test.sh": HARDENED, path: "pwned\n"}, rationale="r")
    with pytest.raises(RepairRejected) as e:
        apply_repair(task.root, reply_, label)
    assert e.value.path == path and reason in e.value.reason
    assert {p: p.read_bytes() for p in task.root.rglob("*") if p.is_file()} == before
    assert not (task.root.parent / "x").exists()


def test_apply_repair_refuses_links_out_and_a_verifier_without_reward(task, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (task.root / "tests" / "out").symlink_to(outside)
    (task.root / "tests" / "up.txt").symlink_to(task.root / "instruction.md")
    for rel in ("tests/out/x.sh", "tests/up.txt"):
        with pytest.raises(RepairRejected, match="symlink"):
            apply_repair(task.root, RepairReply(files={rel: "x"}, rationale="r"),
                         "verifier_too_weak")
    assert list(outside.iterdir()) == [] and (task.root / "instruction.md").read_text() == \
        INSTRUCTION
    no_reward = RepairReply(files={"tests/test.sh": "#!/bin/bash\nexit 0\n"}, rationale="r")
    with pytest.raises(RepairRejected) as e:
        apply_repair(task.root, no_reward, "verifier_too_weak")
    assert e.value.path == "tests/test.sh" and "reward.txt" in e.value.reason
    assert (task.root / "tests/test.sh").read_text() == TEST_SH


def test_replies_are_strict():
    with pytest.raises(ValidationError):
        AuditorReply.model_validate({"label": "clean", "rationale": "ok", "score": 1})
    with pytest.raises(ValidationError):
        RepairReply.model_validate({"files": {}, "rationale": "nothing"})


def test_apply_repair_refuses_a_file_in_the_way_of_another_before_writing(task):
    (task.root / "tests" / "data").write_text("old\n")
    for files, bad in (({"tests/test.sh": HARDENED, "tests/data/in.txt": "1"}, "tests/data/in.txt"),
                       ({"tests/cases": "x", "tests/cases/a.txt": "y"}, "tests/cases/a.txt")):
        with pytest.raises(RepairRejected) as e:
            apply_repair(task.root, RepairReply(files=files, rationale="r"), "verifier_too_weak")
        assert e.value.path == bad
    assert (task.root / "tests/test.sh").read_text() == TEST_SH
    assert not (task.root / "tests/cases").exists()


def test_task_context_names_special_files_without_reading_them(tmp_path):
    root = make_task(tmp_path / "odd", {"environment/latin1.txt": b"caf\xe9 au lait\n"})
    os.mkfifo(root / "environment" / "pipe")  # reading it would block forever
    (root / "environment" / "link").symlink_to("latin1.txt")
    context = task_context(load_task(root), 5000)
    assert "=== environment/pipe (not a regular file) ===" in context
    assert "=== environment/link (symlink -> latin1.txt) ===" in context
    assert "=== environment/latin1.txt (binary, 13 bytes) ===" in context
