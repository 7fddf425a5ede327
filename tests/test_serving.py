"""The serving stack end to end: a real local Ray cluster running Serve (gateway + one verifier replica with
the real SmolLM2), real gRPC on 127.0.0.1 through the SDK, and a real redis-server for the context cache.

The app is deployed once for the module; each test leaves the verifier idle (all KV slots free).
Generation lengths stay small: these tests check behaviour, bench/serving.py measures speed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from services.gateway import Admission, GatewayConfig, QueueFull, affinity_key, route
from spyglass.client import AsyncClient, Client, SpyglassError
from spyglass.engine import plain_generate
from spyglass.models.linear import parse_backend
from spyglass.models.llama import PREFILL_CHUNK
from spyglass.models.loader import resolve_model_dtype
from spyglass.sampling import SamplingParams

MAX_CONTEXT = 2048
GATEWAY_MAX_QUEUED = 2
MAX_BATCH = 4
# the first is the default; every drafter family is served here (dflash-dels-span is dflash-dels plus the spans of
# its copy head)
SERVED_METHODS = ["ngram", "ar", "suffix", "longspec", "longspec-span", "longspec-cape", "glide", "composite"]
SERVED_METHODS += ["dflash-dels-span", "composite-dflash", "tokenswift", "streaming"]
PROMPTS = [
    "List the days of the week, one per line.",
    "Count from one to twenty in words, separated by commas.",
    "Write the alphabet in capital letters separated by spaces.",
    "Name the planets of the solar system in order from the Sun.",
]


# --- pure parts (no cluster) --------------------------------------------------------------------------------
def test_client_imports_without_torch():
    code = "import sys, spyglass.client; assert 'torch' not in sys.modules, 'torch was imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_route_is_deterministic_with_affinity_and_falls_back_when_full():
    loads = [0, 0, 0, 0]
    key = affinity_key({"context_id": "repo-42"}, GatewayConfig())
    first = route(key, loads, capacity=4)
    assert all(route(key, loads, capacity=4) == first for _ in range(5))
    # different contexts spread over replicas
    picks = {route(affinity_key({"context_id": f"c{i}"}, GatewayConfig()), loads, 4) for i in range(32)}
    assert len(picks) > 1
    # the preferred replica is full -> another one; all full -> least loaded
    full = list(loads)
    full[first] = 4
    assert route(key, full, capacity=4) != first
    assert route(key, [5, 4, 6, 7], capacity=4) == 1
    # no useful context -> least loaded
    assert affinity_key({"prompt": "short"}, GatewayConfig()) == ""
    assert route("", [3, 1, 2], capacity=4) == 1
    # the same long prompt prefix -> the same key, whatever the tail
    long = "x" * 3000
    cfg = GatewayConfig(affinity_prefix_chars=2048)
    assert affinity_key({"prompt": long + "a"}, cfg) == affinity_key({"prompt": long + "b"}, cfg) != ""


def test_admission_releases_waves_and_rejects_when_full():
    async def main():
        adm = Admission(1, capacity=2, max_queued=2, wait_s=0.01)
        got = []

        async def req(k):
            await adm.acquire(0)
            got.append(k)

        tasks = [asyncio.create_task(req(k)) for k in range(4)]
        await asyncio.sleep(0.05)
        assert sorted(got) == [0, 1] and adm.in_flight == [2] and adm.queue_depth == 2
        with pytest.raises(QueueFull):
            await adm.acquire(0)
        assert adm.rejected == 1
        adm.release(0)
        adm.release(0)
        await asyncio.sleep(0.05)
        assert sorted(got) == [0, 1, 2, 3] and adm.in_flight == [2] and adm.queue_depth == 0
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_engine_loop_graceful_shutdown_finishes_short_and_aborts_long_requests():
    """The verifier core without Ray: stop() lets live sequences finish for a while, then aborts the rest."""
    import threading

    from services.verifier import EngineLoop, VerifierConfig, build_engine

    # plain decoding (no cost curve to time) at the served stack's capacity (its prefill cost timed once per run)
    cfg = VerifierConfig(methods=["ar"], max_batch=2, max_context=MAX_CONTEXT, threads=1)
    engine, tok, _ = build_engine(cfg)
    loop = EngineLoop(engine, tok, cfg, name="t")
    stopper = threading.Thread(target=loop.stop, kwargs={"drain_timeout_s": 8.0})

    async def run(rid: str, n: int, out: list):
        async for item in loop.generate(
            {"request_id": rid, "prompt": PROMPTS[0], "max_new_tokens": n, "ignore_eos": True}
        ):
            out.append(item)
            if rid == "long" and len(out) == 2:
                stopper.start()

    async def main():
        short, long = [], []
        await asyncio.gather(run("short", 8, short), run("long", MAX_CONTEXT - 200, long))  # cannot finish in the drain
        return short, long

    short, long = asyncio.run(main())
    stopper.join(timeout=60)
    assert short[-1]["final"] and short[-1]["finish_reason"] == "length"
    assert long[-1]["final"] and long[-1]["finish_reason"] == "abort"
    assert not loop._thread.is_alive() and engine.cache.free_slots == 2

    async def after():
        return [item async for item in loop.generate({"prompt": "hi", "max_new_tokens": 4})]

    assert asyncio.run(after())[0]["error"] == "unavailable"


def test_a_stream_sends_its_tokens_at_most_once_per_interval_and_loses_none():
    """`stream_interval_s`: the first chunk goes at once, the tokens of the steps after it wait for the interval to
    pass (here longer than the request: all of them in one chunk, sent before the final item); with 0 every step
    sends its own. A request's own interval wins over the replica's. Either way the tokens and text are plain
    decoding's, in order."""
    from services.verifier import ERR_INVALID, EngineLoop, VerifierConfig, build_engine

    n = 12
    cfg = VerifierConfig(methods=["ar"], max_batch=1, max_context=1024, threads=1)
    engine, tok, _ = build_engine(cfg)
    expected = plain_generate(engine.target, tok.encode(PROMPTS[0]), SamplingParams(max_new_tokens=n, ignore_eos=True))
    loop = EngineLoop(engine, tok, cfg, name="t")

    async def stream(replica: float, request: float | None) -> list[dict]:
        loop.cfg.stream_interval_s = replica
        req = {"prompt": PROMPTS[0], "raw": True, "max_new_tokens": n, "ignore_eos": True}
        if request is not None:
            req["stream_interval_s"] = request
        return [item async for item in loop.generate(req)]

    try:
        # (the replica's interval, the request's, the chunks before the final item: None = one per decoding step)
        for replica, request, chunks in ((3600.0, None, 2), (0.0, None, None), (0.0, 3600.0, 2), (3600.0, 0.0, None)):
            items = asyncio.run(stream(replica, request))
            assert items[-1]["final"] and not any(i.get("final") for i in items[:-1])
            assert len(items) - 1 == (chunks or items[-1]["stats"]["steps"]) and items[-1]["stats"]["steps"] > 2
            assert [t for i in items for t in i["token_ids"]] == items[-1]["output_ids"] == expected
            assert "".join(i["text"] for i in items) == items[-1]["full_text"]
        (item,) = asyncio.run(stream(0.0, -1.0))  # a bad request's interval: its error, nothing queued
        assert item["error"] == ERR_INVALID and "stream_interval_s must be" in item["message"] and not loop.live
    finally:
        loop.stop(drain_timeout_s=1.0)
    for bad in (-0.1, float("inf"), float("nan"), True, "0.05"):
        with pytest.raises(ValueError, match="stream_interval_s"):
            VerifierConfig.from_dict({"stream_interval_s": bad})


def test_a_failed_step_sends_the_tokens_held_for_the_interval_before_its_error():
    """An engine step that raises ends every live request with an `internal` error; the tokens a stream made before
    it and held for `stream_interval_s` reach the client first (they are plain decoding's), and the slot is freed."""
    from services.verifier import EngineLoop, VerifierConfig, build_engine

    n, fail_at = 12, 7  # the step that raises: after the first chunk went and a few steps' tokens were held
    cfg = VerifierConfig(methods=["ar"], max_batch=1, max_context=1024, threads=1, stream_interval_s=3600.0)
    engine, tok, _ = build_engine(cfg)
    expected = plain_generate(engine.target, tok.encode(PROMPTS[0]), SamplingParams(max_new_tokens=n, ignore_eos=True))
    step, made = engine.step, []

    def failing_step():
        if len(made) == fail_at:
            made.append([len(s.output_ids) for s in engine.running])
            raise RuntimeError("injected step failure")
        made.append(None)
        return step()

    engine.step = failing_step
    loop = EngineLoop(engine, tok, cfg, name="t")

    async def stream() -> list[dict]:
        req = {"prompt": PROMPTS[0], "raw": True, "max_new_tokens": n, "ignore_eos": True}
        return [item async for item in loop.generate(req)]

    try:
        items = asyncio.run(stream())
        assert items[-1]["error"] == "internal" and "injected step failure" in items[-1]["message"]
        chunks = items[:-1]
        assert len(chunks) == 2  # the first chunk at once, then those held until the failure
        tokens = [t for c in chunks for t in c["token_ids"]]
        assert [len(tokens)] == made[-1] and 1 < len(tokens) < n
        assert tokens == expected[: len(tokens)]
        assert not loop.live and not engine.running and not engine.waiting
    finally:
        loop.stop(drain_timeout_s=1.0)


def test_the_replica_times_its_cost_curve_with_the_threads_it_decodes_with():
    """Ray starts a replica with OMP_NUM_THREADS = its num_cpus (often 1) and the verifier decodes with `threads`:
    the cost curve that sizes every tree is timed at construction, so it must be timed with `threads` too. The
    replica's info reports that curve and the controller's constants."""
    from dataclasses import asdict

    import torch

    from services.verifier import Verifier
    from spyglass.controller import ControllerConfig
    from spyglass.cost import measured_curve

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # what Ray leaves a 1-CPU replica with
    try:
        config = {"methods": ["ngram"], "max_batch": 1, "max_context": 256, "threads": 2, "warmup_prompt_tokens": 0}
        verifier = Verifier.func_or_class(config)  # the deployment's class, built in process
        try:
            engine = verifier.loop.engine
            assert torch.get_num_threads() == 1  # the engine was built on the loop's thread, at its count
            torch.set_num_threads(2)  # so the curve it uses is the one measured with 2 threads
            assert engine.controller.curve is measured_curve(engine.target, engine.cache)
            info = asyncio.run(verifier.info())
            assert info["cost_curve"] == engine.controller.curve.to_dict()
            assert info["controller_config"] == asdict(ControllerConfig()) == asdict(engine.controller.config)
            assert info["controller_config"]["max_backoff"] == 64
        finally:
            verifier.loop.stop(drain_timeout_s=1.0)
    finally:
        torch.set_num_threads(before)


def test_engine_loop_builds_its_engine_on_its_own_thread_and_raises_what_setup_raised():
    """Every torch computation of a replica runs on the loop's thread (a second OpenMP team in the process slowed
    each decode step by 10-15%); a setup that fails fails the constructor with its own error; a final-only request
    gets one item with the whole output."""
    import threading

    from services.verifier import EngineLoop, VerifierConfig, build_engine

    cfg = VerifierConfig(methods=["ngram"], max_batch=1, max_context=1024, threads=1)
    ran_on = []

    def setup():
        ran_on.append(threading.current_thread())
        engine, tok, _ = build_engine(cfg)
        return engine, tok

    loop = EngineLoop(None, None, cfg, name="t", setup=setup)
    try:
        assert ran_on == [loop._thread] and loop.methods == ["ngram"] and loop.health()["alive"]
        streamed = asyncio.run(_collect(loop, {"prompt": PROMPTS[0], "max_new_tokens": 6}))
        assert streamed[-1]["final"] and streamed[-1]["finish_reason"] == "length" and len(streamed) > 2
        # a unary request (GenerateOnce) gets the final item alone, carrying the whole output
        (only,) = asyncio.run(_collect(loop, {"prompt": PROMPTS[0], "max_new_tokens": 6, "final_only": True}))
        assert only["final"] and only["output_ids"] == [t for item in streamed for t in item["token_ids"]]
        assert only["full_text"] == streamed[-1]["full_text"] and only["text"] == only["full_text"]
    finally:
        loop.stop(drain_timeout_s=1.0)

    def broken():
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="no such model"):
        EngineLoop(None, None, cfg, name="broken", setup=broken)
    with pytest.raises(ValueError, match="either an engine or a setup"):
        EngineLoop(None, None, cfg)


def test_a_replicas_drafters_share_the_targets_weights_and_load_each_draft_checkpoint_once():
    """build_engine: every learned draft reads the target's embedding and LM head in place (no copy), and the
    methods on one draft checkpoint (the longspec variants and the composite on one, the dflash variants and the
    composite on them) share one loaded copy of it, so a replica's memory barely grows with the methods it serves
    (bench/serving.py replica_rss_all_methods_vs_one). Each method still decodes exactly as plain decoding."""
    import torch

    from services.verifier import VerifierConfig, build_engine, encode_prompt

    methods = ["longspec", "longspec-span", "composite-span", "glide", "dflash", "dflash-dels-span", "composite-dflash"]
    engine, tok, _ = build_engine(VerifierConfig(methods=methods, max_batch=2, max_context=1024, threads=1))
    target, d = engine.target, engine.drafters
    longspec = d["longspec"].draft
    assert d["longspec-span"].draft is longspec and d["composite-span"].parts[1].draft is longspec
    assert d["glide"].draft is not longspec  # another checkpoint
    for draft in (longspec, d["glide"].draft):
        assert draft.embed.weight.data_ptr() == target.embed.weight.data_ptr()
        assert draft.full_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    dflash, dels = d["dflash"].draft, d["dflash-dels-span"].local
    assert d["dflash-dels-span"].draft is dflash and d["composite-dflash"].parts[1].draft is dflash
    assert d["composite-dflash"].parts[1].local is dels and dels is not None
    assert dflash.embed is target.embed and dflash.lm_head is target.lm_head
    ids = encode_prompt(tok, PROMPTS[1], raw=False)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reference = plain_generate(target, ids, params)
    with torch.inference_mode():
        for m in methods:
            (seq,) = engine.run([ids], params, method=m)
            assert seq.output_ids == reference, m


def test_a_pinned_linear_backend_is_the_replicas_and_a_bad_one_fails_the_build():
    """`linear_backend` in the verifier config pins the target's kernels (another replica's reported backend makes
    this one round alike); an unknown one fails the build naming the choices."""
    from services.verifier import VerifierConfig, build_engine

    cfg = {"methods": ["ngram"], "max_batch": 1, "max_context": 256, "threads": 1}
    engine, _, info = build_engine(VerifierConfig(**cfg, linear_backend="rows"))
    assert info["linear_backend"] == engine.target.linear_backend == "rows" and engine.target.prefill_row_invariant
    with pytest.raises(ValueError, match="unknown linear backend 'fastest'.*choose 'auto'"):
        build_engine(VerifierConfig(**cfg, linear_backend="fastest"))


async def _collect(loop, req: dict) -> list[dict]:
    return [item async for item in loop.generate(req)]


# --- the deployed stack ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(client):
    """The embedded model as the replica serves it, and its tokenizer: the in-process references. Its dtype is what
    the replica's "auto" resolved to, and its matmul kernels the ones the replica measured fastest
    (ModelInfo.linear_backend): two kernels may round a near tie apart, and plain decoding on other kernels than the
    replica's may then pick the other token."""
    import torch

    from spyglass.models.llama import load_transformer
    from spyglass.models.loader import load_tokenizer, resolve_model

    info = client.model_info()
    resolved = resolve_model(None, dtype=info["dtype"])
    dtype = getattr(torch, info["dtype"])
    model = load_transformer(resolved.path, dtype=dtype, linear_backend=info["linear_backend"])
    assert model.linear_backend == info["linear_backend"]
    return model, load_tokenizer(resolved.path)


@pytest.fixture(scope="module")
def stack(ray_cluster, redis_server):
    from ray import serve

    from services.app import deploy, wait_ready
    from services.local_redis import free_port

    args = {
        "num_verifiers": 1,
        "redis_url": redis_server.url,
        "gateway": {"max_queued": GATEWAY_MAX_QUEUED},
        "verifier": {
            "methods": SERVED_METHODS,
            "max_batch": MAX_BATCH,
            "max_context": MAX_CONTEXT,
            "threads": 1,
            "max_new_tokens_limit": 512,
            "cache_block_size": 64,
            "warmup_prompt_tokens": 96,  # the warm-up itself is tested in test_warmup.py and test_first_run.py
        },
    }
    doc = {"applications": [{"name": "spyglass", "route_prefix": "/", "args": args}]}
    try:  # a failed start must not leave Serve (and its proxy's port) behind for the next module
        address, http = deploy(doc, grpc_port=free_port(), http_port=free_port())
        wait_ready(address, timeout_s=180)
        yield address, http
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def grpc_address(stack):
    return stack[0]


@pytest.fixture(scope="module")
def client(grpc_address):
    with Client(grpc_address, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def reference(served):
    """In-process references: the same engine configuration as the verifier, and plain decoding."""
    from services.verifier import encode_prompt
    from spyglass.drafters import build_drafter
    from spyglass.engine import EngineConfig, SpecEngine, plain_generate
    from spyglass.sampling import SamplingParams

    model, tok = served

    def ids(text: str) -> list[int]:
        return encode_prompt(tok, text, raw=False)

    def engine(text: str, n: int) -> list[int]:
        eng = SpecEngine(model, build_drafter("ngram", model, max_batch=1), EngineConfig(1, MAX_CONTEXT), tok)
        (seq,) = eng.run([ids(text)], SamplingParams(max_new_tokens=n))
        return seq.output_ids

    def plain(text: str, n: int, ignore_eos: bool = False) -> list[int]:
        return plain_generate(model, ids(text), SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos))

    return {"ids": ids, "engine": engine, "plain": plain, "tokenizer": tok}


def wait_idle(client: Client, timeout_s: float = 60.0) -> dict:
    """Poll Health until no sequence is live and every KV slot is back in the pool."""
    t0 = time.monotonic()
    while True:
        rep = client.health()["replicas"][0]
        if rep["live_sequences"] == 0 and rep["free_kv_slots"] == rep["total_kv_slots"]:
            return rep
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"verifier not idle after {timeout_s} s: {rep}")
        time.sleep(0.2)


def test_health_and_model_info(client):
    info = client.model_info()
    assert info["model"].startswith("SmolLM2")
    assert info["context_length"] == MAX_CONTEXT
    assert info["methods"] == SERVED_METHODS and info["default_method"] == "ngram"
    assert info["num_verifiers"] == 1 and info["max_batch"] == MAX_BATCH and info["context_cache"]
    assert info["device"] == "cpu" and info["dtype"] == resolve_model_dtype(None)  # "auto", resolved here
    assert parse_backend(info["linear_backend"])  # the kernels the replica measured, as a backend string
    health = client.health()
    assert health["status"] == "ok"
    (rep,) = health["replicas"]
    assert rep["name"] == "verifier-0" and rep["total_kv_slots"] == MAX_BATCH  # one pool, whatever the methods


def test_stream_and_unary_equal_engine_and_plain_decoding(client, reference):
    text = PROMPTS[1]
    n = 20
    chunks = list(client.generate(text, max_new_tokens=n))
    final = chunks[-1]
    assert final.final and final.finish_reason in ("length", "stop") and not any(c.final for c in chunks[:-1])
    streamed = [t for c in chunks for t in c.token_ids]
    unary = client.generate_text(text, max_new_tokens=n)
    expected = reference["plain"](text, n)
    assert streamed == expected
    assert unary.token_ids == expected
    assert reference["engine"](text, n) == expected
    assert (
        "".join(c.text for c in chunks)
        == unary.text
        == reference["tokenizer"].decode(expected, skip_special_tokens=True)
    )
    s = final.stats
    assert s["generated_tokens"] == len(expected) and s["method"] == "ngram" and s["replica"] == "verifier-0"
    assert s["steps"] >= 1 and s["tau"] >= 1.0 and s["ttft_s"] > 0 and s["latency_s"] >= s["ttft_s"]
    assert len(s["acceptance_by_depth"]) >= 1
    # the plain-decoding method through the server gives the same tokens
    assert client.generate_text(text, max_new_tokens=n, method="ar").token_ids == expected
    counters = client.health()["replicas"][0]["counters"]
    assert counters["spec_decode_num_drafts_total"] > 0
    assert counters["spec_decode_num_draft_tokens_total"] >= counters["spec_decode_num_accepted_tokens_total"]


@pytest.mark.parametrize("method", [m for m in SERVED_METHODS if m not in ("ngram", "ar")])
def test_every_served_drafter_equals_plain_decoding(client, reference, method):
    """Each drafter colocated in the verifier replica (reading the same KVCache), chosen per request."""
    text = PROMPTS[1]
    n = 16
    out = client.generate_text(text, max_new_tokens=n, method=method)
    assert out.token_ids == reference["plain"](text, n)
    assert out.stats["method"] == method and out.stats["steps"] >= 1
    # the controller's decisions travel with the stats: every step either verified nodes or decoded plainly
    s = out.stats
    assert s.get("controller_proposed_nodes", 0) >= s.get("controller_verified_nodes", 0)
    assert s.get("controller_verified_nodes", 0) > 0 or s.get("controller_plain_steps", 0) > 0


def test_stop_string_inside_an_accepted_run_ends_the_stream_where_plain_decoding_does(client, served, reference):
    """A prompt that repeats a sentence: suffix drafting copies it in long accepted runs and the stop phrase falls
    inside one; the streamed token ids end at plain decoding's last token and the text at the stop."""
    from tests.test_stops import REPEAT_PROMPT

    model, tok = served
    stop = "lazy dog"
    params = SamplingParams(max_new_tokens=64, stop=(stop,))
    expected = plain_generate(model, reference["ids"](REPEAT_PROMPT), params, tok)
    assert stop in tok.decode(expected, skip_special_tokens=True)
    chunks = list(client.generate(REPEAT_PROMPT, max_new_tokens=64, stop=[stop], method="suffix"))
    final = chunks[-1]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert final.finish_reason == "stop" and final.stats["generated_tokens"] == len(expected)
    text = tok.decode(expected, skip_special_tokens=True)
    assert "".join(c.text for c in chunks) == text[: text.index(stop)]
    unary = client.generate_text(REPEAT_PROMPT, max_new_tokens=64, stop=[stop], method="suffix")
    assert unary.token_ids == expected and unary.text == text[: text.index(stop)]


def test_prometheus_metrics_are_exported(client, ray_cluster):
    import urllib.request

    client.generate_text(PROMPTS[1], max_new_tokens=12)
    port = ray_cluster._private.worker._global_node.metrics_export_port
    wanted = {
        "ray_spyglass_spec_decode_num_drafts_total",
        "ray_spyglass_spec_decode_num_draft_tokens_total",
        "ray_spyglass_spec_decode_num_accepted_tokens_total",
        "ray_spyglass_spec_decode_num_accepted_tokens_per_pos_total",
        "ray_spyglass_request_latency_seconds_bucket",
        "ray_spyglass_time_to_first_token_seconds_bucket",
        "ray_spyglass_queue_depth",
    }
    t0 = time.monotonic()
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        lines = [line for line in body.splitlines() if line.startswith("ray_spyglass_")]
        names = {line.split("{")[0].split(" ")[0] for line in lines}
        if wanted <= names:
            break
        assert time.monotonic() - t0 < 90, f"missing metrics: {sorted(wanted - names)}"
        time.sleep(2)
    per_pos = [line for line in lines if line.startswith("ray_spyglass_spec_decode_num_accepted_tokens_per_pos_total")]
    assert any('position="0"' in line for line in per_pos)


def test_four_concurrent_streams_share_verifier_batches(grpc_address, reference):
    n = 40  # long enough that all four overlap however late the last request's prefill starts on a busy machine

    async def one(c: AsyncClient, text: str):
        chunks = [ch async for ch in c.generate(text, max_new_tokens=n, ignore_eos=True)]
        return chunks

    async def main():
        async with AsyncClient(grpc_address, timeout=180) as c:
            return await asyncio.gather(*(one(c, t) for t in PROMPTS))

    results = asyncio.run(main())
    for text, chunks in zip(PROMPTS, results, strict=True):
        final = chunks[-1]
        assert final.final and final.stats["generated_tokens"] == n
        assert final.stats["mean_batch_size"] > 1.0, final.stats
        assert [t for c in chunks for t in c.token_ids] == reference["plain"](text, n, ignore_eos=True)
    assert max(c.batch_size for chunks in results for c in chunks) == MAX_BATCH


def test_four_methods_share_one_batch(grpc_address, reference):
    """Four concurrent requests with four different methods run in the replica's one engine: they share target
    forwards (batch size above 1) and each output equals plain decoding. 48 tokens: the requests arrive a step or
    two apart, and a well-drafted one finishes 16 tokens in about six steps."""
    n = 48
    methods = ["ar", "suffix", "longspec-span", "dflash-dels-span"]

    async def one(c: AsyncClient, text: str, method: str):
        return [ch async for ch in c.generate(text, max_new_tokens=n, ignore_eos=True, method=method)]

    async def main():
        async with AsyncClient(grpc_address, timeout=180) as c:
            return await asyncio.gather(*(one(c, t, m) for t, m in zip(PROMPTS, methods, strict=True)))

    results = asyncio.run(main())
    for text, method, chunks in zip(PROMPTS, methods, results, strict=True):
        final = chunks[-1]
        assert final.stats["method"] == method and final.stats["mean_batch_size"] > 1.0, final.stats
        assert [t for c in chunks for t in c.token_ids] == reference["plain"](text, n, ignore_eos=True), method
    assert max(c.batch_size for chunks in results for c in chunks) == len(methods)


@pytest.mark.parametrize("method", ["", "tokenswift"], ids=["default", "tokenswift"])  # tokenswift: a partial KV
def test_abort_frees_the_sequence(client, grpc_address, method):
    before = wait_idle(client)
    rid = uuid.uuid4().hex
    gen = client.generate(PROMPTS[0], max_new_tokens=400, ignore_eos=True, request_id=rid, method=method)
    first = next(gen)
    assert first.request_id == rid
    first = [first, next(gen)]  # tokens arrive step by step, not at the end
    assert all(c.token_ids and not c.final for c in first)
    live = client.health()["replicas"][0]
    assert live["live_sequences"] == 1 and live["free_kv_slots"] == live["total_kv_slots"] - 1
    with Client(grpc_address, timeout=30) as other:
        assert other.abort(rid) is True
    rest = list(gen)
    assert rest[-1].final and rest[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in [*first, *rest]) < 400
    after = wait_idle(client)
    assert after["aborted"] == before["aborted"] + 1
    assert client.abort(rid) is False  # nothing live under that id any more


def test_client_disconnect_frees_the_sequence(client):
    before = wait_idle(client)
    gen = client.generate(PROMPTS[2], max_new_tokens=400, ignore_eos=True)
    next(gen)
    next(gen)
    assert client.health()["replicas"][0]["live_sequences"] == 1
    gen.close()  # cancels the RPC: the client goes away mid-stream
    after = wait_idle(client)
    assert after["aborted"] == before["aborted"] + 1


def test_deadline_exceeded_frees_the_sequence(client):
    before = wait_idle(client)
    with pytest.raises(SpyglassError) as e:
        list(client.generate(PROMPTS[0], max_new_tokens=400, ignore_eos=True, timeout_s=1.0))
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "timeout" in e.value.details
    after = wait_idle(client)
    assert after["aborted"] == before["aborted"] + 1


def test_repeated_long_prompt_reuses_its_prefix_then_stores_it(client, served, redis_server):
    import time

    import redis

    from services.verifier import encode_prompt
    from spyglass.context_cache import ContextCache, kv_namespace
    from spyglass.demo import code_edit_task

    # a unique ~1K-token prompt so earlier runs cannot have cached it
    prompt = f"# run {uuid.uuid4().hex}\n" + code_edit_task(max_chars=3000).prompt
    first = client.generate_text(prompt, max_new_tokens=8)
    assert first.stats["cached_prefix_tokens"] == 0 and first.stats["prompt_tokens"] > 512
    # sent right after the first finished: the slot the first one released still holds the prompt's K/V and the
    # second takes it as it is: all but the last token where prefill chunks may have any size (row-invariant
    # prefill kernels), else whole prefill chunks (the rest computed in the chunks plain decoding computes)
    second = client.generate_text(prompt, max_new_tokens=8)
    grain = 1 if served[0].prefill_row_invariant else PREFILL_CHUNK
    cached = (second.stats["prompt_tokens"] - 1) // grain * grain
    assert second.stats["cached_prefix_tokens"] == cached >= 512
    assert second.token_ids == first.token_ids and second.text == first.text
    counters = client.health()["replicas"][0]["counters"]
    assert counters["cache_hit_tokens_total"] >= second.stats["cached_prefix_tokens"]
    # the prompt's second use (`cache_min_uses` 2): its full blocks are written to Redis, for other replicas
    info = client.model_info()
    cc = ContextCache(None, kv_namespace(info["model"], info["dtype"]), block_size=info["cache_block_size"])
    ids = encode_prompt(served[1], prompt, raw=False)
    keys = cc.block_keys(ids)
    assert len(ids) == second.stats["prompt_tokens"] and len(keys) >= 512 // cc.block_size
    store = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 60
    while store.exists(*keys) < len(keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.exists(*keys) == len(keys)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"prompt": "   "}, "prompt is empty"),
        ({"prompt": "hi", "top_p": 2.0}, "top_p"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "method": "telepathy"}, "unknown method"),
        ({"prompt": "hi", "max_new_tokens": 100000}, "max_new_tokens"),
        ({"prompt_token_ids": [1] * MAX_CONTEXT}, "context holds"),
        ({"prompt": "word " * 2 * MAX_CONTEXT}, "context holds"),
        ({"prompt_token_ids": [10**7]}, "token ids"),
    ],
)
def test_bad_input_is_invalid_argument(client, kwargs, needle):
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(SpyglassError) as e:
        client.generate_text(prompt, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details
    with pytest.raises(SpyglassError) as e:  # the streaming RPC reports the same
        list(client.generate(prompt, **kwargs))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details


def test_queue_full_is_resource_exhausted_and_queued_requests_can_be_aborted(grpc_address, client):
    wait_idle(client)
    rejected_before = client.health()["rejected"]
    ids = [f"hold-{k}-{uuid.uuid4().hex[:8]}" for k in range(MAX_BATCH + GATEWAY_MAX_QUEUED)]
    chunks: dict[str, list] = {rid: [] for rid in ids}

    async def hold(c: AsyncClient, k: int):
        async for ch in c.generate(PROMPTS[k % 4], max_new_tokens=400, ignore_eos=True, request_id=ids[k]):
            chunks[ids[k]].append(ch)

    async def main():
        async with AsyncClient(grpc_address, timeout=120) as c:
            tasks = [asyncio.create_task(hold(c, k)) for k in range(len(ids))]
            t0 = time.monotonic()
            while True:  # the verifier's slots are taken (4 streams running) and the gateway queue is full
                h = await c.health()
                running = [rid for rid in ids if chunks[rid]]
                if h["in_flight"] == MAX_BATCH and h["queue_depth"] == GATEWAY_MAX_QUEUED and len(running) == MAX_BATCH:
                    break
                assert time.monotonic() - t0 < 60, h
                await asyncio.sleep(0.1)
            with pytest.raises(SpyglassError) as e:
                await c.generate_text(PROMPTS[0], max_new_tokens=8)
            # a queued request is aborted before it ever reaches the verifier
            queued = [rid for rid in ids if not chunks[rid]]
            assert await c.abort(queued[0]) is True
            await asyncio.wait_for(tasks[ids.index(queued[0])], 30)
            assert (await c.health())["queue_depth"] == GATEWAY_MAX_QUEUED - 1
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return e.value, queued[0]

    err, aborted = asyncio.run(main())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details
    assert client.health()["rejected"] == rejected_before + 1
    (final,) = chunks[aborted]
    assert final.final and final.finish_reason == "abort" and final.token_ids == []
    wait_idle(client)


def _post(url: str, body: dict) -> tuple[int, bytes]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_openai_completions_http(stack, client):
    import json

    url = stack[1] + "/v1/completions"
    prompt = "The capital of France is"
    expected = client.generate_text(prompt, max_new_tokens=8, raw=True)
    status, body = _post(url, {"model": "x", "prompt": prompt, "max_tokens": 8})
    assert status == 200, body
    doc = json.loads(body)
    assert doc["object"] == "text_completion" and doc["choices"][0]["text"] == expected.text
    assert doc["usage"]["completion_tokens"] == len(expected.token_ids)
    status, body = _post(url, {"prompt": prompt, "max_tokens": 8, "stream": True})
    assert status == 200
    events = [line[len("data: ") :] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parts = [json.loads(e) for e in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in parts) == expected.text
    assert parts[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    status, body = _post(url, {"prompt": "", "max_tokens": 8})
    assert status == 400 and "prompt is empty" in json.loads(body)["error"]["message"]


@pytest.fixture(scope="module")
def openai_client(stack):
    """The official `openai` client on the stack's OpenAI-compatible routes (no token configured: any key passes)."""
    import openai

    with openai.OpenAI(base_url=stack[1] + "/v1", api_key="unused", max_retries=0, timeout=180) as c:
        yield c


def test_openai_chat_plain_and_streamed(openai_client, client, reference):
    model = client.model_info()["model"]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    expected = client.generate_text(PROMPTS[0], max_new_tokens=12)  # gRPC: the chat template on one user turn
    reply = openai_client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    (choice,) = reply.choices
    assert reply.object == "chat.completion" and reply.model == model and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(reference["ids"](PROMPTS[0]))
    stream = openai_client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    wait_idle(client)


def test_a_request_sets_its_own_stream_interval_on_both_routes(openai_client, client):
    """`stream_interval_s` per request (the gRPC field, the OpenAI extension) instead of the replica's 0.05 s: 0 sends
    each decoding step's tokens as they come, an hour holds all but the first step's for the final item; the tokens
    and the text are the same either way."""
    n, tokens, texts = 24, {}, {}
    for interval in (0.0, 3600.0):
        chunks = client.generate(PROMPTS[1], max_new_tokens=n, ignore_eos=True, method="ar", stream_interval_s=interval)
        chunks = list(chunks)
        final = chunks[-1]
        assert final.final and final.stats["steps"] > 2
        assert len([c for c in chunks[:-1] if c.token_ids]) == (final.stats["steps"] if interval == 0 else 2)
        tokens[interval] = [t for c in chunks for t in c.token_ids]
        events = openai_client.completions.create(
            model="m", prompt=PROMPTS[1], max_tokens=n, temperature=0, stream=True,
            extra_body={"method": "ar", "ignore_eos": True, "stream_interval_s": interval},
        )  # fmt: skip
        events = list(events)
        assert len(events) > 3 if interval == 0 else len(events) <= 3  # the first step's, those held, the final
        texts[interval] = "".join(e.choices[0].text for e in events)
    assert tokens[0.0] == tokens[3600.0] and len(tokens[0.0]) == n
    assert texts[0.0] == texts[3600.0] != ""
    wait_idle(client)


def test_chat_messages_through_the_sdk_and_openai_equal_plain_decoding(openai_client, client, served):
    from spyglass.engine import plain_generate
    from spyglass.sampling import SamplingParams

    model, tok = served
    messages = [
        {"role": "system", "content": "You answer in one short line."},
        {"role": "user", "content": "Name a primary colour."},
    ]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    expected = plain_generate(model, ids, SamplingParams(max_new_tokens=10))
    sdk = client.generate_text(messages=messages, max_new_tokens=10, method="suffix")
    assert sdk.token_ids == expected and sdk.stats["prompt_tokens"] == len(ids)
    reply = openai_client.chat.completions.create(
        model="any", messages=messages, max_tokens=10, extra_body={"method": "suffix"}
    )
    assert reply.choices[0].message.content == sdk.text == tok.decode(expected, skip_special_tokens=True)


def test_openai_chat_options_models_and_errors(openai_client, client):
    import openai

    model = client.model_info()["model"]
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    full = client.generate_text(PROMPTS[1], max_new_tokens=40).text
    words = full.split()
    stop = words[len(words) // 2]  # one string, not a list: the output ends before its first occurrence
    cut = openai_client.chat.completions.create(model=model, messages=msgs, max_tokens=40, stop=stop)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[: full.index(stop)]
    kw = dict(max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    sampled = [openai_client.chat.completions.create(model=model, messages=msgs, **kw) for _ in range(2)]
    texts = [r.choices[0].message.content for r in sampled]
    grpc_kw = dict(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    assert texts[0] == texts[1] == client.generate_text(PROMPTS[1], **grpc_kw).text  # a seed makes sampling repeatable
    assert [m.id for m in openai_client.models.list().data] == [model]
    assert openai_client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-4")
    bad = [
        (dict(n=2), "n is not supported"),
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(max_tokens=100000), "max_tokens must be <= 512"),
        (dict(stop=[""]), "stop strings must have 1 to"),
        (dict(extra_body={"method": "telepathy"}), "unknown method"),
        (dict(messages=[{"role": "robot", "content": "hi"}]), "role must be one of"),
    ]
    for kwargs, needle in bad:
        kwargs = {"messages": msgs, **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            openai_client.chat.completions.create(model=model, **kwargs)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
        assert needle in e.value.body["message"], e.value.body
    wait_idle(client)


def test_openai_routes_need_the_bearer_token_when_one_is_set(stack, client):
    """A second gateway on the same verifier, started with a token: the OpenAI routes answer 401 without it."""
    import openai
    from ray import serve

    from services.gateway import Gateway

    model = client.model_info()["model"]
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    expected = client.generate_text(PROMPTS[0], max_new_tokens=4).text
    var = "SPYGLASS_TEST_AUTH_TOKEN"
    verifier = serve.get_deployment_handle("Verifier0", app_name="spyglass")
    opts = {"num_cpus": 0, "runtime_env": {"env_vars": {var: "s3cret"}}}
    app = Gateway.options(name="AuthGateway", ray_actor_options=opts).bind([verifier], {"auth_token_env": var})
    serve.run(app, name="auth", route_prefix="/auth")
    try:
        base = stack[1] + "/auth/v1"
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, timeout=60) as wrong:
            calls = [
                lambda: wrong.models.list(),
                lambda: wrong.chat.completions.create(model=model, messages=msgs, max_tokens=2),
                lambda: wrong.chat.completions.create(model=model, messages=msgs, max_tokens=2, stream=True),
                lambda: wrong.completions.create(model=model, prompt="hi", max_tokens=2),
            ]
            for call in calls:
                with pytest.raises(openai.AuthenticationError) as e:
                    call()
                assert e.value.status_code == 401 and "bearer token" in e.value.body["message"]
        with openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0, timeout=180) as right:
            assert [m.id for m in right.models.list().data] == [model]
            reply = right.chat.completions.create(model=model, messages=msgs, max_tokens=4)
            assert reply.choices[0].message.content == expected
    finally:
        serve.delete("auth")
    wait_idle(client)


def test_cli_generate_server(grpc_address, client):
    import json

    prompt = PROMPTS[0]
    expected = client.generate_text(prompt, max_new_tokens=8)
    cmd = [sys.executable, "-m", "spyglass", "generate", "--server", grpc_address, "--prompt", prompt]
    out = subprocess.run([*cmd, "--max-new-tokens", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["token_ids"] == expected.token_ids and doc["text"] == expected.text
    assert doc["stats"]["generated_tokens"] == len(expected.token_ids)
    bad = subprocess.run([*cmd, "--method", "telepathy"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr and "unknown method" in bad.stderr


def test_the_demo_through_the_learned_draft_equals_the_default_methods_tokens(client, grpc_address):
    """`make run`'s last line: the demo request again through the trained LongSpec draft, which runs in the verifier
    replica beside the target; its greedy tokens are the default method's."""
    from services.app import LEARNED_DEMO_METHOD, demo_via

    reference = client.generate_text(PROMPTS[0], max_new_tokens=24, context_id="demo-via").token_ids
    via = demo_via(grpc_address, PROMPTS[0], LEARNED_DEMO_METHOD, reference, 24, "demo-via")
    assert via["method"] == LEARNED_DEMO_METHOD and via["identical"]
    assert not demo_via(grpc_address, PROMPTS[0], LEARNED_DEMO_METHOD, reference[:-1], 24, "demo-via")["identical"]
