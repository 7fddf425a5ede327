"""The SDK's retry (a server that cannot take the call: UNAVAILABLE) and bearer token, against a plain loopback gRPC
server (no Ray): a restarting gateway is survived, a stream that already delivered tokens is never replayed; the
`spyglass` commands' own clients (serve's readiness, demo and drain; health; generate --server) send the token."""

from __future__ import annotations

import asyncio
import io
from concurrent import futures

import grpc
import pytest

from protos import spyglass_pb2 as pb
from protos import spyglass_pb2_grpc as pb_grpc
from services.gateway import check_sampling
from services.grpc_api import MALFORMED, tolerant_parser
from spyglass.client import AsyncClient, Client, SpyglassError


class Flaky(pb_grpc.SpyglassServicer):
    """UNAVAILABLE for the first `fail` calls of each kind; streams can also fail after their first chunk."""

    def __init__(self, fail: int, fail_mid_stream: bool = False) -> None:
        self.fail = fail
        self.fail_mid_stream = fail_mid_stream
        self.calls = {"once": 0, "stream": 0, "health": 0}
        self.metadata: list[dict] = []

    def _maybe_fail(self, kind: str, context) -> None:
        self.calls[kind] += 1
        self.metadata.append(dict(context.invocation_metadata()))
        if self.calls[kind] <= self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

    def GenerateOnce(self, request, context):
        self._maybe_fail("once", context)
        return pb.GenerateResponse(request_id=request.request_id, text="ok", token_ids=[1, 2], finish_reason="length")

    def Generate(self, request, context):
        self._maybe_fail("stream", context)
        yield pb.GenerateChunk(request_id=request.request_id, token_ids=[1], text="a")
        if self.fail_mid_stream:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica went away")
        rid = request.request_id
        yield pb.GenerateChunk(request_id=rid, token_ids=[2], text="b", final=True, finish_reason="length")

    def Health(self, request, context):
        self._maybe_fail("health", context)
        return pb.HealthResponse(status="ok")


class Guarded(pb_grpc.SpyglassServicer):
    """Answers like a gateway started with a bearer token: UNAUTHENTICATED for a call without it."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.seen: list[str | None] = []

    def _check(self, context) -> None:
        header = dict(context.invocation_metadata()).get("authorization")
        self.seen.append(header)
        if header != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def _stats(self, request) -> pb.Stats:
        return pb.Stats(method=request.method or "ngram", prompt_tokens=5, generated_tokens=2, tokens_per_s=1.0)

    def GenerateOnce(self, request, context):
        self._check(context)
        stats = self._stats(request)
        return pb.GenerateResponse(
            request_id=request.request_id, text="ok", token_ids=[1, 2], finish_reason="length", stats=stats
        )

    def Generate(self, request, context):
        self._check(context)
        yield pb.GenerateChunk(request_id=request.request_id, token_ids=[1], text="o")
        stats = self._stats(request)
        yield pb.GenerateChunk(token_ids=[2], text="k", final=True, finish_reason="length", stats=stats)

    def Health(self, request, context):
        self._check(context)
        return pb.HealthResponse(status="ok", replicas=[pb.ReplicaHealth(name="verifier-0", total_kv_slots=4)])

    def GetModelInfo(self, request, context):
        self._check(context)
        return pb.ModelInfo(model="m", methods=["ngram"], num_verifiers=1)


@pytest.fixture
def server():
    holder = {}

    def start(servicer):
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_SpyglassServicer_to_server(servicer, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        holder["srv"] = srv
        return f"127.0.0.1:{port}"

    yield start
    if "srv" in holder:
        holder["srv"].stop(grace=None)


def test_unary_and_stream_retry_unavailable(server):
    svc = Flaky(fail=2)
    addr = server(svc)
    with Client(addr, timeout=10, retries=3, retry_backoff_s=0.01, token="s3cret") as c:
        assert c.generate_text("hi").text == "ok"
        chunks = list(c.generate("hi"))
        assert [t for ch in chunks for t in ch.token_ids] == [1, 2]
        assert c.health()["status"] == "ok"
    assert svc.calls == {"once": 3, "stream": 3, "health": 3}
    assert all(md.get("authorization") == "Bearer s3cret" for md in svc.metadata)


def test_retries_are_bounded(server):
    addr = server(Flaky(fail=10))
    with Client(addr, timeout=10, retries=2, retry_backoff_s=0.01) as c:
        with pytest.raises(SpyglassError) as e:
            c.generate_text("hi")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_stream_is_not_replayed_after_tokens(server):
    svc = Flaky(fail=0, fail_mid_stream=True)
    addr = server(svc)
    with Client(addr, timeout=10, retries=5, retry_backoff_s=0.01) as c:
        got = []
        with pytest.raises(SpyglassError) as e:
            for ch in c.generate("hi"):
                got += ch.token_ids
    assert got == [1] and e.value.code == grpc.StatusCode.UNAVAILABLE and svc.calls["stream"] == 1


def test_async_client_retries(server):
    svc = Flaky(fail=1)
    addr = server(svc)

    async def main():
        async with AsyncClient(addr, timeout=10, retries=2, retry_backoff_s=0.01) as c:
            one = await c.generate_text("hi")
            chunks = [ch async for ch in c.generate("hi")]
            return one, chunks

    one, chunks = asyncio.run(main())
    assert one.text == "ok" and chunks[-1].final and svc.calls["once"] == 2 and svc.calls["stream"] == 2


def test_sampling_checks_and_tolerant_parser():
    check_sampling(pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3))
    for bad in (dict(temperature=float("nan")), dict(top_p=0.0), dict(min_p=1.0), dict(seed=-2), dict(top_k=-1)):
        with pytest.raises(Exception, match="must be"):
            check_sampling(pb.SamplingParams(**bad))
    parse = tolerant_parser(pb.GenerateRequest, "request_id")
    good = pb.GenerateRequest(prompt="abc", request_id="r1")
    assert parse(good.SerializeToString()) == good
    bad = parse(good.SerializeToString().replace(b"abc", b"a\xffc"))
    assert bad.request_id.startswith(MALFORMED) and "UTF-8" in bad.request_id and bad.prompt == ""
    assert tolerant_parser(pb.HealthRequest, None)(b"\xff\xff") == pb.HealthRequest()


def test_serve_sends_the_token_its_gateway_requires(server, monkeypatch):
    """`spyglass serve` with SPYGLASS_AUTH_TOKEN set: its readiness wait, demo requests and drain send the token."""
    from services.app import auth_token, demo_via, drain, run_demo, wait_ready

    svc = Guarded("s3cret")
    addr = server(svc)
    monkeypatch.setenv("SPYGLASS_AUTH_TOKEN", "s3cret")
    monkeypatch.setenv("OTHER_TOKEN_VAR", "other")
    assert auth_token({}) == "s3cret"
    assert auth_token({"gateway": {"auth_token_env": "OTHER_TOKEN_VAR"}}) == "other"  # the variable the config names
    token = auth_token({})
    assert wait_ready(addr, timeout_s=30, token=token)["model"] == "m"
    stats = run_demo(addr, 2, out=io.StringIO(), token=token, learned_method="ngram")
    assert stats["generated_tokens"] == 2 and stats["learned_check"]["identical"]
    assert demo_via(addr, "hi", "ngram", [1, 2], 2, "ctx", token=token)["identical"]
    assert drain(addr, 1.0, token=token) == 0
    assert len(svc.seen) >= 7 and all(h == "Bearer s3cret" for h in svc.seen)
    # without it the same calls are refused (what `spyglass serve` did before it sent the token)
    with pytest.raises(SpyglassError) as e:
        wait_ready(addr, timeout_s=0)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert drain(addr, 1.0) == -1


def test_cli_commands_send_the_token_from_the_environment(server, monkeypatch, capsys):
    import json

    from cli.main import main

    addr = server(Guarded("s3cret"))
    monkeypatch.delenv("SPYGLASS_AUTH_TOKEN", raising=False)
    assert main(["health", "--server", addr]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["generate", "--server", addr, "--prompt", "hi", "--json"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("SPYGLASS_AUTH_TOKEN", "s3cret")
    assert main(["health", "--server", addr]) == 0
    capsys.readouterr()
    assert main(["generate", "--server", addr, "--prompt", "hi", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "ok"
