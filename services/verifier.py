"""Verifier replica: the target model, a colocated drafter and a SpecEngine behind one step loop.

The engine is not thread-safe, so exactly one thread (`EngineLoop`) owns it: between steps it applies
queued add/abort commands (new requests join the running batch at the next step, finished ones leave),
then runs `engine.step()` and pushes each event into the asyncio queue of its request. Requests stream
back as async generators of plain dicts; closing a generator early (client disconnect, cancellation)
aborts its sequence, which returns the KV slot to the pool.

Errors are reported in-band (`{"error": kind, "message": ...}`) rather than raised, so the gateway can
map them to gRPC codes without depending on how Ray wraps exceptions across processes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from spyglass.limits import SAMPLING_RULES, check_max_new_tokens, check_method, check_stream_interval

try:
    from ray import serve
except ImportError:  # the engine and its builder run without Ray (bench/gpu_check.py on a bare GPU machine)
    serve = None

log = logging.getLogger(__name__)

ERR_INVALID = "invalid_argument"
ERR_EXHAUSTED = "resource_exhausted"
ERR_UNAVAILABLE = "unavailable"


@dataclass
class VerifierConfig:
    """Everything a replica needs to build its engine (a plain dict crosses the Ray boundary)."""

    model: str | None = None  # None = the embedded default (SmolLM2-135M-Instruct)
    # where the target, the drafters, the KV pool and the controller's measurements live: "auto" = the GPU Ray gave
    # the replica (else the CPU), or "cpu", "cuda", "cuda:N" (spyglass.device.resolve_device)
    device: str = "auto"
    dtype: str = "auto"  # "auto": bf16 on a GPU, the CPU's default there (spyglass.models.loader.resolve_dtype)
    methods: list[str] = field(default_factory=lambda: ["suffix", "ngram", "ar"])  # the first is the default
    max_batch: int = 4  # KV slots of the replica's one pool = sequences per verifier step, every method together
    max_context: int | None = None  # KV capacity per sequence: a cap in 2..the model's window (default: the window)
    max_queued: int = 8  # requests waiting for a KV slot beyond max_batch
    max_new_tokens_limit: int = 4096
    default_max_new_tokens: int = 128
    prefill_chunk: int | None = None  # prompt tokens per prefill forward (None: EngineConfig's)
    # seconds of prefill layers a step runs while other sequences decode (None: EngineConfig's, twice a recent round):
    # a stream's longest wait for its next token while prompts are prefilled, against how soon those prompts start
    prefill_step_s: float | None = None
    # the target's matmul kernels (spyglass.models.linear.set_linear_backend): "auto" times them at load; a replica's
    # reported `linear_backend` pins the same kernels, so replicas and restarts round every prompt alike
    linear_backend: str = "auto"
    redis_url: str | None = None
    cache_block_size: int = 128
    cache_max_bytes: int = 2 << 30
    # prompts that must have held a prefix block (on any replica, within an hour) before it is written to Redis: 2
    # spares the writes of prompts seen once; the replica's own released slots serve a repeat from memory meanwhile
    cache_min_uses: int = 2
    # the most of its time the context cache's writer works (it pauses after each block): its copies and checksums
    # come between the steps in pieces instead of taking a core from a step's threads for a whole prompt
    cache_write_share: float = 0.5
    threads: int | None = None  # torch threads in the replica (default: the CPUs Ray gave it)
    # the most often a stream sends its new tokens (s; 0: every step's at once): each chunk crosses the replica, the
    # gateway and the proxy, whose CPU the engine's steps share on a small machine (BENCHMARKS.md, "Stream interval");
    # the first chunk and the final item are never held; a request may set its own (`GenerateRequest.stream_interval_s`)
    stream_interval_s: float = 0.05
    # Warm-up before the replica reports ready (see `warm_up`): 0 = off; else the synthetic prompt's tokens.
    warmup_prompt_tokens: int = 800
    # build_drafter's options for every method, e.g. `draft_model: SOURCE` (or `draft_layers: N`) for small-lm
    drafter_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> VerifierConfig:
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown verifier config keys: {sorted(unknown)}")
        return cls(**d)

    def __post_init__(self) -> None:
        check_stream_interval(self.stream_interval_s)


def encode_prompt(tokenizer, text: str, raw: bool, messages: list[dict[str, str]] | None = None) -> list[int]:
    """Prompt text -> ids, through the chat template unless `raw` (same as `spyglass generate`); or chat
    `messages` (role, content) -> ids through the chat template, ending with the assistant's turn."""
    if messages:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: send a prompt (raw text) instead of messages")
        from jinja2 import TemplateError  # transformers' optional dependency, needed only by chat templates

        try:
            ids = tokenizer.apply_chat_template(
                [{"role": m["role"], "content": m["content"]} for m in messages],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        except TemplateError as e:  # the template's own checks, e.g. roles that must alternate
            raise ValueError(f"the model's chat template rejected the messages: {e}") from None
    elif not raw and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        return tokenizer.encode(text, add_special_tokens=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def sampling_from_request(req: dict[str, Any], cfg: VerifierConfig):
    """Build SamplingParams from a request dict (ValueError with a message on bad values)."""
    from spyglass.sampling import SamplingParams  # torch: in the replica only (see build_engine)

    s = req.get("sampling") or {}
    max_new = int(req.get("max_new_tokens") or cfg.default_max_new_tokens)
    check_max_new_tokens(max_new, cfg.max_new_tokens_limit)
    kwargs = {k: s[k] for k in SAMPLING_RULES if k in s}
    return SamplingParams(
        max_new_tokens=max_new, stop=tuple(req.get("stop") or ()), ignore_eos=bool(req.get("ignore_eos")), **kwargs
    )


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two steps' chunks of one stream as one: their tokens and text in order, the accepted drafts of both, the larger
    of their batches."""
    return {
        **b,
        "token_ids": a["token_ids"] + b["token_ids"],
        "text": a["text"] + b["text"],
        "accepted_tokens": a["accepted_tokens"] + b["accepted_tokens"],
        "batch_size": max(a["batch_size"], b["batch_size"]),
    }


@dataclass
class _Live:
    """A request the loop is serving, with what was already streamed."""

    request_id: str
    method: str
    prompt_ids: list[int]
    params: Any
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    seq: Any = None
    final_only: bool = False  # a unary request: only the final item (full text and ids), no per-step chunks
    interval: float = 0.0  # the most often its chunks are sent (s): the request's stream_interval_s, else the replica's
    t_submit: float = field(default_factory=time.perf_counter)
    held: dict[str, Any] | None = None  # steps' tokens not sent yet (`stream_interval_s`)
    sent: float | None = None  # when the last chunk was sent

    def push(self, item: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def send(self, chunk: dict[str, Any]) -> None:
        """A step's chunk: sent with those held before it once `interval` has passed since the last (the first at once),
        else held for a later step or the final item."""
        if self.held is not None:
            chunk = _merge(self.held, chunk)
        now = time.perf_counter()
        if self.sent is None or now - self.sent >= self.interval:
            self.held, self.sent = None, now
            self.push(chunk)
        else:
            self.held = chunk

    def flush(self) -> None:
        """Send the tokens held back for the interval (before the final item, or an error)."""
        if self.held is not None:
            self.push(self.held)
            self.held = None


class EngineLoop:
    """One thread that owns the replica's engine (every served method in one batch over one KV pool).

    With `setup` (engine and tokenizer None), that thread also builds it: `setup()` returns (engine, tokenizer)
    and runs there before the loop starts; the constructor waits for it and raises what it raised. Every torch
    computation of a replica then runs on one thread: OpenMP gives each thread that runs parallel work its own team,
    and with two teams in a process (load and measure on the actor's thread, decode on this one) libgomp stops its
    idle workers from spinning once it manages more threads than there are cores, so every decode step paid their
    wake-ups: 10-15% slower steps on 2 cores (BENCHMARKS.md, "Serving")."""

    def __init__(
        self,
        engine,
        tokenizer,
        cfg: VerifierConfig,
        name: str = "verifier",
        on_metrics: Callable[[str, float, dict[str, str] | None], None] | None = None,
        setup: Callable[[], tuple[Any, Any]] | None = None,
    ) -> None:
        if (setup is None) == (engine is None):
            raise ValueError("EngineLoop needs either an engine or a setup that builds it")
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.name = name
        self.on_metrics = on_metrics
        self.commands: queue.Queue = queue.Queue()
        self.live: dict[str, _Live] = {}
        self.counters: dict[str, float] = {}
        self.steps = 0
        self.finished = 0
        self.aborted = 0
        self._stop = threading.Event()
        self._setup, self._setup_error, self._ready = setup, None, threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._setup_error is not None:
            self._thread.join(timeout=30)
            raise self._setup_error

    # --- called from the asyncio side -----------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Requests the replica takes at once: running (its KV slots) plus queued. The gateway admits as many."""
        return self.cfg.max_batch + self.cfg.max_queued

    @property
    def methods(self) -> list[str]:
        return self.engine.methods if self.engine is not None else []

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream the chunks of one request; leaving early aborts it (frees the KV slot)."""
        rid = req.get("request_id") or f"req-{time.time_ns()}"
        method = req.get("method") or self.cfg.methods[0]
        if self._stop.is_set():
            yield {"error": ERR_UNAVAILABLE, "message": "the verifier is shutting down"}
            return
        if rid in self.live:
            yield {"error": ERR_INVALID, "message": f"request id {rid!r} is already live"}
            return
        if len(self.live) >= self.capacity:
            yield {"error": ERR_EXHAUSTED, "message": f"verifier {self.name} queue is full ({self.capacity} requests)"}
            return
        try:
            check_method(method, self.methods)
            params = sampling_from_request(req, self.cfg)
            interval = req.get("stream_interval_s")
            interval = self.cfg.stream_interval_s if interval is None else interval
            check_stream_interval(interval)
            if req.get("prompt_token_ids"):
                prompt_ids = [int(t) for t in req["prompt_token_ids"]]
            else:
                prompt = req.get("prompt") or ""
                prompt_ids = encode_prompt(self.tokenizer, prompt, bool(req.get("raw")), req.get("messages"))
        except ValueError as e:
            yield {"error": ERR_INVALID, "message": str(e)}
            return
        loop = asyncio.get_running_loop()
        final_only = bool(req.get("final_only"))
        live = _Live(rid, method, prompt_ids, params, loop, asyncio.Queue(), final_only=final_only, interval=interval)
        self.live[rid] = live
        self.commands.put(("add", live))
        done = False
        try:
            while True:
                item = await live.out.get()
                done = bool(item.get("final") or item.get("error"))
                yield item
                if done:
                    return
        finally:
            if not done:  # the consumer went away: free the sequence
                self.commands.put(("abort", rid))

    def abort(self, request_id: str) -> bool:
        if request_id not in self.live:
            return False
        self.commands.put(("abort", request_id))
        return True

    def health(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "name": self.name,
            "live_sequences": len(self.live),
            "waiting": len(engine.waiting) if engine is not None else 0,
            "free_kv_slots": engine.cache.free_slots if engine is not None else 0,
            "total_kv_slots": engine.cache.max_slots if engine is not None else 0,
            "steps": self.steps,
            "finished": self.finished,
            "aborted": self.aborted,
            "counters": dict(self.counters),
            "alive": self._thread.is_alive(),
        }

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Graceful shutdown: let live sequences finish for a while, then abort the rest."""
        deadline = time.monotonic() + drain_timeout_s
        while self.live and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        for rid in list(self.live):
            self.commands.put(("abort", rid))
        self._stop.set()
        self.commands.put(("wake", None))
        self._thread.join(timeout=30)

    # --- the loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        import torch  # in the replica only (see build_engine)

        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        try:
            if self._setup is not None:
                self.engine, self.tokenizer = self._setup()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor, which raises it
            self._setup_error = e
            return
        finally:
            self._ready.set()
        engine = self.engine
        while True:
            self._apply_commands(block=not engine.has_work)
            if self._stop.is_set() and not engine.has_work:
                self._fail_pending("the verifier is shutting down")
                return
            if not engine.has_work:
                continue
            try:
                with torch.inference_mode():
                    events = engine.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not kill the replica silently
                log.exception("engine step failed")
                self._fail_engine(f"engine step failed: {type(e).__name__}: {e}")
                continue
            self.steps += 1
            for ev in events:
                self._dispatch(ev)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, live: _Live) -> None:
        from spyglass.engine import RequestError  # torch: in the replica only (see build_engine)

        try:
            live.seq = self.engine.add_request(live.prompt_ids, live.params, live.request_id, live.method)
        except (RequestError, ValueError) as e:
            self.live.pop(live.request_id, None)
            live.push({"error": ERR_INVALID, "message": str(e)})
            return
        live.seq.stats.t_start = live.t_submit

    def _abort(self, rid: str) -> None:
        live = self.live.get(rid)
        if live is None or live.seq is None:
            return
        self.engine.abort(rid)
        if live.seq.finished:
            self._finish(live)

    def _dispatch(self, ev) -> None:
        live = self.live.get(ev.seq.seq_id)
        if live is None:
            return
        if ev.batch_size:  # the sequence was in this step's verify forward
            if ev.drafted:
                self._count("spec_decode_num_drafts_total", 1)
                self._count("spec_decode_num_draft_tokens_total", ev.drafted)
                self._count("spec_decode_num_accepted_tokens_total", ev.accepted)
                for pos in range(ev.accepted):
                    self._count("spec_decode_num_accepted_tokens_per_pos_total", 1, {"position": str(pos)})
            self._count("batched_sequence_steps_total", 1)
            self._count("batch_size_sum", ev.batch_size)
        # the step's new tokens and the text the engine released with them (see TextStream.release): a chunk costs
        # the replica and the gateway CPU that the decode steps share, so a unary request gets none
        if not live.final_only and (ev.new_tokens or ev.text):
            live.send(
                {
                    "request_id": live.request_id,
                    "token_ids": list(ev.new_tokens),
                    "text": ev.text,
                    "accepted_tokens": ev.accepted,
                    "batch_size": ev.batch_size,
                }
            )
        if ev.seq.finished:
            self._finish(live)

    def _finish(self, live: _Live) -> None:
        seq = live.seq
        self.live.pop(live.request_id, None)
        if seq.finish_reason == "abort":
            self.aborted += 1
        else:
            self.finished += 1
        stats = seq.stats.summary(seq.num_generated)
        stats.update(method=live.method, replica=self.name, prompt_tokens=seq.num_prompt)
        if stats["cached_prefix_tokens"]:
            self._count("cache_hit_tokens_total", stats["cached_prefix_tokens"])
        if stats["ttft_s"] is not None:
            self._observe("ttft_s", stats["ttft_s"])
        live.flush()  # the tokens held back for the interval go before the final item
        text = self.engine.text(seq)
        # the text not streamed yet (held back at an abort); a unary request streamed nothing: all of it
        rest = text if live.final_only else seq.text_stream.release(final=True)
        live.push(
            {
                "request_id": live.request_id,
                "final": True,
                "finish_reason": seq.finish_reason or "stop",
                "stats": stats,
                "text": rest,
                "token_ids": [],
                "full_text": text,
                "output_ids": seq.output_ids,
            }
        )

    def _fail_engine(self, message: str) -> None:
        """A step raised: every sequence of the batch shared it, so each is aborted (its slot freed) with the error,
        after the tokens it had made and not yet sent (`stream_interval_s`)."""
        for rid, live in list(self.live.items()):
            if live.seq is not None:
                self.engine.abort(rid)
                self.live.pop(rid, None)
                live.flush()
                live.push({"error": "internal", "message": message})

    def _fail_pending(self, message: str) -> None:
        for rid, live in list(self.live.items()):
            self.live.pop(rid, None)
            live.push({"error": ERR_UNAVAILABLE, "message": message})

    def _count(self, name: str, value: float, tags: dict[str, str] | None = None) -> None:
        key = name if not tags else name + "{" + ",".join(f"{k}={v}" for k, v in sorted(tags.items())) + "}"
        self.counters[key] = self.counters.get(key, 0) + value
        if self.on_metrics is not None:
            self.on_metrics(name, value, tags)

    def _observe(self, name: str, value: float) -> None:
        if self.on_metrics is not None:
            self.on_metrics(name, value, None)


# ~1.8K tokens of repetitive code: n-gram and suffix drafters find long matches, so real trees get verified.
WARMUP_TEXT = "Here is a small Python module. Repeat its functions exactly, in order.\n\n" + "".join(
    f"def scale_{i}(values, k={i}):\n    return [v * k + {i} for v in values]\n\n" for i in range(60)
)


def warm_up(engine, tokenizer, cfg: VerifierConfig, prompt_tokens: int | None = None) -> dict:
    """Pay the one-time costs of a fresh process before the replica reports ready, not on the first request.

    The speculation controller's cost-curve measurement (at engine construction) already runs verify-shaped
    forwards over the tree sizes it will use. What stays cold is everything else a first request touches:
    the chat template (compiled on first use), prefill forwards of full and partial chunks (two prompts prefilled
    in turn, one while the other decodes), the KV pages of the slots requests will use, each drafter's own work
    (index building, proposals, commits) and the verify passes over the trees it really proposes, sampling
    and acceptance, and decode steps over a long prefix. So every method serves, in-process, two requests
    together on a synthetic repetitive prompt (greedy and sampled) with the context cache detached: nothing is
    written to Redis and no real request is affected. Returns what was done and how long it took."""
    from spyglass.sampling import SamplingParams  # torch: in the replica only (see build_engine)

    t0 = time.perf_counter()
    ids = encode_prompt(tokenizer, WARMUP_TEXT, raw=False)  # also compiles the chat template
    encode_prompt(tokenizer, "warm-up", raw=True)
    out: dict[str, Any] = {"methods": {}}
    cap = engine.capacity
    chunk = engine.config.prefill_chunk
    saved, engine.context_cache = engine.context_cache, None
    try:
        for k, method in enumerate(engine.methods):
            # a full chunk and a partial one (or what the context holds), with room left for decoding; after the
            # first method a shorter prompt warms the drafter's own work (the target's shapes are warm by then)
            n = min(prompt_tokens or chunk + chunk // 2 + 7, cap - 80, len(ids))
            n = max(n if k == 0 else n // 4, 2)
            new = 24 if k == 0 else 12  # enough draft-verify-commit rounds for a drafter's own shapes
            prompts = [ids[:n], ids[: max(2, n // 3)]]
            params = [
                SamplingParams(max_new_tokens=new, ignore_eos=True),
                SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.8, top_p=0.95, seed=0),
            ]
            t = time.perf_counter()
            import torch

            with torch.inference_mode():
                seqs = engine.run(prompts, params, method=method)
            out["methods"][method] = {
                "seconds": round(time.perf_counter() - t, 3),
                "prompt_tokens": [len(p) for p in prompts],
                "generated": [s.num_generated for s in seqs],
            }
    finally:
        engine.context_cache = saved
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def build_engine(cfg: VerifierConfig) -> tuple[Any, Any, dict[str, Any]]:
    """Load the target once and build the replica's SpecEngine: every method's drafter over one KV pool of
    `max_batch` slots, one continuous batch and one target forward per step (sharing the context cache)."""
    import torch  # torch and the library: in the replica, not in the driver that deploys it (services/app.py)

    from kernels.dispatch import served_kernels
    from spyglass.context_cache import ContextCache, kv_namespace
    from spyglass.device import device_name, resolve_device
    from spyglass.drafters import METHODS, build_drafter
    from spyglass.engine import EngineConfig, SpecEngine
    from spyglass.kv_cache import context_capacity, kv_bytes_per_token
    from spyglass.models.llama import load_transformer
    from spyglass.models.loader import load_tokenizer, resolve_model

    for m in cfg.methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r} in verifier config; available: {', '.join(METHODS)}")
    if len(set(cfg.methods)) != len(cfg.methods):
        raise ValueError(f"verifier config names a method twice: {cfg.methods}")
    device = resolve_device(cfg.device)
    resolved = resolve_model(cfg.model, dtype=cfg.dtype, device=device)  # "auto" resolved here (resolve_dtype)
    target = load_transformer(
        resolved.path, dtype=getattr(torch, resolved.dtype), device=device, linear_backend=cfg.linear_backend
    )
    target.eval()
    tokenizer = load_tokenizer(resolved.path)
    # one pool of max_batch slots serves every method
    capacity = context_capacity(
        target.args, cfg.max_context, max_batch=cfg.max_batch, dtype=target.dtype, device=target.device
    )
    cache = None
    if cfg.redis_url:
        cache = ContextCache(
            cfg.redis_url,
            kv_namespace(resolved.model_id, target.dtype),  # the same keys on every device: blocks move as bytes
            block_size=cfg.cache_block_size,
            max_bytes=cfg.cache_max_bytes,
            min_uses=cfg.cache_min_uses,
            write_share=cfg.cache_write_share,
        )
    loaded: dict = {}  # methods on the same draft checkpoint share its weights (and all share the target's)
    drafters = {
        m: build_drafter(m, target, max_batch=cfg.max_batch, max_context=capacity, loaded=loaded, **cfg.drafter_options)
        for m in cfg.methods
    }
    given = {k: getattr(cfg, k) for k in ("prefill_chunk", "prefill_step_s") if getattr(cfg, k) is not None}
    econf = EngineConfig(max_batch=cfg.max_batch, max_context=capacity, **given)
    engine = SpecEngine(target, config=econf, tokenizer=tokenizer, context_cache=cache, drafters=drafters)
    # the pool's pages resident before the first request: none faults in inside a step that streams wait on
    reserve_s = engine.cache.reserve()
    info = {
        "model": resolved.model_id,
        "context_length": capacity,  # KV capacity per sequence
        "kv_bytes_per_token": kv_bytes_per_token(target.args, target.dtype),
        "kv_bytes": engine.cache.nbytes,  # the target's K/V of the one pool, whatever the number of methods
        "kv_reserve_s": round(reserve_s, 3),
        "methods": list(cfg.methods),
        "default_method": cfg.methods[0],
        "max_new_tokens_limit": cfg.max_new_tokens_limit,
        "max_batch": cfg.max_batch,
        "vocab_size": target.args.vocab_size,
        "context_cache": cache is not None,
        "cache_block_size": cfg.cache_block_size if cache is not None else 0,
        "max_queued": cfg.max_queued,
        "device": str(target.device),  # what `device` resolved to, and what it is
        "device_name": device_name(target.device),
        "dtype": resolved.dtype,  # what `dtype` resolved to
        "kernels": served_kernels(target.device, target.dtype, target.args.head_dim, target.attention_backend),
        "linear_backend": target.linear_backend,  # the matmul kernel per row count measured at load
        "threads": torch.get_num_threads(),
    }
    curve = next((c.curve for c in engine.controllers.values() if c is not None), None)
    if curve is not None:  # what verifying k tokens cost at start-up (one per process): every tree is sized by it
        info["cost_curve"] = curve.to_dict()
        info["controller_config"] = asdict(econf.control)  # the constants every tree is sized with
    return engine, tokenizer, info


# --- the Ray Serve deployment ------------------------------------------------------------------------


def _make_metrics(name: str) -> Callable[[str, float, dict[str, str] | None], None]:
    """Prometheus metrics through Ray's metrics API, named like vLLM's spec-decode counters.

    vLLM writes `vllm:spec_decode_...`; Ray 2.60 deprecates ':' in metric names and its exporter drops
    such metrics, so ours are `spyglass_spec_decode_...` (scraped as `ray_spyglass_spec_decode_..._total`)."""
    from ray.util import metrics

    tags = ("replica",)
    counters = {
        n: metrics.Counter(f"spyglass_{n}", description=d, tag_keys=tags)
        for n, d in [
            ("spec_decode_num_drafts_total", "Draft trees proposed (one per sequence per step)."),
            ("spec_decode_num_draft_tokens_total", "Drafted tokens submitted for verification."),
            ("spec_decode_num_accepted_tokens_total", "Drafted tokens accepted by the target."),
            ("cache_hit_tokens_total", "Prompt tokens reused: from a KV slot (live or released) or the context cache."),
            ("batched_sequence_steps_total", "Sequence-steps run by the verifier."),
            ("batch_size_sum", "Sum over sequence-steps of the verifier batch size."),
        ]
    }
    per_pos = metrics.Counter(
        "spyglass_spec_decode_num_accepted_tokens_per_pos_total",
        description="Accepted drafted tokens by position in the draft.",
        tag_keys=("replica", "position"),
    )
    ttft = metrics.Histogram(
        "spyglass_verifier_time_to_first_token_seconds",
        description="Verifier-side time to first token (queue + prefill).",
        boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60],
        tag_keys=tags,
    )
    base = {"replica": name}

    def emit(metric: str, value: float, extra: dict[str, str] | None) -> None:
        try:
            if metric == "spec_decode_num_accepted_tokens_per_pos_total":
                per_pos.inc(value, tags={**base, **(extra or {})})
            elif metric == "ttft_s":
                ttft.observe(value, tags=base)
            elif metric in counters:
                counters[metric].inc(value, tags=base)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.debug("metric %s failed", metric, exc_info=True)

    return emit


def _deployment(**options):
    """Serve's deployment decorator; without Ray the class stays a plain class (nothing can deploy it there)."""
    return serve.deployment(**options) if serve is not None else (lambda cls: cls)


@_deployment(
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=32,
    graceful_shutdown_timeout_s=20,
    health_check_period_s=10,
)
class Verifier:
    """One replica: target + colocated drafter + continuous-batching engine loop."""

    def __init__(self, config: dict[str, Any] | None = None, name: str = "verifier-0") -> None:
        self.cfg = VerifierConfig.from_dict(config)
        # Ray sets OMP_NUM_THREADS to the replica's num_cpus; more threads than that would oversubscribe.
        self.cfg.threads = self.cfg.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)
        self.name = name

        def setup() -> tuple[Any, Any]:
            # On the engine loop's thread, at its thread count (EngineLoop sets it first): the engine measures its
            # cost curve (what a verify of k tokens costs) at construction, and a curve timed with Ray's
            # OMP_NUM_THREADS (the replica's num_cpus, often 1) sized every tree for a machine it was not running on.
            engine, tokenizer, self._info = build_engine(self.cfg)
            import ray  # optional in this module: the engine builder runs without Ray (bench/gpu_check.py)

            # the accelerators Ray assigned; none outside Ray (get_gpu_ids there would start a local cluster)
            self._info["ray_gpu_ids"] = [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
            if self.cfg.warmup_prompt_tokens > 0:
                report = warm_up(engine, tokenizer, self.cfg, self.cfg.warmup_prompt_tokens)
                self._info["warmup_s"] = report["seconds"]
                # Serve's logger: the line lands in the replica's log file
                serve_log = logging.getLogger("ray.serve")
                serve_log.info(
                    "%s warmed up in %.1f s (its KV pool made resident in %.1f s): %s",
                    name, report["seconds"], self._info["kv_reserve_s"], report["methods"],
                )  # fmt: skip
            # what start-up made (the model's modules, the tokenizer, the drafters: ~360K objects) stays out of the
            # garbage collector's full passes, which the engine loop's allocations trigger every few hundred steps
            # (a SmolLM2 fp32 decode step at 4K: 27.8 -> 27.1 ms, medians of 8 x 60 steps)
            gc.freeze()
            return engine, tokenizer

        self.loop = EngineLoop(None, None, self.cfg, name=name, on_metrics=_make_metrics(name), setup=setup)

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for item in self.loop.generate(req):
            yield item

    async def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)

    async def health(self) -> dict[str, Any]:
        return self.loop.health()

    async def info(self) -> dict[str, Any]:
        return dict(self._info, replica=self.name, capacity=self.loop.capacity)

    async def process_id(self) -> int:
        """The replica's pid (fault-injection tests kill it: `make reliability`)."""
        return os.getpid()

    async def check_health(self) -> None:
        if not self.loop._thread.is_alive() and not self.loop._stop.is_set():
            raise RuntimeError("the engine loop thread died")

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop(drain_timeout_s=5.0)


__all__ = ["EngineLoop", "Verifier", "VerifierConfig", "build_engine", "encode_prompt", "warm_up"]
