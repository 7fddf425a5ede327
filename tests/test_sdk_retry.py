"""The SDK's retry (a server that cannot take the call: UNAVAILABLE) and bearer token, against a plain loopback gRPC
server (no Ray): a restarting gateway is survived, a stream that already delivered tokens is never replayed."""

from __future__ import annotations

import asyncio
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
