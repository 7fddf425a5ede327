"""gRPC client SDK for a spyglass server (sync `Client` and asyncio `AsyncClient`).

Imports only grpc and the generated stubs, never torch, so applications can talk to a server without
the model stack installed. Errors from the server raise `SpyglassError` carrying the gRPC status code.

    with Client("127.0.0.1:9000") as c:
        for chunk in c.generate("Explain KV caches", max_new_tokens=64):
            print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos import spyglass_pb2 as pb
from protos import spyglass_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:9000"
APP_NAME = "spyglass"
# Retried: the server could not take the call at all (restarting, not reachable yet). A stream is retried only
# before its first chunk, so no token is ever delivered twice; a request that failed mid-way is not retried.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# Where a server reads its bearer token (every RPC then needs it) and where the `spyglass` commands that talk to a
# server (serve's own requests, health, generate --server) read the token they send.
AUTH_TOKEN_ENV = "SPYGLASS_AUTH_TOKEN"


def env_token(name: str = AUTH_TOKEN_ENV) -> str | None:
    """The bearer token in the environment variable `name` (None when unset or empty)."""
    return os.environ.get(name) or None


def _metadata(application: str | None, token: str | None) -> tuple | None:
    md = []
    if application:
        md.append(("application", application))
    if token:
        md.append(("authorization", f"Bearer {token}"))
    return tuple(md) or None


def _backoff(attempt: int, base: float) -> float:
    return min(base * (2**attempt), 5.0)


def _channel_credentials(tls: bool | bytes) -> grpc.ChannelCredentials | None:
    if tls is False or tls is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=tls if isinstance(tls, bytes) else None)


class SpyglassError(Exception):
    """A failed call: `code` is the grpc.StatusCode, `details` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> SpyglassError:
        return cls(e.code(), e.details() or "")


@dataclass
class Chunk:
    """One streamed piece: new token ids and their text delta; the final chunk has the stats."""

    request_id: str
    token_ids: list[int]
    text: str
    accepted_tokens: int = 0
    batch_size: int = 0
    final: bool = False
    finish_reason: str = ""
    stats: dict[str, Any] | None = None


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)


def message_to_dict(msg) -> dict[str, Any]:
    """A flat-ish dict of a protobuf message (nested messages and maps become dicts, repeated lists)."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.is_repeated:
            out[f.name] = [message_to_dict(v) if f.message_type is not None else v for v in value]
        elif f.message_type is not None:
            out[f.name] = message_to_dict(value)
        else:
            out[f.name] = value
    return out


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: list[int] | None = None,
    max_new_tokens: int = 0,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    contextual_penalty: float | None = None,
    penalty_window: int | None = None,
    seed: int | None = None,
    stop: str | list[str] | tuple[str, ...] = (),
    ignore_eos: bool = False,
    method: str = "",
    context_id: str = "",
    request_id: str = "",
    timeout_s: float = 0.0,
    raw: bool = False,
    messages: list[dict[str, str]] | None = None,
    stream_interval_s: float | None = None,
) -> pb.GenerateRequest:
    """The wire request; unset sampling fields take the server defaults (greedy). `stop`: one stop string or a list
    of them. `messages`: a chat instead of a prompt, `[{"role": "system" | "user" | "assistant", "content": ...}]`,
    formatted by the server with the model's chat template. `stream_interval_s`: the most often the stream sends
    new tokens (0: each decoding step's as it comes; None: the server's setting)."""
    sampling = {
        k: v
        for k, v in dict(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            contextual_penalty=contextual_penalty,
            penalty_window=penalty_window,
            seed=seed,
        ).items()
        if v is not None
    }
    return pb.GenerateRequest(
        prompt=prompt or "",
        prompt_token_ids=list(prompt_token_ids or []),
        raw=raw,
        sampling=pb.SamplingParams(**sampling),
        max_new_tokens=max_new_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop),
        ignore_eos=ignore_eos,
        method=method,
        context_id=context_id,
        request_id=request_id or uuid.uuid4().hex,
        timeout_s=timeout_s,
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()],
        stream_interval_s=stream_interval_s,
    )


def _chunk(c: pb.GenerateChunk) -> Chunk:
    return Chunk(
        request_id=c.request_id,
        token_ids=list(c.token_ids),
        text=c.text,
        accepted_tokens=c.accepted_tokens,
        batch_size=c.batch_size,
        final=c.final,
        finish_reason=c.finish_reason,
        stats=message_to_dict(c.stats) if c.final else None,
    )


def _completion(r: pb.GenerateResponse) -> Completion:
    return Completion(r.request_id, r.text, list(r.token_ids), r.finish_reason, message_to_dict(r.stats))


class Client:
    """Blocking client. `timeout` (s) is the gRPC deadline of every call unless a call passes its own.

    `retries`: how often a call the server could not take (UNAVAILABLE, e.g. while the gateway restarts) is
    retried, with exponential back-off from `retry_backoff_s`; the channel reconnects by itself. `token`: a
    bearer token sent on every call (servers started with SPYGLASS_AUTH_TOKEN require it). `tls`: True for TLS
    with the system's roots, or the PEM bytes of a root certificate."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout: float | None = None,
        application: str | None = None,
        *,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        token: str | None = None,
        tls: bool | bytes = False,
    ):
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._metadata = _metadata(application, token)
        creds = _channel_credentials(tls)
        self._channel = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        self._stub = pb_grpc.SpyglassStub(self._channel)

    def _retry(self, attempt: int, e: grpc.RpcError) -> bool:
        if e.code() not in RETRYABLE or attempt >= self.retries:
            return False
        time.sleep(_backoff(attempt, self.retry_backoff_s))
        return True

    def generate(self, prompt: str | None = None, *, deadline: float | None = None, **kw) -> Iterator[Chunk]:
        """Stream chunks. Closing the iterator early cancels the call (the server frees the sequence)."""
        request = build_request(prompt, **kw)
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=deadline or self.timeout, metadata=self._metadata)
            done, received = False, False
            try:
                for c in call:
                    chunk = _chunk(c)
                    received = True
                    done = chunk.final
                    yield chunk
                return
            except grpc.RpcError as e:
                done = True
                if not received and self._retry(attempt, e):
                    attempt += 1
                    continue
                raise SpyglassError.from_rpc(e) from None
            finally:
                if not done:
                    call.cancel()

    def generate_text(self, prompt: str | None = None, *, deadline: float | None = None, **kw) -> Completion:
        """Unary generation: the whole output at once."""
        request = build_request(prompt, **kw)
        attempt = 0
        while True:
            try:
                r = self._stub.GenerateOnce(request, timeout=deadline or self.timeout, metadata=self._metadata)
                return _completion(r)
            except grpc.RpcError as e:
                if self._retry(attempt, e):
                    attempt += 1
                    continue
                raise SpyglassError.from_rpc(e) from None

    def abort(self, request_id: str) -> bool:
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id)).aborted

    def health(self) -> dict[str, Any]:
        return message_to_dict(self._unary(self._stub.Health, pb.HealthRequest()))

    def model_info(self) -> dict[str, Any]:
        return message_to_dict(self._unary(self._stub.GetModelInfo, pb.ModelInfoRequest()))

    def _unary(self, fn, request):
        attempt = 0
        while True:
            try:
                return fn(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if self._retry(attempt, e):
                    attempt += 1
                    continue
                raise SpyglassError.from_rpc(e) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same methods as `Client` (use inside a running event loop)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        timeout: float | None = None,
        application: str | None = None,
        *,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        token: str | None = None,
        tls: bool | bytes = False,
    ):
        self.address = address
        self.timeout = timeout
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._metadata = _metadata(application, token)
        creds = _channel_credentials(tls)
        self._channel = grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.SpyglassStub(self._channel)

    async def _retry(self, attempt: int, e: grpc.RpcError) -> bool:
        if e.code() not in RETRYABLE or attempt >= self.retries:
            return False
        await asyncio.sleep(_backoff(attempt, self.retry_backoff_s))
        return True

    async def generate(self, prompt: str | None = None, *, deadline: float | None = None, **kw) -> AsyncIterator[Chunk]:
        request = build_request(prompt, **kw)
        attempt = 0
        while True:
            call = self._stub.Generate(request, timeout=deadline or self.timeout, metadata=self._metadata)
            done, received = False, False
            try:
                async for c in call:
                    chunk = _chunk(c)
                    received = True
                    done = chunk.final
                    yield chunk
                return
            except grpc.RpcError as e:
                done = True
                if not received and await self._retry(attempt, e):
                    attempt += 1
                    continue
                raise SpyglassError.from_rpc(e) from None
            finally:
                if not done:
                    call.cancel()

    async def generate_text(self, prompt: str | None = None, *, deadline: float | None = None, **kw) -> Completion:
        request = build_request(prompt, **kw)
        attempt = 0
        while True:
            try:
                r = await self._stub.GenerateOnce(request, timeout=deadline or self.timeout, metadata=self._metadata)
                return _completion(r)
            except grpc.RpcError as e:
                if await self._retry(attempt, e):
                    attempt += 1
                    continue
                raise SpyglassError.from_rpc(e) from None

    async def abort(self, request_id: str) -> bool:
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id))).aborted

    async def health(self) -> dict[str, Any]:
        return message_to_dict(await self._unary(self._stub.Health, pb.HealthRequest()))

    async def model_info(self) -> dict[str, Any]:
        return message_to_dict(await self._unary(self._stub.GetModelInfo, pb.ModelInfoRequest()))

    async def _unary(self, fn, request):
        attempt = 0
        while True:
            try:
                return await fn(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if await self._retry(attempt, e):
                    attempt += 1
                    continue
                raise SpyglassError.from_rpc(e) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = [
    "AUTH_TOKEN_ENV",
    "AsyncClient",
    "Chunk",
    "Client",
    "Completion",
    "SpyglassError",
    "build_request",
    "env_token",
    "message_to_dict",
]
