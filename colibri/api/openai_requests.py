"""OpenAI request bodies -> a ``Generation`` (the prompt and the sampling parameters), without I/O.

A body that cannot be served becomes an ``ApiError`` naming the offending field. Every field the
server does not serve is refused by name: nothing is silently ignored except what has no effect on
the output: a field at null or at its default (``n: 1``, ``response_format: {"type": "text"}``,
``tools: []``...), as proxies and SDKs send them, and metadata (``user``, ``metadata``,
``prompt_cache_key``...). Of several refused fields the one the client needs is named: ``tools``
before ``parallel_tool_calls``, which only modifies it.

The body's JSON itself (nesting, integer size, lone surrogates in any string) is checked as it is
parsed (``json_body.parse_json``); the per-field surrogate checks here keep a body handed in as a
``dict`` to the same rule. Counts are capped before anything walks the lists: messages
(MAX_MESSAGES), tools and tool calls (``tools.py``).

Structured outputs (``response_format``, ``structured.py``) and tools (``tools.py``) become a
grammar the engine holds every sampled token to; the two at once are refused (one answer cannot be
both a tool envelope and the client's schema).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colibri.api import reasoning

# The body's JSON limits, re-exported: the routes and the tests take them from here.
from colibri.api.json_body import MAX_INT_DIGITS, MAX_JSON_DEPTH, parse_json  # noqa: F401
from colibri.api.openai_errors import bad, shown, too_many
from colibri.api.stop import validate_stops
from colibri.api.structured import response_format_grammar
from colibri.api.tools import (
    ToolPlan,
    count_calls,
    history_message,
    parse_tools,
    prompt_messages,
    tool_grammar,
)
from colibri.errors import ColibriError
from colibri.io.events import TOPK_CANDIDATES
from colibri.model.harmony import speaks_harmony
from colibri.model.text import ClientMarkupError

# The engine's TOPK lines carry this many candidates: the most top_logprobs can give.
MAX_TOP_LOGPROBS = TOPK_CANDIDATES
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_SEED = (1 << 64) - 1  # the engine's seed is a uint64
# A request without max_tokens: at most this many, so a forgotten limit does not fill the context.
DEFAULT_MAX_TOKENS = 1024
# ``max_tokens`` has no upper bound of its own: a value above what the context leaves is capped to
# what fits (``fit_budget``), as llama.cpp's server does (it generates until the context is full);
# coding agents ask for far more than a small context holds (opencode: 32,000).
MIN_MAX_TOKENS = 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's values
MIN_TOP_P = 1e-9  # top_p must be positive (0 would keep no token at all)
# Messages in a chat (input items in a Responses body): checking and rendering cost ~20 us each on
# the event loop, so 50,000 tiny ones held every other client for a second (issue 38); 2048 is far
# more than a conversation that fits a context holds (each costs a few tokens of template alone).
MAX_MESSAGES = 2048
# ``render(messages, enable_thinking[, tools][, template_kwargs=...]) -> prompt``: the model's chat
# template (tools only for a template that takes them; ``enable_thinking`` None: the template's own
# default; ``ModelText.render``).
Render = Callable[..., str]
# What the template gets from the server itself, or calls: a client's ``chat_template_kwargs`` may
# not replace them (jinja's own globals, ``ChatTemplate``'s helpers, the rendering's variables).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
    "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace",
})

# Fields not served, accepted at null or at a value equal to their default (as if absent).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "modalities": (["text"],),
    "prediction": (),
    "verbosity": ("medium",),
    # Served in chat; in the legacy completions, accepted where they change nothing.
    "tools": ([],),
    "functions": ([],),
    # With no tools (tools are refused before these are looked at), "none" and "auto" are the same.
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    # It only modifies tools: without them, either value is the default.
    "parallel_tool_calls": (True, False),
}
# Metadata: any value, no effect on the output.
_HARMLESS = {
    "model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
}
# Checked first: the fields a request needs, before those that only modify them (a LangChain
# ``bind_tools`` request has tools and parallel_tool_calls: false; tools is what it lacks).
_FIRST = ("tools", "functions", "tool_choice", "function_call", "response_format")
_COMMON = {
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "cache_slot",
    "enable_thinking",
    "reasoning_effort",
    "colibri",
}
# Why a field the server does not serve is refused (others: "'<name>' is not supported").
_REFUSALS = {
    "tools": "tools are served in /v1/chat/completions only",
    "tool_choice": "tools are served in /v1/chat/completions only (here tool_choice may only be "
                   "'none' or 'auto')",
    "functions": "the legacy 'functions' are not supported: use 'tools'",
    "function_call": "the legacy 'function_call' is not supported: use 'tool_choice'",
    "n": "only n=1 is supported",
    "best_of": "only best_of=1 is supported",
    "audio": "audio is not supported",
    "modalities": "only text output is supported (modalities: ['text'])",
    "prediction": "predicted outputs are not supported",
    "chat_template_kwargs": "a text completion has no chat template (use /v1/chat/completions)",
    "verbosity": "only the default verbosity 'medium' is supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "logit_bias": "logit_bias is not supported",
    "presence_penalty": "penalties are not supported",
    "frequency_penalty": "penalties are not supported",
}
CHAT_FIELDS = _COMMON | _HARMLESS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "response_format", "chat_template_kwargs",
}
COMPLETION_FIELDS = _COMMON | _HARMLESS | {"prompt", "logprobs", "response_format"}


@dataclass
class Generation:
    """A valid request: what the engine is asked for, and how the answer is to be shaped."""

    kind: str  # "chat" | "completion"
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    cache_slot: int | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    # The template's thinking switch (None: not passed, the template's default) and the client's
    # other ``chat_template_kwargs``.
    enable_thinking: bool | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The reply is split into reasoning and answer (``reasoning.py``): the template writes a
    # reasoning block and no grammar holds the output; ``reasoning_open``: it starts inside it.
    reasoning: bool = False
    reasoning_open: bool = False
    # The reply is in harmony's channels (gpt-oss: ``harmony.py`` splits it; ``reasoning`` too).
    harmony: bool = False
    # What every sampled token must match (``structured.py``'s grammar contract); None: free text.
    grammar: str | None = None
    # The offered tools: the answer's text goes through ``tools.split_output`` with it.
    tools: ToolPlan | None = None
    # The prompt's token ids, set by the server after parsing (model/text.py's trust rule: client
    # text never becomes a control token); empty, the engine tokenizes ``prompt`` itself.
    prompt_ids: tuple[int, ...] = ()
    # The field a client shortens when the prompt is over the context: "messages", "prompt", "input".
    prompt_field: str = "messages"
    # The client's own ``max_tokens`` (None: not given, the default applied): what a cap reports.
    requested_max_tokens: int | None = None
    # ``colibri.speculative``: False, no speculative decoding for this request; None: the engine's.
    speculative: bool | None = None
    # What the server changed or left out of the request, for the answer's ``colibri`` block: a
    # ``max_tokens`` capped to the context, tools dropped (Responses), a cut tool call dropped.
    notes: dict[str, Any] = field(default_factory=dict)


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(name, f"'{name}' must be a number")
    if isinstance(value, float) and not math.isfinite(value):  # not for an int: 10**400 overflows it
        raise bad(name, f"'{name}' must be a finite number")
    if not lo <= value <= hi:
        raise bad(name, f"'{name}' must be between {lo:g} and {hi:g}")
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int | None) -> int | None:
    """``body[name]`` as an integer in [lo, hi] (``hi`` None: no upper bound), None if absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer")
    if hi is None and value < lo:
        raise bad(name, f"'{name}' must be at least {lo}")
    if hi is not None and not lo <= value <= hi:
        raise bad(name, f"'{name}' must be between {lo} and {hi}")
    return value


def fit_budget(gen: Generation, n_ctx: int) -> None:
    """Cap ``gen.max_tokens`` to what the context leaves after the prompt (``gen.prompt_ids``), as
    llama.cpp's server does, and note the cap for the answer's ``colibri`` block. A prompt that
    fills the context whole still gets one token: the engine samples it from the prompt's last
    position and then stops (``finish_reason: "length"``); a longer prompt was refused before."""
    room = max(n_ctx - len(gen.prompt_ids), 1)
    if gen.max_tokens > room:
        asked = gen.requested_max_tokens if gen.requested_max_tokens is not None else gen.max_tokens
        gen.notes["max_tokens"] = {"requested": asked, "capped_to": room, "context_length": n_ctx,
                                   "prompt_tokens": len(gen.prompt_ids)}
        gen.max_tokens = room


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    """``value`` is null or equals a default, of the same kind (``true`` is not ``1``)."""
    return value is None or any(
        value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults
    )


def _check_fields(body: dict, allowed: set[str]) -> None:
    first = [name for name in _FIRST if name in body]
    for name in first + [name for name in body if name not in _FIRST]:
        if name in allowed or name in _HARMLESS:
            continue
        if name in _NEUTRAL and _is_default(body[name], _NEUTRAL[name]):
            continue
        raise bad(name, _REFUSALS.get(name, f"{shown(name)} is not supported"))


def _utf8(text: str, where: str) -> str:
    """``text`` if UTF-8 can encode it. JSON's ``\\ud800`` escapes decode to lone surrogates, which
    no prompt, token or stop string can hold: a 400 here, not a 500 (or a cut stream) later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        raise bad(where, f"'{where}' holds a lone surrogate (\\u{char:04x}), which is not Unicode "
                         "text and cannot be encoded as UTF-8") from None
    return text


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _utf8(content, where)
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(where, f"only text content is supported, not {shown(kind)}")
            parts.append(_utf8(part["text"], where))
        return "".join(parts)
    if content is None:
        return ""
    raise bad(where, "message content must be a string or a list of text parts")


def _common(
    body: dict, kind: str, prompt: str, n_ctx: int, n_slots: int, messages: list[dict[str, Any]] | None = None
) -> Generation:
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_name, MIN_MAX_TOKENS, None)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "'stream' must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", "'stream_options' may only hold 'include_usage'")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options", "'include_usage' must be a boolean")
    try:
        stops = [_utf8(stop, "stop") for stop in validate_stops(body.get("stop"))]
    except ValueError as e:
        raise bad("stop", str(e)) from None
    logprobs, top = body.get("logprobs"), 0
    if kind == "chat":
        if logprobs is not None and not isinstance(logprobs, bool):
            raise bad("logprobs", "'logprobs' must be a boolean")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not logprobs:
            raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        logprobs = bool(logprobs)
    else:  # the legacy API: logprobs is the number of alternatives
        top = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS) or 0
        logprobs = body.get("logprobs") is not None
    return Generation(
        kind=kind,
        prompt=prompt,
        max_tokens=min(max_tokens or DEFAULT_MAX_TOKENS, n_ctx),
        temperature=_number(body, "temperature", 0.0, MAX_TEMPERATURE, 1.0),
        top_p=_number(body, "top_p", MIN_TOP_P, 1.0, 1.0),
        seed=_integer(body, "seed", 0, MAX_SEED),
        stops=stops,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top,
        cache_slot=_integer(body, "cache_slot", 0, n_slots - 1),
        speculative=_speculative(body),
        messages=messages or [],
        prompt_field="messages" if kind == "chat" else "prompt",
        requested_max_tokens=max_tokens,
    )


def _speculative(body: dict) -> bool | None:
    """The request's ``colibri`` object (ours): ``speculative: false`` turns speculative decoding
    off for this request (its tokens are the same either way: only the speed differs)."""
    ours = body.get("colibri")
    if ours is None:
        return None
    if not isinstance(ours, dict) or set(ours) - {"speculative"}:
        raise bad("colibri", "'colibri' may only hold 'speculative'")
    flag = ours.get("speculative")
    if flag is not None and not isinstance(flag, bool):
        raise bad("colibri", "'colibri.speculative' must be a boolean")
    return None if flag is None or flag else False


def thinking(body: dict) -> bool | None:
    """The template's ``enable_thinking``, most specific first: ``chat_template_kwargs``'s, then
    ``enable_thinking``, then ``reasoning_effort`` (any but "none" thinks); None: none was said."""
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is not None:
        if not isinstance(kwargs["enable_thinking"], bool):
            raise bad("chat_template_kwargs", "'chat_template_kwargs.enable_thinking' must be a boolean")
        return kwargs["enable_thinking"]
    flag = body.get("enable_thinking")
    if flag is not None and not isinstance(flag, bool):
        raise bad("enable_thinking", "'enable_thinking' must be a boolean")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad("reasoning_effort", "'reasoning_effort' must be none, minimal, low, medium or high")
    if flag is not None:
        return flag
    return None if effort is None else effort != "none"


def template_kwargs(body: dict) -> dict[str, Any]:
    """``chat_template_kwargs`` (an object of JSON values) as the template gets them, without
    ``enable_thinking`` (``thinking``) and with ``reasoning_effort`` when the client set it (a
    template may read it, as llama.cpp's server passes it). A key the template gets from the
    server is refused: the client's value would replace the conversation or the markup."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad("chat_template_kwargs", f"'chat_template_kwargs' may not set {shown(key)}: the "
                                              "server gives the template that variable itself")
    out = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
    effort = body.get("reasoning_effort")
    if effort is not None and effort != "none":
        out.setdefault("reasoning_effort", effort)
    return out


def _template_flag(render: Render, name: str) -> bool:
    """A property of ``render``'s template, asked of its ModelText when it is one's bound
    ``render`` (the server's), else False (a test's stand-in)."""
    return bool(getattr(getattr(render, "__self__", None), name, False))


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The client's messages, checked, with text content (``tools.history_message``)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise too_many("messages", len(messages), MAX_MESSAGES)
    count_calls(messages)
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "each message must be an object")
        if m.get("function_call"):
            raise bad(where, "the legacy 'function_call' is not supported: use 'tool_calls'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"unknown role {shown(role)}")
        clean.append(history_message(i, m, role, _text_content(m.get("content"), f"{where}.content")))
    return clean


def _grammar(body: dict, plan: ToolPlan | None) -> str | None:
    structured = response_format_grammar(body.get("response_format"))
    if plan is None:
        return structured
    if structured is not None:
        raise bad("response_format", "'response_format' cannot be combined with 'tools': the answer is "
                                     "either a tool call envelope or your schema, not both (send one, "
                                     "or tool_choice 'none')")
    return tool_grammar(plan)


def _template_source(render: Render) -> str:
    """The source of ``render``'s template, when it is a ModelText's bound ``render``; else ""."""
    template = getattr(getattr(render, "__self__", None), "chat_template", None)
    return str(getattr(template, "source", ""))


def parse_chat(
    body: Any, render: Render, n_ctx: int, n_slots: int, template_tools: bool | None = None,
    template_thinks: bool | None = None,
) -> Generation:
    """``render(messages, enable_thinking[, tools][, template_kwargs=]) -> prompt`` is the model's
    chat template; ``template_tools``: whether it renders tools itself, ``template_thinks``:
    whether it writes a reasoning block (None: asked of ``render``'s ModelText)."""
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    clean = _chat_messages(body.get("messages"))
    if template_tools is None:
        template_tools = _template_flag(render, "template_uses_tools")
    source = _template_source(render)
    harmony = speaks_harmony(source)
    if template_thinks is None:
        template_thinks = reasoning.template_thinks(source) or harmony
    plan = parse_tools(body, template_tools)
    grammar = _grammar(body, plan)
    style = plan.style if plan is not None else ("template" if template_tools else "generic")
    clean = prompt_messages(clean, plan, style)
    think, kwargs = thinking(body), template_kwargs(body)
    offered = plan.template_tools if plan is not None else None
    args = [clean, think] if offered is None else [clean, think, offered]
    try:
        prompt = render(*args, template_kwargs=kwargs) if kwargs else render(*args)
    except ClientMarkupError as e:  # the trust rule: a tool's or a kwarg's text would be markup
        raise bad(e.field, str(e)) from None
    except ColibriError as e:  # the template's raise_exception: these messages are not its shape
        raise bad("messages", str(e)) from None
    gen = _common(body, "chat", prompt, n_ctx, n_slots, clean)
    gen.enable_thinking, gen.template_kwargs, gen.grammar, gen.tools = think, kwargs, grammar, plan
    # A grammar holds the whole output (a tool envelope, the client's schema): no room for a block.
    gen.reasoning = template_thinks and grammar is None
    gen.harmony = harmony and grammar is None
    gen.reasoning_open = gen.reasoning and not harmony and reasoning.opens_reasoning(prompt)
    return gen


def parse_completion(body: Any, n_ctx: int, n_slots: int) -> Generation:
    """The legacy API: one prompt string, sent as it is (no template)."""
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "'prompt' must be a string (one prompt per request)")
    if not prompt:
        raise bad("prompt", "'prompt' must not be empty")
    _utf8(prompt, "prompt")
    thinking(body)
    gen = _common(body, "completion", prompt, n_ctx, n_slots)
    gen.grammar = response_format_grammar(body.get("response_format"))
    return gen
