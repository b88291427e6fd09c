"""Multi-head latent attention (deepseek2) in the real engine, on the tiny DeepSeek checkpoints
(``tests/data/tiny_hf/deepseek2``: V2-Lite's layout, ``deepseek3``: V3's): the cache and a slot's
file hold a token's latent and rope key alone, by the ratio the shapes give; a slot persisted by
one ``coli engine`` and restored by the next continues as a fresh engine given the whole prompt;
sixteen slots at once give what each gives alone; a file of the older fused ``attn_kv_b`` reads as the
split one. (The logits against transformers and llama.cpp:
``test_moe_models.py``, ``test_reference.py``, ``test_convert_llama_cpp.py``.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from engine_harness import EngineProcess, engine_args

from colibri.convert.writer import convert
from colibri.io.events import Done, Perf, Submit
from colibri.io.mux import encode_request
from colibri.model.file_info import describe
from colibri.model.generate import SingleSequence
from colibri.model.loader import Model
from colibri.sched import persist
from colibri.store.gguf import GGUFFile

DATA = Path(__file__).parent / "data" / "tiny_hf"
ARCHS = ["deepseek2", "deepseek3", "deepseek3_yarn"]
ENGINE_ARCHS = ARCHS[:2]  # (the YaRN file's cache is deepseek3's: its rope is test_moe_models')


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Each checkpoint with the tiny mixtral's tokenizer (256 tokens, as their vocabulary: the
    engine serves no file without one), converted to f32 and q8_0."""
    out = tmp_path_factory.mktemp("mla")
    done = {}
    for arch in ARCHS:
        ckpt = out / arch
        shutil.copytree(DATA / arch, ckpt)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DATA / "mixtral" / name, ckpt / name)
        for type_name in ("f32", "q8_0"):
            done[arch, type_name] = out / f"{arch}-{type_name}.gguf"
            convert(ckpt, done[arch, type_name], type_name)
    return done


def reference_ids(arch: str) -> tuple[list[int], list[int]]:
    ref = np.load(DATA / arch / "reference.npz")
    return [int(i) for i in ref["prompt_ids"]], [int(i) for i in ref["greedy_ids"]]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_cache_holds_the_latent_and_rope_key_alone(arch, files):
    """Per token and layer: kv_lora_rank + rope values of keys and none of values, where every
    head's key and value would be n_heads * (key_length_mla + value_length_mla); ``coli info``
    says both."""
    model = Model(files[arch, "f32"])
    hp = model.hp
    kv = model.new_kv_cache(2, 64)
    width = hp.kv_lora_rank + hp.rope_dim
    assert kv.k.shape == (2, hp.n_layers, 64, 1, width) and kv.v.shape == (2, hp.n_layers, 64, 1, 0)
    assert kv.bytes_per_token == hp.n_layers * width * 2  # halves, the default
    heads = hp.n_heads * (hp.head_dim_mla + hp.v_dim_mla)
    assert hp.kv_values_uncompressed == heads  # deepseek2: 4 * (48 + 32) = 320 against 48
    info = next(line for line in describe(GGUFFile(files[arch, "f32"])) if line.startswith("kv cache"))
    assert f"{hp.n_layers * width * 2:,} bytes a token (f16)" in info
    assert f"{width} values a layer where the heads' keys and values would take {heads}" in info


async def _turn(engine: EngineProcess, rid: int, ids: list[int], max_tokens: int) -> tuple[bytes, Perf]:
    await engine.send(encode_request(Submit(rid, 0, max_tokens, 0.0, 1.0, "", prompt_ids=tuple(ids))))
    out = await engine.result(rid)
    assert isinstance(out.final, Done), out.final
    return out.text, next(e for e in out.events if isinstance(e, Perf))


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
async def test_a_persisted_latent_slot_continues_after_a_restart(arch, files, nursery, tmp_path):
    """Turn one (the reference prompt and its greedy continuation, up to the tokenizer's end of turn
    where the model draws it) is saved; a restarted engine reuses it for turn two and answers as an
    engine without persistence given the whole prompt. The slot file holds the latent cache's
    bytes per token and nothing more."""
    path, state = files[arch, "f32"], tmp_path / "state"
    prompt, greedy = reference_ids(arch)
    engine = await EngineProcess.start(nursery, "--model", str(path), "--kv-type", "f32",
                                       *engine_args(state))
    first, _ = await _turn(engine, 1, prompt, len(greedy))
    assert await engine.close() == 0
    per_token = persist.TOKEN_DTYPE.itemsize + Model(path, kv_type="f32").new_kv_cache(1, 8).bytes_per_token
    n_saved, rest = divmod(persist.slot_path(state, 0).stat().st_size - persist.HEADER_SIZE, per_token)
    assert rest == 0 and len(prompt) <= n_saved < len(prompt) + len(greedy), n_saved

    second = prompt + greedy + [7, 8, 9]
    engine = await EngineProcess.start(nursery, "--model", str(path), "--kv-type", "f32",
                                       *engine_args(state))
    restored, perf = await _turn(engine, 2, second, 12)
    assert await engine.close() == 0
    assert perf.reused_tokens >= len(prompt)
    fresh = await EngineProcess.start(nursery, "--model", str(path), "--kv-type", "f32", *engine_args(None))
    plain, _ = await _turn(fresh, 3, second, 12)
    assert await fresh.close() == 0
    assert restored == plain and first


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
async def test_sixteen_latent_slots_at_once_give_what_each_gives_alone(arch, files, nursery):
    path = files[arch, "q8_0"]
    rng = np.random.default_rng(3)
    prompts = [[1, *(int(t) for t in rng.integers(3, 256, n))] for n in rng.integers(3, 20, 16)]
    many = await EngineProcess.start(nursery, "--model", str(path), *engine_args(None, slots=16))
    subs = [Submit(i + 1, i, 12, 0.0, 1.0, "", prompt_ids=tuple(p)) for i, p in enumerate(prompts)]
    await many.send(b"".join(encode_request(s) for s in subs))
    together = [(await many.result(s.id)).text for s in subs]
    assert await many.close() == 0
    one = await EngineProcess.start(nursery, "--model", str(path), *engine_args(None))
    alone = [(await _turn(one, 100 + i, p, 12))[0] for i, p in enumerate(prompts)]
    assert await one.close() == 0
    assert together == alone and all(together)


def legacy_copy(src: Path, out: Path) -> Path:
    """``src`` as llama.cpp's converter wrote DeepSeek before it split ``attn_kv_b``: per layer one
    fused ``attn_kv_b`` (each head's key rows, then its value rows), the heads' key and value
    lengths, as many kv heads as heads, no ``_mla`` lengths."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = "deepseek2"
    fields = {f.name: f for f in reader.fields.values()}
    scalar = lambda key: int(fields[f"{arch}.{key}"].parts[-1][0])  # noqa: E731
    heads, k_mla, v_mla = scalar("attention.head_count"), scalar("attention.key_length_mla"), \
        scalar("attention.value_length_mla")
    writer = gguf.GGUFWriter(out, arch)
    renamed = {f"{arch}.attention.key_length": k_mla, f"{arch}.attention.value_length": v_mla,
               f"{arch}.attention.head_count_kv": heads}
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name.endswith("_mla"):
            continue
        if f.name in renamed:
            writer.add_uint32(f.name, renamed[f.name])
            continue
        value = f.contents()
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(f.name, value)
        else:
            writer.add_key_value(f.name, value, vtype)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.name.endswith("attn_v_b.weight"):
            continue
        if t.name.endswith("attn_k_b.weight"):
            k_b = np.asarray(t.data, np.float32)  # [heads, kv_lora, nope]
            v_b = np.asarray(tensors[t.name.replace("attn_k_b", "attn_v_b")].data, np.float32)
            fused = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
            writer.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(fused))
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_a_file_with_the_older_fused_kv_b_gives_the_split_files_logits(arch, files, tmp_path):
    """A DeepSeek file converted before llama.cpp split ``attn_kv_b`` is split at load
    (``mla.split_kv_b``): its logits are the split file's (f32: the same values), and its cache is
    the latent's too."""
    legacy = legacy_copy(files[arch, "f32"], tmp_path / f"{arch}-legacy.gguf")
    assert "blk.1.attn_kv_b.weight" in GGUFFile(legacy).tensors
    prompt, greedy = reference_ids(arch)
    split, old = Model(files[arch, "f32"], kv_type="f32"), Model(legacy, kv_type="f32")
    assert (old.hp.n_kv_heads, old.hp.head_dim, old.hp.head_dim_mla, old.hp.v_dim_mla) == \
        (split.hp.n_kv_heads, split.hp.head_dim, split.hp.head_dim_mla, split.hp.v_dim_mla)
    seq = prompt + greedy
    want = SingleSequence(split, 256, 512).prefill(seq, all_logits=True)
    got = SingleSequence(old, 256, 512).prefill(seq, all_logits=True)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    # and the copy is a legacy file as llama.cpp reads one (its non-MLA path: K and V decompressed)
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(legacy), n_ctx=256, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(seq)
    theirs = np.array(llm.scores[: len(seq)])
    assert np.abs(theirs - want).max() <= 1e-3  # (measured 3.4e-5 on deepseek2)
