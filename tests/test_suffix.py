"""Suffix drafting: the automaton against brute force, incremental matching, the bounded global index."""

from __future__ import annotations

import random

import torch

from spyglass.drafters.base import DraftRequest
from spyglass.drafters.suffix import GlobalIndex, Matcher, SuffixAutomaton, SuffixDrafter
from spyglass.sampling import SamplingParams
from spyglass.sequence import Sequence


def brute_longest_repeat(text: list[int]) -> int:
    """Length of the longest suffix that also ends at an earlier position."""
    n = len(text)
    best = 0
    for length in range(1, n):
        suf = text[n - length :]
        if any(text[e - length + 1 : e + 1] == suf for e in range(length - 1, n - 1)):
            best = length
    return best


def brute_most_recent(text: list[int], pattern: list[int]) -> int:
    """The token that followed the last earlier occurrence of `pattern`."""
    m = len(pattern)
    return next(text[s + m] for s in range(len(text) - m - 1, -1, -1) if text[s : s + m] == pattern)


def brute_continuations(text: list[int], pattern: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    m = len(pattern)
    for s in range(0, len(text) - m):
        if text[s : s + m] == pattern:
            t = text[s + m]
            out[t] = out.get(t, 0) + 1
    return out


def _streams():
    rng = random.Random(0)
    yield [rng.randrange(4) for _ in range(200)]  # small alphabet: many repeats
    base = [rng.randrange(50) for _ in range(40)]
    yield base + [rng.randrange(50) for _ in range(10)] + base[5:30] + base  # copied spans
    yield [7] * 100  # the worst case for suffix links
    from pathlib import Path

    text = Path(__file__).read_text()[:500]  # real text (bytes as tokens)
    yield list(text.encode())


def test_longest_repeat_and_counts_match_brute_force():
    for stream in _streams():
        sam = SuffixAutomaton()
        for i, tok in enumerate(stream):
            sam.append(tok)
            if i % 7 and i < len(stream) - 1:
                continue
            state, length = sam.longest_repeat()
            prefix = stream[: i + 1]
            assert length == brute_longest_repeat(prefix), f"at {i}"
            if length:
                conts = sam.continuations(state)
                got = {t: c for t, _, c in conts}
                pattern = prefix[len(prefix) - length :]
                want = brute_continuations(prefix, pattern)
                if stream != [7] * 100:  # counts are exact unless the suffix-link walk is capped
                    assert got == want
                else:
                    assert set(got) == set(want)
                # the most recent continuation leads (what predict guesses), then the most frequent
                assert conts[0][0] == sam.predict(state) == brute_most_recent(prefix, pattern), f"at {i}"
                assert [c for _, _, c in conts[1:]] == sorted((c for _, _, c in conts[1:]), reverse=True)


def test_matcher_follows_a_stream_through_another_text():
    rng = random.Random(1)
    corpus = [rng.randrange(6) for _ in range(400)]
    sam = SuffixAutomaton()
    sam.extend(corpus)
    m = Matcher(sam)
    stream = [rng.randrange(6) for _ in range(200)]
    for i, t in enumerate(stream):
        m.feed(t)
        best = 0
        for length in range(1, i + 2):
            suf = stream[i + 1 - length : i + 1]
            if any(corpus[s : s + length] == suf for s in range(len(corpus) - length + 1)):
                best = length
            else:
                break
        assert m.length == best


def test_global_index_memory_is_bounded():
    g = GlobalIndex(max_tokens=4_000)
    rng = random.Random(2)
    peak = 0
    for _ in range(2_000):  # thousands of requests
        g.add([rng.randrange(5000) for _ in range(rng.randrange(5, 40))])
        peak = max(peak, sum(len(x) for x in g.generations))
    assert peak <= 4_000 + 45
    assert g.epoch > 5
    assert g.nbytes() < 8 << 20


def test_the_automaton_counts_its_transitions_as_it_grows():
    """nbytes() reads a transition count kept as tokens are appended (GlobalIndex asks after every finished
    request: a recount over every state was quadratic in the requests served); it equals a recount, clones
    included."""
    rng = random.Random(5)
    sam = SuffixAutomaton()
    for _ in range(3):
        sam.extend(rng.randrange(6) for _ in range(400))  # a small alphabet: many repeats, so many clones
        assert sam.edges == sum(len(d) for d in sam.next) > len(sam.tokens)
    assert len(sam.length) > len(sam.tokens) + 1  # clones were made


def _seq(tokens, max_new=32):
    seq = Sequence(tokens, SamplingParams(max_new_tokens=max_new))
    return seq


def test_drafts_the_continuation_of_a_repeat_with_scores():
    text = list(range(10, 40)) + [5, 6, 7] + list(range(10, 20))
    seq = _seq(text)
    d = SuffixDrafter(use_global=False)
    d.start(seq)
    tree = d.propose([seq], [DraftRequest()])[0]
    assert tree.tokens[1:6].tolist() == [20, 21, 22, 23, 24]  # what followed 10..19 before
    s = tree.scores
    assert s[0] == 1.0 and all(0 < s[i] <= s[tree.parents[i]] for i in range(1, len(tree)))
    assert tree.max_depth <= d.max_depth


def test_global_index_drafts_what_an_earlier_request_generated():
    d = SuffixDrafter()
    first = _seq([1, 2, 3, 4], max_new=20)
    d.start(first)
    for t in range(100, 120):  # its "output"
        first.append(t)
    d.release(first)
    second = _seq([9, 9, 3, 4, 100, 101, 102])
    d.start(second)
    tree = d.propose([second], [DraftRequest()])[0]
    assert tree.tokens[1:4].tolist() == [103, 104, 105]
    no_global = SuffixDrafter(use_global=False)
    no_global.start(second)
    assert len(no_global.propose([second], [DraftRequest()])[0]) == 1


def test_state_grows_linearly_not_quadratically():
    d = SuffixDrafter(use_global=False)
    g = torch.Generator().manual_seed(0)
    small = _seq(torch.randint(0, 1000, (1000,), generator=g).tolist())
    big = _seq(torch.randint(0, 1000, (4000,), generator=g).tolist())
    d.start(small)
    d.start(big)
    assert d.state_bytes(big) < 6 * d.state_bytes(small)


def test_never_drafts_past_the_end_of_an_earlier_output():
    d = SuffixDrafter()
    first = _seq([1, 2, 3], max_new=4)
    d.start(first)
    for t in (50, 51, 52):
        first.append(t)
    d.release(first)
    second = _seq([7, 50, 51, 52])  # matches the whole earlier output, whose continuation is its end marker
    d.start(second)
    tree = d.propose([second], [DraftRequest()])[0]
    assert (tree.tokens >= 0).all()


def test_scores_follow_how_reliable_each_match_length_was_in_this_text():
    """A period-50 text repeated: every long match was right, so the tree's first nodes score near 1; a random
    stream over 4 symbols: short matches are right about a quarter of the time, so their scores stay low."""
    g = torch.Generator().manual_seed(0)
    block = torch.randint(100, 200, (50,), generator=g).tolist()
    periodic = _seq(block * 4 + block[:12])
    noisy = _seq(torch.randint(0, 4, (400,), generator=g).tolist())
    d = SuffixDrafter(use_global=False)
    d.start(periodic)
    d.start(noisy)
    sure, unsure = periodic.drafter_state.reliability, noisy.drafter_state.reliability
    assert sure(30) > 0.95 and unsure(2) < 0.5
    t_sure, t_unsure = d.propose([periodic, noisy], [DraftRequest()] * 2)
    assert t_sure.tokens[1:4].tolist() == block[12:15] and t_sure.scores[3] > 0.8
    assert max(t_unsure.scores[1:]) < 0.6


def test_build_drafter_can_turn_the_global_index_off():
    from spyglass.drafters import build_drafter

    assert build_drafter("suffix", None).global_index is not None  # on by default: what a replica serves
    assert build_drafter("suffix", None, suffix_global=False).global_index is None
