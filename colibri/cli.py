"""``coli``: the command line. Each subcommand is a small function over the model layer.

Errors a user can act on (``ColibriError``) print one line and exit 1; nothing prints a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from colibri import __version__, settings
from colibri.errors import ColibriError, ConfigError
from colibri.store.gguf import GGUFError, GGUFFile


def _ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ColibriError(f"--prompt-ids: {text!r} is not a comma-separated list of integers") from None
    if not ids:
        raise ColibriError("--prompt-ids: no ids given")
    return ids


def _load(args: argparse.Namespace):
    from colibri.model.loader import Model  # imported here: numba is slow to import

    return Model(settings.model_path(args), ram_budget=settings.ram_budget(args),
                 kv_type=settings.kv_type(args))


def _check_ids(model, ids: list[int]) -> None:
    bad = [i for i in ids if not 0 <= i < model.hp.n_vocab]
    if bad:
        raise ColibriError(f"token id {bad[0]} is outside the vocabulary (0..{model.hp.n_vocab - 1})")


def _sequence(model, args: argparse.Namespace):
    from colibri.model.generate import SingleSequence

    n_ctx = min(settings.resolve(args, settings.CTX), model.hp.context_length)
    given = settings.resolve(args, settings.PREFILL_CHUNK)
    chunks = settings.prefill_chunks(given, model.experts is not None, model.streams_experts)
    return SingleSequence(model, n_ctx, chunks.alone)  # one sequence: no stream beside it


def cmd_run(args: argparse.Namespace) -> int:
    from colibri.model.generate import Timings
    from colibri.model.sampling import Sampler, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, seed=args.seed,
    )
    try:
        sampler = Sampler(params)
    except ValueError as e:
        raise ColibriError(str(e)) from None
    model = _load(args)
    if args.prompt_ids is not None:
        prompt = _ids(args.prompt_ids)
    else:
        if args.prompt is None:
            raise ColibriError("no prompt: give PROMPT, or --prompt-ids")
        tok = model.tokenizer
        if args.raw:
            prompt = tok.encode(args.prompt, special=True)
        else:
            messages = [{"role": "user", "content": args.prompt}]
            if args.system is not None:
                messages.insert(0, {"role": "system", "content": args.system})
            prompt = model.text.encode_chat(messages)  # PROMPT is data: no control tokens in it
    _check_ids(model, prompt)
    stop_ids = _stop_ids(model)
    decoder = model.tokenizer.stream() if args.output != "ids" else None
    timings, text = Timings(), []
    seq = _sequence(model, args)
    for token in seq.generate(prompt, sampler, args.max_tokens, stop_ids, timings):
        if decoder is not None:
            piece = decoder.feed(token)
            text.append(piece)
            if args.output == "text" and piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
    if decoder is not None:
        text.append(decoder.flush())
    if args.output == "text":
        sys.stdout.write(text[-1] + "\n")
    elif args.output == "ids":
        print(",".join(map(str, timings.ids)))
    else:
        print(json.dumps({
            "text": "".join(text),
            "ids": timings.ids,
            "prompt_tokens": timings.prompt_tokens,
            "completion_tokens": timings.generated_tokens,
            "prefill_tokens_per_s": round(timings.prefill_tps, 2),
            "decode_tokens_per_s": round(timings.decode_tps, 2),
        }, ensure_ascii=False))
    return 0


def _stop_ids(model) -> frozenset[int]:
    """The tokenizer's end-of-generation ids; from the metadata alone for a file without a
    vocabulary (``--prompt-ids`` runs need none)."""
    try:
        return model.tokenizer.stop_ids
    except GGUFError:  # no vocabulary this tokenizer reads: the ids the metadata names
        pass
    ids = (model.gguf.get("tokenizer.ggml.eos_token_id"), model.gguf.get("tokenizer.ggml.eot_token_id"))
    return frozenset(i for i in ids if i is not None)


def cmd_logits(args: argparse.Namespace) -> int:
    model = _load(args)
    if args.prompt_ids is not None:
        ids = _ids(args.prompt_ids)
    else:
        ids = model.tokenizer.encode(args.raw, special=True, add_special=True)
    _check_ids(model, ids)
    logits = _sequence(model, args).prefill(ids, all_logits=True)
    k = logits.shape[1] if args.top == 0 else min(args.top, logits.shape[1])
    out = sys.stdout
    for pos, row in enumerate(logits):
        top = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
        top = top[np.argsort(-row[top], kind="stable")]
        out.write(json.dumps({"pos": pos, "top": [[int(i), round(float(row[i]), 5)] for i in top]}) + "\n")
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from colibri.model.tokenizer import GGUFTokenizer
    from colibri.store.gguf import GGUFFile

    tok = GGUFTokenizer(GGUFFile(settings.model_path(args)))
    print(",".join(map(str, tok.encode(args.text, special=args.special))))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from colibri.model.file_info import describe

    print("\n".join(describe(GGUFFile(settings.model_path(args)))))
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from colibri.sched.engine_process import EngineConfig, run_engine
    from colibri.store.experts import ExpertsPerLayer

    n_slots = settings.kv_slots(args, settings.KV_SLOTS)
    ctx = settings.resolve(args, settings.CTX, host=True)
    chunk = settings.resolve(args, settings.PREFILL_CHUNK)
    max_tokens = settings.resolve(args, settings.MAX_TOKENS, host=True)
    if ctx < 1 or (chunk is not None and chunk < 1):
        raise ColibriError("--ctx and --prefill-chunk must be positive")
    if max_tokens < 1:
        raise ConfigError(f"--max-tokens/{settings.MAX_TOKENS.env}/NGEN must be positive, got {max_tokens}")
    if args.cap is not None and args.cap < 0:
        raise ConfigError(f"the cap (experts per MoE layer kept in RAM) must be >= 0, got {args.cap}")
    if args.cap and args.ram_budget is not None:
        raise ConfigError("give the cap (experts per MoE layer) or --ram-budget (GB), not both")
    # The C engine's positional cap: experts per MoE layer resident; 0 is its "auto": our budget.
    budget = ExpertsPerLayer(args.cap) if args.cap else settings.ram_budget(args)
    mode, draft_max, draft_min = settings.speculation(args)
    cfg = EngineConfig(
        speculative=mode, draft_max=draft_max, draft_min=draft_min,
        model_path=settings.model_path(args, host=True), n_slots=n_slots, n_ctx=ctx,
        state_dir=None if args.no_persist else settings.state_dir(args), prefill_chunk=chunk,
        protocol=settings.protocol(args), topk=settings.flag_env("SERVE_TOPK"),
        perf=settings.flag_env("SERVE_PERF"), max_tokens=max_tokens,
        ram_budget=budget, kv_type=settings.kv_type(args), cap=args.cap,
    )
    return run_engine(cfg)


def _model_and_ctx(args: argparse.Namespace) -> list[str]:
    """``--model`` and ``--ctx`` for an engine child, resolved by this command's own rule."""
    return ["--model", str(settings.model_path(args)), "--ctx", str(settings.resolve(args, settings.CTX))]


def cmd_chat(args: argparse.Namespace) -> int:
    from colibri.terminal_chat import chat

    if args.state_dir is not None:
        settings.state_dir(args)  # a bad one fails here, once, not in the engine it starts
    # the model and context resolved here, as this command reads them: the engine child would also
    # read the C engine's SNAP and CTX, which a shell may export for that engine
    engine_args = ["--protocol", "legacy", "--max-tokens", str(args.max_tokens), *_model_and_ctx(args)]
    for flag, value in (("--state-dir", args.state_dir), ("--ram-budget", args.ram_budget)):
        if value is not None:
            engine_args += [flag, str(value)]
    return chat(engine_args)


def cmd_channel(args: argparse.Namespace) -> int:
    from colibri.terminal_channel import channel_chat

    if args.state_dir is not None and not args.no_persist:
        settings.state_dir(args)  # a bad one fails here, once, not in the engine it starts
    engine_args = (["--no-persist"] if args.no_persist else []) + _model_and_ctx(args)
    for flag, value in (("--state-dir", args.state_dir), ("--ram-budget", args.ram_budget)):
        if value is not None:
            engine_args += [flag, str(value)]
    return channel_chat(engine_args)


def cmd_serve(args: argparse.Namespace, open_browser: bool = False) -> int:
    from pathlib import Path

    from colibri.api.affinity import MAX_REPLICA_ID, valid_replica_id
    from colibri.api.http_server import ServeConfig, run_server

    path = settings.model_path(args)
    settings.ram_budget(args)  # a bad value fails here, not in every restart of the engine child
    n_slots = settings.kv_slots(args, settings.SERVE_SLOTS)
    max_queue = settings.resolve(args, settings.MAX_QUEUE)
    timeout = settings.resolve(args, settings.QUEUE_TIMEOUT)
    if max_queue < 0 or timeout < 0:
        raise ColibriError("--max-queue and --queue-timeout must not be negative")
    port = settings.resolve(args, settings.PORT)
    if not 0 <= port <= 65535:
        raise ColibriError(f"--port must be 0..65535, got {port}")
    web = settings.resolve(args, settings.WEB_DIST)
    if web and Path(web).exists() and not Path(web).is_dir():  # missing is fine: "not built"
        raise ConfigError(f"--web-dist {web!r} is not a directory")
    prefix_share = settings.resolve(args, settings.PREFIX_SHARE)
    if not 0 <= prefix_share <= 1:
        raise ColibriError(f"--prefix-share must be 0..1, got {prefix_share}")
    replica_id = settings.resolve(args, settings.REPLICA_ID) or None
    if replica_id is not None and not valid_replica_id(replica_id):
        raise ColibriError(f"--replica-id must be 1-{MAX_REPLICA_ID} characters of A-Z a-z 0-9 . _ : @ - [ ]")
    limits = {s.name: settings.resolve(args, s) for s in settings.HTTP_LIMITS}
    if not all(value > 0 for value in limits.values()):
        raise ColibriError("--max-body-mb, --body-timeout, --max-requests, --keep-alive, "
                           "--write-timeout and --drain-timeout must be positive")
    cfg = ServeConfig(
        model_path=path, host=settings.resolve(args, settings.HOST), port=port,
        model_id=settings.resolve(args, settings.MODEL_ID) or path.name.removesuffix(".gguf"),
        api_key=settings.resolve(args, settings.API_KEY) or None, kv_slots=n_slots,
        ctx=settings.resolve(args, settings.CTX), max_queue=max_queue, queue_timeout=timeout,
        cors_origins=settings.cors_origins(args),
        state_dir=None if args.no_persist else settings.state_dir(args),
        insecure=args.insecure, ram_budget_gb=args.ram_budget, kv_type=settings.kv_type(args),
        speculation=settings.speculation(args), web_dist=Path(web) if web else settings.WEB_CONSOLE_DIR,
        open_browser=open_browser, max_body=int(limits["max_body_mb"] * (1 << 20)),
        body_timeout_s=limits["body_timeout"], max_requests=limits["max_requests"],
        keep_alive_s=limits["keep_alive"], write_timeout_s=limits["write_timeout"],
        drain_timeout_s=limits["drain_timeout"],
        prefix_share=prefix_share, replica_id=replica_id, sampling_defaults=_sampling_defaults(args),
    )
    return run_server(cfg)


def _sampling_defaults(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """--temperature and --top-p as given, each checked against OpenAI's range here, once."""
    from colibri.api.openai_requests import MAX_TEMPERATURE

    given = {s.name: settings.resolve(args, s) for s in settings.SAMPLING_DEFAULTS}
    temperature, top_p = given["temperature"], given["top_p"]
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise ColibriError(f"--temperature must be 0-{MAX_TEMPERATURE:g}, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ColibriError(f"--top-p must be above 0 and at most 1, got {top_p}")
    return tuple((name, value) for name, value in given.items() if value is not None)


def cmd_deploy_nginx(args: argparse.Namespace) -> int:
    """Print the nginx configuration for the replicas (colibri/api/nginx_config.py)."""
    from colibri.api import nginx_config

    p = nginx_config.plan(args.listen, args.replica, fail_timeout_s=args.fail_timeout,
                          max_fails=args.max_fails, read_timeout_s=args.read_timeout,
                          max_body_mb=args.max_body_mb)
    sys.stdout.write(nginx_config.render(p))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from colibri.convert.writer import convert, main_warn

    s = convert(args.hf_dir, args.output, args.type, progress=sys.stderr, warn=main_warn)
    types = ", ".join(f"{k} x{v}" for k, v in sorted(s.type_counts.items()))
    print(f"{s.path}: {s.arch}, {s.n_tensors} tensors ({types}), {s.nbytes / 2**20:.1f} MiB of weights")
    return 0


def cmd_atlas(args: argparse.Namespace) -> int:
    from colibri.atlas import ATLAS_FILE, measure, read_prompts, write_atlas
    from colibri.model.loader import Model
    from colibri.state_files import check_state_dir

    prompts = read_prompts(Path(args.prompts))
    out = Path(args.out) if args.out else settings.state_dir(args) / ATLAS_FILE
    check_state_dir(out.parent)  # before the measurement, not after it: the file goes there
    atlas = measure(Model(settings.model_path(args)), prompts)
    write_atlas(atlas, out)
    print(f"{out}: {atlas['rows']} layers x {atlas['cols']} experts, {len(atlas['topics'])} topics, "
          f"{sum(atlas['tokens'])} tokens")
    return 0


def _add_model_commands(sub: argparse._SubParsersAction) -> None:
    """run, logits, tokenize: one process over the model, no engine."""
    run = sub.add_parser("run", help="generate a completion, streamed to stdout")
    settings.add(run, settings.MODEL, settings.CTX, settings.PREFILL_CHUNK, settings.RAM_BUDGET,
                 settings.KV_TYPE)
    run.add_argument("prompt", nargs="?", metavar="PROMPT")
    run.add_argument("--system", help="system message for the chat template")
    run.add_argument("--raw", action="store_true",
                     help="pass PROMPT as-is, without the chat template; control-token text in it "
                          "(<|im_end|>) becomes the control token, on purpose")
    run.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0, help="0: no limit")
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--repeat-penalty", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--output", choices=("text", "ids", "json"), default="text")
    run.set_defaults(func=cmd_run)

    logits = sub.add_parser("logits", help="top logits at every prompt position, as JSON lines")
    settings.add(logits, settings.MODEL, settings.CTX, settings.PREFILL_CHUNK, settings.RAM_BUDGET,
                 settings.KV_TYPE)
    src = logits.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", metavar="IDS")
    src.add_argument("--raw", metavar="TEXT")
    logits.add_argument("--top", type=int, default=10, help="0: all")
    logits.set_defaults(func=cmd_logits)

    tokenize = sub.add_parser("tokenize", help="token ids of TEXT")
    settings.add(tokenize, settings.MODEL)
    tokenize.add_argument("--special", action="store_true", help="parse special-token text")
    tokenize.add_argument("text", metavar="TEXT")
    tokenize.set_defaults(func=cmd_tokenize)



def _add_engine_commands(sub: argparse._SubParsersAction) -> None:
    """engine, chat and channel: the engine process, and the terminal clients of its legacy and
    Channel protocols."""
    engine = sub.add_parser("engine", help="the engine process: serve_protocol.md on stdin/stdout; "
                                           "started as the C engine is (`engine <cap>`, SNAP, CTX, "
                                           "NGEN, KV_SLOTS: docs/serve_protocol.md)")
    engine.add_argument("cap", nargs="?", type=int, default=None,
                        help="the C engine's expert cache cap: experts per MoE layer kept in RAM, "
                             "turned into the bytes they take (instead of --ram-budget); 0: auto "
                             "(--ram-budget, or its default); on a dense model, accepted and ignored")
    settings.add(engine, settings.MODEL, settings.CTX, settings.MAX_TOKENS, host=True)
    settings.add(engine, settings.KV_SLOTS, settings.STATE_DIR, settings.PREFILL_CHUNK,
                 settings.RAM_BUDGET, settings.KV_TYPE, settings.SPECULATIVE, settings.DRAFT_MAX,
                 settings.DRAFT_MIN)
    engine.add_argument("--protocol", choices=("mux", "legacy", "channel"),
                        help="default: mux (SERVE_BATCH=1); legacy with SERVE=1 alone; channel: the "
                             "binary frames of docs/channel_protocol.md. A SUBMIT's text, legacy "
                             "input and DIRECT Channel text parse control-token text on purpose (the "
                             "host owns the template); SUBMIT_IDS carries tokens the host chose")
    engine.add_argument("--no-persist", action="store_true", help="keep slots in memory only")
    engine.set_defaults(func=cmd_engine)

    chat = sub.add_parser("chat", help="chat in the terminal (/reset, /more, Ctrl-C stops an answer); "
                                       "control-token text you type is parsed, on purpose: the "
                                       "terminal's user owns the conversation")
    settings.add(chat, settings.MODEL, settings.CTX, settings.STATE_DIR, settings.RAM_BUDGET)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.set_defaults(func=cmd_chat)

    chan = sub.add_parser("channel", help="talk to the engine in its binary Channel protocol "
                                          "(docs/channel_protocol.md): a line is a turn, /help lists the "
                                          "other requests, Ctrl-C sends ABORT")
    settings.add(chan, settings.MODEL, settings.CTX, settings.STATE_DIR, settings.RAM_BUDGET)
    chan.add_argument("--no-persist", action="store_true", help="the engine keeps its slot in memory only")
    chan.set_defaults(func=cmd_channel)


def _add_server_commands(sub: argparse._SubParsersAction) -> None:
    """serve and web: the HTTP server (web also opens the browser)."""
    for name, helptext in (("serve", "the OpenAI-compatible HTTP server"),
                           ("web", "coli serve, then open the web console in the browser")):
        srv = sub.add_parser(name, help=helptext)
        settings.add(srv, settings.MODEL, settings.HOST, settings.PORT, settings.MODEL_ID, settings.API_KEY,
                     settings.SERVE_SLOTS, settings.MAX_QUEUE, settings.QUEUE_TIMEOUT, settings.CTX,
                     settings.STATE_DIR, settings.WEB_DIST, settings.RAM_BUDGET, *settings.HTTP_LIMITS,
                     settings.PREFIX_SHARE, settings.REPLICA_ID, settings.KV_TYPE,
                     *settings.SAMPLING_DEFAULTS, settings.SPECULATIVE, settings.DRAFT_MAX,
                     settings.DRAFT_MIN)
        cors = settings.CORS_ORIGINS
        srv.add_argument(cors.flag, dest=cors.name, action="append", metavar="ORIGIN",
                         help=f"{cors.help} [{cors.env}]")
        srv.add_argument("--insecure", action="store_true",
                         help="allow a non-loopback bind without an API key")
        srv.add_argument("--no-persist", action="store_true", help="keep slots in memory only")
        srv.set_defaults(func=cmd_serve if name == "serve" else partial(cmd_serve, open_browser=True))


def _add_deploy_commands(sub: argparse._SubParsersAction) -> None:
    """deploy nginx: configuration for several replicas behind a load balancer."""
    from colibri.api import nginx_config as nc  # constants only

    deploy = sub.add_parser("deploy", help="configuration for running colibri behind other software")
    kinds = deploy.add_subparsers(dest="kind", required=True)
    nginx = kinds.add_parser("nginx", help="an nginx configuration for several coli serve replicas, "
                                           "with conversation affinity on X-Session-Id (docs/deploy.md)")
    nginx.add_argument("--listen", required=True, metavar="HOST:PORT", help="where nginx listens")
    nginx.add_argument("--replica", required=True, action="append", metavar="HOST:PORT",
                       help="a coli serve replica (repeat for each)")
    nginx.add_argument("--fail-timeout", type=float, default=nc.FAIL_TIMEOUT_S, metavar="S",
                       help=f"seconds a failed replica stays out (default {nc.FAIL_TIMEOUT_S})")
    nginx.add_argument("--max-fails", type=int, default=nc.MAX_FAILS,
                       help=f"failed attempts that take a replica out (default {nc.MAX_FAILS})")
    nginx.add_argument("--read-timeout", type=float, default=nc.READ_TIMEOUT_S, metavar="S",
                       help=f"longest silence from a replica, in seconds (default {nc.READ_TIMEOUT_S})")
    nginx.add_argument("--max-body-mb", type=float, default=nc.MAX_BODY_MB,
                       help=f"largest request body (default {nc.MAX_BODY_MB}, the replicas' default)")
    nginx.set_defaults(func=cmd_deploy_nginx)


def _add_file_commands(sub: argparse._SubParsersAction) -> None:
    """convert and info: model files, written and described."""
    from colibri.convert import DEFAULT_TYPE, TYPE_NAMES  # constants only: gguf is imported on use

    convert = sub.add_parser("convert", help="a Hugging Face checkpoint (safetensors) to GGUF")
    convert.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and *.safetensors")
    convert.add_argument("-o", "--output", required=True, metavar="OUT.gguf")
    convert.add_argument("--type", choices=TYPE_NAMES, default=DEFAULT_TYPE,
                         help=f"block type of the matrices (norms, biases and routers stay f32; "
                              f"default {DEFAULT_TYPE})")
    convert.set_defaults(func=cmd_convert)

    atlas = sub.add_parser("atlas", help="measure which experts each topic routes to (experts.json)")
    settings.add(atlas, settings.MODEL, settings.STATE_DIR)
    atlas.add_argument("--prompts", required=True, metavar="FILE",
                       help='JSON object {"topic": ["prompt", ...], ...}')
    atlas.add_argument("--out", metavar="PATH",
                       help="default: experts.json in the state directory, where coli serve publishes it")
    atlas.set_defaults(func=cmd_atlas)

    info = sub.add_parser("info", help="architecture, sizes, block types")
    settings.add(info, settings.MODEL)
    info.set_defaults(func=cmd_info)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coli", description="colibri: LLM inference on ordinary machines")
    p.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_model_commands(sub)
    _add_engine_commands(sub)
    _add_server_commands(sub)
    _add_deploy_commands(sub)
    _add_file_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if (getattr(args, "max_tokens", None) or 0) < 0 or getattr(args, "top", 0) < 0:
            raise ColibriError("counts must not be negative")
        return args.func(args)
    except ColibriError as e:
        print(f"coli: error: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
