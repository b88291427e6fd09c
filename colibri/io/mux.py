"""The mux protocol (docs/serve_protocol.md), both directions, sans-IO.

Engine side: ``RequestReader.receive_data(bytes) -> [Submit | Cancel | ProtocolError | EndOfInput]``
and ``encode_response(event) -> bytes``. Server side: ``encode_request(event) -> bytes`` and
``ResponseReader.receive_data(bytes) -> [response events]``.

Resynchronisation: a SUBMIT whose payload is not followed by ``\\n`` (its byte count lied) yields
BAD_FRAME and the reader drops everything through the next ``\\n``, then reads a header line again.
A header line longer than MAX_LINE yields BAD_FRAME and is dropped through its ``\\n``. A SUBMIT
header that is framed but invalid (bad numbers, id 0, …) yields BAD_REQUEST and, when its byte
count could be read, its payload is skipped, so the stream stays in step.
"""

from __future__ import annotations

import math

from colibri.io.buffer import ReceiveBuffer
from colibri.io.events import (
    Cancel,
    Data,
    Done,
    EndOfInput,
    Entropy,
    Error,
    ErrorCode,
    ExpertMap,
    Gpu,
    Gpus,
    Hits,
    HwInfo,
    Perf,
    ProtocolError,
    Ready,
    Repin,
    Stat,
    Submit,
    Tiers,
    TopK,
    UnknownLine,
)

READY_LINE = b"\x01\x01READY\x01\x01"
# A request header is a verb and six numbers: 256 bytes is generous; more is a broken peer.
MAX_LINE = 256
# Largest SUBMIT payload: a rendered prompt. 16 MiB is far past any context the engine serves
# (~4 bytes per token) and bounds what a peer can make the engine buffer.
MAX_PAYLOAD = 16 << 20
# Largest response line the server-side reader buffers (EMAP of a big MoE: a few hundred KB hex).
MAX_RESPONSE_LINE = 8 << 20
MAX_ID = (1 << 64) - 1
MAX_TOKENS_LIMIT = 1 << 20
TOPK_COUNT = 5


def _uint(text: bytes, limit: int) -> int:
    if not text.isdigit() or len(text) > 20:
        raise ValueError
    value = int(text)
    if value > limit:
        raise ValueError
    return value


def _float(text: bytes) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError
    return value


class RequestReader:
    """Engine side: bytes from the server -> requests."""

    def __init__(self) -> None:
        self._buf = ReceiveBuffer()
        self._payload: tuple[int, Submit | None] | None = None  # (bytes, header) being read
        self._eof = False

    def receive_data(self, data: bytes) -> list[Submit | Cancel | ProtocolError | EndOfInput]:
        """Feed bytes (``b""`` means end of input) and return the complete events."""
        if self._eof:
            return []
        if data:
            self._buf.feed(data)
        events = self._parse()
        if not data:
            self._eof = True
            if self._payload is not None:
                header = self._payload[1]
                rid = header.id if header else 0
                events.append(ProtocolError(rid, ErrorCode.BAD_FRAME, "EOF in payload"))
            elif len(self._buf) and not self._buf.pending_skip and not self._buf.dropping_line:
                events.append(ProtocolError(0, ErrorCode.BAD_FRAME, "EOF in a line"))
            events.append(EndOfInput())
        return events

    def _parse(self) -> list[Submit | Cancel | ProtocolError]:
        out: list[Submit | Cancel | ProtocolError] = []
        while True:
            if not self._buf.resynced():
                return out
            if self._payload is not None:
                n, header = self._payload
                got = self._buf.take_payload(n)
                if got is None:
                    return out
                payload, framed = got
                self._payload = None
                if not framed:
                    out.append(ProtocolError(header.id if header else 0, ErrorCode.BAD_FRAME,
                                             "payload not followed by newline"))
                    continue
                if header is not None:
                    try:
                        prompt = payload.decode("utf-8")
                    except UnicodeDecodeError:
                        out.append(ProtocolError(header.id, ErrorCode.BAD_REQUEST, "payload is not UTF-8"))
                        continue
                    out.append(Submit(header.id, header.slot, header.max_tokens, header.temperature,
                                      header.top_p, prompt, header.seed))
                continue
            line = self._buf.take_line()
            if line is None:
                if len(self._buf) > MAX_LINE:
                    out.append(ProtocolError(0, ErrorCode.BAD_FRAME, "line too long"))
                    self._buf.drop_through_newline()
                    continue
                return out
            if len(line) > MAX_LINE:
                out.append(ProtocolError(0, ErrorCode.BAD_FRAME, "line too long"))
                continue
            event = self._header(line)
            if event is not None:
                out.append(event)

    def _header(self, line: bytes) -> Cancel | ProtocolError | None:
        fields = line.split(b" ")
        verb = fields[0]
        if verb == b"CANCEL":
            if len(fields) != 2:
                return ProtocolError(0, ErrorCode.BAD_REQUEST, "CANCEL takes one field")
            try:
                rid = _uint(fields[1], MAX_ID)
            except ValueError:
                return ProtocolError(0, ErrorCode.BAD_REQUEST, "CANCEL id is not a number")
            if rid == 0:
                return ProtocolError(0, ErrorCode.BAD_REQUEST, "id 0")
            return Cancel(rid)
        if verb != b"SUBMIT":
            return ProtocolError(0, ErrorCode.BAD_REQUEST, f"unknown verb {verb[:32]!r}")
        if len(fields) not in (7, 8):
            return ProtocolError(0, ErrorCode.BAD_REQUEST, "SUBMIT takes six fields (seven with a seed)")
        try:
            rid = _uint(fields[1], MAX_ID)
        except ValueError:
            rid = 0
        try:
            n = _uint(fields[3], MAX_ID)
        except ValueError:
            return ProtocolError(rid, ErrorCode.BAD_REQUEST, "byte count is not a number")
        if n > MAX_PAYLOAD:
            self._buf.discard(n + 1)
            return ProtocolError(rid, ErrorCode.BAD_REQUEST, f"payload over {MAX_PAYLOAD} bytes")
        try:
            if rid == 0:
                raise ValueError("id 0")
            slot = _uint(fields[2], 255)
            max_tokens = _uint(fields[4], MAX_TOKENS_LIMIT)
            temperature, top_p = _float(fields[5]), _float(fields[6])
            if temperature < 0 or not 0 < top_p <= 1:
                raise ValueError
            seed = _uint(fields[7], MAX_ID) if len(fields) == 8 else None
        except ValueError:
            self._payload = (n, None)
            return ProtocolError(rid, ErrorCode.BAD_REQUEST, "bad SUBMIT field")
        self._payload = (n, Submit(rid, slot, max_tokens, temperature, top_p, "", seed))
        return None


def encode_request(event: Submit | Cancel) -> bytes:
    if isinstance(event, Submit):
        payload = event.prompt.encode("utf-8")
        seed = "" if event.seed is None else f" {event.seed}"
        head = (f"SUBMIT {event.id} {event.slot} {len(payload)} {event.max_tokens} "
                f"{event.temperature!r} {event.top_p!r}{seed}\n")
        return head.encode() + payload + b"\n"
    return f"CANCEL {event.id}\n".encode()


def _hex_map(kind: str, rows: int, cols: int, data: bytes) -> bytes:
    return f"{kind} {rows} {cols} {data.hex()}\n".encode()


def encode_response(event) -> bytes:
    """One response or telemetry event -> its bytes: one line (DATA: header, payload, newline)."""
    match event:
        case Ready():
            return READY_LINE + b"\n"
        case Stat(rss_gb=rss):
            return f"STAT 0 0.00 0.0 {rss:.2f}\n".encode()
        case Data(id=rid, text=text):
            return f"DATA {rid} {len(text)}\n".encode() + text + b"\n"
        case TopK(id=rid, candidates=cands):
            parts = " ".join(f"{lp:.4f} {text.hex() or '-'}" for lp, text in cands)
            return f"TOPK {rid} {len(cands)} {parts}\n".encode()
        case Done():
            e = event
            return (f"DONE {e.id} STAT {e.emitted} {e.tok_s:.2f} {e.hit_pct:.1f} {e.rss_gb:.2f} "
                    f"{e.prompt_tokens} {int(e.length_limited)}\n").encode()
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
                    + f" {e.reused_tokens} {e.prefilled_tokens}\n").encode()
        case Entropy(bits=bits):
            return " ".join(["ENTROPY", *(f"{b:.3f}" for b in bits)]).encode() + b"\n"
        case Gpus(gpus=gpus):
            parts = [f"{g.used_gb:.2f} {g.total_gb:.2f} {g.experts}" for g in gpus]
            return " ".join(["GPUS", str(len(gpus)), *parts]).encode() + b"\n"
    raise TypeError(f"not a mux response: {event!r}")


class ResponseReader:
    """Server side: bytes from the engine -> response and telemetry events."""

    def __init__(self) -> None:
        self._buf = ReceiveBuffer()
        self._data: tuple[int, int] | None = None  # DATA (id, bytes) whose payload is awaited

    def receive_data(self, data: bytes) -> list:
        self._buf.feed(data)
        out: list = []
        while True:
            if not self._buf.resynced():
                return out
            if self._data is not None:
                rid, n = self._data
                got = self._buf.take_payload(n)
                if got is None:
                    return out
                self._data = None
                text, framed = got
                if not framed:
                    out.append(ProtocolError(rid, ErrorCode.BAD_FRAME, "DATA payload without newline"))
                    continue
                out.append(Data(rid, text))
                continue
            line = self._buf.take_line()
            if line is None:
                if len(self._buf) > MAX_RESPONSE_LINE:
                    out.append(ProtocolError(0, ErrorCode.BAD_FRAME, "line too long"))
                    self._buf.drop_through_newline()
                    continue
                return out
            if len(line) > MAX_RESPONSE_LINE:  # as when it arrives in pieces
                out.append(ProtocolError(0, ErrorCode.BAD_FRAME, "line too long"))
                continue
            try:
                event = self._line(line)
            except (ValueError, IndexError):
                event = ProtocolError(0, ErrorCode.BAD_FRAME, f"malformed line {line[:40]!r}")
            if event is not None:
                out.append(event)

    def _line(self, line: bytes):
        if line == READY_LINE:
            return Ready()
        text = line.decode("utf-8", errors="replace")
        f = text.split(" ")
        kind = f[0]
        if kind == "DATA":
            rid, n = int(f[1]), int(f[2])
            if n < 0:
                raise ValueError("negative DATA byte count")
            self._data = (rid, n)
            return None
        if kind == "DONE":
            return Done(int(f[1]), int(f[3]), float(f[4]), float(f[5]), float(f[6]), int(f[7]), f[8] == "1")
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
            extra = [int(x) for x in f[9:11]]
            return Perf(int(f[1]), *times, *extra)
        if kind == "ENTROPY":
            return Entropy(tuple(float(x) for x in f[1:] if x))
        if kind == "GPUS":
            n = int(f[1])
            g = f[2:]
            return Gpus(tuple(Gpu(float(g[3 * i]), float(g[3 * i + 1]), int(g[3 * i + 2])) for i in range(n)))
        return UnknownLine(line)
