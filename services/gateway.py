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
from spyglass import limits
from spyglass.client import AUTH_TOKEN_ENV
from spyglass.limits import SAMPLING_RULES, RequestError

log = logging.getLogger(__name__)

SAMPLING_FIELDS = tuple(SAMPLING_RULES)
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


def invalid(message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class GatewayConfig:
    max_queued: int = 16  # per verifier, beyond its in-flight limit
    batch_wait_timeout_s: float = 0.005  # admission batching window
    affinity_prefix_chars: int = 2048  # prompt prefix hashed for affinity when no context id is given
    min_affinity_chars: int = 256  # shorter prompts carry no useful context: least loaded wins
    # Limits checked on the parsed request before anything is tokenized, queued or allocated (spyglass/limits.py
    # holds every rule, the stop strings' limits and these defaults).
    max_prompt_chars: int = limits.MAX_PROMPT_CHARS  # prompt text (the context limit is checked on tokens)
    max_id_chars: int = limits.MAX_ID_CHARS  # request_id and context_id
    max_timeout_s: float = limits.MAX_TIMEOUT_S
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
    if req.get("messages"):
        req = {"prompt": "".join(m["content"] for m in req["messages"])}
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
        "messages": [{"role": m.role, "content": m.content} for m in r.messages],
        "stream_interval_s": r.stream_interval_s if r.HasField("stream_interval_s") else None,
    }


def check_sampling(sp: pb.SamplingParams) -> None:
    """The sampling fields' rules (spyglass/limits.py: the verifier's SamplingParams checks the same ones)."""
    try:
        limits.check_sampling({f: getattr(sp, f) for f in SAMPLING_FIELDS if sp.HasField(f)})
    except RequestError as e:
        raise invalid(str(e)) from None


def validate_request(r: pb.GenerateRequest, info: dict[str, Any], cfg: GatewayConfig) -> None:
    """Everything about a request that can be checked before it is tokenized or queued (spyglass/limits.py's rules;
    `info`: the verifiers' model info). A text prompt's length in tokens is checked by the verifier."""
    try:
        if sum(map(bool, (r.prompt, r.prompt_token_ids, r.messages))) > 1:
            raise RequestError("give only one of prompt, prompt_token_ids and messages")
        if r.messages:
            limits.check_messages([{"role": m.role, "content": m.content} for m in r.messages], cfg.max_prompt_chars)
        elif r.prompt_token_ids:
            limits.check_prompt_ids(r.prompt_token_ids, info["vocab_size"], info["context_length"])
        else:
            limits.check_prompt_text(r.prompt, cfg.max_prompt_chars)
        if r.method:  # "" = the server's default
            limits.check_method(r.method, info["methods"])
        if r.max_new_tokens:  # 0 = the server's default
            limits.check_max_new_tokens(r.max_new_tokens, info["max_new_tokens_limit"])
        limits.check_timeout(r.timeout_s, cfg.max_timeout_s)
        if r.HasField("stream_interval_s"):  # unset: the replica's
            limits.check_stream_interval(r.stream_interval_s)
        limits.check_stop(r.stop)
        limits.check_id("context_id", r.context_id, cfg.max_id_chars)
    except RequestError as e:
        raise invalid(str(e)) from None
    check_sampling(r.sampling)


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
    from ray.util import metrics  # Ray: in the Serve replica that records them (at the top, it crashed test_serving)

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


# --- OpenAI-compatible HTTP on the same deployment: /v1/completions, /v1/chat/completions, /v1/models -----------
http_app = FastAPI(title="spyglass", description="OpenAI-compatible completions and chat over the spyglass gateway")
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
}
INT_FIELDS = ("top_k", "penalty_window", "seed")
# OpenAI fields this server cannot honour: refused (400) rather than ignored; a value equal to the default is fine.
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "logprobs": False,
    "top_logprobs": 0,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "tools": [],
    "functions": [],
    "suffix": "",
}


def _number(body: dict[str, Any], key: str, integer: bool) -> int | float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise invalid(f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    return value


def _message(m: Any) -> dict[str, Any]:
    """An OpenAI chat message -> {role, content} ("developer" is the system role; content parts must be text)."""
    if not isinstance(m, dict):
        raise invalid("each message must be an object with a role and a content")
    role, content = m.get("role"), m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise invalid("a message's content must be text (content parts of type 'text')")
        content = "".join(p["text"] for p in content)
    return {"role": "system" if role == "developer" else role, "content": content}


def openai_request(body: Any, chat: bool, info: dict[str, Any], cfg: GatewayConfig) -> pb.GenerateRequest:
    """An OpenAI /v1/completions (raw text, no chat template) or /v1/chat/completions (the model's chat template on
    `messages`) body -> GenerateRequest, checked with the same rules as the gRPC path (spyglass/limits.py).
    Extensions: `method` (the drafter), the other sampling fields of SamplingParams, `ignore_eos`,
    `stream_interval_s` (the most often a stream's new tokens are sent; 0: every step's)."""
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    for key, default in UNSUPPORTED.items():
        if body.get(key) not in (None, default):
            raise invalid(f"{key} is not supported (only {key}={json.dumps(default)}), got {body[key]!r}")
    req = pb.GenerateRequest()
    try:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise invalid("messages must be a list of messages")
            messages = [_message(m) for m in messages]
            limits.check_messages(messages, cfg.max_prompt_chars)
            for m in messages:
                req.messages.add(role=m["role"], content=m["content"])
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                if len(prompt) != 1:
                    raise invalid("exactly one prompt per request is supported")
                prompt = prompt[0]
            req.raw = True
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                limits.check_prompt_ids(prompt, info["vocab_size"], info["context_length"])
                req.prompt_token_ids.extend(prompt)
            elif isinstance(prompt, str):
                req.prompt = prompt
            else:
                raise invalid("prompt must be a string or a list of token ids")
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, integer=True)
        if max_tokens is None and not chat:
            max_tokens = 16  # OpenAI's default for completions; chat: the server's default
        if max_tokens is not None:
            limits.check_max_new_tokens(max_tokens, info["max_new_tokens_limit"], name=key)
            req.max_new_tokens = max_tokens
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list):
            raise invalid("stop must be a string or a list of strings")
        limits.check_stop(stop)
        req.stop.extend(stop)
        sampling = {k: _number(body, k, integer=k in INT_FIELDS) for k in SAMPLING_FIELDS}
        limits.check_sampling(sampling)
        for k, v in sampling.items():
            if v is not None:
                setattr(req.sampling, k, v)
        for key, kind in (("method", str), ("ignore_eos", bool)):
            if body.get(key) is not None and not isinstance(body[key], kind):
                raise invalid(f"{key} must be a {kind.__name__}, got {body[key]!r}")
        req.method = body.get("method") or ""
        req.ignore_eos = bool(body.get("ignore_eos"))
        if (interval := _number(body, "stream_interval_s", integer=False)) is not None:
            limits.check_stream_interval(interval)
            req.stream_interval_s = interval
    except RequestError as e:
        raise invalid(str(e)) from None
    except ValueError as e:  # a number the wire format cannot hold (e.g. top_k over 2**31)
        raise invalid(f"bad request body: {e}") from None
    return req


def _openai_error(e: GatewayError) -> JSONResponse:
    kind = "invalid_request_error" if e.code == grpc.StatusCode.INVALID_ARGUMENT else e.code.name.lower()
    doc = {"error": {"message": e.message, "type": kind, "param": None, "code": None}}
    return JSONResponse(doc, status_code=HTTP_STATUS.get(e.code, 500))


def _usage(stats: dict[str, Any]) -> dict[str, int]:
    p, g = stats.get("prompt_tokens", 0), stats.get("generated_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def _choice(chat: bool, text: str, finish_reason: str | None, delta: bool = False, first: bool = False):
    """One OpenAI choice: a completion's `text`, a chat reply's `message`, or a streamed chat chunk's `delta` (the
    first one names the role)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason or None}
    if not chat:
        choice["text"] = text
    elif not delta:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
    return choice


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
        self._started = int(time.time())
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
        validate_request(r, await self.info(), self.cfg)
        return request_to_dict(r, rid)

    async def _stream(self, r: pb.GenerateRequest, final_only: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The verifier's items for one request, with admission, routing, deadline and cleanup (`final_only`: the
        verifier sends the final item alone, for a unary reply)."""
        t0 = time.perf_counter()
        if r.request_id.startswith(MALFORMED):
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, r.request_id[len(MALFORMED) :])
        try:
            limits.check_id("request_id", r.request_id, self.cfg.max_id_chars)
        except RequestError as e:
            raise invalid(str(e)) from None
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
        try:
            limits.check_id("request_id", rid, self.cfg.max_id_chars, required=True)
        except RequestError as e:
            self._fail(grpc_context, invalid(str(e)))
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
        """OpenAI-style text completion (no chat template); `"stream": true` answers with server-sent events."""
        return await self._openai(request, chat=False)

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        """OpenAI-style chat: the model's chat template on `messages`; `"stream": true` streams `delta` chunks."""
        return await self._openai(request, chat=True)

    @http_app.get("/v1/models")
    async def models(self, request: Request):
        """The served model (one per deployment)."""
        if not self._authorized(request.headers.get("authorization")):
            return _openai_error(GatewayError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"))
        return {"object": "list", "data": [await self._model_card()]}

    @http_app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        if not self._authorized(request.headers.get("authorization")):
            return _openai_error(GatewayError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"))
        card = await self._model_card()
        if model != card["id"]:
            return _openai_error(GatewayError(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here"))
        return card

    async def _model_card(self) -> dict[str, Any]:
        return {"id": (await self.info())["model"], "object": "model", "created": self._started, "owned_by": "spyglass"}

    async def _openai(self, request: Request, chat: bool):
        """The OpenAI routes: same limits, bearer token and errors as the gRPC path; errors as OpenAI's error JSON.
        The request's `model` is not checked (one model is served; replies name it)."""
        if not self._authorized(request.headers.get("authorization")):
            return _openai_error(GatewayError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"))
        info = await self.info()
        try:
            body = await request.json()
            req = openai_request(body, chat, info, self.cfg)
        except GatewayError as e:
            return _openai_error(e)
        except ValueError as e:
            return _openai_error(invalid(f"bad request body: {e}"))
        created, model = int(time.time()), info["model"]
        streaming = bool(body.get("stream"))
        stream = self._stream(req, final_only=not streaming)  # a non-streaming reply: the final item
        try:  # the first item surfaces validation and admission errors as HTTP statuses
            first = await stream.__anext__()
        except GatewayError as e:
            return _openai_error(e)
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + first["request_id"], "created": created, "model": model}
        if streaming:
            options = body.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

            async def events():
                item, opening = first, True
                doc = dict(head, object=kind + ".chunk" if chat else kind)
                try:
                    while True:
                        finish = item.get("finish_reason") if item.get("final") else None
                        doc["choices"] = [_choice(chat, item.get("text") or "", finish, delta=True, first=opening)]
                        opening = False
                        if item.get("final") and not chat:  # completions: usage on the last chunk
                            doc["usage"] = _usage(item["stats"])
                        yield f"data: {json.dumps(doc)}\n\n"
                        if item.get("final"):
                            if include_usage and chat:  # chat (OpenAI's stream_options): a last chunk, no choices
                                yield f"data: {json.dumps(dict(doc, choices=[], usage=_usage(item['stats'])))}\n\n"
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
        choice = _choice(chat, item["full_text"], item["finish_reason"])
        return dict(head, object=kind, choices=[choice], usage=_usage(item["stats"]))


__all__ = [
    "Admission",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "affinity_key",
    "openai_request",
    "validate_request",
    "http_app",
    "route",
]
