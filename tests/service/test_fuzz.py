"""Fuzzed GenerateRequests against a real server (issue 15, item 10).

Hypothesis builds the request bytes by hand, at the wire level, so it can send what the generated
stubs refuse to: negative and huge token ids (varints that protobuf truncates into uint32),
out-of-range int32 fields, NaN and infinite doubles, malformed UTF-8, unknown fields. Every
request must end OK or INVALID_ARGUMENT (with a message), never INTERNAL or UNKNOWN; requests
drawn only from valid values must end OK; an OK answer must be well formed; and afterwards the
server must answer a known greedy request with the same text as before, holding no slot or page.
"""

from __future__ import annotations

import math
import struct

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from tests.service.conftest import serving, wait_until

VOCAB = 512  # stories260k
CONTEXT = 256  # the shared engine's max_model_len (tests/service/conftest.py)
METHODS = ("/jaxserve.v1.JaxServe/Generate", "/jaxserve.v1.JaxServe/GenerateUnary")
KNOWN = dict(max_tokens=24, temperature=0.0, ignore_eos=True)  # the before/after probe


@pytest.fixture(scope="module")
def server(engine):
    assert (engine.model.config.vocab_size, engine.max_model_len) == (VOCAB, CONTEXT)
    with serving(engine) as handle:
        yield handle


# ---- the wire format, by hand ---------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative ints go out as 10-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _tag(number, 2) + _varint(len(data)) + data


def _int_field(number: int, value: int) -> bytes:
    return _tag(number, 0) + _varint(value)


def _double_field(number: int, value: float) -> bytes:
    return _tag(number, 1) + struct.pack("<d", value)


def _packed(number: int, values: list[int]) -> bytes:
    return _bytes_field(number, b"".join(_varint(v) for v in values))


# ---- what hypothesis draws ------------------------------------------------------------------

# One field at a time takes any value (its "fault"), the others valid ones, so a wrongly
# accepted value is not masked by another that gets the request refused anyway; "chaos" lets
# every field take any value at once. Each fault gets its own examples: hypothesis, left to
# choose among them, never drew some. Field numbers: service/proto/jaxserve/v1/jaxserve.proto.
FAULTS = {  # fault: examples
    "none": 30, "prompt": 12, "temperature": 8, "top_k": 8, "top_p": 8, "min_p": 8, "seed": 8,
    "max_tokens": 10, "logprobs": 8, "stop": 8, "stop_token_ids": 8, "request_id": 6,
    "priority": 8, "chaos": 20,
}  # fmt: skip
# The edges first, so a modest number of examples is sure to try them.
_EDGE_INTS = [0, -1, 2**31 - 1, -(2**31), 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]
_any_int = st.one_of(st.sampled_from(_EDGE_INTS), st.integers(-(2**63), 2**64 - 1))
_EDGE_FLOATS = [math.nan, math.inf, -math.inf, -0.0, -1.0, 1.5, 1e308, 5e-324, -5e-324]
_any_float = st.one_of(st.sampled_from(_EDGE_FLOATS), st.floats(allow_nan=True))
_valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=48)
# (number, wire kind, valid values, any values) of SamplingOptions' scalar fields.
_SCALARS = {
    "temperature": (1, "d", st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.3]), _any_float),
    "top_k": (2, "i", st.integers(0, 50), _any_int),
    "top_p": (3, "d", st.floats(0.05, 1.0), _any_float),
    "min_p": (4, "d", st.floats(0.0, 0.5), _any_float),
    "seed": (5, "i", st.integers(0, 2**32 - 1), _any_int),
    "max_tokens": (6, "i", st.integers(1, 24), _any_int),
    "logprobs": (10, "i", st.integers(0, 5), st.integers(-(2**31), 2**31 - 1)),
}


def _prompt(draw, wild: bool) -> bytes:
    if not wild:
        if draw(st.booleans()):
            return _bytes_field(2, _packed(1, draw(_valid_ids)))
        # 40 characters fit the context whatever they are (4 byte-fallback tokens at most each).
        return _bytes_field(1, draw(st.text(min_size=1, max_size=40)).encode())
    kind = draw(st.sampled_from(["ids", "text", "bad_utf8", "none"]))
    if kind == "ids":  # negative and huge ids reach the server as truncated uint32s
        ids = draw(st.lists(st.one_of(_any_int, st.integers(-3, VOCAB + 3)), max_size=300))
        return _bytes_field(2, _packed(1, ids))
    if kind == "text":
        return _bytes_field(1, draw(st.text(max_size=400)).encode())
    if kind == "bad_utf8":
        return _bytes_field(1, draw(st.binary(max_size=20)) + b"\xff\xfe")
    return b""


def _sampling(draw, fault: str) -> bytes:
    out = []
    for name, (number, kind, valid, wild) in _SCALARS.items():
        value = draw(wild if fault in (name, "chaos") else st.one_of(st.none(), valid))
        if value is not None:
            out.append(_double_field(number, value) if kind == "d" else _int_field(number, value))
    if fault in ("stop", "chaos"):
        stops = draw(st.lists(st.text(max_size=300), max_size=20))
    else:
        stops = draw(st.lists(st.text(min_size=1, max_size=8), max_size=3))
    out += [_bytes_field(7, x.encode()) for x in stops]
    wild_ids = fault in ("stop_token_ids", "chaos")
    stop_ids = draw(st.lists(_any_int if wild_ids else st.integers(0, VOCAB - 1), max_size=3))
    if stop_ids:
        out.append(_packed(8, stop_ids))
    if draw(st.booleans()):
        out.append(_int_field(9, 1))  # ignore_eos
    return b"".join(draw(st.permutations(out)))


@st.composite
def requests(draw, fault: str):
    """(bytes of a GenerateRequest, must it be OK?): fields in any order, unknown ones too."""
    parts = [_prompt(draw, fault in ("prompt", "chaos")), _bytes_field(3, _sampling(draw, fault))]
    # priority: any int32 reaches the server; by default clients may send 0 to 2**31 - 1 only
    wild_priority = fault in ("priority", "chaos")
    parts.append(_int_field(4, draw(_any_int if wild_priority else st.integers(0, 2**31 - 1))))
    if fault in ("request_id", "chaos"):
        rid = draw(st.text(min_size=100, max_size=200))
    else:
        rid = draw(st.one_of(st.just(""), st.text(max_size=40)))
    parts.append(_bytes_field(5, rid.encode()))
    if draw(st.booleans()):  # an unknown field: proto3 skips it
        parts.append(_bytes_field(draw(st.integers(6, 1000)), draw(st.binary(max_size=8))))
    return b"".join(draw(st.permutations(parts))), fault == "none"


# ---- the test -------------------------------------------------------------------------------


def _call(channel: grpc.Channel, method: str, data: bytes):
    """Sends raw request bytes; returns (status code, details, parsed responses)."""
    ident = bytes  # the bytes go out exactly as drawn
    parse = pb.GenerateResponse.FromString
    try:
        if method.endswith("Unary"):
            return (
                grpc.StatusCode.OK,
                "",
                [channel.unary_unary(method, ident, parse)(data, timeout=60)],
            )
        return (
            grpc.StatusCode.OK,
            "",
            list(channel.unary_stream(method, ident, parse)(data, timeout=60)),
        )
    except grpc.RpcError as e:
        return e.code(), e.details() or "", []


def _must_refuse(data: bytes) -> bool:
    """Requests the server has to refuse, whatever else they hold."""
    try:
        req = pb.GenerateRequest.FromString(data)
    except Exception:  # malformed UTF-8: protobuf itself refuses it
        return True
    s, ids = req.sampling, req.token_ids.ids
    has = s.HasField
    return (
        req.WhichOneof("prompt") is None
        or (req.WhichOneof("prompt") == "token_ids" and not ids)
        or any(t >= VOCAB for t in [*ids, *s.stop_token_ids])
        # float32 reads 5e-324 as 0 and 1e308 as inf: SamplingParams' bounds (0, or 1e-5-100)
        or (has("temperature") and not (s.temperature == 0 or 1e-5 <= s.temperature <= 100))
        or (has("top_k") and s.top_k < 0)
        or (has("top_p") and not 0 < s.top_p <= 1)
        or (has("min_p") and not 0 <= s.min_p <= 1)
        or (has("seed") and s.seed >= 2**32)
        or (has("logprobs") and not 0 <= s.logprobs <= 20)
        or (has("max_tokens") and s.max_tokens < 1)
        or (has("max_tokens") and ids and s.max_tokens > CONTEXT - len(ids))
        or len(s.stop) > 16
        or any(not 0 < len(x) <= 256 for x in s.stop)
        or len(req.request_id) > 128
        or req.priority < 0
    )


def _check_ok(data: bytes, responses: list[pb.GenerateResponse]) -> None:
    req = pb.GenerateRequest.FromString(data)
    last = responses[-1]
    tokens = [t for r in responses for t in r.token_ids]
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), last
    assert last.usage.completion_tokens == len(tokens)
    assert all(t < VOCAB for t in tokens)
    if req.sampling.HasField("max_tokens"):
        assert len(tokens) <= req.sampling.max_tokens
    if req.WhichOneof("prompt") == "token_ids":
        assert last.usage.prompt_tokens == len(req.token_ids.ids)
    if req.request_id:
        assert all(r.request_id == req.request_id for r in responses)
    if req.sampling.HasField("logprobs"):
        logprobs = [lp for r in responses for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens
        assert all(len(lp.top) == req.sampling.logprobs for lp in logprobs)
        assert all(lp.logprob <= 0 and not math.isnan(lp.logprob) for lp in logprobs)


def test_fuzzed_requests_get_ok_or_invalid_argument_and_the_server_still_answers(server, engine):
    with server.client() as client:
        before = client.generate_unary([1, 2, 3, 4, 5], **KNOWN)
    assert before.usage.completion_tokens == KNOWN["max_tokens"]
    channel = grpc.insecure_channel(server.target)
    seen = {"ok": 0, "invalid": 0}

    def one(request, method):
        data, must_succeed = request
        code, details, responses = _call(channel, method, data)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            assert not must_succeed, f"a valid request was refused: {details}"
            assert details.endswith((".", ")")) and len(details) > 10, details
            seen["invalid"] += 1
        else:
            assert not _must_refuse(data), "an invalid request was accepted"
            _check_ok(data, responses)
            seen["ok"] += 1

    try:
        for fault, examples in FAULTS.items():
            run = settings(
                max_examples=examples,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            )(given(request=requests(fault), method=st.sampled_from(METHODS))(one))
            run()
    finally:
        channel.close()
    # Both outcomes occurred often enough for the checks above to mean something.
    assert seen["ok"] >= 20 and seen["invalid"] >= 20, seen
    with server.client() as client:
        after = client.generate_unary([1, 2, 3, 4, 5], **KNOWN)
    assert (after.text, list(after.token_ids)) == (before.text, list(before.token_ids))
    s = engine.scheduler
    assert wait_until(lambda: not engine.has_unfinished())
    assert (s.num_slots_used, s.num_pages_used) == (0, 0)
