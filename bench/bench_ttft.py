"""Time to first token of a coding agent's long prompt through ``coli serve``, cold and on a next turn.

    python bench/bench_ttft.py [--model PATH] [--tokens 6500] [--runs 3]

A coding agent's first request is long (Codex CLI's is ~6,500 tokens of instructions and tools,
opencode's ~7,700) and each next request repeats it with the last turn appended. This starts
``coli serve`` (4 slots, no persistence), builds a chat of about --tokens tokens (a system prompt
of instructions and this repository's own source text, as an agent pastes files, then a question)
and measures, with the official openai SDK streaming, the wall time from sending the request to
its first streamed token:

- cold: the prompt into an empty slot (every token prefilled);
- next turn: the same conversation with an assistant answer and a new user message appended,
  sent to the slot that holds it (its prefix reused: only the new tokens are prefilled).

Each figure is the median of --runs runs; a cold run first fills its slot with another prompt so
nothing of the measured one is cached.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http import Server  # noqa: E402

from colibri.model.text import ModelText  # noqa: E402
from colibri.settings import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INSTRUCTIONS = ("You are a coding agent in a terminal. Read the files below, answer questions about "
                "them and propose changes as unified diffs.\n\n")
QUESTION = "Which function in these files writes a key and a value into the cache?"
NEXT = "Now say in one sentence what that function checks first."


def source_text(text: ModelText, tokens: int, skip: int = 0) -> str:
    """This repository's own modules, whole files, until the chat is ``tokens`` tokens long."""
    files = sorted((ROOT / "colibri").rglob("*.py"))[skip:]
    parts, total = [], 0
    for path in files:
        body = f"### {path.relative_to(ROOT)}\n{path.read_text()}\n"
        n = text.count_tokens(body)
        if total + n > tokens:
            break
        parts.append(body)
        total += n
    return "".join(parts)


def first_token_s(client: openai.OpenAI, messages: list[dict], slot: int) -> tuple[float, str]:
    """Seconds to the first streamed token, and the whole answer (32 tokens at most, greedy)."""
    start = time.perf_counter()
    first, answer = None, []
    stream = client.chat.completions.create(model="bench", messages=messages, max_tokens=32, temperature=0,
                                            stream=True, extra_body={"cache_slot": slot})
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.content:
            if first is None:
                first = time.perf_counter() - start
            answer.append(delta.content)
    return (first if first is not None else time.perf_counter() - start), "".join(answer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=6500)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model = args.model or default_model_path()
    text = ModelText.open(model)
    budget = args.tokens - text.count_tokens(INSTRUCTIONS + QUESTION) - 16  # the template's own
    chat = [{"role": "system", "content": INSTRUCTIONS + source_text(text, budget)},
            {"role": "user", "content": QUESTION}]
    other = [{"role": "system", "content": INSTRUCTIONS + source_text(text, budget, skip=7)},
             {"role": "user", "content": QUESTION}]
    server = Server(model)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=600)
        cold, warm, n_prompt = [], [], None
        for _ in range(args.runs):
            first_token_s(client, other, 0)  # slot 0 holds another prompt: the next run is cold
            seconds, answer = first_token_s(client, chat, 0)
            cold.append(seconds)
            follow = [*chat, {"role": "assistant", "content": answer}, {"role": "user", "content": NEXT}]
            warm.append(first_token_s(client, follow, 0)[0])
            if n_prompt is None:
                usage = client.chat.completions.create(model="bench", messages=chat, max_tokens=1,
                                                       extra_body={"cache_slot": 1}).usage
                n_prompt = usage.prompt_tokens if usage else None
    finally:
        server.close()
    print(f"\n### time to first token, {model.name}, coli serve, median of {args.runs} runs\n")
    print("| request | prompt tokens | time to first token |\n|---|---:|---:|")
    print(f"| an agent's first request (cold slot) | {n_prompt} | {statistics.median(cold):.1f} s |")
    print(f"| its next turn (prefix in the slot) | {n_prompt} + ~60 | {statistics.median(warm):.2f} s |")


if __name__ == "__main__":
    main()
