"""tmax gen: axes, task drafts, the generation loop with the scripted server as the teacher."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tmax.agent.scripted_server import ScriptedServer
from tmax.cli import main
from tmax.data.axes import AXIS_NAMES, Axes, sample_axes
from tmax.data.config import DEFAULT_CONFIG, GenConfigError, load_gen_config
from tmax.data.gen import (
    RECORDS,
    Generator,
    TaskReply,
    draft_of,
    drop_reasons,
    format_yield,
    yield_table,
)
from tmax.tasks import load_task, validate_task, write_task

CACHE = Path.home() / ".cache" / "tmax"
DOCKERFILE = "FROM python:3.11-slim\nWORKDIR /app\nRUN printf '3\\n5\\n7\\n' > /app/numbers.txt\n"
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
got=$(cat /app/sum.txt 2>/dev/null | tr -d '[:space:]')
if [ "$got" = "15" ]; then r=1; else r=0; fi
printf '{"reward": %s, "exact": %s}\\n' "$r" "$r" > /logs/verifier/reward.json
"""
SOLVE_SH = "#!/bin/bash\nawk '{s+=$1} END {print s}' /app/numbers.txt > /app/sum.txt\n"


def task_json(**over) -> str:
    """A realistic teacher reply: a tiny task as the prompt asks for it."""
    reply = {"instruction": "Add up the numbers in /app/numbers.txt (one per line) and write "
                            "the total, as a bare integer, to /app/sum.txt.",
             "difficulty": "easy", "skills": ["awk", "file reading"],
             "dockerfile": DOCKERFILE, "test_sh": TEST_SH, "solve_sh": SOLVE_SH} | over
    return json.dumps(reply)


def item(**over) -> dict:
    return {"content": task_json(**over)}


def gen_config(server_url: str, tmp: Path, **generation):
    config = load_gen_config()
    teacher = config.teacher.model_copy(update={
        "base_url": server_url, "api_key_env": None, "backoff_s": 0.0, "parse_retries": 1,
        "cache_dir": str(tmp / "teacher-cache")})
    gen = config.generation.model_copy(update={"repair_rounds": 1, **generation})
    return config.model_copy(update={"teacher": teacher, "generation": gen})


# --------------------------------------------------------------------------- axes, config


def test_shipped_config_parses_and_rejects_unknown_keys(tmp_path):
    config = load_gen_config(DEFAULT_CONFIG)
    assert len(config.axes.domains) == 9 and config.generation.repair_rounds == 3
    for d in config.axes.domains.values():
        assert 4 <= len(d.skill_types) <= 7 and 6 <= len(d.personas) <= 18
    bad = tmp_path / "gen.yaml"
    bad.write_text(DEFAULT_CONFIG.read_text().replace("repair_rounds:", "repair_round:"))
    with pytest.raises(GenConfigError, match="generation.repair_round"):
        load_gen_config(bad)
    bad.write_text(DEFAULT_CONFIG.read_text().replace("api_key_env:", "api_key:"))
    with pytest.raises(GenConfigError, match="teacher.api_key"):
        load_gen_config(bad)


def test_axes_are_a_pure_function_of_the_seed():
    axes = load_gen_config().axes
    a = sample_axes(axes, 12345)
    assert a == sample_axes(axes, 12345)
    assert tuple(a)[:9] == AXIS_NAMES and set(a) == {*AXIS_NAMES, "difficulty"}
    assert a != sample_axes(axes, 12346)
    skills = a["primitive_skills"].split("; ")
    assert 3 <= len(skills) <= 5 and set(skills) <= set(axes.domains[a["domain"]].skills)
    # uniform over domains and difficulty buckets, weighted languages
    draws = [sample_axes(axes, s) for s in range(2700)]
    domains = {d: sum(x["domain"] == d for x in draws) for d in axes.domains}
    assert min(domains.values()) > 220 and max(domains.values()) < 380  # 300 expected
    python = sum(x["language"] == "python" for x in draws) / len(draws)
    assert abs(python - 0.30) < 0.05  # weight 30 of 100


def test_axes_reject_unknown_domains_and_short_pools():
    base = {"languages": {"bash": 1}, "task_complexity": ["a"], "command_complexity": ["b"],
            "verifier_kind": ["c"], "fixture_kind": ["d"]}
    one = {"skill_types": ["x"], "skills": ["a", "b", "c", "d", "e"], "personas": ["p"]}
    assert Axes.model_validate({**base, "domains": {"security": one}})
    with pytest.raises(ValueError, match="unknown domains"):
        Axes.model_validate({**base, "domains": {"cooking": one}})
    with pytest.raises(ValueError, match="fewer than primitive_skills.max"):
        Axes.model_validate({**base, "domains": {"security": one | {"skills": ["a"]}}})


def test_a_reply_becomes_a_valid_native_task_with_its_axes(tmp_path):
    config = load_gen_config()
    axes = sample_axes(config.axes, 7)
    reply = TaskReply.model_validate_json(task_json(
        environment_files={"data/in.txt": "x\n"}, test_files={"tests/helper.py": "pass\n"}))
    task = write_task(draft_of(reply, 7, axes, config), tmp_path)
    assert task.task_id == "gen-000007" and validate_task(task.root) == []
    loaded = load_task(task.root)
    assert loaded.config.metadata.axes == axes
    assert loaded.config.metadata.domain == axes["domain"]
    assert loaded.config.metadata.extra == {"gen_seed": 7}
    assert (task.root / "environment" / "data" / "in.txt").read_text() == "x\n"
    assert (task.root / "tests" / "helper.py").is_file()
    assert (task.root / "tests" / "test.sh").stat().st_mode & 0o111
    # a run of its own in a shared store: its own ids
    mine = config.model_copy(update={"generation": config.generation.model_copy(
        update={"id_prefix": "run2"})})
    assert draft_of(reply, 7, axes, mine).task_id == "run2-000007"
    with pytest.raises(ValueError, match="id_prefix"):
        load_gen_config().generation.model_validate({"id_prefix": "Run 2"})
    res = CliRunner().invoke(main, ["gen", "--out", str(tmp_path / "r"), "--id-prefix", "a b"])
    assert res.exit_code == 2 and "--id-prefix" in res.output and "lower-case" in res.output


@pytest.mark.parametrize("over, message", [
    ({"dockerfile": "RUN echo hi\n"}, "must start with a FROM line"),
    ({"test_sh": "#!/bin/bash\nexit 0\n"}, "reward.json or reward.txt"),
    ({"environment_files": {"../escape": "x"}}, "must be relative"),
    ({"instruction": "short"}, "at least 20 characters"),
])
def test_reply_schema_rejects_unusable_tasks(over, message):
    with pytest.raises(ValueError, match=message):
        TaskReply.model_validate_json(task_json(**over))


def test_yield_table_and_drop_reasons_by_hand():
    def rec(domain, outcome, *flags, failed=None):
        stages = [{"name": failed, "ok": False}] if failed else []
        return {"axes": {"domain": domain}, "outcome": outcome, "stages": stages,
                **dict(zip(("parsed", "built", "checked", "kept"), flags, strict=True))}

    records = [rec("security", "kept", 1, 1, 1, 1),
               rec("security", "dropped", 1, 1, 0, 0, failed="check"),
               rec("debugging", "dropped", 0, 0, 0, 0, failed="parse"),
               rec("debugging", "dropped", 1, 0, 0, 0, failed="build"),
               rec("debugging", "error", 0, 0, 0, 0)]
    table = yield_table(records)
    assert table == {
        "debugging": {"attempted": 2, "parsed": 1, "built": 0, "checked": 0, "kept": 0},
        "security": {"attempted": 2, "parsed": 2, "built": 2, "checked": 1, "kept": 1},
        "all": {"attempted": 4, "parsed": 3, "built": 2, "checked": 1, "kept": 1}}
    assert list(table) == ["debugging", "security", "all"]
    assert format_yield(table).splitlines()[-1].split() == ["all", "4", "3", "2", "1", "1"]
    assert drop_reasons(records) == {"check": 1, "parse": 1, "build": 1}


class NoBuilds:
    """Stands in for ImageBuilds where the teacher fails before anything is built."""

    store = None
    checker = staticmethod(lambda *a: None)

    def build(self, task):
        raise AssertionError("nothing should be built")


def test_unparsable_replies_are_dropped_and_a_dead_teacher_is_retried_on_rerun(tmp_path):
    with ScriptedServer([{"content": "Sure! I will write the task now."},
                         {"content": task_json(dockerfile="no from line")},
                         {"status": 503}, {"status": 503}]) as server:
        config = gen_config(server.url, tmp_path)
        config = config.model_copy(update={"teacher": config.teacher.model_copy(
            update={"max_retries": 1})})
        gen = Generator(config, tmp_path / "run", NoBuilds())  # type: ignore[arg-type]
        records = asyncio.run(gen.run([0, 1], jobs=1, progress=False))
        assert len(server.requests) == 4
    assert [r["outcome"] for r in records] == ["dropped", "error"]
    assert records[0]["reason"].startswith("unparsable: the JSON does not match")
    assert "must start with a FROM line" in records[0]["reason"]
    assert "teacher unavailable" in records[1]["reason"]
    assert gen.teacher.usage.dropped == 1 and gen.teacher.usage.parse_failures == 2
    mine = records[0]["teacher"]  # the task's own share of the teacher's usage
    assert (mine["requests"], mine["parse_failures"], mine["dropped"]) == (2, 2, 1)
    assert records[1]["teacher"]["requests"] == 0
    assert mine["prompt_tokens"] == gen.teacher.usage.prompt_tokens
    # the rerun skips the dropped seed and retries the one the teacher never answered
    with ScriptedServer([{"content": "still not json"}, {"content": "nope"}]) as server:
        gen = Generator(gen_config(server.url, tmp_path), tmp_path / "run", NoBuilds())  # type: ignore[arg-type]
        records = asyncio.run(gen.run([0, 1], jobs=1, progress=False))
        assert len(server.requests) == 2
        assert "Sure!" not in json.dumps(server.requests)  # seed 0 was not asked again
    assert [r["outcome"] for r in records] == ["dropped", "dropped"]
    lines = (tmp_path / "run" / RECORDS).read_text().splitlines()
    assert len(lines) == 3  # one per finished attempt, the latest wins


def test_an_answer_left_in_the_environment_goes_back_to_the_teacher(tmp_path):
    from tmax.data.gen import leaks

    expected = "total: 15 (3 + 5 + 7)\n"
    leaky = task_json(environment_files={"expected.txt": expected},
                      test_files={"expected.txt": expected})
    config = load_gen_config()
    draft = draft_of(TaskReply.model_validate_json(leaky), 0, sample_axes(config.axes, 0),
                     config)
    assert leaks(draft) == [("environment/expected.txt is a copy of tests/expected.txt, "
                             "which the agent must not see")]
    with ScriptedServer([{"content": leaky}, {"content": "sorry"}, {"content": "no"}]) as server:
        gen = Generator(gen_config(server.url, tmp_path), tmp_path / "run", NoBuilds())  # type: ignore[arg-type]
        (record,) = asyncio.run(gen.run([0], jobs=1, progress=False))
        repair = server.requests[1]["messages"][-1]["content"]
    assert "failed at the leak stage" in repair and "tests/expected.txt" in repair
    assert [(s["name"], s["ok"]) for s in record["stages"]] == [
        ("parse", True), ("leak", False), ("parse", False)]
    assert record["outcome"] == "dropped" and record["reason"].startswith("unparsable")


# --------------------------------------------------------------------------- end to end


@pytest.fixture
def gen_builds(image_store):
    from tmax.images.build import ImageBuilds
    from tmax.images.builders import LocalBuilder
    from tmax.images.checks import image_checker

    return ImageBuilds(image_store, LocalBuilder(CACHE), checker=image_checker(CACHE, "local"))


BROKEN_DOCKERFILE = ("FROM python:3.11-slim\nWORKDIR /app\n"
                     "RUN sort /app/raw-numbers.txt > /app/numbers.txt\n")
LAX_TEST = ("#!/bin/bash\nmkdir -p /logs/verifier\n"
            "test -f /app/numbers.txt && r=1 || r=0\necho $r > /logs/verifier/reward.txt\n")


@pytest.mark.slow
@pytest.mark.sandbox
def test_generation_end_to_end_with_repairs_drops_and_the_cache(tmp_path, gen_builds):
    script = [
        item(),                                            # seed 0: good at once
        {"content": "Here is your task!"}, {"content": "{not json"},  # seed 1: unparsable
        item(dockerfile=BROKEN_DOCKERFILE), item(),        # seed 2: build fails, repaired
        item(test_sh=LAX_TEST), item(test_sh=LAX_TEST),    # seed 3: nop passes twice
        item(solve_sh="#!/bin/bash\necho 14 > /app/sum.txt\n"), item(),  # seed 4: bad oracle
    ]
    with ScriptedServer(script) as server:
        gen = Generator(gen_config(server.url, tmp_path), tmp_path / "run", gen_builds)
        records = asyncio.run(gen.run(range(5), jobs=1, progress=False))
        requests = server.requests
    by_seed = {r["seed"]: r for r in records}
    assert {s: r["outcome"] for s, r in by_seed.items()} == {
        0: "kept", 1: "dropped", 2: "kept", 3: "dropped", 4: "kept"}
    assert by_seed[1]["reason"].startswith("unparsable")
    assert by_seed[3]["reason"] == ("after 1 repair rounds: check: the untouched environment "
                                    "already scores 1.0")
    assert [(s["name"], s["ok"]) for s in by_seed[2]["stages"]] == [
        ("parse", True), ("validate", True), ("build", False),
        ("parse", True), ("validate", True), ("build", True), ("check", True), ("write", True)]
    # the teacher saw the failing build's error tail in the repair request
    repair = requests[4]["messages"][-1]["content"]
    assert "failed at the build stage" in repair and "raw-numbers.txt" in repair
    assert "No such file or directory" in repair
    oracle_repair = requests[8]["messages"][-1]["content"]
    assert "the reference solution scores 0.0, not 1" in oracle_repair
    # kept tasks validate and their images passed the checks
    kept = sorted(p.name for p in (tmp_path / "run" / "tasks").iterdir())
    assert kept == ["gen-000000", "gen-000002", "gen-000004"]
    manifest = gen_builds.store.read()
    for name in kept:
        assert validate_task(tmp_path / "run" / "tasks" / name) == []
        checks = manifest.tasks[name].checks
        assert (checks.ok, checks.nop_reward, checks.oracle_reward) == (True, 0.0, 1.0)
        assert load_task(tmp_path / "run" / "tasks" / name).config.metadata.axes == \
            sample_axes(gen.config.axes, int(name[-6:]))
    assert yield_table(records)["all"] == {"attempted": 5, "parsed": 4, "built": 4,
                                           "checked": 3, "kept": 3}
    u = gen.teacher.usage
    assert (u.requests, u.cache_hits, u.parse_failures, u.dropped) == (9, 0, 2, 1)
    prompt_words = sum(len(" ".join(m["content"] for m in r["messages"]).split())
                       for r in requests)
    assert u.prompt_tokens == prompt_words
    assert sum(r["teacher"]["prompt_tokens"] for r in records) == prompt_words
    assert [r["teacher"]["requests"] for r in records] == [1, 2, 2, 2, 2]
    assert u.completion_tokens == sum(len(str(i["content"]).split()) for i in script)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["yield"]["all"]["kept"] == 3

    # rerun into the same folder: every seed is done, nothing is asked
    with ScriptedServer([]) as empty:
        again = Generator(gen_config(empty.url, tmp_path), tmp_path / "run", gen_builds)
        asyncio.run(again.run(range(5), jobs=1, progress=False))
        assert empty.requests == []
    # a fresh run folder with the same teacher cache: every reply from the cache
    with ScriptedServer([]) as empty:
        fresh = Generator(gen_config(empty.url, tmp_path), tmp_path / "run2", gen_builds)
        records2 = asyncio.run(fresh.run(range(5), jobs=1, progress=False))
        assert empty.requests == []
    assert [r["outcome"] for r in records2] == [r["outcome"] for r in records]
    assert (fresh.teacher.usage.requests, fresh.teacher.usage.cache_hits) == (0, 9)


@pytest.mark.slow
@pytest.mark.sandbox
def test_gen_cli_runs_with_several_jobs_and_prints_the_yield(tmp_path, image_store,
                                                             monkeypatch):
    monkeypatch.setenv("TMAX_CACHE", str(CACHE))
    config = tmp_path / "gen.yaml"
    config.write_text(DEFAULT_CONFIG.read_text().replace("api_key_env: OPENAI_API_KEY",
                                                         "api_key_env: null"))
    fixtures = [{"kind": "stripped-binary", "path": "data/adder",
                 "files": {"main.c": '#include <stdio.h>\nint main(void){puts("15");return 0;}\n'}},
                {"kind": "wav-tones", "path": "data/beep.wav", "tones_hz": [440, 880]}]
    with_fixtures = item(dockerfile=DOCKERFILE + "COPY data/ /app/data/\n", fixtures=fixtures,
                         solve_sh="#!/bin/bash\n/app/data/adder > /app/sum.txt\n")
    with ScriptedServer([with_fixtures, item()]) as server:
        res = CliRunner().invoke(main, [
            "gen", "--config", str(config), "--out", str(tmp_path / "run"), "-n", "2",
            "--jobs", "2", "--base-url", server.url, "--store", str(image_store.root),
            "--builder", "local", "--no-progress"])
    assert res.exit_code == 0, res.output
    last = [line for line in res.output.splitlines() if line.startswith("all")]
    assert last and last[0].split() == ["all", "2", "2", "2", "2", "2"]
    assert "teacher: 2 requests, 0 from cache" in res.output
    res = CliRunner().invoke(main, ["data", "yield", str(tmp_path / "run"), "-o", "json"])
    assert json.loads(res.output)["all"]["kept"] == 2
    env = [tmp_path / "run" / "tasks" / t / "environment" / "data" for t in ("gen-000000",
                                                                            "gen-000001")]
    env = [e for e in env if e.is_dir()]
    assert len(env) == 1 and (env[0] / "adder").read_bytes()[:4] == b"\x7fELF"
    assert (env[0] / "beep.wav").read_bytes()[:4] == b"RIFF"


def test_fixtures_are_made_by_code_the_same_every_time(tmp_path):
    import io
    import shutil
    import subprocess
    import tarfile
    import wave

    from PIL import Image

    from tmax.data.fixtures import Fixture, FixtureError, render

    def twice(**spec):
        f = Fixture.model_validate(spec)
        a, b = render(f), render(f)
        assert a == b
        return a

    wav = twice(kind="wav-tones", path="a.wav", tones_hz=[440, 880], seconds_per_tone=0.25)
    with wave.open(io.BytesIO(wav)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (1, 16000, 8000)
    png = twice(kind="png-text", path="scan.png", text="INVOICE 42\nTOTAL 17.50")
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.getextrema() == (0, 255)
    pkg = twice(kind="vendored-package", path="vendor/tinycalc-0.1.0.tar.gz",
                package="tinycalc", files={"__init__.py": "def add(a, b):\n    return a + b\n"})
    with tarfile.open(fileobj=io.BytesIO(pkg)) as tar:
        assert tar.getnames() == ["tinycalc-0.1.0/pyproject.toml",
                                  "tinycalc-0.1.0/tinycalc/__init__.py"]
        assert {m.mtime for m in tar.getmembers()} == {0}
    binary = twice(kind="stripped-binary", path="bin/answer",
                   files={"main.c": "int main(void){return 42;}\n"})
    exe = tmp_path / "answer"
    exe.write_bytes(binary)
    exe.chmod(0o755)
    assert subprocess.run([str(exe)], timeout=30).returncode == 42
    assert b".symtab" not in binary  # stripped
    with pytest.raises(FixtureError, match="failed"):
        render(Fixture(kind="stripped-binary", path="x", files={"main.c": "not C"}))
    with pytest.raises(ValueError, match="relative to environment"):
        Fixture(kind="wav-tones", path="../x.wav")
    if shutil.which("ffmpeg") is None:
        with pytest.raises(FixtureError, match="ffmpeg is not on PATH"):
            render(Fixture(kind="video", path="v.mp4", tones_hz=[440]))


# --------------------------------------------------------------------------- decontam, stats


BENCH = ("Find every file larger than ten megabytes under /data and write their paths, one "
         "per line, sorted by size, to /app/big.txt.")


def write_instruction_task(root: Path, name: str, instruction: str, axes: dict | None = None,
                           seed: int = 0) -> Path:
    config = load_gen_config()
    axes = axes or sample_axes(config.axes, seed)
    reply = TaskReply.model_validate_json(task_json(instruction=instruction))
    draft = draft_of(reply, seed, axes, config)
    draft.task_id = name
    return write_task(draft, root).root


def test_decontam_counts_shared_ngrams_by_hand(tmp_path):
    from tmax.data.decontam import build_index, instructions, overlap, report, tokens

    write_instruction_task(tmp_path / "bench", "find-big-files", BENCH)
    write_instruction_task(tmp_path / "bench", "other", "Compress the logs in /var/log nightly.")
    a = ("Please FIND every file larger than ten megabytes under /data and write their paths, "
         "one per line, to /out.txt")
    b = "Count the lines of /var/log/syslog and print the number of lines."
    assert tokens(a)[:3] == ["please", "find", "every"] and len(tokens(a)) == 20
    index = build_index(tmp_path / "bench")
    assert index.tasks == 2
    # a shares the 16-token run find..line: 4 of its 8 13-grams, 9 of its 13 8-grams
    o13, o8 = overlap(a, index, 13), overlap(a, index, 8)
    assert (o13.hits, o13.ngrams, o13.matches) == (4, 8, ["find-big-files"])
    assert (o8.hits, o8.ngrams) == (9, 13) and o8.fraction == pytest.approx(9 / 13)
    assert overlap(b, index, 8).hits == 0
    write_instruction_task(tmp_path / "gen", "a", a, seed=1)
    write_instruction_task(tmp_path / "gen", "b", b, seed=2)
    rows = report(instructions(tmp_path / "gen"), index)
    assert [(r.task_id, r.contaminated) for r in rows] == [("a", True), ("b", False)]
    res = CliRunner().invoke(main, ["data", "decontam", str(tmp_path / "gen"), "--against",
                                    str(tmp_path / "bench"), "--write-clean",
                                    str(tmp_path / "clean")])
    assert res.exit_code == 0, res.output
    assert "1/2 tasks share a 13-gram" in res.output and "n13 4/8  n8 9/13" in res.output
    assert sorted(p.name for p in (tmp_path / "clean").iterdir()) == ["b"]


def test_balance_by_hand():
    from tmax.data.stats import balance

    # H = -(3/4 ln 3/4 + 1/4 ln 1/4) = 0.562335; exp(H) = 1.754765
    assert balance({"a": 3, "b": 1}) == pytest.approx(1.754765 / 2, abs=1e-6)
    assert balance({"a": 3, "b": 1}, ["a", "b", "c"]) == pytest.approx(1.754765 / 3, abs=1e-6)
    assert balance({"a": 2, "b": 2, "c": 2, "d": 2}) == pytest.approx(1.0)
    assert balance({"a": 5}) == 1.0 and balance({"a": 5}, ["a", "b"]) == 0.5
    assert balance({}) == 0.0


def test_data_stats_counts_axes_side_by_side(tmp_path):
    from tmax.data.stats import dataset_stats

    base = sample_axes(load_gen_config().axes, 0)
    for i, (domain, kind) in enumerate([("security", "text"), ("security", "text"),
                                        ("debugging", "text"), ("debugging", "vendored package")]):
        axes = base | {"domain": domain, "fixture_kind": kind}
        write_instruction_task(tmp_path / "one", f"t{i}", BENCH + f" Variant {i}.", axes, i)
    write_instruction_task(tmp_path / "two", "only", BENCH, base | {"domain": "security"})
    s = dataset_stats(tmp_path / "one")
    assert s["tasks"] == 4 and s["counts"]["domain"] == {"debugging": 2, "security": 2}
    assert s["balance"]["domain"] == 1.0
    assert s["balance"]["fixture_kind"] == pytest.approx(1.754765 / 2, abs=1e-4)
    assert s["instruction_words"]["mean"] == len(BENCH.split()) + 2
    assert s["verifier_lines"]["max"] == len(TEST_SH.splitlines())
    res = CliRunner().invoke(main, ["data", "stats", str(tmp_path / "one"),
                                    str(tmp_path / "two")])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split() == ["one", "two"]
    assert [line.split() for line in lines if line.startswith("tasks")] == [["tasks", "4", "1"]]
    assert ["domain=security", "2", "1"] in [line.split() for line in lines]


def test_shards_split_the_seeds_and_share_the_run_folder(tmp_path):
    with ScriptedServer([{"content": "no"}] * 8) as server:
        for k in (0, 1):
            gen = Generator(gen_config(server.url, tmp_path), tmp_path / "run", NoBuilds(),  # type: ignore[arg-type]
                            shard=(k, 2))
            records = asyncio.run(gen.run(range(4), jobs=2, progress=False))
            assert [r["seed"] for r in records] == [k, k + 2]
        assert len(server.requests) == 8  # 4 seeds x (1 + parse_retries)
    assert sorted(p.name for p in (tmp_path / "run").glob("records*.jsonl")) == [
        "records.shard-0-of-2.jsonl", "records.shard-1-of-2.jsonl"]
    assert sorted(Generator(gen_config(server.url, tmp_path), tmp_path / "run",
                            NoBuilds()).records()) == [0, 1, 2, 3]  # type: ignore[arg-type]
    res = CliRunner().invoke(main, ["data", "yield", str(tmp_path / "run")])
    assert res.output.splitlines()[-1].split() == ["all", "4", "0", "0", "0", "0"]
    with pytest.raises(ValueError, match="0 <= k < n"):
        Generator(gen_config(server.url, tmp_path), tmp_path / "x", NoBuilds(), shard=(2, 2))  # type: ignore[arg-type]
    res = CliRunner().invoke(main, ["gen", "--out", str(tmp_path / "y"), "--shard", "3"])
    assert res.exit_code == 2 and "K/N with 0 <= K < N" in res.output


@pytest.mark.slow
@pytest.mark.slurm
def test_gen_array_runs_the_shards_as_one_slurm_array_and_reads_their_records(
        local_slurm, tmp_path):
    with ScriptedServer([{"content": "no"}] * 8) as server:
        config = tmp_path / "gen.yaml"
        config.write_text(yaml.safe_dump(gen_config(server.url, tmp_path).model_dump()))
        res = CliRunner().invoke(main, [
            "gen", "--config", str(config), "--out", str(tmp_path / "run"), "-n", "4",
            "--jobs", "1", "--store", str(tmp_path / "store"), "--array", "2",
            "--time-min", "10", "--no-progress"])
        logs = "\n".join(p.read_text() for p in (tmp_path / "run" / "slurm").rglob("*.err"))
        assert res.exit_code == 0, res.output + logs
        assert len(server.requests) == 8  # 4 seeds x (1 + parse_retries), each asked once
    assert sorted(p.name for p in (tmp_path / "run").glob("records*.jsonl")) == [
        "records.shard-0-of-2.jsonl", "records.shard-1-of-2.jsonl"]
    assert [line.split() for line in res.output.splitlines() if line.startswith("all")] == [
        ["all", "4", "0", "0", "0", "0"]]
    assert "2 array tasks (job " in res.output and ", 0 failed;" in res.output


@pytest.mark.slow
def test_self_generation_with_the_tiny_model_drops_its_garbage_cleanly(tmp_path):
    """The tiny model behind `tmax serve`'s HTTP server as the teacher: nothing it says is a
    task; every seed is dropped as unparsable, with the yield and the usage reported."""
    import torch

    from tests.conftest import EXAMPLES
    from tmax.agent.policies.hf import HFPolicy
    from tmax.inference.hf_server import HFServer
    from tmax.models.tiny import (
        build_tiny_model,
        build_tokenizer,
        corpus_texts,
        save_pretrained_dir,
    )
    from tmax.tasks import find_tasks

    torch.set_num_threads(1)
    tokenizer = build_tokenizer(corpus_texts(find_tasks(EXAMPLES)))
    model_dir = save_pretrained_dir(build_tiny_model(tokenizer, n_layers=2, d_model=64,
                                                     n_heads=4, seed=0), tokenizer,
                                    tmp_path / "tiny")
    policy = HFPolicy.from_pretrained(model_dir, max_new_tokens=16, temperature=0.8, seed=1,
                                      max_batch=4)
    with HFServer(policy, model_name="tiny") as server:
        config = gen_config(server.url, tmp_path)
        config = config.model_copy(update={"teacher": config.teacher.model_copy(update={
            "model": "tiny", "temperature": 0.8, "max_tokens": 16})})
        gen = Generator(config, tmp_path / "run", NoBuilds())  # type: ignore[arg-type]
        records = asyncio.run(gen.run(range(3), jobs=3, progress=False))
    assert [r["outcome"] for r in records] == ["dropped"] * 3
    assert all(r["reason"].startswith("unparsable") for r in records)
    assert yield_table(records)["all"] == {"attempted": 3, "parsed": 0, "built": 0,
                                           "checked": 0, "kept": 0}
    u = gen.teacher.usage
    assert (u.requests, u.parse_failures, u.dropped) == (6, 6, 3)
    assert 0 < u.completion_tokens <= 6 * 16 and u.prompt_tokens > 0


def test_the_shipped_scripted_teacher_parses_and_covers_its_four_seeds():
    server = ScriptedServer.from_file(Path(__file__).parents[1] / "data" / "gen" / "teacher.yaml")
    config = load_gen_config()
    # seed 0: 1 reply; seed 1: 1 + parse_retries; seed 2: 2; seed 3: 1 + repair_rounds
    assert len(server.responses) == 1 + (1 + config.teacher.parse_retries) + 2 + \
        (1 + config.generation.repair_rounds)
    good = [TaskReply.model_validate_json(r["content"]) for r in server.responses
            if r["content"].startswith("{\"instruction\": \"Add")]
    assert len(good) == 7


def test_gen_refuses_zero_tasks_before_touching_the_run_folder(tmp_path):
    out = tmp_path / "new" / "run"
    result = CliRunner().invoke(main, ["gen", "-n", "0", "--out", str(out)])
    assert result.exit_code == 2
    assert "--num-tasks" in result.output and "0 is not in the range" in result.output
    assert not out.parent.exists()
