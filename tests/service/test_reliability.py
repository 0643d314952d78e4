"""No client can stall the others, and one bad request never kills the engine (issue 15).

Huge prompts are refused before they are tokenized and tokenizing runs off the event loop; an
oversized message is INVALID_ARGUMENT naming the limit; a fault in one request's output
processing ends that request alone; health probes may skip the bearer token when asked to.
Each test runs its own server over the session's engine on 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import random
import threading
import time
import urllib.request

import grpc
import pytest

from service import validation
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from service.grpc.client import make_request
from tests.service.conftest import serving

HUGE = "a b " * 1_047_552  # 4 MiB less a little: under gRPC's default 4 MiB receive limit
STREAM = dict(max_tokens=200, temperature=0.0, ignore_eos=True)


def _calls_metric(server, method: str, code: str) -> float:
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    key = f'jaxserve_grpc_calls_total{{code="{code}",method="{method}"}} '
    lines = [line for line in text.splitlines() if line.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


# ---- defect 2: a huge prompt must not freeze the other streams ------------------------------


def test_prompt_limit_bounds_the_bytes_of_any_tokenized_text(engine):
    """Whatever the text, its bytes never exceed its tokens times the limit's bytes per token,
    so refusing beyond max_model_len * bytes_per_token never refuses a prompt that fits."""
    limit = validation.prompt_limit(engine.tokenizer, engine.max_model_len)
    assert limit.max_model_len == engine.max_model_len
    rng = random.Random(0)
    alphabet = "ab cd\n\t.,!é漢字😀\u200b" + "".join(map(chr, range(32, 127)))
    vocab = [engine.tokenizer.decode([i]) for i in range(len(engine.tokenizer))]
    for _ in range(200):
        if rng.random() < 0.5:
            text = "".join(rng.choices(alphabet, k=rng.randint(1, 300)))
        else:  # runs of whole vocabulary pieces: the longest tokens, back to back
            text = "".join(rng.choices(vocab, k=rng.randint(1, 100))) or "x"
        ids = engine.encode(text)
        assert len(text.encode()) <= len(ids) * limit.bytes_per_token, text


def test_huge_prompt_is_refused_at_once_and_streams_keep_flowing(engine):
    """While a client sends a 4 MiB prompt in a loop, another stream keeps flowing and the huge
    prompt is refused at once (issue 15: tokenizing it took 3-4 s on the event loop, stalling
    every stream that long).

    The margins come from the distributions on this 2-core machine with two busy-looping
    processes beside the test (load ~12, four runs): the stream's largest gap was 0.07-0.16 s
    (idle: 0.03-0.05), the median refusal 16-28 ms, the slowest 0.05-0.18 s, the 90th
    percentile up to 0.13 s (the OS now and then holds a 4 MiB transfer up: a fixed "9 in 10
    under 100 ms" failed two of those four runs). So the test bounds what a loaded machine
    cannot move much and a broken server cannot meet:
    - the median refusal under 0.1 s: a server that blocks 0.1 s per huge prompt, on the loop
      or off it, measured 0.17 s (0.2 s: 0.23 s); the OS's stalls hit single refusals;
    - every refusal and every gap under 1.5 s: tokenizing 4 MiB before refusing took 3-4 s
      idle and 11 s at that load, with or without the loop (and a slower machine only makes
      that longer), and at least 5 refusals must land while the stream runs.
    """
    with serving(engine) as server, server.client() as c, server.client() as flood:
        limit = server.server.lifecycle.prompt_limit
        assert limit.max_bytes < len(HUGE) // 100
        flood.generate_unary("Once upon a time", max_tokens=2)  # connected and warm
        # Serialized once: what is timed is the server's answer, not this process encoding
        # 4 MiB for every call (tens of ms on a loaded CI machine).
        huge = make_request(HUGE, max_tokens=4).SerializeToString()
        send = flood.channel.unary_unary("/jaxserve.v1.JaxServe/GenerateUnary")
        with pytest.raises(grpc.RpcError):  # the first 4 MiB grows gRPC's buffers: not timed
            send(huge, timeout=30)
        stop, refusals, errors = threading.Event(), [], []

        def send_huge():
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    send(huge, timeout=30)
                except grpc.RpcError as e:
                    refusals.append(time.perf_counter() - start)
                    errors.append(e)

        arrivals = []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            flooding = pool.submit(send_huge)
            try:
                for response in c.generate("Once upon a time", timeout=120, **STREAM):
                    arrivals.append((time.perf_counter(), len(response.token_ids)))
            finally:
                stop.set()
                flooding.result()
        assert sum(n for _, n in arrivals) == STREAM["max_tokens"]
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(arrivals)]
        assert len(refusals) >= 5, f"the flood must overlap the stream: {refusals} s"
        assert max(gaps) < 1.5, f"largest gap {max(gaps):.3f}s among {len(gaps)}"
        slowest = sorted(refusals)
        assert slowest[len(slowest) // 2] < 0.1, f"refusals took {slowest} s"
        assert slowest[-1] < 1.5, f"refusals took {slowest} s"
        for e in errors:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {limit.max_bytes} bytes" in e.details()
            assert "max_model_len=256" in e.details()
        took = []  # Tokenize has the same cap, checked before tokenizing: best of 3 (a
        for _ in range(3):  # stalled transfer is the OS's; tokenizing first takes seconds)
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as err:
                c.tokenize(HUGE, timeout=30)
            took.append(time.perf_counter() - start)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {limit.max_bytes} bytes" in err.value.details()
        assert min(took) < 0.5, f"Tokenize refusals took {took} s"
        # Just inside the cap is tokenized and judged by its tokens, as before.
        text = "Once upon a time " * 80
        assert len(text.encode()) <= limit.max_bytes
        with pytest.raises(grpc.RpcError) as err:
            c.generate_unary(text, max_tokens=4)
        assert "has 322 tokens" in err.value.details()
        assert len(c.tokenize(text)) == 322


# ---- defect 4: oversized messages are INVALID_ARGUMENT, not "retry later" ------------------


def test_message_over_max_message_bytes_is_invalid_argument_and_counted(engine):
    limit = 4 << 20
    prompt = "x" * 10_500_000  # over the limit, within gRPC's own 4x transport limit
    with serving(engine, max_message_bytes=limit) as server, server.client() as c:
        before = _calls_metric(server, "GenerateUnary", "INVALID_ARGUMENT")
        for send in (
            lambda: c.generate_unary(prompt, max_tokens=4, timeout=30),
            lambda: list(c.generate(prompt, max_tokens=4, timeout=30)),
            lambda: c.tokenize(prompt, timeout=30),
        ):
            with pytest.raises(grpc.RpcError) as err:
                send()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert f"at most {limit}" in err.value.details()
            assert "--max-message-bytes" in err.value.details()
        assert _calls_metric(server, "GenerateUnary", "INVALID_ARGUMENT") == before + 1
        assert _calls_metric(server, "Generate", "INVALID_ARGUMENT") >= 1
        assert _calls_metric(server, "Tokenize", "INVALID_ARGUMENT") >= 1
        assert len(c.generate_unary("Once upon a time", max_tokens=4).token_ids) == 4


def test_max_message_bytes_is_checked():
    from service.server import ServerOptions

    with pytest.raises(ValueError, match="max_message_bytes=10 must be in"):
        ServerOptions(max_message_bytes=10)


# ---- item 5: a fault in one request's output ends it alone ---------------------------------


def test_output_fault_ends_one_call_with_finish_reason_error_and_8_others_complete(engine):
    prompts = ["Once upon a time", "The sun was hot", "Lily went to the park", "A big box"]
    cases = [(prompts[i % 4], dict(max_tokens=20 + i, temperature=0.0)) for i in range(8)]
    with serving(engine) as server, server.client() as c:
        want = [c.generate_unary(p, **s) for p, s in cases]
        outputs = {"bad": 0}

        def hook(request_id):  # the engine knows calls as `<caller's id>#<n>`
            if request_id.partition("#")[0] == "bad":
                outputs["bad"] += 1
                if outputs["bad"] == 4:
                    raise RuntimeError("injected stop-string failure")

        engine.outputs.fault_hook = hook
        try:
            with concurrent.futures.ThreadPoolExecutor(9) as pool:
                bad = pool.submit(
                    lambda: list(
                        c.generate("Once upon a time", request_id="bad", timeout=60, **STREAM)
                    )
                )
                got = list(pool.map(lambda case: c.generate_unary(case[0], **case[1]), cases))
                bad = bad.result()
        finally:
            engine.outputs.fault_hook = None
        last = bad[-1]
        assert last.finish_reason == pb.FINISH_REASON_ERROR
        assert "injected stop-string failure" in last.error
        assert sum(len(r.token_ids) for r in bad) == 3  # the outputs before the fault
        for g, w in zip(got, want, strict=True):
            assert list(g.token_ids) == list(w.token_ids) and g.text == w.text
            assert g.finish_reason == w.finish_reason and not g.error
        # The server serves on, and the failed call's slot and pages came back.
        assert len(c.generate_unary("Once upon a time", max_tokens=4).token_ids) == 4
        snap = server.server.engine.snapshot()
        assert snap.kv_pages_used == 0 and snap.slots_used == 0


# ---- item 7: health probes without the token, when asked ----------------------------------


def test_health_without_auth_lets_only_health_in_without_the_token(engine):
    with serving(engine, auth_token="s3cret", health_without_auth=True) as server:
        with server.client() as anonymous:
            assert anonymous.health() == "SERVING"
            assert anonymous.health("jaxserve.v1.JaxServe") == "SERVING"
            for call in (
                lambda: anonymous.generate_unary("Once upon a time", max_tokens=2),
                anonymous.model_info,
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with server.client(token="s3cret") as c:
            assert len(c.generate_unary("Once upon a time", max_tokens=2).token_ids) == 2
    with serving(engine, auth_token="s3cret") as server, server.client() as anonymous:
        with pytest.raises(grpc.RpcError) as err:  # the default: health needs the token too
            anonymous.health()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
