"""The compact runner's logits equal HF transformers' (fp32) on tiny random models of both families,
with RoPE scaling variants, in one pass, chunked prefill and a tree verify pass."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from spyglass.models.llama import Segment, load_transformer
from spyglass.tree import DraftTree


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_match_hf(tiny_dir, family):
    path = tiny_dir[family]
    model = load_transformer(path)
    ids = torch.randint(3, model.args.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(path, ids)
    cache = model.new_cache(128, 1)
    slot = cache.allocate()
    ours = model([Segment(slot, 0, ids, torch.arange(70))], cache)[0]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    cache.release(slot)
    slot = cache.allocate()
    last = model.prefill(cache, slot, ids, chunk_size=16)  # chunked prefill over a growing prefix
    torch.testing.assert_close(last, ref[-1], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ],
    ids=["linear", "llama3"],
)
def test_rope_scaling_matches_hf(tmp_path, rope):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rope_parameters=rope,
        initializer_range=0.2,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_transformer(tmp_path)
    ids = torch.randint(0, 96, (200,), generator=torch.Generator().manual_seed(2))  # past the original window
    cache = model.new_cache(256, 1)
    ours = model([Segment(cache.allocate(), 0, ids, torch.arange(200))], cache)[0]
    torch.testing.assert_close(ours, hf_logits(tmp_path, ids), atol=2e-5, rtol=1e-4)


def test_tree_verify_rows_equal_per_path_forward(tiny_target):
    """Each tree node's logits equal those of a plain forward over prefix + the node's root path."""
    prefix = torch.randint(3, tiny_target.args.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    tree = DraftTree.from_paths(7, [[1, 2, 3], [1, 4], [5, 6, 8, 9]])
    cache = tiny_target.new_cache(64, 2)
    slot = cache.allocate()
    tiny_target.prefill(cache, slot, prefix)
    rows = tiny_target([Segment(slot, 30, tree.tokens, tree.positions(30), tree.mask())], cache)[0]
    anc = tree.ancestor_mask()
    other = cache.allocate()
    for node in range(len(tree)):
        path = tree.tokens[anc[node]]
        ids = torch.cat([prefix, path])
        cache.lengths[other] = 0
        ref = tiny_target([Segment(other, 0, ids, torch.arange(len(ids)), None, "last")], cache)[0][0]
        torch.testing.assert_close(rows[node], ref, atol=2e-5, rtol=1e-4)


def _mappings() -> list[tuple[int, int, str, set[str]]]:
    """This process's memory mappings: (start, end, backing file or "", VmFlags)."""
    maps, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                cur = [lo, hi, parts[5] if len(parts) > 5 and parts[5].startswith("/") else "", set()]
                maps.append(cur)
            elif parts[0] == "VmFlags:" and cur is not None:
                cur[3] = set(parts[1:])
    return [tuple(m) for m in maps]


def _thp_available() -> bool:
    """The kernel offers transparent huge pages to madvise (its mode is not [never], or it has none)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _thp_available(), reason="needs Linux with transparent huge pages (reads /proc/self/smaps)")
def test_loaded_weights_live_in_anonymous_huge_page_memory_not_in_the_file(smollm2):
    """A 1-token step streams every weight: from the safetensors file's page-cache pages it ran 4-6% slower than from
    huge pages. Every large weight sits in anonymous memory advised for huge pages."""
    model, _ = smollm2
    maps = _mappings()
    large = [p for p in model.parameters() if p.numel() * p.element_size() >= 1 << 20]
    assert len(large) >= model.args.n_layers  # the projections of every layer, the embedding
    for p in large:
        mid = p.data_ptr() + p.numel() * p.element_size() // 2
        (region,) = [m for m in maps if m[0] <= mid < m[1]]
        assert region[2] == "" and "hg" in region[3], (region[2], sorted(region[3]))
    if model.args.tie_embeddings:
        assert model.lm_head.weight is model.embed.weight
