"""The expert atlas: ``coli atlas`` over a tiny converted MoE model, through the real command line.

A token is routed to ``n_expert_used`` experts in every MoE layer, so each layer's routing shares
sum to exactly that; an expert's affinities sum to 1 over the topics (0 where nothing used it), and
its dominant topic is the one with the largest. A dense model and a bad prompts file are one-line
errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from convert_harness import TINY

from colibri.cli import main
from colibri.model.loader import Model

# token ids: the tiny checkpoints carry no tokenizer (a placeholder vocabulary)
PROMPTS = {"counting": [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]],
           "letters": [[40, 41, 42, 43, 44], [50, 51, 52]]}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("atlas") / "qwen2moe.gguf"
    assert main(["convert", str(TINY / "qwen2moe"), "-o", str(out), "--type", "f32"]) == 0
    return out


def test_atlas_shares_and_affinities(tiny_moe, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    out = tmp_path / "experts.json"
    assert main(["atlas", "--model", str(tiny_moe), "--prompts", str(prompts), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    atlas = json.loads(out.read_text())
    hp = Model(tiny_moe).hp
    rows, cols = atlas["rows"], atlas["cols"]
    assert (cols, atlas["topics"], atlas["tokens"]) == (hp.n_expert, ["counting", "letters"], [11, 8])
    share = np.asarray(atlas["share"])
    assert share.shape == (rows, cols)
    np.testing.assert_allclose(share.sum(axis=1), hp.n_expert_used, atol=1e-4)
    affinity = np.asarray(atlas["affinity"])
    assert affinity.shape == (rows, cols, 2)
    used = share > 0
    np.testing.assert_allclose(affinity.sum(axis=2)[used], 1.0, atol=1e-4)
    assert not affinity[~used].any()
    dominant = np.asarray(atlas["dominant"])
    assert (dominant[~used] == -1).all()
    assert (dominant[used] == affinity.argmax(axis=2)[used]).all()


def test_the_server_publishes_it(tiny_moe, tmp_path):
    """``coli serve`` serves the state directory's experts.json at /atlas, read at each request
    (404 before it exists). The default model is dense, so the file here is written by hand.
    /health carries the block types and the hardware the console shows, and a slot's KV bytes per
    token."""
    from serve_harness import running_server

    state = tmp_path / "state"
    state.mkdir()
    with running_server("--state-dir", str(state), "--web-dist", "/nonexistent") as srv, srv.http() as h:
        assert h.get("/atlas").status_code == 404
        (state / "experts.json").write_text(json.dumps({"rows": 1, "cols": 2, "topics": ["a"]}))
        r = h.get("/atlas")
        assert r.status_code == 200 and r.json()["topics"] == ["a"]
        # what the console's runtime panel shows beside it: the file's block formats, the hardware
        health = h.get("/health").json()
        assert {"Q4_1", "F32"} <= set(health["block_types"]), health
        assert health["hardware"]["cores"] >= 1 and health["hardware"]["ram_total_gb"] > 0, health
        # SmolLM2-135M: 30 layers, 3 kv heads of 64, keys and values in halves
        assert health["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 2, health


def test_atlas_errors(tiny_moe, tmp_path, model_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"a": ["hello"]}))
    assert main(["atlas", "--model", str(model_path), "--prompts", str(prompts),
                 "--out", str(tmp_path / "x.json")]) != 0
    assert "no experts" in capsys.readouterr().err
    for bad in ("[1, 2]", '{"a": []}', '{"a": [""]}', "not json"):
        prompts.write_text(bad)
        assert main(["atlas", "--model", str(tiny_moe), "--prompts", str(prompts),
                     "--out", str(tmp_path / "x.json")]) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "prompts" in err, err
    assert not (tmp_path / "x.json").exists()
