"""Client JSON -> Python values within limits, without I/O: the request body, and the JSON text a body
carries inside a string (a tool call's ``arguments``), parsed by this one function so both get the
same limits; each broken limit is a 400 naming it, before anything else walks the value.

- Strict JSON: no NaN or Infinity (``json.dumps`` would write them back as no JSON).
- Integers of at most MAX_INT_DIGITS digits, nesting at most MAX_JSON_DEPTH deep: past them
  Python's own guards raise (a ValueError at 4300 digits, a RecursionError near 1000 levels) in
  whatever converts or walks the value next.
- No lone surrogate in any string, keys included. Checked here, once over the whole value, rather
  than field by field in the parsers: every string of a body reaches something that encodes it as
  UTF-8 (the tokenizer, the chat template's prompt, a grammar, a streamed echo such as Responses'
  ``metadata``), and a field-by-field check misses the field added next (issue 38 found seven).
  The body must be UTF-8, which cannot hold a surrogate, so one can only come from a ``\\uD800``
  to ``\\uDFFF`` escape: a text without such an escape is not walked at all.
"""

from __future__ import annotations

import json
import re
from typing import Any

from colibri.api.openai_errors import MAX_SHOWN_CHARS, ApiError, bad

# An OpenAI body nests about 5 deep (messages[i].content[j].text); deeper is no request but a bid
# for the recursion of whatever walks it (json's own parser fails near 1000 with RecursionError).
MAX_JSON_DEPTH = 64
# The longest integer a field takes is a uint64 seed (20 digits); longer ones are refused while
# parsing, before Python's own guard (4300 digits, a ValueError) or a quadratic conversion.
MAX_INT_DIGITS = 40
# A digit run that long somewhere in the text (perhaps in a string): only then is each integer
# checked as it is parsed, a Python call per integer that plain bodies need not pay. Scanned in the
# body's bytes (one a character: faster than a decoded text that holds any character past U+FFFF).
_LONG_DIGITS = {bytes: re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1)),
                str: re.compile(rf"[0-9]{{{MAX_INT_DIGITS + 1}}}")}
# The escape of a surrogate, paired or not (or, in a ``str`` handed in, a surrogate itself): only a
# text holding one can hold a lone surrogate once parsed.
_MAYBE_SURROGATE = {bytes: re.compile(rb"\\u[dD][89a-fA-F]"),
                    str: re.compile("\\\\u[dD][89a-fA-F]|[\ud800-\udfff]")}
_SURROGATE = re.compile("[\ud800-\udfff]")

_RAISE: Any = object()  # parse_json's ``not_json`` default: text that is no JSON is a 400
Path = tuple[str | int, ...]  # keys and list indexes from the top of a value


class _Constant(ValueError):
    """NaN, Infinity or -Infinity: Python's extensions, no JSON numbers."""


def _refuse_constant(name: str) -> Any:
    raise _Constant(f"{name} is not a JSON number")


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than ``limit`` deep; iterative, so any depth is safe to ask."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def _encodable(value: Any) -> bool:
    """Whether every string of ``value`` (within MAX_JSON_DEPTH) is UTF-8: json's C encoder and one
    encode, several times faster than a walk in Python, which only then finds the culprit."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(value: Any) -> tuple[Path, str, bool] | None:
    """(the path to the first string, in document order, that holds a lone surrogate, that string,
    whether it is a key), or None. Iterative: any depth is safe to walk."""
    stack: list[tuple[Any, Path, bool]] = [(value, (), False)]
    while stack:
        node, path, is_key = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return path, node, is_key
        elif isinstance(node, dict):
            for key, child in reversed(node.items()):  # popped in order: each key, then its value
                stack += ((child, (*path, key), False), (key, path, True))
        elif isinstance(node, list):
            stack.extend((node[i], (*path, i), False) for i in range(len(node) - 1, -1, -1))
    return None


def path_text(path: Path, where: str = "") -> str:
    """``messages[0].content[1].text``: ``where`` (the field the JSON text came from), then the
    path inside it, cut to MAX_SHOWN_CHARS (keys are the client's)."""
    text = where
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else f".{step}" if text else step
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + "..."


def _field(path: Path) -> Path:
    """The request field a path lies in, as the parsers name fields: a top-level key, or a key of
    one item of a top-level list (``messages[0].content``, ``input[2].name``, ``tools[1].function``)."""
    if len(path) >= 3 and isinstance(path[1], int) and isinstance(path[2], str):
        return path[:3]
    return path[:1]


def _described(where: str) -> str:
    return f"'{where}'" if where else "the request body"


def _surrogate_error(found: tuple[Path, str, bool], where: str, param: str) -> ApiError:
    path, text, is_key = found
    char = ord(_SURROGATE.search(text)[0])  # type: ignore[index]
    place = path_text(path, where)
    what = (f"a key of {_described(place)}" if is_key else _described(place))
    return bad(param or path_text(_field(path)),
               f"{what} holds a lone surrogate (\\u{char:04x}), which is not Unicode text and cannot "
               "be encoded as UTF-8")


def parse_json(raw: bytes | str, where: str = "", param: str | None = None, not_json: Any = _RAISE) -> Any:
    """JSON text as a value, within the module's limits, or a 400 naming what is wrong with it.

    ``where``: the field that held the text ("" for the request body itself), named in the errors;
    ``param``: the errors' ``param`` (None: ``where``; for a lone surrogate in the body itself, the
    request field it lies in); ``not_json``: returned for text that is no JSON at all (by default
    a 400), while a broken limit is a 400 all the same (a tool call's arguments are kept as
    written when they are no JSON, but are never handed on past a limit)."""
    param_of = where if param is None else param
    described = _described(where)
    too_deep = bad(param_of, f"{described} is nested too deep (more than {MAX_JSON_DEPTH} levels)")
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise bad(param_of, f"{described} is not UTF-8") from None
    else:
        text = raw

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise bad(param_of, f"{described} holds an integer of {len(digits.lstrip('-'))} digits; "
                                f"at most {MAX_INT_DIGITS} are taken")
        return int(digits)

    try:
        value = json.loads(text, parse_int=parse_int if _LONG_DIGITS[type(raw)].search(raw) else None,
                           parse_constant=_refuse_constant)
    except (json.JSONDecodeError, _Constant) as e:
        if not_json is not _RAISE:
            return not_json
        why = f"{e.msg} at {e.pos}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise bad(param_of, f"{described} is not valid JSON: {why}") from None
    except RecursionError:  # json's parser recurses per level: far past MAX_JSON_DEPTH anyway
        raise too_deep from None
    # Fewer brackets than the limit (counted in strings too) cannot nest past it: no walk needed.
    brackets = (b"[", b"{") if isinstance(raw, bytes) else ("[", "{")
    if sum(raw.count(b) for b in brackets) > MAX_JSON_DEPTH and _nested_deeper_than(value, MAX_JSON_DEPTH):
        raise too_deep
    if _MAYBE_SURROGATE[type(raw)].search(raw) and not _encodable(value):
        raise _surrogate_error(_lone_surrogate(value), where, param_of)  # type: ignore[arg-type]
    return value
