"""Offline corpora and Anchor-Offset positions."""

from __future__ import annotations

import json

import pytest
import torch

from spyglass.training.data import ByteTokenizer, CorpusConfig, build_corpus, code_documents, load_contexts, split_of
from spyglass.training.positions import PositionScheme, anchor_offset_positions

PROSE = ["/usr/share/common-licenses"]


def test_anchor_offset_positions_keep_anchors_and_shift_the_rest():
    pos = anchor_offset_positions(10, 4, 100)
    assert pos.tolist() == [0, 1, 2, 3, 104, 105, 106, 107, 108, 109]


def test_position_scheme_is_deterministic_bounded_and_varies_by_context():
    scheme = PositionScheme("anchor_offset", anchors=4, max_offset=5000, seed=3)
    offsets = set()
    for i in range(20):
        tokens = torch.arange(i, i + 64)
        pos = scheme.positions(tokens, max_position=2048)
        assert pos[:4].tolist() == [0, 1, 2, 3]
        assert torch.equal(pos[4:] - pos[4], torch.arange(60))
        assert int(pos[-1]) < 2048  # capped by the model's max position, not only by max_offset
        assert torch.equal(pos, scheme.positions(tokens.clone(), max_position=2048))
        offsets.add(int(pos[4]) - 4)
    assert len(offsets) > 10
    assert PositionScheme().positions(torch.arange(7)).tolist() == list(range(7))
    assert scheme.tag() != PositionScheme("anchor_offset", anchors=4, max_offset=5000, seed=4).tag()
    with pytest.raises(ValueError):
        PositionScheme("rope-yolo")


def test_code_documents_are_grouped_by_package():
    docs = code_documents(CorpusConfig(code_packages=["json", "email", "heapq"]))
    groups = {d.group for d in docs}
    assert groups == {"code:json", "code:email", "code:heapq"}
    assert all(d.path.endswith(".py") for d in docs)
    assert sum(d.group == "code:email" for d in docs) > 5


def test_corpus_splits_are_disjoint_deterministic_and_reported_in_tokens(tmp_path):
    cfg = CorpusConfig(
        code_packages=["json", "email", "csv", "textwrap", "heapq", "bisect", "shlex", "glob", "netrc", "colorsys"],
        prose_roots=PROSE,
        prose_suffixes=[""],
        seq_len=32,
        max_contexts={"train": 24, "eval": 6},
        eval_fraction=0.3,
    )
    tok = ByteTokenizer(128)
    m1 = build_corpus(cfg, tok, tmp_path / "a")
    m2 = build_corpus(cfg, tok, tmp_path / "b")
    train, ev = m1["splits"]["train"], m1["splits"]["eval"]
    assert not set(train["groups_assigned"]) & set(ev["groups_assigned"])
    assert not set(train["files_used"]) & set(ev["files_used"])
    assert train["contexts"] == 24 and train["tokens"] == 24 * 32
    assert ev["contexts"] > 0 and ev["tokens"] == ev["contexts"] * 32
    assert train["kinds"]["code"] > 0 and train["kinds"]["prose"] > 0
    for split in ("train", "eval"):
        a, b = load_contexts(tmp_path / "a", split), load_contexts(tmp_path / "b", split)
        assert torch.equal(a, b) and a.shape[1] == 32
        assert int(a.max()) < 128
    assert json.loads((tmp_path / "a" / "corpus.json").read_text())["splits"] == m2["splits"]
    for g in train["groups_used"]:
        assert split_of(g, cfg) == "train"


def test_skipped_contexts_are_the_ones_a_smaller_run_used(tmp_path):
    """A follow-up corpus with `skip_contexts` starts where the first one stopped, kind by kind: no context repeats
    and the held-out split is unchanged."""
    base = dict(
        code_packages=["json", "email", "csv", "textwrap", "heapq", "bisect", "shlex", "glob", "netrc", "colorsys"],
        prose_roots=PROSE,
        prose_suffixes=[""],
        seq_len=32,
        eval_fraction=0.3,
    )
    tok = ByteTokenizer(128)
    build_corpus(CorpusConfig(**base, max_contexts={"train": 20, "eval": 4}), tok, tmp_path / "all")
    build_corpus(CorpusConfig(**base, max_contexts={"train": 8, "eval": 4}), tok, tmp_path / "first")
    later = CorpusConfig(**base, max_contexts={"train": 12, "eval": 4}, skip_contexts={"train": 8})
    build_corpus(later, tok, tmp_path / "later")
    whole, first, rest = (load_contexts(tmp_path / d) for d in ("all", "first", "later"))
    # prose then code in each corpus: 4 + 4 first, then 6 + 6; the whole run is 10 prose + 10 code
    assert torch.equal(first[:4], whole[:4]) and torch.equal(rest[:6], whole[4:10])
    assert torch.equal(first[4:], whole[10:14]) and torch.equal(rest[6:], whole[14:])
    assert not {tuple(r) for r in first.tolist()} & {tuple(r) for r in rest.tolist()}
    assert torch.equal(load_contexts(tmp_path / "first", "eval"), load_contexts(tmp_path / "later", "eval"))
