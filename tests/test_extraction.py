"""Extraction: shards equal a direct forward, positions as configured, resume, Redis reuse and Redis down."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from actors.common import load_config
from actors.extraction import Extractor, ExtractSpec, greedy_continuations, resolve_target, run_extraction
from spyglass.models.llama import Segment, load_transformer
from spyglass.training.positions import PositionScheme

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-longspec.yaml"


def _hf_oracle(path: Path, tokens: torch.Tensor, positions: torch.Tensor):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(tokens[None], position_ids=positions[None], output_hidden_states=True)
    return out.logits[0], out.hidden_states


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_extraction_equals_direct_forward_at_anchor_offset_positions(tiny_dir, family):
    target = load_transformer(tiny_dir[family])
    n = target.args.n_layers
    spec = ExtractSpec(
        kv_layers=[-1, 0],
        hidden_layers=[0],
        topk=5,
        positions={"scheme": "anchor_offset", "anchors": 4, "max_offset": 700, "seed": 1},
    )
    ex = Extractor(target, spec)
    tokens = torch.randint(3, 128, (48,), generator=torch.Generator().manual_seed(0))
    feats, cached = ex.features(tokens)
    assert not cached
    pos = feats["positions"]
    assert pos[:4].tolist() == [0, 1, 2, 3] and int(pos[4]) > 4  # offset applied after the anchors
    assert torch.equal(pos, PositionScheme.from_dict(spec.positions).positions(tokens, target.args.max_position))

    # Our own packed forward at the same positions: the K/V it leaves in the cache (a forward without logits, as the
    # extraction's: prefill forwards may run other matmul kernels than those that return every row's logits), and
    # every row's logits.
    scratch = target.new_cache(64, 1)
    logits = target([Segment(scratch.allocate(), 0, tokens, pos, None, "all")], scratch)[0]
    cache = target.new_cache(64, 1)
    slot = cache.allocate()
    target([Segment(slot, 0, tokens, pos, None, "none")], cache)
    for layer in (0, n - 1):
        k, v = cache.layer(slot, layer)
        assert torch.equal(feats[f"kv.{layer}"][0], k[:, :48])
        assert torch.equal(feats[f"kv.{layer}"][1], v[:, :48])
    lp, ids = logits.log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(feats["topk_ids"], ids)
    torch.testing.assert_close(feats["topk_logprobs"], lp)

    # And the HF oracle with the same position ids: hidden states of layer 0 and the top-k.
    hf_logits, hf_hidden = _hf_oracle(tiny_dir[family], tokens, pos)
    torch.testing.assert_close(feats["hidden.0"], hf_hidden[1][0], atol=2e-5, rtol=1e-4)
    hf_lp = hf_logits.log_softmax(-1).gather(-1, feats["topk_ids"])
    torch.testing.assert_close(feats["topk_logprobs"], hf_lp, atol=2e-5, rtol=1e-4)

    # Positions matter: plain positions give different keys (RoPE).
    plain = Extractor(target, ExtractSpec(kv_layers=[-1], topk=0)).features(tokens)[0]
    assert not torch.allclose(plain[f"kv.{n - 1}"][0], feats[f"kv.{n - 1}"][0])


def test_greedy_continuations_equal_full_recompute_argmax(tiny_dir):
    """Batched, cached decoding (batches of 2 over 3 rows) equals re-running the whole text for every new token."""
    target = load_transformer(tiny_dir["llama"])
    contexts = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(2))
    out = greedy_continuations(target, contexts, keep=12, batch=2)
    assert torch.equal(out[:, :12], contexts[:, :12])
    for row in range(3):
        text = contexts[row, :12].tolist()
        while len(text) < 20:
            cache = target.new_cache(20, 1)
            ids = torch.tensor(text)
            logits = target([Segment(cache.allocate(), 0, ids, torch.arange(len(text)), None, "last")], cache)[0]
            text.append(int(logits[-1].argmax()))
        assert out[row].tolist() == text
    assert not torch.equal(out, contexts)  # the continuation replaced the random tail
    with pytest.raises(ValueError, match="continue_from"):
        greedy_continuations(target, contexts, keep=20)


def _cfg(tmp_path: Path, model_dir: Path, **extract) -> dict:
    sets = [f"model={model_dir}", "corpus.max_contexts={train: 24, eval: 8}"]
    sets += [f"extract.{k}={json.dumps(v)}" for k, v in extract.items()]
    return load_config(CONFIG, sets, str(tmp_path))


def _shard_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("shard-*.safetensors"))}


def test_ray_extraction_manifest_and_resume_skips_finished_shards(tmp_path, tiny_dir, ray_cluster):
    cfg = _cfg(tmp_path / "run", tiny_dir["llama"])
    first = run_extraction(cfg)
    out = tmp_path / "run" / "extract"
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert first["shards_written"] == 4 and first["shards_skipped"] == 0  # 3 train + 1 eval shards of 8
    for key in ("model_id", "tokenizer_hash", "kv_layers", "hidden_layers", "dtype", "position_scheme", "tokens"):
        assert key in manifest
    assert manifest["kv_layers"] == [1] and manifest["hidden_layers"] == [0]
    assert manifest["position_scheme"]["scheme"] == "anchor_offset"
    assert manifest["tokens"] == 24 * 64 == manifest["corpus_tokens"]
    shard = load_file(str(out / "train" / "shard-00001.safetensors"))
    assert shard["kv.1"].shape == (8, 2, 2, 64, 16) and shard["hidden.0"].shape == (8, 64, 64)
    assert torch.equal(shard["positions"][:, :4], torch.arange(4).expand(8, 4))
    assert (shard["positions"][:, 4] > 4).any()
    # The shard holds the target's K/V and hidden states at those positions (direct forward). Equal up to fp32
    # rounding: the extraction worker and this process each time the matmul kernels and keep the fastest
    # (spyglass.models.linear), and two kernels may sum in different orders; a wrong position or row is far off.
    close = dict(rtol=1e-5, atol=1e-5)
    target = load_transformer(tiny_dir["llama"])
    for row in (0, 7):
        tokens, pos = shard["tokens"][row], shard["positions"][row]
        cache = target.new_cache(64, 1)
        slot = cache.allocate()
        target([Segment(slot, 0, tokens, pos, None, "none")], cache)
        k, v = cache.layer(slot, 1)
        torch.testing.assert_close(shard["kv.1"][row, 0], k[:, :64], **close)
        torch.testing.assert_close(shard["kv.1"][row, 1], v[:, :64], **close)
    hidden = target.embed(shard["tokens"][7])
    cos, sin = target._rope(shard["positions"][7])
    with torch.inference_mode():
        cache = target.new_cache(64, 1)
        seg = [Segment(cache.allocate(), 0, shard["tokens"][7], shard["positions"][7])]
        hidden = target.layers[0](hidden, cos, sin, seg, cache, 0, target.attention_backend)
    torch.testing.assert_close(shard["hidden.0"][7], hidden, **close)

    # Remove one finished shard: a rerun recomputes only that one and leaves the others untouched.
    mtimes = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("shard-*.safetensors")}
    before = _shard_bytes(out)
    (out / "train" / "shard-00001.json").unlink()
    os.remove(out / "train" / "shard-00001.safetensors")
    second = run_extraction(cfg)
    assert second["shards_written"] == 1 and second["shards_skipped"] == 3
    assert _shard_bytes(out) == before
    for p in out.rglob("shard-*.safetensors"):
        if p.relative_to(out) != Path("train/shard-00001.safetensors"):
            assert p.stat().st_mtime_ns == mtimes[p.relative_to(out)]


def test_on_policy_extraction_continues_every_context_with_the_target(tmp_path, tiny_dir, ray_cluster):
    """`continue_from`: the shards hold the corpus prompt, then the target's own greedy continuation."""
    cfg = _cfg(tmp_path / "run", tiny_dir["llama"], continue_from=40, generate_batch=4, splits=["eval"])
    run_extraction(cfg)
    corpus = load_file(str(tmp_path / "run" / "corpus" / "contexts-eval.safetensors"))["tokens"]
    shard = load_file(str(tmp_path / "run" / "extract" / "eval" / "shard-00000.safetensors"))
    target = load_transformer(tiny_dir["llama"])
    assert torch.equal(shard["tokens"], greedy_continuations(target, corpus[:8], keep=40))
    assert not torch.equal(shard["tokens"][:, 40:], corpus[:8, 40:])
    manifest = json.loads((tmp_path / "run" / "extract" / "eval" / "manifest.json").read_text())
    assert manifest["continue_from"] == 40
    # at the plain positions it was generated at, the target's top-1 after the prompt is the continuation itself
    plain = Extractor(target, ExtractSpec(kv_layers=[-1], topk=1))
    for row in shard["tokens"]:
        assert torch.equal(plain.features(row)[0]["topk_ids"][39:-1, 0], row[40:])


def test_redis_reuse_counts_hits_and_writes_identical_shards(tmp_path, tiny_dir, ray_cluster, redis_server):
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    first = run_extraction(_cfg(tmp_path / "a", tiny_dir["qwen2"], redis_url=redis_server.url))
    assert first["cache_block_hits"] == 0 and first["contexts_from_cache"] == 0
    second = run_extraction(_cfg(tmp_path / "b", tiny_dir["qwen2"], redis_url=redis_server.url))
    assert second["contexts_from_cache"] == 32  # every context of both splits
    assert second["cache_block_hits"] == 32 * (64 // 16)
    a, b = _shard_bytes(tmp_path / "a" / "extract"), _shard_bytes(tmp_path / "b" / "extract")
    assert a == b and len(a) == 4

    # A different position scheme is another namespace: no stale reuse.
    target = load_transformer(tiny_dir["qwen2"])
    model_id = resolve_target(str(tiny_dir["qwen2"]), "float32", needs_tokenizer=False).model_id
    tokens = load_file(str(tmp_path / "a" / "corpus" / "contexts-train.safetensors"))["tokens"][0]
    same = Extractor(
        target,
        ExtractSpec(**{**_cfg(tmp_path / "x", tiny_dir["qwen2"], redis_url=redis_server.url)["extract"]}),
        model_id,
    )
    assert same.features(tokens)[1] and same.cache.stats.hits == 4
    spec = _cfg(tmp_path / "y", tiny_dir["qwen2"], redis_url=redis_server.url, positions={"scheme": "plain"})["extract"]
    other = Extractor(target, ExtractSpec(**spec), model_id)
    assert not other.features(tokens)[1] and other.cache.stats.hits == 0


def test_extraction_completes_with_redis_down(tmp_path, tiny_dir):
    from tests.redis_server import RedisServer

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    url = server.url
    server.stop()
    target = load_transformer(tiny_dir["llama"])
    contexts = torch.randint(3, 128, (3, 32), generator=torch.Generator().manual_seed(1))
    down = Extractor(target, ExtractSpec(redis_url=url, block_size=16, topk=2))
    info = down.run_shard(contexts, 0, tmp_path / "down", {})
    assert info["contexts"] == 3 and down.cache.stats.errors > 0 and down.cache.stats.hits == 0
    ref = Extractor(target, ExtractSpec(redis_url=None, block_size=16, topk=2)).run_shard(
        contexts, 0, tmp_path / "ref", {}
    )
    assert ref["tokens"] == info["tokens"]
    assert _shard_bytes(tmp_path / "down") == _shard_bytes(tmp_path / "ref")
    shutil.rmtree(tmp_path / "redis", ignore_errors=True)
