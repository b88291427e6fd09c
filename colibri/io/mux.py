"""The mux protocol (docs/serve_protocol.md), both directions, sans-IO.

Engine side: ``RequestReader.receive_data(bytes) -> [Submit | Cancel | ProtocolError | EndOfInput]``
and ``encode_response(event) -> bytes``. Server side: ``encode_request(event) -> bytes`` and
``ResponseReader.receive_data(bytes) -> [response events]``.

Framing (where a line or a payload ends, resynchronisation, line limits) is ``framing.py``'s; this
module gives lines and payloads their meaning. A SUBMIT whose payload is not followed by ``\\n``
(its byte count lied) yields BAD_FRAME and the reader drops everything through the next ``\\n``,
then reads a header line again. A header line longer than MAX_LINE yields BAD_FRAME and is dropped
through its ``\\n``. A SUBMIT header that is framed but invalid (bad numbers, id 0, …) yields
BAD_REQUEST and, when its byte count could be read, its payload is skipped, so the stream stays in
step.
"""

from __future__ import annotations

import math
from dataclasses import replace

from colibri.io.events import (
    TOPK_CANDIDATES,
    Accept,
    Cancel,
    Data,
    Done,
    EndOfInput,
    Entropy,
    Error,
    ErrorCode,
    ExpertMap,
    Forget,
    Gpu,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    Prof,
    ProtocolError,
    Ready,
    Repin,
    Response,
    Stat,
    Stop,
    Submit,
    Tiers,
    TopK,
    UnknownLine,
)
from colibri.io.framing import (
    FrameReader,
    Item,
    Line,
    Overlong,
    Payload,
    Truncated,
    Unframed,
    Unterminated,
)

# The handshake line: the \x01 bytes keep it from looking like any other line.
READY_LINE = b"\x01\x01READY\x01\x01"
# A request header is a verb and at most eight numbers: 256 bytes is generous; more is a broken
# peer, and the engine never buffers more of one line than this.
MAX_LINE = 256
# Largest SUBMIT payload a reader accepts unless told its context (``payload_limit``): 16 MiB is far
# past any context the engine serves and bounds what a peer can make the engine buffer.
MAX_PAYLOAD = 16 << 20
# A refused payload up to this size is skipped (dropped as it arrives, never buffered), so the
# stream stays in step: a few times MAX_PAYLOAD, under a second of a pipe. A larger count is no
# prompt at all: waiting for that many bytes would stall the stream for good (a count of 10^12), so
# the reader answers BAD_REQUEST and reads what follows as lines, as after a count that lied.
MAX_SKIP = 4 * MAX_PAYLOAD
# Largest response line the server-side reader buffers (EMAP of a big MoE: a few hundred KB hex).
MAX_RESPONSE_LINE = 8 << 20
# Ids are the C engine's u64; 0 is reserved (ERROR 0 answers a request whose id was unreadable).
MAX_ID = (1 << 64) - 1
# Digits of MAX_ID: a longer number is refused before int() converts it.
U64_DIGITS = len(str(MAX_ID))
# A slot index is a byte on the wire; the core refuses slots it does not have (KV_SLOTS <= 16).
MAX_SLOT = 255
# The most tokens one SUBMIT may ask for: past any context length, so never the binding limit.
MAX_TOKENS_LIMIT = 1 << 20
# Largest grammar (the 7th field's extra payload): a JSON schema of a few hundred tools is ~100 KB;
# 1 MiB bounds what a peer can make the engine compile.
MAX_GRAMMAR = 1 << 20
# Candidates on a TOPK line (the protocol fixes five).
TOPK_COUNT = TOPK_CANDIDATES
# PROF with its verb: the gateway's layout has no request id (it belongs to the DONE after it), and
# the gateway reads exactly these fields.
PROF_FIELDS = 10


def _uint(text: bytes, limit: int) -> int:
    """An unsigned decimal, digits only (no sign, space or underscore), at most ``limit``."""
    if not text.isdigit() or len(text) > U64_DIGITS:
        raise ValueError
    value = int(text)
    if value > limit:
        raise ValueError
    return value


def _float(text: bytes) -> float:
    """A finite float: NaN and infinities would reach the sampler."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


def payload_limit(n_ctx: int, bytes_per_token: int) -> int:
    """The largest SUBMIT payload that can fit a context of ``n_ctx`` tokens, where no token stands
    for more than ``bytes_per_token`` bytes (of text, or of a SUBMIT_IDS id and its comma): a larger
    one cannot fit, and is refused before it is read into memory or tokenized."""
    return min(n_ctx * bytes_per_token, MAX_PAYLOAD)


# A SUBMIT header waiting for its payload, and its grammar's length; None: a refused one.
_Pending = tuple[Submit, int] | None


class RequestReader:
    """Engine side: bytes from the server -> requests. ``max_payload``: the largest payload accepted
    (the engine passes ``payload_limit`` of its context)."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        # The header kept until its payload arrives: a Submit with an empty prompt and the grammar's
        # length, or None for a rejected header whose payload is still read, so its framing is
        # checked and the stream stays in step.
        self._frames: FrameReader[_Pending] = FrameReader(MAX_LINE)
        self._eof = False
        self.max_payload = max_payload

    def receive_data(self, data: bytes) -> list[Submit | Cancel | Stop | Forget | ProtocolError | EndOfInput]:
        """Feed bytes (``b""`` means end of input) and return the complete events."""
        if self._eof:
            return []
        if data:
            self._frames.feed(data)
        events: list[Submit | Cancel | Stop | Forget | ProtocolError | EndOfInput] = []
        while (item := self._frames.next_item()) is not None:
            event = self._interpret(item)
            if event is not None:
                events.append(event)
        if not data:
            self._eof = True
            match self._frames.close():
                case Truncated(header=header):
                    events.append(ProtocolError(header[0].id if header else 0, ErrorCode.BAD_FRAME,
                                                "EOF in payload"))
                case Unterminated():
                    events.append(ProtocolError(0, ErrorCode.BAD_FRAME, "EOF in a line"))
            events.append(EndOfInput())
        return events

    def _interpret(self, item: Item[_Pending]) -> Submit | Cancel | Stop | Forget | ProtocolError | None:
        match item:
            case Line(data=line):
                return self._header(line)
            case Payload(header=None):
                return None  # the header was answered already
            case Payload(header=(header, g), data=payload):
                return _submit(header, g, payload)
            case Unframed(header=header):
                return ProtocolError(header[0].id if header else 0, ErrorCode.BAD_FRAME,
                                     "payload not followed by newline")
            case Overlong():
                return ProtocolError(0, ErrorCode.BAD_FRAME, "line too long")

    def _header(self, line: bytes) -> Cancel | Stop | Forget | ProtocolError | None:
        """A request line: a CANCEL, a rejection, or None when a SUBMIT's payload is to follow.
        The byte count is read first: once it is known the payload is consumed whatever else is
        wrong with the header, so its lines are never mistaken for requests."""
        fields = line.split(b" ")
        verb = fields[0]
        if verb in (b"CANCEL", b"STOP"):
            return _by_id(fields)
        if verb == b"FORGET":
            return _forget(fields)
        if verb not in (b"SUBMIT", b"SUBMIT_IDS"):
            return ProtocolError(0, ErrorCode.BAD_REQUEST, f"unknown verb {verb[:32]!r}")
        if len(fields) not in (7, 8, 9, 10):
            return ProtocolError(0, ErrorCode.BAD_REQUEST, "SUBMIT takes six fields (seven with a "
                                 "grammar, eight with a seed, nine with speculation's switch)")
        try:
            rid = _uint(fields[1], MAX_ID)
        except ValueError:
            rid = 0
        try:
            n = _uint(fields[3], MAX_ID)
            g = _uint(fields[7], MAX_ID) if len(fields) > 7 else 0
        except ValueError:  # where the payload ends is unknown: its lines are read as lines
            return ProtocolError(rid, ErrorCode.BAD_REQUEST, "byte count is not a number")
        if n > self.max_payload or g > MAX_GRAMMAR:
            if n + g <= MAX_SKIP:
                self._frames.skip_payload(n + g)
            what = (f"payload over {self.max_payload}" if n > self.max_payload
                    else f"grammar over {MAX_GRAMMAR}")
            return ProtocolError(rid, ErrorCode.BAD_REQUEST, f"{what} bytes")
        try:
            if rid == 0:
                raise ValueError("id 0")
            slot = _uint(fields[2], MAX_SLOT)
            max_tokens = _uint(fields[4], MAX_TOKENS_LIMIT)
            temperature, top_p = _float(fields[5]), _float(fields[6])
            if temperature < 0 or not 0 < top_p <= 1:
                raise ValueError
            seed = _uint(fields[8], MAX_ID) if len(fields) > 8 and fields[8] != b"-" else None
            speculative = _switch(fields[9]) if len(fields) > 9 else None
        except ValueError:
            self._frames.expect_payload(n + g, None)
            return ProtocolError(rid, ErrorCode.BAD_REQUEST, "bad SUBMIT field")
        ids = () if verb == b"SUBMIT_IDS" else None
        # The payload is the prompt, then the grammar's g bytes: the header keeps g until it is read.
        submit = Submit(rid, slot, max_tokens, temperature, top_p, "", seed, ids, speculative=speculative)
        self._frames.expect_payload(n + g, (submit, g))
        return None


def _switch(field: bytes) -> bool | None:
    """SUBMIT's speculation field: 0, no drafts for this request; 1, the engine's setting."""
    if field not in (b"0", b"1"):
        raise ValueError(field)
    return None if field == b"1" else False


def _submit(header: Submit, g: int, payload: bytes) -> Submit | ProtocolError:
    """A SUBMIT whose payload arrived: the prompt (text or ids), then the grammar's ``g`` bytes."""
    prompt, grammar = (payload[: len(payload) - g], payload[len(payload) - g :]) if g else (payload, b"")
    try:
        text = grammar.decode("utf-8") if g else None
    except UnicodeDecodeError:
        return ProtocolError(header.id, ErrorCode.BAD_REQUEST, "grammar is not UTF-8")
    if header.prompt_ids is not None:
        ids = _token_ids(prompt)
        if ids is None:
            return ProtocolError(header.id, ErrorCode.BAD_REQUEST, "SUBMIT_IDS payload is not ids")
        return replace(header, prompt_ids=ids, grammar=text)
    try:
        return replace(header, prompt=prompt.decode("utf-8"), grammar=text)
    except UnicodeDecodeError:
        return ProtocolError(header.id, ErrorCode.BAD_REQUEST, "payload is not UTF-8")


def _token_ids(payload: bytes) -> tuple[int, ...] | None:
    """SUBMIT_IDS' payload: decimal token ids separated by commas, at least one; None if not."""
    parts = payload.split(b",")
    if not all(p.isdigit() and len(p) <= U64_DIGITS for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _by_id(fields: list[bytes]) -> Cancel | Stop | ProtocolError:
    """``CANCEL <id>`` or ``STOP <id>``, split on spaces."""
    verb = fields[0].decode()
    if len(fields) != 2:
        return ProtocolError(0, ErrorCode.BAD_REQUEST, f"{verb} takes one field")
    try:
        rid = _uint(fields[1], MAX_ID)
    except ValueError:
        return ProtocolError(0, ErrorCode.BAD_REQUEST, f"{verb} id is not a number")
    if rid == 0:
        return ProtocolError(0, ErrorCode.BAD_REQUEST, "id 0")
    return Cancel(rid) if verb == "CANCEL" else Stop(rid)


def _forget(fields: list[bytes]) -> Forget | ProtocolError:
    """``FORGET <slot>``."""
    try:
        if len(fields) != 2:
            raise ValueError
        return Forget(_uint(fields[1], MAX_SLOT))
    except ValueError:
        return ProtocolError(0, ErrorCode.BAD_REQUEST, "FORGET takes a slot number")


def encode_request(event: Submit | Cancel | Stop | Forget) -> bytes:
    """Server side: a request's bytes. Floats are written with ``repr`` so the engine samples with
    exactly the temperature and top_p the client asked for. The grammar field is written when
    there is a grammar, a seed (which comes after it: 0 is "no grammar") or speculation turned off
    (after the seed: ``-`` is "no seed")."""
    if isinstance(event, Submit):
        if event.prompt_ids is not None:
            verb, payload = "SUBMIT_IDS", ",".join(map(str, event.prompt_ids)).encode()
        else:
            verb, payload = "SUBMIT", event.prompt.encode("utf-8")
        grammar = (event.grammar or "").encode("utf-8")
        tail = ""
        if event.speculative is False:
            tail = f" {len(grammar)} {'-' if event.seed is None else event.seed} 0"
        elif grammar or event.seed is not None:
            tail = f" {len(grammar)}" + ("" if event.seed is None else f" {event.seed}")
        head = (f"{verb} {event.id} {event.slot} {len(payload)} {event.max_tokens} "
                f"{event.temperature!r} {event.top_p!r}{tail}\n")
        return head.encode() + payload + grammar + b"\n"
    if isinstance(event, Forget):
        return f"FORGET {event.slot}\n".encode()
    verb = "CANCEL" if isinstance(event, Cancel) else "STOP"
    return f"{verb} {event.id}\n".encode()


def _hex_map(kind: str, rows: int, cols: int, data: bytes) -> bytes:
    """EMAP and HITS: hex keeps a bitmap line-shaped."""
    return f"{kind} {rows} {cols} {data.hex()}\n".encode()


def encode_response(event: Response) -> bytes:
    """One response or telemetry event -> its bytes: one line (DATA: header, payload, newline)."""
    match event:
        case Ready():
            return READY_LINE + b"\n"
        case Stat(rss_gb=rss):
            return f"STAT 0 0.00 0.0 {rss:.2f}\n".encode()
        case Accept(id=rid, prompt_tokens=n):
            return f"ACCEPT {rid} {n}\n".encode()
        case Data(id=rid, text=text):
            return f"DATA {rid} {len(text)}\n".encode() + text + b"\n"
        case TopK(id=rid, candidates=cands):
            parts = " ".join(f"{lp:.4f} {text.hex() or '-'}" for lp, text in cands)
            return f"TOPK {rid} {len(cands)} {parts}\n".encode()
        case Done():
            e = event
            saved = "" if e.saved is None else f" {int(e.saved)}"  # unknown: the spec's eight fields
            return (f"DONE {e.id} STAT {e.emitted} {e.tok_s:.2f} {e.hit_pct:.1f} {e.rss_gb:.2f} "
                    f"{e.prompt_tokens} {int(e.length_limited)}{saved}\n").encode()
        case Error(id=rid, code=code, args=args):
            return " ".join(["ERROR", str(rid), str(code), *map(str, args)]).encode() + b"\n"
        case HwInfo():
            e = event
            return (f"HWINFO {e.cores} {e.ram_total_gb:.1f} {e.ram_avail_gb:.1f} {e.ngpu} "
                    f"{e.vram_total_gb:.1f} {e.cpu_name}|{e.gpu_name}\n").encode()
        case Tiers():
            e = event
            return (f"TIERS {e.vram_experts} {e.ram_experts} {e.disk_experts} "
                    f"{e.vram_gb:.2f} {e.ram_gb:.2f}\n").encode()
        case ExpertMap(rows=r, cols=c, data=d):
            return _hex_map("EMAP", r, c, d)
        case Hits(rows=r, cols=c, data=d):
            return _hex_map("HITS", r, c, d)
        case Repin():
            return f"REPIN {event.layer} {event.expert} {event.old_tier} {event.gpu}\n".encode()
        case Perf():
            e = event
            times = (e.dt, e.t_edisk, e.t_ewait, e.t_emm, e.t_attn, e.t_kvb, e.t_head)
            return (f"PERF {e.id} " + " ".join(f"{t:.4f}" for t in times)
                    + f" {e.reused_tokens} {e.prefilled_tokens} {e.drafted_tokens} {e.accepted_tokens}\n"
                    ).encode()
        case Prof():
            e = event
            return (f"PROF {e.wall:.4f} {e.prompt_tokens} {e.completion_tokens} {e.t_edisk:.4f} "
                    f"{e.t_ewait:.4f} {e.t_emm:.4f} {e.t_attn:.4f} {e.t_head:.4f} {e.forwards}\n").encode()
        case Entropy(bits=bits):
            return " ".join(["ENTROPY", *(f"{b:.3f}" for b in bits)]).encode() + b"\n"
        case Gpus(gpus=gpus):
            parts = [f"{g.used_gb:.2f} {g.total_gb:.2f} {g.experts}" for g in gpus]
            return " ".join(["GPUS", str(len(gpus)), *parts]).encode() + b"\n"
    raise TypeError(f"not a mux response: {event!r}")


def _saved(field: list[str]) -> bool | None:
    """DONE's ninth field, ours: absent (an engine of the spec's eight fields) is unknown, None; a
    persistence report must not be guessed either way. Anything but 0 or 1 is a malformed line."""
    if not field:
        return None
    if field[0] not in ("0", "1"):
        raise ValueError("DONE's saved field is not 0 or 1")
    return field[0] == "1"


class ResponseReader:
    """Server side: bytes from the engine -> response and telemetry events."""

    def __init__(self) -> None:
        self._frames: FrameReader[int] = FrameReader(MAX_RESPONSE_LINE)  # header: the DATA's id

    def receive_data(self, data: bytes) -> list[Response | ProtocolError | UnknownLine]:
        """Feed bytes and return the complete events (the engine's EOF is the caller's to notice)."""
        self._frames.feed(data)
        out: list[Response | ProtocolError | UnknownLine] = []
        while (item := self._frames.next_item()) is not None:
            match item:
                case Payload(header=rid, data=text):
                    out.append(Data(rid, text))
                case Unframed(header=rid):
                    out.append(ProtocolError(rid, ErrorCode.BAD_FRAME, "DATA payload without newline"))
                case Overlong():
                    out.append(ProtocolError(0, ErrorCode.BAD_FRAME, "line too long"))
                case Line(data=line):
                    try:
                        event = self._line(line)
                    except (ValueError, IndexError, OverflowError):  # int(float("inf")) is an OverflowError
                        event = ProtocolError(0, ErrorCode.BAD_FRAME, f"malformed line {line[:40]!r}")
                    if event is not None:
                        out.append(event)
        return out

    def _line(self, line: bytes) -> Response | UnknownLine | None:
        """One response line -> its event, or None for a DATA header (its payload follows). Raises
        ValueError or IndexError for a known kind with malformed fields."""
        if line == READY_LINE:
            return Ready()
        text = line.decode("utf-8", errors="replace")
        f = text.split(" ")
        kind = f[0]
        if kind == "DATA":
            rid, n = int(f[1]), int(f[2])
            if n < 0:
                raise ValueError("negative DATA byte count")
            self._frames.expect_payload(n, rid)
            return None
        if kind == "ACCEPT":
            return Accept(int(f[1]), int(f[2]))
        if kind == "PROF":
            if len(f) != PROF_FIELDS:
                raise ValueError("PROF is ten fields")
            t = [float(x) for x in f[1:10]]
            return Prof(t[0], _count(f[2]), _count(f[3]), *t[3:8], _count(f[9]))
        if kind == "DONE":
            return Done(int(f[1]), int(f[3]), float(f[4]), float(f[5]), float(f[6]), int(f[7]), f[8] == "1",
                        _saved(f[9:10]))
        if kind == "STAT":
            return Stat(float(f[4]))
        if kind == "ERROR":
            return Error(int(f[1]), ErrorCode(f[2]), tuple(int(x) for x in f[3:]))
        if kind == "TOPK":
            n = int(f[2])
            cands = tuple((float(f[3 + 2 * i]), b"" if f[4 + 2 * i] == "-" else bytes.fromhex(f[4 + 2 * i]))
                          for i in range(n))
            return TopK(int(f[1]), cands)
        if kind == "HWINFO":
            cpu, _, gpu = " ".join(f[6:]).partition("|")
            return HwInfo(int(f[1]), float(f[2]), float(f[3]), int(f[4]), float(f[5]), cpu, gpu)
        if kind == "TIERS":
            return Tiers(int(f[1]), int(f[2]), int(f[3]), float(f[4]), float(f[5]))
        if kind in ("EMAP", "HITS"):
            cls = ExpertMap if kind == "EMAP" else Hits
            return cls(int(f[1]), int(f[2]), bytes.fromhex(f[3] if len(f) > 3 else ""))
        if kind == "REPIN":
            return Repin(int(f[1]), int(f[2]), int(f[3]), int(f[4]))
        if kind == "PERF":
            if len(f) < 3:
                raise ValueError("PERF without timings")
            times = [float(x) for x in f[2:9]]
            extra = [int(x) for x in f[9:13]]
            return Perf(int(f[1]), *times, *extra)
        if kind == "ENTROPY":
            return Entropy(tuple(float(x) for x in f[1:] if x))
        if kind == "GPUS":
            n = int(f[1])
            g = f[2:]
            return Gpus(tuple(Gpu(float(g[3 * i]), float(g[3 * i + 1]), int(g[3 * i + 2])) for i in range(n)))
        return UnknownLine(line)


def _count(field: str) -> int:
    """A PROF count: exact as an integer (a float loses counts past 2**53), or a peer's ``12.0``."""
    return int(field) if field.isdigit() else int(float(field))
