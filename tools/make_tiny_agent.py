"""Make ``tests/data/tiny_hf/agent``: a tiny Gemma 3 trained to take one tool turn as the coding
agents ask for one: a call of the client's file tool, then, given its result, an answer in words.

The default model (135M) mostly calls tools again after a result until the context is full
(docs/api.md, "Coding agents"), so a turn with it ends by the model's doing and exit 0 cannot be
required of the client. This model is *trained*, briefly, on the prompts the server renders from the
agents' own requests (``requests.json``: the first request of Codex CLI, opencode and Continue's
``cn`` as their pinned releases sent them, and opencode's title request): given the test's task,
one call in colibri's tool envelope (Codex's ``exec_command``, opencode's ``read``, Continue's
``Read``); given the call's result, ``{"response": ANSWER}``; given the title request, a title.
Whatever the tool returned, the answer is the same sentence: the model learns the protocol's turns,
not to read.

Both its layers are local (Gemma 3 makes every sixth layer global; it has two), attending to
``WINDOW`` positions, so a reply depends on the prompt's last 2 × WINDOW tokens only: the long
instructions and paths before them cannot move it, and training on each prompt's last
``CROP`` tokens is training on the whole prompt. The scratch directory, the date, the shell and
the timezone (which Codex writes just before the task), the call ids, Codex's chunk ids and wall
times and the tools' outputs are drawn afresh for each of ``VARIANTS`` copies of a conversation. The script
checks the greedy replies on the whole prompts (not cropped) and on fresh draws, and refuses a
model whose smallest top-1 margin over them is under ``MIN_MARGIN``.

Beside transformers' checkpoint (float32): a byte-level BPE trained on the prompts, with ChatML's
special tokens, SmolLM2's chat template (the default model's: the server's generic tool envelope),
and ``conversations.json``: each conversation's prompt tail, reply and ids.

Needs torch, transformers and tokenizers, and colibri itself (it renders the prompts with the
server's own request parsers): ``pip install -e '.[tools]'``, best in a separate venv:

    python tools/make_tiny_agent.py [--out tests/data/tiny_hf]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from make_tiny_moe import versions
from tiny_training import byte_level_bpe, top1_margin
from tokenizers import Tokenizer

from colibri.api import responses_api
from colibri.api.openai_requests import Generation, parse_chat
from colibri.model.chat import ChatTemplate
from colibri.model.tool_format import envelope

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny_hf"
NAME = "agent"
SEED = 3
STEPS = 200
LEARNING_RATE = 3e-3
VARIANTS = 12  # copies of each conversation a step, each with fresh ids and tool outputs
WINDOW = 96  # positions each (local) layer attends to
CROP = 2 * WINDOW + 16  # prompt tokens kept for training: past 2 × WINDOW a reply cannot see them
MIN_MARGIN = 2.0  # logits between the learned token and the next best, at every reply position
VOCAB = 1024
N_CTX = 32768
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2-135M-Instruct's chat template (the default model's, read from its GGUF).
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ANSWER = "I read the file: the secret word is lighthouse."
TITLE = "Reading notes"
NOTES = "The secret word is lighthouse.\n"  # the test's notes.txt (tests/agents_clients.py)
SCRATCH, RECORDED_ON = "/tmp/scratch", "2026-12-07"  # requests.json's scratch directory and date
CODEX_SHELL, CODEX_ZONE = "<shell>bash</shell>", "<timezone>Etc/UTC</timezone>"  # and its host's
# client: (its tool call on the test's task, the request's endpoint)
CALLS: dict[str, tuple[str, dict[str, Any], str]] = {
    "codex": ("exec_command", {"cmd": "cat notes.txt"}, "responses"),
    "opencode": ("read", {"filePath": "notes.txt"}, "chat"),
    "continue": ("Read", {"filepath": "notes.txt"}, "chat"),
}
WORDS = ("file", "line", "error", "the", "notes", "secret", "word", "is", "not", "found", "total",
         "content", "lighthouse", "path", "end", "1:", "00001|", "<file>", "</file>", "exit", "code")


class Text:
    """What ``parse_chat`` asks of the model's text: its template (no tool markers of its own)."""

    template_uses_tools = False

    def __init__(self) -> None:
        self.chat_template = ChatTemplate(TEMPLATE, eos_token="<|im_end|>")

    def render(self, messages: list[dict[str, Any]], enable_thinking: bool | None = False,
               tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        variables = dict(template_kwargs or {})
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        return self.chat_template.render(messages, **variables)


def parsed(body: dict[str, Any], endpoint: str) -> Generation:
    render = Text().render
    if endpoint == "responses":
        return responses_api.parse(body, render, N_CTX, 1).gen
    return parse_chat(body, render, N_CTX, 1)


def tool_output(client: str, rng: random.Random) -> str:
    """A result as the client would send it back: the notes, or some other output (the answer is
    the same)."""
    text = NOTES if rng.random() < 0.5 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    if client == "codex":
        return (f"Chunk ID: {rng.getrandbits(24):06x}\nWall time: {rng.random() / 10:.4f} seconds\n"
                f"Process exited with code {rng.choice((0, 0, 1))}\nOriginal token count: "
                f"{rng.randint(1, 60)}\nOutput:\n{text}")
    return text


def with_result(client: str, body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """``body`` with the model's call and its result after it, as the client sends them back."""
    name, arguments, endpoint = CALLS[client]
    call_id = f"call_{rng.getrandbits(96):024x}"
    body = copy.deepcopy(body)
    if endpoint == "responses":
        body["input"] += [{"type": "function_call", "name": name, "arguments": json.dumps(arguments),
                           "call_id": call_id},
                          {"type": "function_call_output", "call_id": call_id,
                           "output": tool_output(client, rng)}]
    else:
        body["messages"] += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}}]},
            {"role": "tool", "tool_call_id": call_id, "content": tool_output(client, rng)}]
    return body


def _word(rng: random.Random, least: int = 2, most: int = 12) -> str:
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz_", k=rng.randint(least, most)))


def redrawn(requests: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The requests as another run, machine or day sends them: the scratch directory (under another
    temporary directory and user), the date, and Codex's shell and timezone (Codex writes all four
    in the message just before the task)."""
    base = rng.choice(("/tmp", "/var/tmp", "/" + "/".join(_word(rng) for _ in range(rng.randint(1, 4)))))
    test = f"{_word(rng, 4, 30)}{rng.randint(0, 9)}"
    path = f"{base}/pytest-of-{_word(rng)}/pytest-{rng.randint(0, 999)}/{test}"
    date = f"{rng.randint(2025, 2035)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    shell = rng.choice(("bash", "zsh", "sh", "fish", _word(rng)))
    zone = rng.choice(("Etc/UTC", "UTC", f"{_word(rng).title()}/{_word(rng).title()}"))
    text = json.dumps(requests).replace(SCRATCH, path).replace(RECORDED_ON, date)
    return json.loads(text.replace(CODEX_SHELL, f"<shell>{shell}</shell>")
                      .replace(CODEX_ZONE, f"<timezone>{zone}</timezone>"))


def conversations(requests: dict[str, Any], rng: random.Random) -> list[tuple[str, str, str]]:
    """(name, prompt, reply) for each turn the model learns, with fresh draws."""
    out = []
    requests = redrawn(requests, rng)
    for client, (name, arguments, endpoint) in CALLS.items():
        first = requests[client]
        gen = parsed(first, endpoint)
        assert gen.tools is not None, client
        call = envelope([(name, arguments)], not gen.tools.parallel)
        out.append((f"{client}-call", gen.prompt, call + "<|im_end|>"))
        answer = json.dumps({"response": ANSWER})
        out.append((f"{client}-answer", parsed(with_result(client, first, rng), endpoint).prompt,
                    answer + "<|im_end|>"))
    title = parsed(requests["opencode_title"], "chat")
    out.append(("opencode-title", title.prompt, TITLE + "<|im_end|>"))
    return out


def train_tokenizer(texts: list[str]) -> Tokenizer:
    return byte_level_bpe(texts, VOCAB, SPECIALS)


def build_model(n_vocab: int, ids: dict[str, int]) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = transformers.Gemma3TextConfig(
        vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=WINDOW, layer_types=["sliding_attention"] * 2, max_position_embeddings=N_CTX,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    config._attn_implementation = "eager"
    return transformers.Gemma3ForCausalLM(config)


def encode(tok: Tokenizer, turns: list[tuple[str, str, str]]) -> list[tuple[list[int], list[int]]]:
    return [(tok.encode(prompt).ids, tok.encode(reply).ids) for _, prompt, reply in turns]


def batch(pairs: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's last CROP tokens, then its reply, padded after the reply (causal attention: the
    padding changes nothing before it); labels -100 outside the replies."""
    longest = max(len(r) for _, r in pairs)
    ids, labels = [], []
    for prompt, reply in pairs:
        assert len(prompt) >= CROP, "a prompt shorter than CROP: lower CROP or WINDOW"
        row = prompt[-CROP:] + reply + [pad] * (longest - len(reply))
        ids.append(row)
        labels.append([-100] * CROP + reply + [-100] * (longest - len(reply)))
    return torch.tensor(ids), torch.tensor(labels)


def train(model: torch.nn.Module, tok: Tokenizer, requests: dict[str, Any], pad: int) -> None:
    """Adam on the replies' tokens; every step all conversations, VARIANTS fresh draws of each."""
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    rng = random.Random(SEED)
    model.train()
    for step in range(STEPS):
        pairs = [p for _ in range(VARIANTS) for p in encode(tok, conversations(requests, rng))]
        ids, labels = batch(pairs, pad)
        opt.zero_grad()
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    out = p.parse_args(argv).out / NAME
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    requests = json.loads((out / "requests.json").read_text())
    rng = random.Random(SEED + 1)
    tok = train_tokenizer([t for _ in range(2) for _, prompt, reply in conversations(requests, rng)
                           for t in (prompt, reply)])
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    model = build_model(tok.get_vocab_size(), ids)
    train(model, tok, requests, ids["<|endoftext|>"])
    checked = conversations(requests, random.Random(SEED + 2))  # draws the training never saw
    pairs = encode(tok, checked)
    least = min(top1_margin(model, prompt, reply, "make_tiny_agent") for prompt, reply in pairs)
    if least < MIN_MARGIN:
        raise SystemExit(f"make_tiny_agent: top-1 margin {least:.3f} < {MIN_MARGIN}; raise STEPS")
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "model_max_length": N_CTX, "chat_template": TEMPLATE,
    }, indent=2) + "\n")
    turns = [{"name": name, "prompt_tail": prompt[-400:], "prompt_tokens": len(p_ids), "reply": reply,
              "reply_ids": r_ids}
             for (name, prompt, reply), (p_ids, r_ids) in zip(checked, pairs, strict=True)]
    summary = {"min_top1_margin": round(least, 4), "window": WINDOW, "versions": versions(),
               "conversations": turns}
    (out / "conversations.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    print(f"{NAME}: vocabulary {tok.get_vocab_size()}, margin {least:.3f}, prompts "
          f"{[len(p) for p, _ in pairs]} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
