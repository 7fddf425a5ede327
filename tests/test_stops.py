"""Exact stops under speculation and incremental detokenisation.

A stop string, EOS or max_new_tokens ends the output at exactly the token where plain decoding ends it, even
when that token sits inside a run of accepted drafted tokens: what comes after it is never part of the output,
never streamed, never counted. The text streams out through a per-sequence incremental decoder whose pieces add
up to the whole output decoded at once, at a cost linear in the output's length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from spyglass.detokenize import REPLACEMENT, IncrementalDecoder, TextStream
from spyglass.engine import EngineConfig, RequestError, SpecEngine, plain_generate
from spyglass.models.llama import load_transformer
from spyglass.sampling import SamplingParams
from tests.test_engine_identity import drafters
from tests.tiny import free_tokens_curve, make_prompts, make_tiny_model, make_tiny_tokenizer

MAX_NEW = 40
# The case: one sentence repeated, a stop phrase inside it; suffix/n-gram drafting copies whole sentences.
SENTENCE = "The quick brown fox jumps over the lazy dog."
REPEAT_PROMPT = "Repeat this sentence exactly, six times:\n" + " ".join([SENTENCE] * 6)
# Characters of several UTF-8 lengths, some split over byte-level tokens by SmolLM2's tokenizer.
MULTIBYTE = "Hello 😀 world 中文字符 naïve 🇫🇷 ok\n日本語のテキスト 🎉🎉 ✓ Ω"


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_transformer(tiny_dir["llama"])


@pytest.fixture(scope="module")
def tiny_tok():
    return make_tiny_tokenizer()


class CountingTokenizer:
    """The real tokenizer, counting the token ids that decode calls are given (the detokenisation work)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def run_events(engine: SpecEngine, prompts, params) -> tuple[list, dict[str, list]]:
    """Run requests to completion, keeping each sequence's events."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    events = {s.seq_id: [] for s in seqs}
    while engine.has_work:
        for ev in engine.step():
            events[ev.seq.seq_id].append(ev)
    return seqs, events


def round_tokens(events: list, i: int) -> int:
    """Tokens event i's verify round appended (the first event also carries the prefill's token)."""
    ev = events[i]
    return len(ev.new_tokens) - (1 if i == 0 else 0)


def inside_runs(events: list) -> list[int]:
    """Output positions of tokens that an accepted run carried with more of its tokens after them."""
    pos, inside = 0, []
    for i, ev in enumerate(events):
        if ev.batch_size:
            run = min(round_tokens(events, i), ev.accepted + 1)
            inside.extend(range(pos + len(ev.new_tokens) - run, pos + len(ev.new_tokens) - 1))
        pos += len(ev.new_tokens)
    return inside


def cut_inside_run(events: list) -> bool:
    """The last round accepted more tokens than the output kept (the end fell inside its run)."""
    last = len(events) - 1
    return bool(events[last].batch_size) and round_tokens(events, last) < events[last].accepted + 1


def plain_stop(tokenizer, ids: list[int], stop: str) -> int | None:
    """Plain decoding's rule on a known output: how many tokens it keeps (up to the first token whose text makes the
    decoded output contain `stop`), None if it never does."""
    for i in range(len(ids)):
        if stop in tokenizer.decode(ids[: i + 1], skip_special_tokens=True):
            return i + 1
    return None


def stop_completed_by(tokenizer, ids: list[int], k: int) -> str | None:
    """A stop string that token k completes and no earlier token does, spanning tokens: the shortest text ending at
    token k's first character, beginning in an earlier token, that the text before token k does not contain."""
    before = tokenizer.decode(ids[:k], skip_special_tokens=True)
    upto = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
    if not before or before.endswith(REPLACEMENT) or not upto.startswith(before) or len(upto) == len(before):
        return None
    end = len(before) + 1
    for n in range(2, end + 1):
        stop = upto[end - n : end]
        if REPLACEMENT in stop:
            return None
        if stop not in before:
            return stop
    return None


def check_stream(engine: SpecEngine, seq, events: list) -> None:
    """What streamed is the output: its tokens once each, and text adding up to the engine's (cut) text."""
    assert [t for ev in events for t in ev.new_tokens] == seq.output_ids
    assert "".join(ev.text for ev in events) == engine.text(seq)
    assert sum(seq.stats.new_tokens_per_step) + 1 == seq.num_generated  # counted: the kept tokens only
    # the events carry what the step verified, as the sequence's stats recorded it
    assert [ev.batch_size for ev in events if ev.batch_size] == seq.stats.batch_sizes
    assert sum(ev.drafted for ev in events) == seq.stats.drafted_nodes
    assert sum(ev.accepted for ev in events) == sum(seq.stats.depth_hits)


# --- every drafter: stops, EOS and max_new_tokens inside accepted runs ---------------------------------------------
def test_every_drafter_stops_where_plain_decoding_does(llama, tiny_tok):
    prompts = make_prompts(llama.args.vocab_size, 6, seed=5)
    base = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    refs = [plain_generate(llama, p, base) for p in prompts]
    eos_before = llama.args.eos_token_ids
    cut = {"stop": [], "length": [], "eos": []}  # drafters whose output ended inside an accepted run
    config = EngineConfig(max_batch=4, max_context=512, controller=free_tokens_curve())
    names = []
    for name, drafter in drafters(llama):
        names.append(name)
        # the runs this drafter's greedy output is accepted in (its output without stops is plain decoding's)
        seqs, events = run_events(SpecEngine(llama, drafter, config, tiny_tok), prompts, base)
        assert [s.output_ids for s in seqs] == refs, name
        cases, eos_case = [], None
        for p, ref, seq in zip(prompts, refs, seqs, strict=True):
            inside = inside_runs(events[seq.seq_id])
            for k in inside:
                stop = stop_completed_by(tiny_tok, ref, k)
                if stop is not None:
                    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop=("never there", stop))
                    assert plain_stop(tiny_tok, ref, stop) == k + 1
                    cases.append(("stop", p, params, ref[: k + 1]))
                    break
            if inside:
                k = inside[len(inside) // 2]
                cases.append(("length", p, SamplingParams(max_new_tokens=k + 1, ignore_eos=True), ref[: k + 1]))
            firsts = [k for k in inside if ref[k] not in ref[:k] and ref[k] not in eos_before]
            if eos_case is None and firsts:
                eos_case = (p, ref[firsts[0]], ref[: firsts[0] + 1])
        assert cases, f"{name}: no accepted run to stop inside"
        engine = SpecEngine(llama, drafter, config, tiny_tok)
        seqs, events = run_events(engine, [c[1] for c in cases], [c[2] for c in cases])
        for (kind, p, params, expected), seq in zip(cases, seqs, strict=True):
            assert seq.output_ids == expected, f"{name}: {kind} {params.stop} ends the output elsewhere"
            assert plain_generate(llama, p, params, tiny_tok) == expected
            assert seq.finish_reason == ("stop" if kind == "stop" else "length")
            check_stream(engine, seq, events[seq.seq_id])
            if cut_inside_run(events[seq.seq_id]):
                cut[kind].append(name)
        if eos_case is not None:  # that token made the EOS: plain decoding and the engine end at its first occurrence
            p, eos, expected = eos_case
            llama.args = dataclasses.replace(llama.args, eos_token_ids=(eos,))
            try:
                eos_engine = SpecEngine(llama, drafter, config, tiny_tok)
                params = SamplingParams(max_new_tokens=MAX_NEW)
                (seq,), ev = run_events(eos_engine, [p], params)
                assert plain_generate(llama, p, params) == expected == seq.output_ids, f"{name}: EOS"
                assert seq.finish_reason == "stop"
                check_stream(eos_engine, seq, ev[seq.seq_id])
                if cut_inside_run(ev[seq.seq_id]):
                    cut["eos"].append(name)
            finally:
                llama.args = dataclasses.replace(llama.args, eos_token_ids=eos_before)
    assert set(cut["stop"]) == set(names), f"no stop fell inside an accepted run: {set(names) - set(cut['stop'])}"
    assert set(cut["length"]) == set(names)
    assert len(cut["eos"]) >= len(names) // 2, cut["eos"]


def test_a_stop_string_needs_a_tokenizer(llama):
    engine = SpecEngine(llama, None, EngineConfig(max_batch=1, max_context=64, controller=free_tokens_curve()))
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, stop=("x",)))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        plain_generate(llama, [5, 6, 7], SamplingParams(max_new_tokens=4, stop=("x",)))
    assert not engine.has_work


# --- the real model: the repeated sentence --------------------------------------------------------------
@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_repeated_sentence_stops_inside_the_copied_run(smollm2, method, capsys):
    """`spyglass generate --method suffix --stop "lazy dog" --compare-ar`: the drafter copies the sentence in long
    accepted runs and the stop phrase falls inside one; the output still ends at plain decoding's token, the CLI's
    comparison with plain decoding holds on token ids, and the streamed text is the cut text."""
    from cli.main import _generate_once
    from services.verifier import encode_prompt
    from spyglass.drafters import build_drafter

    model, tok = smollm2
    ids = encode_prompt(tok, REPEAT_PROMPT, raw=False)
    params = SamplingParams(max_new_tokens=64, stop=("lazy dog",))
    expected = plain_generate(model, ids, params, tok)
    text = tok.decode(expected, skip_special_tokens=True)
    assert text.endswith("lazy dog") or "lazy dog" in text[-12:], text  # the model copies the sentence
    assert "lazy dog" not in tok.decode(expected[:-1], skip_special_tokens=True)
    config = EngineConfig(max_batch=1, max_context=1024, controller=free_tokens_curve())
    engine = SpecEngine(model, build_drafter(method, model, max_batch=1, max_context=1024), config, tok)
    (seq,), events = run_events(engine, [ids], params)
    assert seq.output_ids == expected and seq.finish_reason == "stop"
    check_stream(engine, seq, events[seq.seq_id])
    assert cut_inside_run(events[seq.seq_id]), "the stop did not fall inside an accepted run"
    assert engine.text(seq) == text[: text.index("lazy dog")]
    # the CLI's path: streamed text, token ids, and the comparison with plain decoding
    capsys.readouterr()
    spec = _generate_once(SpecEngine(model, engine.drafter, config, tok), ids, params, stream=True)
    ar = _generate_once(SpecEngine(model, None, config, tok), ids, params, stream=False)
    assert spec["token_ids"] == ar["token_ids"] == expected
    assert capsys.readouterr().out == spec["text"] + "\n" and spec["text"] == ar["text"] == engine.text(seq)


# --- the incremental decoder with SmolLM2's tokenizer ---------------------------------------------------------
def test_incremental_decoding_across_split_characters(smollm2):
    _, tok = smollm2
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    ids = ids[:5] + [im_start] + ids[5:12] + [im_end] + ids[12:] + [im_end]
    # the case at hand: characters whose bytes are split over tokens decode to U+FFFD a token at a time
    assert sum(REPLACEMENT in tok.decode([t]) for t in ids) >= 6
    whole = tok.decode(ids, skip_special_tokens=True)
    assert REPLACEMENT not in whole and "<|im_end|>" not in whole
    rng = random.Random(0)
    for sizes in ([1] * len(ids), [rng.randint(1, 4) for _ in ids]):
        dec = IncrementalDecoder(tok)
        pieces, at = [], 0
        for n in sizes:
            if at < len(ids):
                pieces.append(dec.add(ids[at : at + n]))
                at += n
        pieces.append(dec.flush())
        assert all(REPLACEMENT not in p for p in pieces), pieces  # incomplete characters were held back
        assert "".join(pieces) == whole
    # an output that ends inside a character: the end shows what decoding it at once shows
    emoji = tok.encode("ok 😀", add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    shown = dec.add(emoji[:-1])
    assert REPLACEMENT not in shown and dec.add([]) == ""
    assert shown + dec.flush() == tok.decode(emoji[:-1]) and tok.decode(emoji[:-1]).endswith(REPLACEMENT)


def test_stop_strings_split_over_tokens_and_characters(smollm2):
    _, tok = smollm2
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    whole = tok.decode(ids)
    # a stop inside one multi-token character run ("文字" is two 3-byte characters), one across a character split
    # over tokens ("😀 w"), one over a word boundary, and one that never occurs
    for stops in (("文字",), ("😀 w",), ("naïve 🇫", "zzz"), ("lo 😀 world 中文字符 n",), ("never",)):
        expected = min(plain_stop(tok, ids, s) or len(ids) + 1 for s in stops)
        stream = TextStream(tok, stops)
        released, kept = [], len(ids)
        for i, t in enumerate(ids):
            stopped = stream.add([t])
            released.append(stream.release())
            if stopped:
                kept = i + 1
                break
        released.append(stream.release(final=True))
        cuts = [whole.find(s) for s in stops if s in whole]
        assert kept == min(expected, len(ids)), stops
        assert "".join(released) == (whole[: min(cuts)] if cuts else whole)
        assert all(not any(s in "".join(released[: j + 1]) for s in stops) for j in range(len(released)))


def test_decoding_work_is_linear_in_the_output(smollm2):
    _, tok = smollm2
    ids = (tok.encode(MULTIBYTE * 200, add_special_tokens=False) * 4)[:4096]
    for step in (1, 3):
        counting = CountingTokenizer(tok)
        stream = TextStream(counting, ("never there",))
        text = []
        for at in range(0, len(ids), step):
            stream.add(ids[at : at + step])
            text.append(stream.release())
        text.append(stream.release(final=True))
        assert "".join(text) == tok.decode(ids)
        assert counting.decoded == stream.decoder.decoded_tokens <= 5 * len(ids), counting.decoded


# --- the verifier's stream ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("long") / "llama", "llama", seed=0, max_position=8192)
    return load_transformer(path)


def test_streaming_4096_tokens_decodes_linearly(long_tiny, tiny_tok):
    """The verifier streams each step's text from the engine's incremental decoder: decoding a 4,096-token output
    takes a few decodes of each token in all (re-decoding the whole output per chunk took ~n^2 / 2)."""
    from services.verifier import EngineLoop, VerifierConfig
    from spyglass.drafters.suffix import SuffixDrafter

    n = 4096
    tok = CountingTokenizer(tiny_tok)
    cfg = VerifierConfig(
        methods=["suffix"], max_batch=1, max_context=n + 256, max_new_tokens_limit=n, threads=1, stream_interval_s=0
    )  # a chunk per step
    econf = EngineConfig(max_batch=1, max_context=n + 256, controller=free_tokens_curve())
    engine = SpecEngine(long_tiny, config=econf, tokenizer=tok, drafters={"suffix": SuffixDrafter()})
    loop = EngineLoop(engine, tok, cfg)
    prompt = make_prompts(long_tiny.args.vocab_size, 2, seed=3)[1]
    req = {"prompt_token_ids": prompt, "max_new_tokens": n, "ignore_eos": True, "stop": ["~~"]}  # '~' is no token

    async def run():
        return [item async for item in loop.generate(req)]

    try:
        items = asyncio.run(run())
    finally:
        loop.stop(drain_timeout_s=1.0)
    final = items[-1]
    assert final["final"] and final["finish_reason"] == "length" and len(final["output_ids"]) == n
    assert [t for item in items for t in item["token_ids"]] == final["output_ids"]
    assert (
        "".join(item["text"] for item in items)
        == final["full_text"]
        == tiny_tok.decode(final["output_ids"], skip_special_tokens=True)
    )
    assert len(items) > 100  # it streamed step by step
    assert tok.decoded <= 5 * n, tok.decoded  # the final text's one whole decode included
