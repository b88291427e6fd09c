"""Make ``tests/data/tiny_hf/gpt_oss_harmony``: a tiny gpt-oss that speaks OpenAI's harmony format.

A random tiny model writes no channels, so this one is *trained*, briefly, to answer a few fixed
conversations in harmony: an analysis message, then a final one; with a tool offered, an analysis
message and a call through ``commentary to=functions.get_weather``; after the tool's result, a final
answer. What it shows is the server's side (the prompt's markup, the channels split into
``reasoning_content`` and ``content``, the call into ``tool_calls``) on a real gpt-oss forward pass
and a real token stream; how a released gpt-oss words its analysis is the model's.

Beside transformers' checkpoint (``GptOssForCausalLM``, float32, the MoE layout of
``make_tiny_moe.py``'s gpt_oss): a byte-level BPE with the harmony tokens as special tokens, a chat
template of harmony's shape (written here: system with the reasoning level, developer with the tools
as a TypeScript namespace, messages, ``<|start|>assistant`` to generate), and
``conversations.json``: each conversation as the server receives it, with its prompt ids and the
reply the model learned. The script refuses a model whose greedy replies are not those, or whose
smallest top-1 margin over them is under ``MIN_MARGIN``.

Needs torch, transformers and tokenizers (``pip install -e '.[tools]'``, best in a separate venv):

    python tools/make_tiny_harmony.py [--out tests/data/tiny_hf]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from make_tiny_moe import versions
from tiny_training import byte_level_bpe, top1_margin
from tokenizers import Tokenizer

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny_hf"
NAME = "gpt_oss_harmony"
SEED = 11
STEPS = 400
LEARNING_RATE = 3e-3
MIN_MARGIN = 1.0  # logits between the learned token and the next best, at every reply position
VOCAB = 320
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>"]

TEMPLATE = (
    "<|start|>system<|message|>You are a tiny test model.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{% for t in tools %}type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n"
    "{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|start|>developer<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for tc in m.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>json"
    "<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ m.name | default('tool') }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_ID = "call_0"
QUESTION = "What is the weather in Oslo?"
# (name, messages as the server passes them to the template, tools, the reply learned)
CONVERSATIONS: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None, str]] = [
    ("greeting", [{"role": "user", "content": "Hello!"}], None,
     "<|channel|>analysis<|message|>The user greets me. I greet back.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"),
    ("call", [{"role": "user", "content": QUESTION}], [WEATHER],
     "<|channel|>analysis<|message|>I need the weather in Oslo.<|end|>"
     '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Oslo"}<|call|>'),
    ("result", [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": CALL_ID, "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "sunny, 21 C", "tool_call_id": CALL_ID, "name": "get_weather"}],
     [WEATHER],
     "<|channel|>analysis<|message|>The tool says sunny.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo, 21 C.<|return|>"),
]


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt as the server renders it (``colibri.model.chat``: the same jinja options and
    ``tojson``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False)
    return env.from_string(TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=True)


def train_tokenizer() -> Tokenizer:
    return byte_level_bpe([render(m, t) + reply for _, m, t, reply in CONVERSATIONS] * 4, VOCAB, SPECIALS)


def build_model(n_vocab: int, ids: dict[str, int]) -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = transformers.GptOssConfig(
        vocab_size=n_vocab, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=ids["<|startoftext|>"], eos_token_id=ids["<|return|>"],
        pad_token_id=ids["<|endoftext|>"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=4096))
    config._attn_implementation = "eager"
    return transformers.GptOssForCausalLM(config)


def train(model: torch.nn.Module, batch: list[tuple[list[int], list[int]]]) -> None:
    """Adam on the replies' tokens (the prompts are context), all conversations each step."""
    opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    model.train()
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(reply_loss(model, p, r) for p, r in batch) / len(batch)
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    model.eval()


def reply_loss(model: torch.nn.Module, prompt: list[int], reply: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + reply])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(reply))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT_DIR)
    out = p.parse_args(argv).out / NAME
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    tok = train_tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    batch = [(tok.encode(render(m, t)).ids, tok.encode(reply).ids) for _, m, t, reply in CONVERSATIONS]
    model = build_model(tok.get_vocab_size(), ids)
    train(model, batch)
    margin = min(top1_margin(model, p_ids, r_ids, "make_tiny_harmony") for p_ids, r_ids in batch)
    if margin < MIN_MARGIN:
        raise SystemExit(f"make_tiny_harmony: top-1 margin {margin:.3f} < {MIN_MARGIN}; raise STEPS")
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "model_max_length": 512, "chat_template": TEMPLATE,
    }, indent=2) + "\n")
    conversations = [{"name": name, "messages": m, "tools": t, "prompt_ids": p_ids, "reply": reply,
                      "reply_ids": r_ids}
                     for (name, m, t, reply), (p_ids, r_ids) in zip(CONVERSATIONS, batch, strict=True)]
    summary = {"min_top1_margin": round(margin, 4), "versions": versions(), "conversations": conversations}
    (out / "conversations.json").write_text(json.dumps(summary, indent=1))
    print(f"{NAME}: vocabulary {tok.get_vocab_size()}, margin {margin:.3f}, "
          f"{sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
