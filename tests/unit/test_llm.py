"""tmax.llm: the teacher client against the scripted OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import BaseModel, ValidationError

from tmax.agent.scripted_server import ScriptedServer
from tmax.llm import (
    StructuredOutputError,
    Teacher,
    TeacherConfig,
    TeacherUnavailable,
    parse_json_reply,
)


class Answer(BaseModel):
    a: int


def config(server: ScriptedServer, **kw) -> TeacherConfig:
    return TeacherConfig(base_url=server.url, model="teacher", api_key_env=None,
                         backoff_s=0.0, **kw)


def run(coro):
    return asyncio.run(coro)


async def ask(teacher: Teacher, messages, model=Answer):
    async with teacher:
        return await teacher.structured(messages, model)


def test_tokens_and_cost_are_counted_from_the_servers_usage(tmp_path):
    # the scripted server counts whitespace-split words: prompt "one two three" + "four" = 4,
    # completion '{"a":' '1}' = 2
    with ScriptedServer([{"content": '{"a": 1}'}]) as server:
        teacher = Teacher(config(server, price_prompt_per_m=2.0, price_completion_per_m=10.0))
        answer, conversation = run(ask(teacher, [
            {"role": "system", "content": "one two three"}, {"role": "user", "content": "four"}]))
    assert answer == Answer(a=1)
    assert conversation[-1] == {"role": "assistant", "content": '{"a": 1}'}
    u = teacher.usage
    assert (u.requests, u.prompt_tokens, u.completion_tokens, u.cache_hits) == (1, 4, 2, 0)
    assert u.cost == pytest.approx((4 * 2.0 + 2 * 10.0) / 1e6)


def test_an_unparsable_reply_goes_back_with_its_error_then_parses():
    script = [{"content": "Sure! Here is the task."}, {"content": '{"a": "many"}'},
              {"content": 'Done:\n```json\n{"a": 7}\n```'}]
    with ScriptedServer(script) as server:
        teacher = Teacher(config(server, parse_retries=2))
        answer, _ = run(ask(teacher, [{"role": "user", "content": "go"}]))
        requests = server.requests
    assert answer.a == 7
    assert len(requests) == 3
    second = requests[1]["messages"]
    assert second[1] == {"role": "assistant", "content": "Sure! Here is the task."}
    assert "holds no JSON object" in second[2]["content"]
    third = requests[2]["messages"][-1]["content"]
    assert "a: Input should be a valid integer" in third
    assert (teacher.usage.parse_failures, teacher.usage.dropped) == (2, 0)


def test_a_reply_that_never_parses_is_dropped_and_counted():
    with ScriptedServer([{"content": "no"}, {"content": "[1, 2]"}]) as server:
        teacher = Teacher(config(server, parse_retries=1))
        with pytest.raises(StructuredOutputError) as e:
            run(ask(teacher, [{"role": "user", "content": "go"}]))
        assert len(server.requests) == 2
    assert len(e.value.errors) == 2 and "expected one JSON object, got list" in e.value.errors[1]
    assert (teacher.usage.parse_failures, teacher.usage.dropped, teacher.usage.requests) == \
        (2, 1, 2)


def test_server_errors_are_retried_by_the_policy_and_a_dead_endpoint_is_unavailable():
    with ScriptedServer([{"status": 503}, {"status": 429}, {"content": '{"a": 3}'}]) as server:
        teacher = Teacher(config(server))
        answer, _ = run(ask(teacher, [{"role": "user", "content": "go"}]))
        assert len(server.requests) == 3
    assert answer.a == 3 and teacher.usage.requests == 1
    with ScriptedServer([{"status": 500}] * 3) as server:
        teacher = Teacher(config(server, max_retries=2))
        with pytest.raises(TeacherUnavailable, match="after 3 attempts"):
            run(ask(teacher, [{"role": "user", "content": "go"}]))
    with ScriptedServer([{"status": 401}]) as server, \
            pytest.raises(TeacherUnavailable, match="HTTP 401"):
        run(ask(Teacher(config(server)), [{"role": "user", "content": "go"}]))


def test_a_rerun_gets_every_reply_from_the_cache(tmp_path):
    script = [{"content": "garbage"}, {"content": '{"a": 5}'}]
    messages = [{"role": "user", "content": "make a task"}]
    with ScriptedServer(script) as server:
        first = Teacher(config(server), cache_dir=tmp_path / "cache")
        answer, _ = run(ask(first, messages))
    assert answer.a == 5 and first.usage.requests == 2
    files = sorted(p.name for p in (tmp_path / "cache").rglob("*"))
    assert len([f for f in files if f.endswith(".json")]) == 2
    assert not [f for f in files if f.endswith(".tmp")]
    with ScriptedServer([]) as empty:  # would answer anything with a shell command
        second = Teacher(config(empty), cache_dir=tmp_path / "cache")
        again, _ = run(ask(second, messages))
        assert empty.requests == []
    assert again == answer
    u = second.usage
    assert (u.requests, u.cache_hits, u.prompt_tokens, u.parse_failures) == (0, 2, 0, 1)
    # other sampling params are another key
    with ScriptedServer([{"content": '{"a": 6}'}]) as server:
        hotter = Teacher(config(server, temperature=1.3), cache_dir=tmp_path / "cache")
        assert run(ask(hotter, messages))[0].a == 6 and len(server.requests) == 1


def test_concurrency_and_rate_limits():
    script = [{"content": '{"a": 1}', "delay_s": 0.3} for _ in range(6)]
    with ScriptedServer(script) as server:
        teacher = Teacher(config(server, concurrency=2))

        async def many():
            async with teacher:
                return await asyncio.gather(*(teacher.structured(
                    [{"role": "user", "content": f"q{i}"}], Answer) for i in range(6)))

        run(many())
        assert server.max_in_flight == 2
    with ScriptedServer([{"content": '{"a": 1}'}] * 3) as server:
        teacher = Teacher(config(server, requests_per_minute=300))  # one start per 0.2 s

        async def three():
            async with teacher:
                await asyncio.gather(*(teacher.chat([{"role": "user", "content": f"{i}"}])
                                       for i in range(3)))

        start = time.monotonic()
        run(three())
        assert time.monotonic() - start >= 0.4


def test_track_usage_splits_the_spend_between_concurrent_tasks():
    from tmax.llm import track_usage

    script = [{"content": '{"a": 1}', "delay_s": 0.2}, {"content": '{"a": 2}', "delay_s": 0.2}]
    with ScriptedServer(script) as server:
        teacher = Teacher(config(server, concurrency=2))

        async def one(words: str):
            with track_usage() as usage:
                await teacher.structured([{"role": "user", "content": words}], Answer)
            return usage

        async def both():
            async with teacher:
                return await asyncio.gather(one("a b"), one("c d e f"))

        short, long = run(both())
    assert (short.prompt_tokens, long.prompt_tokens) == (2, 4)
    assert (short.requests, long.requests, teacher.usage.requests) == (1, 1, 2)
    assert teacher.usage.prompt_tokens == 6


def test_config_is_strict_and_never_holds_the_key(monkeypatch):
    with pytest.raises(ValidationError, match="api_key"):
        TeacherConfig.model_validate({"api_key": "sk-secret"})
    monkeypatch.setenv("MY_TEACHER_KEY", "sk-from-env")
    teacher = Teacher(TeacherConfig(api_key_env="MY_TEACHER_KEY"))
    assert teacher.policy.api_key == "sk-from-env"


def test_parse_json_reply_forms():
    assert parse_json_reply('{"a": 1}', Answer).a == 1
    assert parse_json_reply('text\n```json\n{"a": 2}\n```\nmore', Answer).a == 2
    assert parse_json_reply('The answer: {"a": 3} hope it helps', Answer).a == 3
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_json_reply('{"a": 1', Answer)
