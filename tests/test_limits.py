"""One table of request limits and sampling rules (spyglass/limits.py): every place that checks a request (the
gateway's gRPC validation, its OpenAI translation, SamplingParams, the verifier's request parsing and
SpecEngine.add_request) rejects a bad value with the same message, and lets good values through. No cluster."""

from __future__ import annotations

import math
import subprocess
import sys

import grpc
import pytest

from protos import spyglass_pb2 as pb
from services.gateway import GatewayConfig, GatewayError, openai_request, request_to_dict, validate_request
from services.verifier import VerifierConfig, sampling_from_request
from spyglass.client import build_request
from spyglass.engine import EngineConfig, RequestError, SpecEngine
from spyglass.limits import MAX_STOP_CHARS, MAX_STOP_STRINGS, check_stream_interval
from spyglass.sampling import SamplingParams

LIMIT = 512  # the verifier's max_new_tokens_limit
CFG = GatewayConfig()

# (sampling field, bad value, the message every path gives)
SAMPLING_CASES = [
    ("temperature", math.nan, "temperature must be a finite number, got nan"),
    ("temperature", math.inf, "temperature must be a finite number, got inf"),
    ("temperature", -1.0, "temperature must be >= 0 (0 = greedy), got -1.0"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", math.nan, "top_p must be a finite number, got nan"),
    ("top_k", -1, "top_k must be >= 0 (0 = off), got -1"),
    ("min_p", 1.0, "min_p must be in [0, 1), got 1.0"),
    ("min_p", -0.5, "min_p must be in [0, 1), got -0.5"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
    ("repetition_penalty", -math.inf, "repetition_penalty must be a finite number, got -inf"),
    ("contextual_penalty", 0.5, "contextual_penalty must be >= 1 (1 = off), got 0.5"),
    ("penalty_window", 0, "penalty_window must be > 0 tokens, got 0"),
    ("seed", -1, "seed must be in [0, 2**63), got -1"),
]
GOOD_SAMPLING = dict(
    temperature=0.5,
    top_k=40,
    top_p=0.5,
    min_p=0.25,
    repetition_penalty=1.5,
    contextual_penalty=2.0,
    penalty_window=64,
    seed=2**62,
)
STOP_CASES = [
    ([f"s{k}" for k in range(MAX_STOP_STRINGS + 1)], f"at most {MAX_STOP_STRINGS} stop strings, got 17"),
    ([""], f"stop strings must have 1 to {MAX_STOP_CHARS} characters"),
    (["x" * (MAX_STOP_CHARS + 1)], f"stop strings must have 1 to {MAX_STOP_CHARS} characters"),
]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from spyglass.models.llama import load_transformer
    from tests.tiny import make_tiny_tokenizer

    # with a tokenizer: an engine without one refuses stop strings (it could not find them in the text)
    config = EngineConfig(max_batch=1, max_context=64)
    return SpecEngine(load_transformer(tiny_dir["llama"]), None, config, make_tiny_tokenizer())


def info(engine: SpecEngine | None = None) -> dict:
    """The verifiers' model info the gateway validates against (the tiny engine's vocabulary and context)."""
    vocab, context = (engine.target.args.vocab_size, engine.capacity) if engine else (1000, 64)
    methods = engine.methods if engine else ["ar"]
    return {"vocab_size": vocab, "context_length": context, "methods": methods, "max_new_tokens_limit": LIMIT}


def gateway_message(request: pb.GenerateRequest, model_info: dict | None = None) -> str:
    with pytest.raises(GatewayError) as e:
        validate_request(request, model_info or info(), CFG)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.message


def openai_message(body: dict, chat: bool = False, model_info: dict | None = None) -> str:
    with pytest.raises(GatewayError) as e:
        openai_request(body, chat, model_info or info(), CFG)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value.message


def error_message(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args, **kwargs)
    return str(e.value)


@pytest.mark.parametrize("field, value, message", SAMPLING_CASES, ids=[f"{c[0]}={c[1]}" for c in SAMPLING_CASES])
def test_a_bad_sampling_value_gets_one_message_everywhere(field, value, message):
    grpc_request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(**{field: value}))
    assert gateway_message(grpc_request) == message
    assert openai_message({"prompt": "hi", field: value}) == message
    assert openai_message({"messages": [{"role": "user", "content": "hi"}], field: value}, chat=True) == message
    assert error_message(SamplingParams, **{field: value}) == message
    verifier_request = {"prompt": "hi", "sampling": {field: value}}
    assert error_message(sampling_from_request, verifier_request, VerifierConfig()) == message


@pytest.mark.parametrize("stop, message", STOP_CASES, ids=["too-many", "empty", "too-long"])
def test_a_bad_stop_list_gets_one_message_everywhere(stop, message):
    assert gateway_message(pb.GenerateRequest(prompt="hi", stop=stop)) == message
    assert openai_message({"prompt": "hi", "stop": stop}) == message
    assert error_message(SamplingParams, stop=tuple(stop)) == message
    assert error_message(sampling_from_request, {"prompt": "hi", "stop": stop}, VerifierConfig()) == message


def test_max_new_tokens_rules():
    over = f"max_new_tokens must be <= {LIMIT}, got {LIMIT + 1}"
    assert gateway_message(pb.GenerateRequest(prompt="hi", max_new_tokens=LIMIT + 1)) == over
    cfg = VerifierConfig(max_new_tokens_limit=LIMIT)
    assert error_message(sampling_from_request, {"prompt": "hi", "max_new_tokens": LIMIT + 1}, cfg) == over
    assert error_message(SamplingParams, max_new_tokens=0) == "max_new_tokens must be > 0, got 0"
    # the OpenAI routes name their own fields, with the same rule
    over = f"max_tokens must be <= {LIMIT}, got {LIMIT + 1}"
    assert openai_message({"prompt": "hi", "max_tokens": LIMIT + 1}) == over
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}
    assert openai_message(body, chat=True) == "max_completion_tokens must be > 0, got 0"


def test_a_stream_interval_has_one_rule_everywhere():
    for value in (-0.5, math.nan, math.inf, 3601.0):
        message = f"stream_interval_s must be a number of seconds in [0, 3600], got {value!r}"
        assert gateway_message(pb.GenerateRequest(prompt="hi", stream_interval_s=value)) == message
        assert openai_message({"prompt": "hi", "stream_interval_s": value}) == message
        assert error_message(VerifierConfig, stream_interval_s=value) == message
        # the verifier's own check (a request from a Python handle; its error item: tests/test_serving.py)
        assert error_message(check_stream_interval, value) == message
    assert openai_message({"prompt": "hi", "stream_interval_s": "0"}) == "stream_interval_s must be a number, got '0'"
    for good in (0.0, 0.25, 3600.0):  # unset: the replica's; set: carried to the verifier as given
        req = openai_request({"prompt": "hi", "stream_interval_s": good}, False, info(), CFG)
        assert req.HasField("stream_interval_s") and req.stream_interval_s == good
        validate_request(req, info(), CFG)
        assert request_to_dict(req, "r")["stream_interval_s"] == good
    assert request_to_dict(pb.GenerateRequest(prompt="hi"), "r")["stream_interval_s"] is None


def test_a_bad_prompt_or_method_gets_one_message_at_the_gateway_and_the_engine(engine):
    model_info = info(engine)
    vocab, context = model_info["vocab_size"], model_info["context_length"]
    cases = [
        ([], "the prompt is empty"),
        ([1, vocab], f"prompt token ids must be in [0, {vocab})"),
        ([1, -1], f"prompt token ids must be in [0, {vocab})"),
        (
            [1] * context,
            f"the prompt has {context} tokens but the context holds {context}: shorten it or raise max_context",
        ),
    ]
    for ids, message in cases:
        assert gateway_message(pb.GenerateRequest(prompt_token_ids=ids), model_info) == message
        assert openai_message({"prompt": ids}, model_info=model_info) == message
        with pytest.raises(RequestError) as e:
            engine.add_request(ids, SamplingParams())
        assert str(e.value) == message
    message = f"unknown method 'telepathy'; available: {', '.join(engine.methods)}"
    assert gateway_message(pb.GenerateRequest(prompt="hi", method="telepathy"), model_info) == message
    with pytest.raises(RequestError) as e:
        engine.add_request([1, 2], SamplingParams(), method="telepathy")
    assert str(e.value) == message
    assert not engine.waiting  # nothing was queued


def test_good_values_pass_everywhere(engine):
    model_info = info(engine)
    ids = [1] * (model_info["context_length"] - 1)
    sampling = pb.SamplingParams(**GOOD_SAMPLING)
    validate_request(pb.GenerateRequest(prompt_token_ids=ids, sampling=sampling, max_new_tokens=LIMIT), model_info, CFG)
    stops = ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    validate_request(pb.GenerateRequest(prompt="hi", stop=stops, timeout_s=60), model_info, CFG)
    req = openai_request({"prompt": ids, "max_tokens": LIMIT, "stop": stops, **GOOD_SAMPLING}, False, model_info, CFG)
    assert list(req.prompt_token_ids) == ids and req.max_new_tokens == LIMIT and req.sampling.seed == 2**62
    params = SamplingParams(max_new_tokens=LIMIT, stop=tuple(stops), **GOOD_SAMPLING)
    assert sampling_from_request({"sampling": GOOD_SAMPLING, "stop": stops}, VerifierConfig()) == SamplingParams(
        stop=tuple(stops), **GOOD_SAMPLING
    )
    seq = engine.add_request(ids, params)
    assert engine.waiting[-1] is seq
    engine.waiting.clear()


def test_other_request_limits_at_the_gateway():
    too_long = "x" * (CFG.max_prompt_chars + 1)
    chars = f"the prompt has {len(too_long)} characters; the limit is {CFG.max_prompt_chars}"
    assert gateway_message(pb.GenerateRequest(prompt=too_long)) == chars
    assert gateway_message(pb.GenerateRequest(prompt=" \n")) == "the prompt is empty"
    assert "only one of" in gateway_message(pb.GenerateRequest(prompt="hi", prompt_token_ids=[1]))
    assert "only one of" in gateway_message(pb.GenerateRequest(prompt="hi", messages=[pb.ChatMessage(role="user")]))
    assert gateway_message(pb.GenerateRequest(prompt="hi", timeout_s=-1)) == "timeout_s must be in [0, 3600], got -1.0"
    long_id = "c" * (CFG.max_id_chars + 1)
    long_context_id = pb.GenerateRequest(prompt="hi", context_id=long_id)
    assert gateway_message(long_context_id) == "context_id must have at most 128 characters"
    unknown = "unknown method 'telepathy'; available: ar"
    assert gateway_message(pb.GenerateRequest(prompt="hi", method="telepathy")) == unknown
    bad_role = pb.GenerateRequest(messages=[pb.ChatMessage(role="robot", content="hi")])
    message = "a message's role must be one of system, user, assistant, got 'robot'"
    assert gateway_message(bad_role) == message
    assert openai_message({"messages": [{"role": "robot", "content": "hi"}]}, chat=True) == message
    assert gateway_message(pb.GenerateRequest()) == "the prompt is empty"


def test_openai_bodies_translate_to_the_grpc_request():
    chat = {
        "model": "anything",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]},
        ],
        "stop": "\n",
        "max_tokens": 7,
        "max_completion_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.5,
        "seed": 3,
        "method": "ar",
        "n": 1,
    }
    req = openai_request(chat, True, info(), CFG)
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "Hello, there")]
    assert list(req.stop) == ["\n"] and req.max_new_tokens == 9 and req.method == "ar"
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.seed) == (0.5, 0.5, 3)
    assert not req.raw and not req.prompt
    assert openai_request({"messages": [{"role": "user", "content": "x"}]}, True, info(), CFG).max_new_tokens == 0
    text = openai_request({"prompt": ["Once upon"], "stop": ["a", "b"]}, False, info(), CFG)
    assert text.raw and text.prompt == "Once upon" and list(text.stop) == ["a", "b"] and text.max_new_tokens == 16
    assert openai_request({"prompt": [5, 6]}, False, info(), CFG).prompt_token_ids == [5, 6]
    msg = [{"role": "user", "content": "hi"}]
    bad = [
        ({"messages": msg, "n": 2}, "n is not supported (only n=1), got 2"),
        ({"messages": msg, "logprobs": True}, "logprobs is not supported"),
        ({"messages": msg, "presence_penalty": 0.5}, "presence_penalty is not supported"),
        ({"messages": msg, "temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"messages": msg, "seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"messages": msg, "max_tokens": True}, "max_tokens must be an integer"),
        ({"messages": msg, "stop": 3}, "stop must be a string or a list of strings"),
        ({"messages": msg, "method": 3}, "method must be a str"),
        ({"messages": "hi"}, "messages must be a list of messages"),
        ({"messages": []}, "messages must hold at least one message"),
        ({"messages": [{"role": "user", "content": None}]}, "a message's content must be text"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "a message's content must be text"),
        ({"messages": ["hi"]}, "each message must be an object"),
    ]
    for body, needle in bad:
        assert needle in openai_message(body, chat=True), body
    assert openai_message([1, 2], chat=True) == "the body must be a JSON object"
    assert openai_message({"prompt": ["a", "b"]}) == "exactly one prompt per request is supported"
    assert openai_message({"prompt": {"text": "a"}}) == "prompt must be a string or a list of token ids"
    assert openai_message({"prompt": "hi", "top_k": 2**40}).startswith("bad request body")


def test_one_stop_string_is_not_split_into_characters():
    assert list(build_request("hi", stop="lazy dog").stop) == ["lazy dog"]
    assert list(build_request("hi", stop=["a", "b"]).stop) == ["a", "b"]
    assert SamplingParams(stop="lazy dog").stop == ("lazy dog",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    chat = build_request(messages=[{"role": "user", "content": "hi"}])
    assert [(m.role, m.content) for m in chat.messages] == [("user", "hi")] and not chat.prompt


def test_the_gateway_and_limits_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import services.gateway, spyglass.limits, spyglass.client\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
