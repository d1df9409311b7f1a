"""The teacher client shared by generation, audit and repair: any OpenAI-compatible
endpoint, with concurrency and rate limits, retries (those of ``OpenAIPolicy``), a response
cache on disk, token and cost accounting, and strict structured output."""

from tmax.llm.client import (
    Reply,
    ResponseCache,
    StructuredOutputError,
    Teacher,
    TeacherConfig,
    TeacherUnavailable,
    Usage,
    parse_json_reply,
    track_usage,
)

__all__ = ["Reply", "ResponseCache", "StructuredOutputError", "Teacher", "TeacherConfig",
           "TeacherUnavailable", "Usage", "parse_json_reply", "track_usage"]
