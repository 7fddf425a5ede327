"""The gRPC ingress (through Ray Serve's gRPC proxy): validation, admission, routing, streaming.

- Validation: bad input becomes INVALID_ARGUMENT with a message (checked here when cheap, in the
  verifier otherwise and reported back in-band).
- Admission: per verifier at most `max_batch` requests in flight (its KV slots); more wait in a
  bounded queue (full -> RESOURCE_EXHAUSTED) and are released in waves of up to `max_batch` after a
  short batching window, so requests arriving together are prefilled in the same engine step.
- Routing with context affinity: the same context id (or the same prompt prefix) goes to the same
  verifier replica while it has room (rendezvous hashing), where the context cache and warm pages help;
  otherwise the least loaded replica.
- Cancellation: `Abort`, a client disconnect or a deadline stops the verifier-side sequence, which frees
  its KV slot. The gateway holds no model and never imports torch.
"""

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from protos import spyglass_pb2 as pb
from services.grpc_api import MALFORMED  # a request the gRPC layer could not parse: INVALID_ARGUMENT

log = logging.getLogger(__name__)

SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "contextual_penalty",
    "penalty_window",
    "seed",
)
STATS_FIELDS = set(pb.Stats.DESCRIPTOR.fields_by_name)
ERROR_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
}


def replica_failure(streamed_tokens: int) -> "GatewayError":
    """What a client sees when its verifier replica dies or becomes unreachable mid-request."""
    if streamed_tokens:
        return GatewayError(
            grpc.StatusCode.ABORTED,
            f"the server serving this request stopped after {streamed_tokens} tokens; "
            "the output is incomplete: retry the request",
        )
    return GatewayError(
        grpc.StatusCode.UNAVAILABLE, "the server serving this request is temporarily unavailable: retry shortly"
    )


class GatewayError(Exception):
    """A request that ends with a gRPC status other than OK."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # crosses the replica -> proxy boundary inside Serve's gRPCStatusError
        return (GatewayError, (self.code, self.message))


# Where a bearer token for the gRPC service may be given (the config names the variable, never the secret).
AUTH_TOKEN_ENV = "SPYGLASS_AUTH_TOKEN"


@dataclass
class GatewayConfig:
    max_queued: int = 16  # per verifier, beyond its in-flight limit
    batch_wait_timeout_s: float = 0.005  # admission batching window
    affinity_prefix_chars: int = 2048  # prompt prefix hashed for affinity when no context id is given
    min_affinity_chars: int = 256  # shorter prompts carry no useful context: least loaded wins
    # Limits checked on the parsed request before anything is tokenized, queued or allocated.
    max_prompt_chars: int = 1 << 20  # prompt text (the context limit is checked on tokens by the verifier)
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_id_chars: int = 128  # request_id and context_id
    max_timeout_s: float = 3600.0
    health_timeout_s: float = 5.0  # a verifier that does not answer Health within this is reported down
    auth_token_env: str = AUTH_TOKEN_ENV  # bearer token required on every RPC when this variable is set

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "GatewayConfig":
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown gateway config keys: {sorted(unknown)}")
        return cls(**d)


# --- routing ---------------------------------------------------------------------------------------------
def affinity_key(req: dict[str, Any], cfg: GatewayConfig) -> str:
    """What identifies a request's context: its context id, else a hash of its prompt prefix ('' = none)."""
    if req.get("context_id"):
        return "ctx:" + req["context_id"]
    ids = req.get("prompt_token_ids") or []
    if len(ids) * 4 >= cfg.min_affinity_chars:
        head = ids[: cfg.affinity_prefix_chars // 4]
        return "ids:" + hashlib.sha256(",".join(map(str, head)).encode()).hexdigest()[:32]
    text = req.get("prompt") or ""
    if len(text) >= cfg.min_affinity_chars:
        return "txt:" + hashlib.sha256(text[: cfg.affinity_prefix_chars].encode()).hexdigest()[:32]
    return ""


def route(key: str, loads: list[int], capacity: int) -> int:
    """Pick a verifier: rendezvous-hash order for `key`, first one with room; no key or no room -> least loaded.

    Deterministic for equal inputs, and adding a replica only moves the keys that now rank it first.
    """
    n = len(loads)
    least = min(range(n), key=lambda i: (loads[i], i))
    if n == 1 or not key:
        return least
    ranked = sorted(range(n), key=lambda i: hashlib.sha256(f"{key}|{i}".encode()).digest(), reverse=True)
    for i in ranked:
        if loads[i] < capacity:
            return i
    return least


# --- admission ---------------------------------------------------------------------------------------------
class QueueFull(Exception):
    pass


class Evicted(Exception):
    """A queued request was aborted before it was admitted."""


class Admission:
    """Per-verifier in-flight limit with a bounded FIFO released in batches after a short window."""

    def __init__(self, n: int, capacity: int, max_queued: int, wait_s: float) -> None:
        self.capacity = capacity
        self.max_queued = max_queued
        self.wait_s = wait_s
        self.in_flight = [0] * n
        self.waiting: list[deque[asyncio.Future]] = [deque() for _ in range(n)]
        self._dispatching = [False] * n
        self._by_token: dict[str, tuple[int, asyncio.Future]] = {}
        self.rejected = 0

    def loads(self) -> list[int]:
        return [f + len(w) for f, w in zip(self.in_flight, self.waiting, strict=True)]

    @property
    def queue_depth(self) -> int:
        return sum(len(w) for w in self.waiting)

    async def acquire(self, i: int, token: str | None = None) -> None:
        if len(self.waiting[i]) >= self.max_queued and self.in_flight[i] >= self.capacity:
            self.rejected += 1
            raise QueueFull(
                f"the verifier queue is full ({self.capacity} in flight, {len(self.waiting[i])} waiting): retry later"
            )
        fut = asyncio.get_running_loop().create_future()
        self.waiting[i].append(fut)
        if token is not None:
            self._by_token[token] = (i, fut)
        self._kick(i)
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self.waiting[i]:
                self.waiting[i].remove(fut)
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(i)
            raise
        finally:
            if token is not None:
                self._by_token.pop(token, None)

    def evict(self, token: str) -> bool:
        """Drop a still-queued request (its acquire raises Evicted); False if it is not queued."""
        entry = self._by_token.get(token)
        if entry is None or entry[1].done():
            return False
        i, fut = entry
        self.waiting[i].remove(fut)
        fut.set_exception(Evicted(token))
        return True

    def release(self, i: int) -> None:
        self.in_flight[i] -= 1
        self._kick(i)

    def _kick(self, i: int) -> None:
        if not self._dispatching[i] and self.waiting[i] and self.in_flight[i] < self.capacity:
            self._dispatching[i] = True
            asyncio.get_running_loop().create_task(self._dispatch(i))

    async def _dispatch(self, i: int) -> None:
        try:
            room = self.capacity - self.in_flight[i]
            if len(self.waiting[i]) < room and self.wait_s > 0:
                await asyncio.sleep(self.wait_s)  # let co-arriving requests join this wave
            room = self.capacity - self.in_flight[i]
            while room > 0 and self.waiting[i]:
                fut = self.waiting[i].popleft()
                if fut.done():
                    continue
                self.in_flight[i] += 1
                fut.set_result(None)
                room -= 1
        finally:
            self._dispatching[i] = False
        if self.waiting[i] and self.in_flight[i] < self.capacity:
            self._kick(i)


# --- protobuf <-> dict -------------------------------------------------------------------------------------------
def request_to_dict(r: pb.GenerateRequest, request_id: str) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "prompt": r.prompt,
        "prompt_token_ids": list(r.prompt_token_ids),
        "raw": r.raw,
        "sampling": {f: getattr(r.sampling, f) for f in SAMPLING_FIELDS if r.sampling.HasField(f)},
        "max_new_tokens": r.max_new_tokens,
        "stop": list(r.stop),
        "ignore_eos": r.ignore_eos,
        "method": r.method,
        "context_id": r.context_id,
    }


def check_sampling(sp: pb.SamplingParams) -> None:
    """The sampling fields' ranges, checked at the gateway (the verifier's SamplingParams checks them again)."""

    def bad(name: str, rule: str) -> GatewayError:
        return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be {rule}, got {getattr(sp, name)}")

    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "contextual_penalty"):
        if sp.HasField(name) and not math.isfinite(getattr(sp, name)):
            raise bad(name, "a finite number")
    checks = {
        "temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
        "top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
        "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
        "min_p": (lambda v: 0 <= v < 1, "in [0, 1)"),
        "repetition_penalty": (lambda v: v > 0, "> 0"),
        "contextual_penalty": (lambda v: v >= 1, ">= 1 (1 = off)"),
        "penalty_window": (lambda v: v > 0, "> 0 tokens"),
        "seed": (lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
    }
    for name, (ok, rule) in checks.items():
        if sp.HasField(name) and not ok(getattr(sp, name)):
            raise bad(name, rule)


def stats_to_pb(stats: dict[str, Any]) -> pb.Stats:
    kept = {k: v for k, v in stats.items() if k in STATS_FIELDS and v is not None}
    return pb.Stats(**kept)


def chunk_to_pb(item: dict[str, Any]) -> pb.GenerateChunk:
    chunk = pb.GenerateChunk(
        request_id=item.get("request_id", ""),
        token_ids=item.get("token_ids") or [],
        text=item.get("text") or "",
        accepted_tokens=item.get("accepted_tokens") or 0,
        batch_size=item.get("batch_size") or 0,
        final=bool(item.get("final")),
        finish_reason=item.get("finish_reason") or "",
    )
    if item.get("stats"):
        chunk.stats.CopyFrom(stats_to_pb(item["stats"]))
    return chunk


def _make_metrics():
    from ray.util import metrics

    latency = metrics.Histogram(
        "spyglass_request_latency_seconds",
        description="End-to-end request latency at the gateway.",
        boundaries=[0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300],
        tag_keys=("method", "status"),
    )
    ttft = metrics.Histogram(
        "spyglass_time_to_first_token_seconds",
        description="Time to first token at the gateway (admission + routing + prefill).",
        boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60],
        tag_keys=("method",),
    )
    depth = metrics.Gauge("spyglass_queue_depth", description="Requests waiting for admission at the gateway.")
    requests = metrics.Counter("spyglass_requests_total", description="Requests by final status.", tag_keys=("status",))
    return latency, ttft, depth, requests


# --- OpenAI-compatible HTTP (/v1/completions, streaming included) on the same deployment -------------------------
http_app = FastAPI(title="spyglass", description="OpenAI-compatible completions over the spyglass gateway")
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
}


def completion_request(body: dict[str, Any]) -> pb.GenerateRequest:
    """OpenAI /v1/completions body -> GenerateRequest (raw text completion: no chat template)."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "exactly one prompt per request is supported")
        prompt = prompt[0]
    req = pb.GenerateRequest(raw=True, max_new_tokens=int(body.get("max_tokens") or 16))
    if isinstance(prompt, list):  # token ids
        req.prompt_token_ids.extend(int(t) for t in prompt)
    elif isinstance(prompt, str):
        req.prompt = prompt
    else:
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "prompt must be a string or a list of token ids")
    stop = body.get("stop") or []
    req.stop.extend([stop] if isinstance(stop, str) else list(stop))
    for key in ("temperature", "top_p", "seed"):
        if body.get(key) is not None:
            setattr(req.sampling, key, body[key])
    if body.get("method"):
        req.method = body["method"]
    return req


def _openai_error(e: GatewayError) -> JSONResponse:
    kind = "invalid_request_error" if e.code == grpc.StatusCode.INVALID_ARGUMENT else e.code.name.lower()
    return JSONResponse({"error": {"message": e.message, "type": kind}}, status_code=HTTP_STATUS.get(e.code, 500))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512, graceful_shutdown_timeout_s=20)
@serve.ingress(http_app)
class Gateway:
    """The `spyglass.v1.Spyglass` service; method names match the RPC names exactly (Serve's gRPC proxy)."""

    def __init__(self, verifiers: list, config: dict[str, Any] | None = None) -> None:
        self.cfg = GatewayConfig.from_dict(config)
        self.verifiers = list(verifiers)
        self._info: dict[str, Any] | None = None
        self._admission: Admission | None = None
        self.live: dict[str, int] = {}
        self.queued: set[str] = set()
        self._token = os.environ.get(self.cfg.auth_token_env) or None
        self._latency, self._ttft, self._depth, self._requests = _make_metrics()

    # --- helpers -----------------------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.verifiers[0].info.remote()
            self._admission = Admission(
                len(self.verifiers), self._info["max_batch"], self.cfg.max_queued, self.cfg.batch_wait_timeout_s
            )
        return self._info

    async def _validate(self, r: pb.GenerateRequest, rid: str) -> dict[str, Any]:
        info = await self.info()
        cfg = self.cfg
        if r.prompt and r.prompt_token_ids:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "give either prompt or prompt_token_ids, not both")
        if not r.prompt.strip() and not r.prompt_token_ids:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
        if r.method and r.method not in info["methods"]:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown method {r.method!r}; available: {', '.join(info['methods'])}",
            )
        if r.max_new_tokens > info["max_new_tokens_limit"]:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"max_new_tokens must be <= {info['max_new_tokens_limit']}, got {r.max_new_tokens}",
            )
        if len(r.prompt_token_ids) >= info["context_length"]:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the prompt has {len(r.prompt_token_ids)} tokens but the context holds {info['context_length']}",
            )
        if not 0 <= r.timeout_s <= cfg.max_timeout_s:  # also NaN
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be in [0, {cfg.max_timeout_s:g}], got {r.timeout_s}"
            )
        vocab = info.get("vocab_size") or 0
        if r.prompt_token_ids and vocab and not 0 <= min(r.prompt_token_ids) <= max(r.prompt_token_ids) < vocab:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt token ids must be in [0, {vocab})")
        if len(r.stop) > cfg.max_stop_strings:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, f"at most {cfg.max_stop_strings} stop strings, got {len(r.stop)}"
            )
        for stop in r.stop:
            if not stop or len(stop) > cfg.max_stop_chars:
                raise GatewayError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"stop strings must have 1 to {cfg.max_stop_chars} characters"
                )
        if len(r.context_id) > cfg.max_id_chars:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"context_id has more than {cfg.max_id_chars} chars")
        check_sampling(r.sampling)
        return request_to_dict(r, rid)

    async def _stream(self, r: pb.GenerateRequest, final_only: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The verifier's items for one request, with admission, routing, deadline and cleanup (`final_only`: the
        verifier sends the final item alone, for a unary reply)."""
        t0 = time.perf_counter()
        if r.request_id.startswith(MALFORMED):
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, r.request_id[len(MALFORMED) :])
        if len(r.request_id) > self.cfg.max_id_chars:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"request_id is over {self.cfg.max_id_chars} chars")
        if len(r.prompt) > self.cfg.max_prompt_chars:  # before the prompt is copied, tokenized or queued
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the prompt has {len(r.prompt)} characters; the limit is {self.cfg.max_prompt_chars}",
            )
        rid = r.request_id or uuid.uuid4().hex
        if rid in self.live or rid in self.queued:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already live")
        self.queued.add(rid)  # claimed before the first await: a concurrent duplicate is rejected above
        try:
            req = await self._validate(r, rid)
        except BaseException:
            self.queued.discard(rid)
            raise
        adm = self._admission
        i = route(affinity_key(req, self.cfg), adm.loads(), adm.capacity)
        try:
            await adm.acquire(i, token=rid)
        except QueueFull as e:
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except Evicted:  # aborted while queued: it never reached a verifier
            waited = time.perf_counter() - t0
            stats = {"latency_s": waited, "queue_time_s": waited, "method": req["method"]}
            yield {"request_id": rid, "final": True, "finish_reason": "abort", "stats": stats, "full_text": ""}
            return
        finally:
            self.queued.discard(rid)
            self._depth.set(adm.queue_depth)
        queue_time = time.perf_counter() - t0
        self.live[rid] = i
        req["final_only"] = final_only
        gen = self.verifiers[i].options(stream=True).generate.remote(req)
        deadline = t0 + r.timeout_s if r.timeout_s > 0 else None
        method = req["method"] or self._info["default_method"]
        status, first, finished, streamed = "ok", True, False, 0
        try:
            it = gen.__aiter__()
            while True:
                remaining = None if deadline is None else deadline - time.perf_counter()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                try:
                    item = await asyncio.wait_for(it.__anext__(), remaining)
                except StopAsyncIteration:
                    raise GatewayError(grpc.StatusCode.INTERNAL, "the verifier stream ended early") from None
                except (TimeoutError, asyncio.CancelledError, GatewayError):
                    raise
                except Exception as e:  # the replica died or became unreachable: no Ray internals to the user
                    log.warning("request %s: verifier-%d failed: %r", rid, i, e)
                    raise replica_failure(streamed) from None
                streamed += len(item.get("token_ids") or ())
                if "error" in item:
                    code = ERROR_CODES.get(item["error"], grpc.StatusCode.INTERNAL)
                    raise GatewayError(code, item.get("message", item["error"]))
                if first and item.get("token_ids"):
                    self._ttft.observe(time.perf_counter() - t0, tags={"method": method})
                    first = False
                if item.get("final"):
                    if first and item["stats"].get("ttft_s") is not None:  # final only: the verifier timed it
                        self._ttft.observe(queue_time + item["stats"]["ttft_s"], tags={"method": method})
                    item["stats"].update(latency_s=time.perf_counter() - t0, queue_time_s=queue_time)
                    finished = True
                    yield item
                    return
                yield item
        except TimeoutError:
            status = "deadline_exceeded"
            raise GatewayError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} exceeded its timeout of {r.timeout_s:g} s"
            ) from None
        except GatewayError as e:
            status = e.code.name.lower()
            raise
        except BaseException:
            status = "cancelled"
            raise
        finally:
            if not finished:
                gen.cancel()  # the verifier's generator closes and aborts the sequence
                for v in self.verifiers:  # belt and braces: the abort must reach the engine
                    v.abort.remote(rid)
            self.live.pop(rid, None)
            adm.release(i)
            self._depth.set(adm.queue_depth)
            self._latency.observe(time.perf_counter() - t0, tags={"method": method, "status": status})
            self._requests.inc(tags={"status": status})

    @staticmethod
    def _fail(grpc_context, e: GatewayError) -> None:
        if grpc_context is not None:
            grpc_context.set_code(e.code)
            grpc_context.set_details(e.message)
        raise e

    def _authorized(self, header: str | None) -> bool:
        if self._token is None:
            return True
        want = f"Bearer {self._token}".encode()
        return header is not None and hmac.compare_digest(header.encode(), want)

    def _check_auth(self, grpc_context) -> None:
        """With a token configured, every RPC needs the metadata `authorization: Bearer <token>`."""
        if self._token is None:
            return
        header = None
        if grpc_context is not None:
            header = dict(grpc_context.invocation_metadata()).get("authorization")
        if not self._authorized(header):
            self._fail(grpc_context, GatewayError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"))

    async def _verifier_call(self, v, name: str, *args) -> Any:
        """One call to a verifier with a bound on the wait (a dead replica must not hang Health or Abort)."""

        async def call():
            return await getattr(v, name).remote(*args)

        return await asyncio.wait_for(call(), self.cfg.health_timeout_s)

    async def process_id(self) -> int:
        """The replica's pid (fault-injection tests kill it: `make reliability`)."""
        return os.getpid()

    # --- RPCs ------------------------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateChunk]:
        self._check_auth(grpc_context)
        try:
            async for item in self._stream(request):
                yield chunk_to_pb(item)
        except GatewayError as e:
            self._fail(grpc_context, e)

    async def GenerateOnce(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        self._check_auth(grpc_context)
        final: dict[str, Any] = {}
        try:
            async for item in self._stream(request, final_only=True):
                if item.get("final"):
                    final = item
        except GatewayError as e:
            self._fail(grpc_context, e)
        return pb.GenerateResponse(
            request_id=final["request_id"],
            text=final["full_text"],
            token_ids=final.get("output_ids", []),
            finish_reason=final["finish_reason"],
            stats=stats_to_pb(final["stats"]),
        )

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:
        self._check_auth(grpc_context)
        rid = request.request_id
        if rid.startswith(MALFORMED):
            self._fail(grpc_context, GatewayError(grpc.StatusCode.INVALID_ARGUMENT, rid[len(MALFORMED) :]))
        if not rid or len(rid) > self.cfg.max_id_chars:
            msg = f"request_id must have 1 to {self.cfg.max_id_chars} characters"
            self._fail(grpc_context, GatewayError(grpc.StatusCode.INVALID_ARGUMENT, msg))
        await self.info()
        if self._admission.evict(rid):
            return pb.AbortResponse(aborted=True)
        calls = (self._verifier_call(v, "abort", rid) for v in self.verifiers)
        results = await asyncio.gather(*calls, return_exceptions=True)
        return pb.AbortResponse(aborted=any(r is True for r in results))

    async def Health(self, request: pb.HealthRequest, grpc_context=None) -> pb.HealthResponse:
        self._check_auth(grpc_context)
        await self.info()
        calls = (self._verifier_call(v, "health") for v in self.verifiers)
        reports = await asyncio.gather(*calls, return_exceptions=True)
        resp = pb.HealthResponse(
            status="ok",
            queue_depth=self._admission.queue_depth,
            in_flight=sum(self._admission.in_flight),
            rejected=self._admission.rejected,
        )
        for k, rep in enumerate(reports):
            if isinstance(rep, BaseException) or not rep.get("alive", False):
                resp.status = "degraded"
                resp.replicas.add(name=f"verifier-{k}")
                continue
            rep = {key: val for key, val in rep.items() if key != "alive"}
            resp.replicas.add(**rep)
        return resp

    async def GetModelInfo(self, request: pb.ModelInfoRequest, grpc_context=None) -> pb.ModelInfo:
        self._check_auth(grpc_context)
        info = await self.info()
        fields = set(pb.ModelInfo.DESCRIPTOR.fields_by_name)
        return pb.ModelInfo(num_verifiers=len(self.verifiers), **{k: v for k, v in info.items() if k in fields})

    @http_app.post("/v1/completions")
    async def completions(self, request: Request):
        """OpenAI-style text completion; `"stream": true` answers with server-sent events."""
        if not self._authorized(request.headers.get("authorization")):
            return _openai_error(GatewayError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"))
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "the body must be a JSON object")
            req = completion_request(body)
        except GatewayError as e:
            return _openai_error(e)
        except ValueError as e:
            return _openai_error(GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"bad request body: {e}"))
        created = int(time.time())
        model = (await self.info())["model"]
        stream = self._stream(req, final_only=not body.get("stream"))  # a non-streaming reply: the final item
        try:  # the first item surfaces validation and admission errors as HTTP statuses
            first = await stream.__anext__()
        except GatewayError as e:
            return _openai_error(e)

        def choice(item: dict[str, Any], text: str) -> dict[str, Any]:
            return {"text": text, "index": 0, "logprobs": None, "finish_reason": item.get("finish_reason") or None}

        def usage(stats: dict[str, Any]) -> dict[str, int]:
            p, g = stats.get("prompt_tokens", 0), stats.get("generated_tokens", 0)
            return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

        rid = "cmpl-" + first["request_id"]
        if body.get("stream"):

            async def events():
                item = first
                try:
                    while True:
                        doc = {"id": rid, "object": "text_completion", "created": created, "model": model}
                        doc["choices"] = [choice(item, item.get("text") or "")]
                        if item.get("final"):
                            doc["usage"] = usage(item["stats"])
                        yield f"data: {json.dumps(doc)}\n\n"
                        if item.get("final"):
                            break
                        item = await stream.__anext__()
                except GatewayError as e:
                    yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.code.name.lower()}})}\n\n"
                finally:
                    await stream.aclose()
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        item = first
        try:
            while not item.get("final"):
                item = await stream.__anext__()
        except GatewayError as e:
            return _openai_error(e)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice(item, item["full_text"])],
            "usage": usage(item["stats"]),
        }


__all__ = [
    "Admission",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "affinity_key",
    "completion_request",
    "http_app",
    "route",
]
