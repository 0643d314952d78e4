"""The gRPC service end to end, one real server on 127.0.0.1 shared by the module.

Expected outputs come from the same engine run offline (`LLM.generate`) before it starts
serving, so every streamed token is checked, not just counted.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.llm import LLM
from jaxserve.sampling_params import SamplingParams
from service.gen.jaxserve.v1 import jaxserve_pb2 as pb
from service.grpc.client import make_request
from tests.service.conftest import serving, wait_until

# (prompt, sampling): greedy, seeded top-p/top-k/min-p, token-id prompts, a stop string, logprobs.
REQUESTS = [
    ("Once upon a time", dict(max_tokens=24, temperature=0.0)),
    ("Tom had a red ball", dict(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)),
    ([1, 403, 407], dict(max_tokens=16, temperature=1.0, top_k=20, seed=3, ignore_eos=True)),
    ("The little dog", dict(max_tokens=40, temperature=0.0, stop=["."])),
    ("A cat", dict(max_tokens=8, temperature=0.0, logprobs=2)),
    ("Sam", dict(max_tokens=20, temperature=1.2, min_p=0.1, seed=11, stop_token_ids=[13])),
]
STORY_PROMPTS = ["Once upon a time", "The sun was hot", "Lily went to the park", "A big box"]
CONCURRENT = [
    (STORY_PROMPTS[i % 4], dict(max_tokens=12 + i % 5, temperature=0.9, seed=100 + i))
    if i % 2
    else (STORY_PROMPTS[i % 4], dict(max_tokens=12 + i % 7, temperature=0.0, ignore_eos=True))
    for i in range(32)
]
LONG = ("Once upon a time", dict(max_tokens=60, temperature=0.0, ignore_eos=True))
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


@pytest.fixture(scope="module")
def served(engine):
    """(server, expected): expected[(prompt, sampling)] is the offline Completion."""
    cases, llm, expected = [*REQUESTS, *CONCURRENT, LONG], LLM(engine=engine), {}
    for i in range(0, len(cases), 32):  # max_waiting_requests: LLM queues a batch at once
        batch = cases[i : i + 32]
        outs = llm.generate([p for p, _ in batch], [SamplingParams(**s) for _, s in batch])
        expected.update({_key(p, s): out for (p, s), out in zip(batch, outs, strict=True)})
    with serving(engine) as server:
        yield server, expected


@pytest.fixture(scope="module")
def client(served):
    with served[0].client() as c:
        yield c


def _key(prompt, sampling) -> str:
    return repr((prompt, sorted(sampling.items())))


def _collect(responses) -> dict:
    responses = list(responses)
    return dict(
        token_ids=[t for r in responses for t in r.token_ids],
        text="".join(r.text for r in responses),
        logprobs=[lp for r in responses for lp in r.logprobs],
        last=responses[-1],
    )


def _check(got: dict, want) -> None:
    assert got["token_ids"] == want.token_ids
    assert got["text"] == want.text
    last = got["last"]
    assert last.finish_reason == FINISH[want.finish_reason]
    assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert last.usage.completion_tokens == len(want.token_ids)
    assert 0 <= last.timings.queue_wait_s <= last.timings.ttft_s <= last.timings.e2e_s
    if want.logprobs is not None:
        assert [lp.token_id for lp in got["logprobs"]] == [lp.token_id for lp in want.logprobs]
        for g, w in zip(got["logprobs"], want.logprobs, strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert [t.token_id for t in g.top] == [t for t, _ in w.top]


def test_streamed_and_unary_outputs_equal_offline(served, client):
    _, expected = served
    for prompt, sampling in REQUESTS:
        want = expected[_key(prompt, sampling)]
        _check(_collect(client.generate(prompt, **sampling)), want)
        unary = client.generate_unary(prompt, **sampling)
        _check(
            dict(
                token_ids=list(unary.token_ids),
                text=unary.text,
                logprobs=list(unary.logprobs),
                last=unary,
            ),
            want,
        )
    assert any(expected[_key(*r)].finish_reason == "stop" for r in REQUESTS)


def test_32_concurrent_streams_all_finish_correctly(served, client):
    _, expected = served

    def run(case):
        return _collect(client.generate(case[0], timeout=60, **case[1]))

    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        results = list(pool.map(run, CONCURRENT))
    for case, got in zip(CONCURRENT, results, strict=True):
        _check(got, expected[_key(*case)])


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_cancel_or_deadline_frees_slot_and_pages_within_an_iteration(served, engine, how):
    """The request leaves the engine in the iteration after its abort reached the engine."""
    server, _ = served
    async_engine = server.server.engine
    aborted_at = []
    real_abort = engine.abort

    def recording_abort(request_id):  # runs on the engine thread, between iterations
        # The engine knows the call by an internal id, `<caller's id>#<n>`.
        caller_id = request_id.rpartition("#")[0]
        aborted_at.append((caller_id, async_engine.snapshot().iteration))
        real_abort(request_id)

    def slow_step():  # >= 5 ms an iteration, so 250 tokens outlast the 0.5 s deadline anywhere
        time.sleep(0.005)
        return real_step()

    rid, real_step = f"{how}-me", engine.step_updates  # the engine thread's iteration
    engine.abort, engine.step_updates = recording_abort, slow_step
    try:
        with server.client() as c:
            call = c.generate(
                LONG[0],
                request_id=rid,
                timeout=0.5 if how == "deadline" else None,
                max_tokens=250,
                temperature=0.0,
                ignore_eos=True,
            )
            stream = iter(call)
            next(stream), next(stream)
            assert rid in async_engine.snapshot().request_ids
            if how == "cancel":
                call.cancel()
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
            code = (
                grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED
            )
            assert err.value.code() == code
            gone = wait_until(
                lambda: (
                    (s := async_engine.snapshot()).num_running == 0
                    and rid not in s.request_ids
                    and s
                ),
                timeout=5,
            )
    finally:
        del engine.abort, engine.step_updates
    assert gone.kv_pages_used == 0 and gone.slots_used == 0
    [abort_iteration] = [i for r, i in aborted_at if r == rid]
    assert gone.iteration - abort_iteration <= 1


BAD = [
    # (what to send, status code, parts of the message: the field and the value)
    (dict(prompt=""), "INVALID_ARGUMENT", ["text=''", "empty"]),
    (dict(prompt=[]), "INVALID_ARGUMENT", ["token_ids.ids=[]"]),
    (
        dict(prompt="Once upon a time " * 80),
        "INVALID_ARGUMENT",
        ["has 322 tokens", "max_model_len=256"],
    ),
    (dict(prompt=[1] * 256), "INVALID_ARGUMENT", ["256 tokens", "max_model_len=256"]),
    (dict(prompt=[1, 600]), "INVALID_ARGUMENT", ["token_ids.ids[1]=600", "[0, 512)"]),
    (dict(max_tokens=0), "INVALID_ARGUMENT", ["max_tokens=0"]),
    (dict(max_tokens=252), "INVALID_ARGUMENT", ["max_tokens=252", "room for 251"]),
    (dict(temperature=-0.5), "INVALID_ARGUMENT", ["temperature=-0.5"]),
    (dict(temperature=float("nan")), "INVALID_ARGUMENT", ["temperature=nan"]),
    (dict(temperature=float("inf")), "INVALID_ARGUMENT", ["temperature=inf"]),
    (dict(top_p=0.0), "INVALID_ARGUMENT", ["top_p=0.0", "(0, 1]"]),
    (dict(top_p=1.5), "INVALID_ARGUMENT", ["top_p=1.5"]),
    (dict(top_k=-1), "INVALID_ARGUMENT", ["top_k=-1"]),
    (dict(min_p=2.0), "INVALID_ARGUMENT", ["min_p=2.0"]),
    (dict(logprobs=21), "INVALID_ARGUMENT", ["logprobs=21"]),
    (dict(seed=2**40), "INVALID_ARGUMENT", [f"seed={2**40}"]),
    (dict(stop=["."] * 17), "INVALID_ARGUMENT", ["sampling.stop has 17 strings", "16"]),
    (dict(stop=["x" * 300]), "INVALID_ARGUMENT", ["sampling.stop[0]=", "300 characters"]),
    (dict(stop=["ok", ""]), "INVALID_ARGUMENT", ["sampling.stop[1]=''"]),
    (dict(stop_token_ids=[9999]), "INVALID_ARGUMENT", ["sampling.stop_token_ids[0]=9999"]),
    (dict(request_id="r" * 200), "INVALID_ARGUMENT", ["request_id=", "200 characters"]),
    (b"\n\x04On\xffe", "INVALID_ARGUMENT", ["text=b'On\\xffe'", "UTF-8"]),
    (b"\n\x02Hi\x1a\x04:\x02\xc3(", "INVALID_ARGUMENT", ["sampling.stop=b'\\xc3('", "UTF-8"]),
    (b"\n\x02Hi\x1a\xff", "INVALID_ARGUMENT", ["not a valid GenerateRequest"]),
]


def _send_bad(channel, client, what):
    """One bad Generate call; returns its RpcError."""
    if isinstance(what, bytes):  # malformed on the wire: no protobuf client would send it
        call = channel.unary_stream("/jaxserve.v1.JaxServe/Generate")(what, timeout=10)
    else:
        kwargs = {"prompt": "Once upon a time", **what}
        call = client.stub.Generate(make_request(**kwargs), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    return err.value


@pytest.mark.parametrize("what,code,parts", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_gets_its_code_and_a_message_naming_field_and_value(client, what, code, parts):
    err = _send_bad(client.channel, client, what)
    assert err.code().name == code, err.details()
    for part in parts:
        assert part in err.details()


def test_bad_inputs_leave_other_requests_serving(served, client):
    _, expected = served
    prompt, sampling = REQUESTS[0]
    good = client.generate(prompt, **sampling)
    first = next(iter(good))
    errors = [_send_bad(client.channel, client, what) for what, _, _ in BAD]
    assert {e.code() for e in errors} == {grpc.StatusCode.INVALID_ARGUMENT}
    got = _collect([first, *good])
    _check(got, expected[_key(prompt, sampling)])
    with pytest.raises(grpc.RpcError) as err:  # no prompt at all
        client.stub.GenerateUnary(pb.GenerateRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        client.tokenize("")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_full_waiting_queue_is_resource_exhausted_while_admitted_complete(served, client):
    """48 long requests at once: the 32 the queue holds (and the few that find it drained
    into running slots) complete; the rest are refused at once."""
    _, expected = served
    want = expected[_key(*LONG)]
    start = threading.Barrier(48)

    def run(_):
        start.wait()
        try:
            return _collect(client.generate(LONG[0], timeout=60, **LONG[1]))
        except grpc.RpcError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(run, range(48)))
    refused = [r for r in results if isinstance(r, grpc.RpcError)]
    done = [r for r in results if not isinstance(r, grpc.RpcError)]
    assert refused and len(done) >= 32, [r.details() for r in refused]
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        assert "max_waiting_requests=32" in e.details()
    for got in done:
        _check(got, want)


def test_duplicate_request_id_is_refused(client):
    first = client.generate(LONG[0], request_id="same", **LONG[1])
    next(iter(first))
    with pytest.raises(grpc.RpcError) as err:
        client.generate_unary("Hi", request_id="same", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'same'" in err.value.details()
    first.cancel()


def test_model_info_tokenize_and_metrics(served, client, engine):
    server, _ = served
    info = client.model_info()
    assert info.context_length == 256 and info.vocab_size == 512
    assert info.limits.max_num_seqs == 8 and info.limits.max_waiting_requests == 32
    assert "stories260k" in info.model
    assert client.tokenize("Once upon a time") == engine.encode("Once upon a time")
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert 'jaxserve_grpc_calls_total{code="OK",method="Tokenize"}' in text
    assert "jaxserve_generation_tokens_total" in text  # the engine's own registry
    assert "jaxserve_serving 1.0" in text


def test_the_default_host_kv_pool_is_sized_from_the_device_pool_logged_and_shown(engine, caplog):
    """No --host-kv-gb: the host pool is twice the device pool's bytes (the embedded model's
    pool is far below a quarter of any free memory), said in the serving log and /metrics."""
    assert engine.config.host_kv_gb is None
    with caplog.at_level(logging.INFO, logger="jaxserve.server"), serving(engine) as server:
        info = server.server.engine.info
        url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert info.kv_bytes > 0 and info.num_host_pages == 2 * info.num_pages
    assert info.host_kv_bytes == 2 * info.kv_bytes
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert values["jaxserve_host_kv_bytes"] == info.host_kv_bytes
    assert values["jaxserve_host_kv_pages"] == info.num_host_pages
    (line,) = [r for r in caplog.records if r.getMessage() == "serving"]
    assert line.fields["host_kv_bytes"] == info.host_kv_bytes
    assert line.fields["host_kv_pages"] == info.num_host_pages
    assert line.fields["kv_bytes"] == info.kv_bytes
