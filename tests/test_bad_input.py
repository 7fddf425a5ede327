"""Bad input through the real gRPC stack (Ray Serve gRPC proxy -> gateway -> verifier, SmolLM2, Redis).

Every case must end with the right status and a message meant for users (no Ray internals, no traceback), be
rejected before anything is allocated for it, and leave the replica healthy and idle. One stack per module.
"""

from __future__ import annotations

import asyncio
import math
import uuid

import grpc
import pytest

from protos import spyglass_pb2 as pb
from services.gateway import GatewayConfig
from spyglass.client import AsyncClient, Client, SpyglassError
from spyglass.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS

MAX_CONTEXT = 2048
NEW_TOKENS_LIMIT = 512
IA = grpc.StatusCode.INVALID_ARGUMENT
PROMPT = "List the days of the week, one per line."
INTERNALS = ("Traceback", "RayTaskError", "ActorID", "actor_id", "ray::", "Exception deserializing", "pid=")


@pytest.fixture(scope="module")
def stack(ray_cluster, redis_server):
    from ray import serve

    from services.app import deploy, wait_ready
    from services.local_redis import free_port

    args = {
        "num_verifiers": 1,
        "redis_url": redis_server.url,
        "gateway": {"max_queued": 2},
        "verifier": {
            "methods": ["ngram", "ar"],
            "max_batch": 2,
            "max_context": MAX_CONTEXT,
            "threads": 1,
            "max_new_tokens_limit": NEW_TOKENS_LIMIT,
            "cache_block_size": 64,
            "warmup_prompt_tokens": 200,
        },
    }
    doc = {"applications": [{"name": "spyglass", "route_prefix": "/", "args": args}]}
    try:  # a failed start must not leave Serve (and its proxy's port) behind for the next module
        address, _ = deploy(doc, grpc_port=free_port(), http_port=free_port())
        wait_ready(address, timeout_s=600)
        yield address
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def channel(stack):
    with grpc.insecure_channel(stack) as ch:
        yield ch


def assert_user_message(details: str) -> None:
    assert details and not any(s in details for s in INTERNALS), details


def idle(client: Client) -> dict:
    import time

    t0 = time.monotonic()
    while True:
        h = client.health()
        (rep,) = h["replicas"]
        if rep["live_sequences"] == 0 and rep["free_kv_slots"] == rep["total_kv_slots"] and h["in_flight"] == 0:
            return h
        assert time.monotonic() - t0 < 60, h
        time.sleep(0.2)


LIMITS = GatewayConfig()
# (id, keyword arguments of the SDK's request, substring of the message); all INVALID_ARGUMENT
CASES = [
    ("empty-prompt", {"prompt": ""}, "prompt is empty"),
    ("blank-prompt", {"prompt": " \n\t "}, "prompt is empty"),
    ("prompt-and-ids", {"prompt": "hi", "prompt_token_ids": [1, 2]}, "only one of"),
    ("ids-fill-context", {"prompt_token_ids": [1] * MAX_CONTEXT}, "context holds"),
    ("text-over-context", {"prompt": "word " * 2 * MAX_CONTEXT}, "context holds"),
    ("prompt-over-char-limit", {"prompt": "x" * (LIMITS.max_prompt_chars + 1)}, "the limit is"),
    ("negative-token-id", {"prompt_token_ids": [1, -1]}, "token ids must be in"),
    ("token-id-vocab", {"prompt_token_ids": [49152]}, "token ids must be in"),
    ("token-id-int32-max", {"prompt_token_ids": [2**31 - 1]}, "token ids must be in"),
    ("temperature-nan", {"temperature": math.nan}, "temperature must be a finite number"),
    ("temperature-inf", {"temperature": math.inf}, "temperature must be a finite number"),
    ("temperature-negative", {"temperature": -1.0}, "temperature must be >= 0"),
    ("top-p-zero", {"top_p": 0.0}, "top_p must be in (0, 1]"),
    ("top-p-over-one", {"top_p": 1.5}, "top_p must be in (0, 1]"),
    ("top-p-nan", {"top_p": math.nan}, "top_p must be a finite number"),
    ("top-k-negative", {"top_k": -1}, "top_k must be >= 0"),
    ("min-p-one", {"min_p": 1.0}, "min_p must be in [0, 1)"),
    ("repetition-penalty-zero", {"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ("repetition-penalty-neg-inf", {"repetition_penalty": -math.inf}, "repetition_penalty must be a finite"),
    ("contextual-penalty-below-one", {"contextual_penalty": 0.5}, "contextual_penalty must be >= 1"),
    ("penalty-window-negative", {"penalty_window": -5}, "penalty_window must be > 0"),
    ("seed-negative", {"seed": -1}, "seed must be in"),
    ("max-new-tokens-over-limit", {"max_new_tokens": 100000}, f"max_new_tokens must be <= {NEW_TOKENS_LIMIT}"),
    ("unknown-method", {"method": "telepathy"}, "unknown method"),
    ("method-not-served", {"method": "longspec"}, "unknown method"),
    ("timeout-negative", {"timeout_s": -1.0}, "timeout_s must be in"),
    ("timeout-nan", {"timeout_s": math.nan}, "timeout_s must be in"),
    ("timeout-inf", {"timeout_s": math.inf}, "timeout_s must be in"),
    ("too-many-stops", {"stop": [f"s{k}" for k in range(MAX_STOP_STRINGS + 1)]}, "stop strings"),
    ("empty-stop", {"stop": [""]}, "stop strings must have"),
    ("huge-stop", {"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop strings must have"),
    ("long-request-id", {"request_id": "r" * (LIMITS.max_id_chars + 1)}, "request_id must have at most"),
    ("long-context-id", {"context_id": "c" * (LIMITS.max_id_chars + 1)}, "context_id must have at most"),
    ("prompt-and-messages", {"messages": [{"role": "user", "content": "hi"}]}, "only one of"),
    ("chat-role", {"prompt": None, "messages": [{"role": "robot", "content": "hi"}]}, "role must be one of"),
    ("chat-empty", {"prompt": None, "messages": []}, "the prompt is empty"),
    (
        "chat-over-context",
        {"prompt": None, "messages": [{"role": "user", "content": "word " * 2 * MAX_CONTEXT}]},
        "holds",
    ),
]


@pytest.mark.parametrize("kwargs, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_is_invalid_argument(client, kwargs, needle):
    kw = dict(kwargs)
    prompt = kw.pop("prompt", None if "prompt_token_ids" in kw else PROMPT)
    kw.setdefault("max_new_tokens", 4)
    with pytest.raises(SpyglassError) as unary:
        client.generate_text(prompt, **kw)
    with pytest.raises(SpyglassError) as stream:
        list(client.generate(prompt, **kw))
    for e in (unary.value, stream.value):
        assert e.code == IA, (e.code, e.details)
        assert needle in e.details, e.details
        assert_user_message(e.details)


def _raw_generate(channel, payload: bytes, method: str = "/spyglass.v1.Spyglass/GenerateOnce"):
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    return call(payload, timeout=60)


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"\xff\xff\xff\xff\x0f garbage", "not a valid GenerateRequest"),
        (pb.GenerateRequest(prompt="abcdef").SerializeToString()[:-2], "not a valid GenerateRequest"),
        (pb.GenerateRequest(prompt="abcd").SerializeToString().replace(b"abcd", b"ab\xff\xfe"), "UTF-8"),
    ],
    ids=["garbage", "truncated", "invalid-utf8"],
)
def test_unparsable_request_is_invalid_argument(channel, payload, needle):
    for method in ("/spyglass.v1.Spyglass/GenerateOnce", "/spyglass.v1.Spyglass/Generate"):
        with pytest.raises(grpc.RpcError) as e:
            if method.endswith("/Generate"):
                stream = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
                list(stream(payload, timeout=60))
            else:
                _raw_generate(channel, payload, method)
        assert e.value.code() == IA, (e.value.code(), e.value.details())
        assert needle in e.value.details()
        assert_user_message(e.value.details())


def test_unknown_fields_are_ignored(channel):
    """Forward compatibility: a field this server does not know (number 99) does not break the request."""
    base = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=2).SerializeToString()
    unknown = bytes([0x98, 0x06, 0x01])  # field 99, varint 1
    resp = pb.GenerateResponse.FromString(_raw_generate(channel, base + unknown))
    assert resp.finish_reason in ("length", "stop") and len(resp.token_ids) >= 1


@pytest.mark.parametrize("method", ["/spyglass.v1.Spyglass/Telepathy", "/spyglass.v2.Spyglass/Generate", "/Nope/Nope"])
def test_unknown_rpc_is_unimplemented(channel, method):
    with pytest.raises(grpc.RpcError) as e:
        _raw_generate(channel, pb.GenerateRequest(prompt=PROMPT).SerializeToString(), method)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_oversized_message_is_rejected(client):
    """A 9 MB prompt: refused by the transport's message limit or by the gateway's prompt limit, quickly."""
    with pytest.raises(SpyglassError) as e:
        client.generate_text("y" * (9 << 20), max_new_tokens=4)
    assert e.value.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, IA), e.value
    assert_user_message(e.value.details)


def test_abort_bad_ids(client):
    with pytest.raises(SpyglassError) as e:
        client.abort("")
    assert e.value.code == IA and "request_id" in e.value.details
    with pytest.raises(SpyglassError) as e:
        client.abort("a" * (LIMITS.max_id_chars + 1))
    assert e.value.code == IA
    assert client.abort(f"never-seen-{uuid.uuid4().hex}") is False


def test_duplicate_live_request_id_and_repeated_aborts(client, stack):
    idle(client)
    rid = f"dup-{uuid.uuid4().hex}"
    gen = client.generate(PROMPT, max_new_tokens=300, ignore_eos=True, request_id=rid)
    first = next(gen)
    assert first.request_id == rid
    with Client(stack, timeout=60) as other:
        with pytest.raises(SpyglassError) as e:
            other.generate_text(PROMPT, max_new_tokens=4, request_id=rid)
        assert e.value.code == IA and "already live" in e.value.details
        assert other.abort(rid) is True
        assert other.abort(rid) in (True, False)  # the first abort may still be on its way to the engine
    rest = list(gen)
    assert rest[-1].final and rest[-1].finish_reason == "abort"
    idle(client)
    assert client.abort(rid) is False and client.abort(rid) is False
    # the id is free again once the request ended
    assert client.generate_text(PROMPT, max_new_tokens=2, request_id=rid).request_id == rid


def test_concurrent_duplicate_request_ids_admit_exactly_one(stack, client):
    idle(client)
    rid = f"race-{uuid.uuid4().hex}"

    async def main():
        async with AsyncClient(stack, timeout=120) as c:
            calls = [c.generate_text(PROMPT, max_new_tokens=3, request_id=rid) for _ in range(4)]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(main())
    ok = [r for r in results if not isinstance(r, BaseException)]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(ok) >= 1, results
    for e in errors:  # a duplicate is refused while the first is live (a later one may run after it ended)
        assert isinstance(e, SpyglassError) and e.code == IA and "already live" in e.details, e
    idle(client)


def test_replica_is_healthy_after_everything(client):
    """Runs last in this module: nothing above left a sequence, a slot or a queued request behind."""
    h = idle(client)
    assert h["status"] == "ok" and h["queue_depth"] == 0
    (rep,) = h["replicas"]
    assert rep["free_kv_slots"] == rep["total_kv_slots"] == 2  # one KV pool of max_batch slots for both methods
    out = client.generate_text(PROMPT, max_new_tokens=6)
    assert out.finish_reason in ("length", "stop") and out.token_ids
