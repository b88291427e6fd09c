"""Structured outputs and forced tool calls hold at temperature 1.

Thirty sampled replies through the official SDK, four at a time (the server's slots batch them):
ten strict ``json_schema`` outputs and twenty calls forced by ``tool_choice`` naming the function
(ten with ``parallel_tool_calls: false``, ten leaving it out, which is one call too). Not sampled
here: ``parallel_tool_calls: true``, where the default model, free to go on, calls the same function
again and again until ``max_tokens`` cuts it (7 of 10 seeds when tried): its taste, not the
constraint, which a unit test checks (``test_tools``). Every one must end on
its own (not cut by ``max_tokens``), parse as JSON and validate against its schema with
``jsonschema``: 100%, not most. The schemas are bounded (lengths, ranges, item counts) so a valid
reply always fits in the token budget; what is measured is the engine's constraint, not the
model's taste. One real server, shared.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from serve_harness import user

SAMPLES = 10  # per kind; three kinds
MAX_TOKENS = 160
REVIEW = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genre": {"type": "string", "enum": ["drama", "comedy", "horror", "documentary"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "recommended": {"type": "boolean"},
    },
    "required": ["title", "rating", "genre", "tags", "recommended"],
    "additionalProperties": False,
}
MEETING = {
    "type": "object",
    "properties": {
        "day": {"type": "string", "enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 16},
                      "minItems": 1, "maxItems": 3},
        "online": {"type": "boolean"},
    },
    "required": ["day", "hour", "attendees", "online"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "schedule_meeting", "parameters": MEETING, "strict": True,
                                      "description": "Put a meeting in the calendar"}},
    {"type": "function", "function": {"name": "cancel_meeting", "description": "Cancel a meeting",
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}},
]


def review(client, model: str, seed: int) -> list[str]:
    """One json_schema sample; what is wrong with it (nothing: [])."""
    r = client.chat.completions.create(
        model=model, messages=user("Review a film you like."), max_tokens=MAX_TOKENS, temperature=1,
        seed=seed, response_format={"type": "json_schema",
                                    "json_schema": {"name": "review", "schema": REVIEW, "strict": True}},
    )
    choice = r.choices[0]
    if choice.finish_reason != "stop":
        return [f"seed {seed}: finish_reason {choice.finish_reason}: {choice.message.content!r}"]
    return validate(seed, choice.message.content, REVIEW)


def meeting(client, model: str, seed: int, parallel: bool | None) -> list[str]:
    """One forced tool call; what is wrong with it (nothing: [])."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(
        model=model, messages=user("Set up a meeting with Ann and Bob next week."), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "schedule_meeting"}},
        max_tokens=MAX_TOKENS, temperature=1, seed=seed, **extra,
    )
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    if choice.finish_reason != "tool_calls" or not calls:
        return [f"seed {seed}: finish_reason {choice.finish_reason}, {len(calls)} calls: "
                f"{choice.message.content!r}"]
    problems = [f"seed {seed}: called {c.function.name}" for c in calls
                if c.function.name != "schedule_meeting"]
    if parallel is not True and len(calls) != 1:
        problems.append(f"seed {seed}: {len(calls)} calls with parallel_tool_calls {parallel}")
    for c in calls:
        problems += validate(seed, c.function.arguments, MEETING)
    return problems


def validate(seed: int, text: str | None, schema: dict) -> list[str]:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return [f"seed {seed}: {type(e).__name__}: {str(e).splitlines()[0]}: {text!r}"]
    return []


@pytest.mark.parametrize("kind", ["json_schema", "tool-single", "tool-default"])
def test_every_sampled_output_is_valid(client, server, kind):
    """Ten samples at temperature 1 (distinct seeds): every one parses and validates."""
    def one(seed: int) -> list[str]:
        if kind == "json_schema":
            return review(client, server.model_id, seed)
        parallel = {"tool-single": False, "tool-default": None}[kind]
        return meeting(client, server.model_id, seed, parallel)

    with ThreadPoolExecutor(4) as pool:
        problems = [p for ps in pool.map(one, range(1000, 1000 + SAMPLES)) for p in ps]
    assert not problems, f"{len(problems)} problems in {SAMPLES} samples:\n" + "\n".join(problems)
