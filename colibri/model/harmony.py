"""OpenAI's harmony format (gpt-oss): its markup tokens, named once (the tokenizer renders them as
their text; of them only ``RETURN`` and ``CALL`` end a generation), the template check, and the
replies split as they stream, for the HTTP server and ``coli chat``: the ``analysis`` channel is
the reasoning, ``final`` (and ``commentary`` addressed to no one, a preamble) the answer, and a
message addressed to a function a tool call.

A reply is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

(the prompt ends with ``<|start|>assistant``, so the first header has no role). The vocabulary's
harmony tokens render as their text for such a model, and ``<|return|>`` and ``<|call|>`` end the
generation (so a reply's last one is no text), ``<|end|>`` only a message. A call leaves here as
the Hermes markers every template-style tool plan reads (``tool_format.CALL_OPEN``), its
arguments the body's JSON, so it becomes an OpenAI ``tool_calls`` entry like any other; a call cut
by ``max_tokens`` leaves as an unclosed marker, which the server drops (``tools.cut_call``).

``HarmonySplit`` has ``ReasoningSplit``'s interface (``feed``, ``flush``, ``opened``,
``reasoning_tokens``); a reply that opens with no header (a grammar held it: a JSON schema) is all
answer. Only the model's output is parsed: a client's text is data (``model/text.py``).
"""

from __future__ import annotations

import json
import re

from colibri.model.tool_format import CALL_CLOSE, CALL_OPEN

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKUP = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
# What ends a body: its own end, or a header that begins without one.
_BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)
# A header longer than this never closed: its text is shown, not held forever.
MAX_HEADER = 512
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."  # the namespace the template declares the client's tools in


def speaks_harmony(texts: str | dict[str, int]) -> bool:
    """A template's source, or a vocabulary's control tokens, of the harmony format: it writes
    channel headers (and a model's calls as ``to=functions.NAME`` messages)."""
    return CHANNEL in texts and MESSAGE in texts


# The states: before the first header (it may be none), in a header, in a body, a plain reply.
_START, _HEADER, _BODY, _PLAIN = "start", "header", "body", "plain"


def _partial_marker(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    at = text.rfind("<|")
    if at < 0:
        return 1 if text.endswith("<") else 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) and m != tail for m in MARKUP) else 0


# What a harmony reply may open with: a header, or (the role written by the prompt) a recipient.
OPENERS = (START, CHANNEL, "to=")


class HarmonySplit:
    """Streamed reply text in, (reasoning, answer) pieces out; ``flush`` at the end. ``openers``:
    what makes a reply a harmony one (any other is all answer); ``coli chat``, which runs every
    model's replies through it and offers no tools, takes the headers alone."""

    def __init__(self, openers: tuple[str, ...] = OPENERS) -> None:
        self.openers = openers
        self.state = _START
        self.opened = False  # the reply had an analysis message
        self.reasoning_tokens = 0
        self._buf = ""
        self._channel = ""
        self._recipient: str | None = None
        self._call = ""  # a call's body so far

    def feed(self, text: str, tokens: int = 0) -> tuple[str, str]:
        if self.state == _BODY and self._channel == "analysis" and self._recipient is None:
            self.reasoning_tokens += tokens
        self._buf += text
        return self._run(final=False)

    def flush(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, answer = [], []
        while True:
            r, a, more = self._step(final)
            reasoning.append(r)
            answer.append(a)
            if not more:
                return "".join(reasoning), "".join(answer)

    def _step(self, final: bool) -> tuple[str, str, bool]:
        """One move of the state machine: (reasoning, answer, whether to go on)."""
        buf = self._buf
        if self.state == _START:
            head = buf.lstrip()
            if head.startswith(self.openers):
                self.state = _HEADER
                return "", "", True
            if not final and head and any(m.startswith(head) for m in self.openers) or not head:
                return "", "", False
            self.state = _PLAIN
            return "", "", True
        if self.state == _PLAIN:
            self._buf = ""
            return "", buf, False
        if self.state == _HEADER:
            return self._header(buf, final)
        return self._body(buf, final)

    def _header(self, buf: str, final: bool) -> tuple[str, str, bool]:
        at = buf.find(MESSAGE)
        if at < 0:
            if final or len(buf) > MAX_HEADER:  # never closed: no message, nothing to show
                self._buf = ""
            return "", "", False
        header, self._buf = buf[:at], buf[at + len(MESSAGE):]
        channel, recipient = _CHANNEL_NAME.search(header), _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else None
        self.opened = self.opened or (self._channel == "analysis" and self._recipient is None)
        self.state, self._call = _BODY, ""
        return "", "", True

    def _body(self, buf: str, final: bool) -> tuple[str, str, bool]:
        ends = [(buf.find(m), m) for m in _BODY_ENDS if m in buf]
        if ends:
            at, marker = min(ends)
            piece = buf[:at]
            self._buf = buf[at + len(marker):] if marker in (END, CALL, RETURN) else buf[at:]
            r, a = self._emit(piece, closed=True)
            self.state = _HEADER
            return r, a, True
        keep = len(buf) if final else len(buf) - _partial_marker(buf)
        self._buf = buf[keep:]
        if self._recipient is not None and final:  # the reply ends inside a call
            self._call += buf[:keep]
            if self._whole_call():
                return "", self._call_text(), False
            return "", self._call_open() + self._call if self._call else "", False  # cut short: unclosed
        r, a = self._emit(buf[:keep], closed=False)
        return r, a, False

    def _whole_call(self) -> bool:
        """A call at the end of the reply whose arguments are whole JSON: its ``<|call|>`` ended the
        generation (a stop token, never text)."""
        try:
            json.loads(self._call)
        except ValueError:
            return False
        return True

    def _emit(self, piece: str, closed: bool) -> tuple[str, str]:
        if self._recipient is not None:
            self._call += piece
            if not closed:
                return "", ""
            return "", self._call_text()
        if self._channel == "analysis":
            return piece, ""
        return "", piece

    def _name(self) -> str:
        recipient = self._recipient or ""
        return recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else recipient

    def _call_open(self) -> str:
        return f'{CALL_OPEN}{{"name": {json.dumps(self._name())}, "arguments": '

    def _call_text(self) -> str:
        """A whole call as the markers carry it; arguments that are no JSON go as the text they are
        (no call then: ``ToolSet.read_call`` takes only an object)."""
        body = self._call.strip()
        try:
            arguments = json.dumps(json.loads(body), ensure_ascii=False)
        except ValueError:
            arguments = json.dumps(body, ensure_ascii=False)
        return f"{self._call_open()}{arguments}}}{CALL_CLOSE}"


def split_harmony(text: str) -> tuple[str | None, str]:
    """A whole reply's (reasoning, answer); reasoning None when it has no analysis message."""
    split = HarmonySplit()
    r1, a1 = split.feed(text)
    r2, a2 = split.flush()
    return (r1 + r2 if split.opened else None), a1 + a2
