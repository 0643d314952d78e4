"""The OpenAI-compatible HTTP API end to end: a real server on 127.0.0.1, the official `openai`
client, and raw HTTP for what no client would send.

Expected outputs come from the same engine run offline (`LLM.generate`) before it serves, so
every text is checked, not just counted. One server serves the module; the auth, warm-up and
--no-grpc tests start their own, cheap ones over the same compiled engine.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import math
import re
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from jaxserve import LLM, SamplingParams
from tests.service import strict_json
from tests.service.conftest import serving, wait_until

PROMPT = "Once upon a time"
GREEDY = dict(max_tokens=24, temperature=0.0)
SEEDED = dict(max_tokens=12, temperature=1.0, seed=7)
LONG = dict(max_tokens=150, temperature=0.0, ignore_eos=True)
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
# A ChatML-style template, set on the tokenizer by the chat test (stories260k has none).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def served(engine):
    """(server, expected): expected[name] is the offline Completion of that case."""
    llm = LLM(engine=engine)
    seeds = [SEEDED["seed"] + i for i in range(3)]
    cases = {
        "greedy": (PROMPT, SamplingParams(**GREEDY)),
        "long": (PROMPT, SamplingParams(**LONG)),
        **{
            f"seed{s}": (PROMPT, SamplingParams(**{**SEEDED, "seed": s}))
            for s in [*seeds, SEEDED["seed"]]
        },
        "ids": ([1, 403, 407], SamplingParams(max_tokens=6, temperature=0.0)),
        "bias": (PROMPT, SamplingParams(max_tokens=5, temperature=0.0, logit_bias={300: 100})),
        "penalized": (PROMPT, SamplingParams(**LONG, **PENALTIES)),
    }
    engine.tokenizer.chat_template = CHAT_TEMPLATE  # rendered here; the chat test sets it too
    try:
        cases["chat"] = (_chat_ids(engine), SamplingParams(max_tokens=16, temperature=0.0))
    finally:
        engine.tokenizer.chat_template = None
    outs = llm.generate([p for p, _ in cases.values()], [s for _, s in cases.values()])
    expected = dict(zip(cases, outs, strict=True))
    with serving(engine, http_port=0) as server:
        yield server, expected


def _chat_ids(engine) -> list[int]:
    tokenizer = engine.tokenizer
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == "<s>user: Tell me a story\nassistant:"
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    return ids


@pytest.fixture(scope="module")
def client(served):
    server, _ = served
    return server.openai()


def _post(server, path: str, body, headers=None, *, with_headers=False):
    """Raw POST (bytes or JSON); returns (status, parsed body), and the response's headers
    third when asked."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}{path}",
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, parsed, got = r.status, strict_json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        status, parsed, got = e.code, strict_json.loads(e.read()), e.headers
    return (status, parsed, got) if with_headers else (status, parsed)


def _get(server, path: str, headers=None) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.server.http_port}{path}", headers=headers or {}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_greedy_completion_equals_llm_generate_streamed_or_not(served, client):
    _, expected = served
    want = expected["greedy"]
    got = client.completions.create(model="any", prompt=PROMPT, **GREEDY)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(
        client.completions.create(
            model="any",
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert len([c for c in chunks if c.choices]) > 2  # streamed, not sent at once
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    ids = client.completions.create(model="any", prompt=[1, 403, 407], max_tokens=6, temperature=0)
    assert ids.choices[0].text == expected["ids"].text


def test_list_prompts_echo_and_logprobs(served, client):
    _, expected = served
    got = client.completions.create(
        model="any", prompt=[PROMPT, [1, 403, 407]], max_tokens=6, temperature=0, echo=True
    )
    assert [c.index for c in got.choices] == [0, 1]
    echoed, generated = got.choices[0].text[: len(PROMPT)], got.choices[0].text[len(PROMPT) :]
    assert echoed == PROMPT and generated and expected["greedy"].text.startswith(generated)
    assert got.choices[1].text.endswith(expected["ids"].text)
    lp = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 4 and len(logprobs.top_logprobs[0]) == 3
    # Greedy: the chosen token is the most likely one, and its logprob is the top's.
    for token, chosen, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert chosen == pytest.approx(max(top.values()), abs=1e-5) and chosen <= 0
        assert top[token] == pytest.approx(chosen, abs=1e-5)


def test_processed_logprobs_are_over_the_top_k_after_the_temperature(served, client):
    # top_k=3 with logprobs=3: the processed top three are the whole distribution drawn from.
    asked = dict(model="any", prompt=PROMPT, max_tokens=4, temperature=0.7, seed=5, logprobs=3)
    raw, processed = (
        client.completions.create(**asked, extra_body={"top_k": 3, **extra}).choices[0].logprobs
        for extra in ({}, {"logprobs_mode": "processed"})
    )
    assert raw.tokens == processed.tokens
    for r, p in zip(raw.top_logprobs, processed.top_logprobs, strict=True):
        assert set(r) == set(p)
        assert sum(math.exp(v) for v in p.values()) == pytest.approx(1.0, abs=1e-4)
        norm = math.log(sum(math.exp(v / 0.7) for v in r.values()))  # raw: untempered, of all
        for token, value in r.items():
            assert p[token] == pytest.approx(value / 0.7 - norm, abs=1e-4)


def test_processed_logprobs_over_grpc_too(served):
    server, _ = served
    asked = dict(max_tokens=4, temperature=0.7, top_k=3, seed=5, logprobs=3)
    with server.client() as grpc_client:
        raw, processed = (
            grpc_client.generate_unary(PROMPT, **asked, **extra).logprobs
            for extra in ({}, {"logprobs_mode": "processed"})
        )
        with pytest.raises(grpc.RpcError) as err:
            grpc_client.generate_unary(PROMPT, logprobs_mode="logits")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs_mode='logits'" in err.value.details()
    assert [e.token_id for e in raw] == [e.token_id for e in processed]
    for r, p in zip(raw, processed, strict=True):
        norm = math.log(sum(math.exp(t.logprob / 0.7) for t in r.top))
        assert [t.token_id for t in p.top] == [t.token_id for t in r.top]
        for rt, pt in zip(r.top, p.top, strict=True):
            assert pt.logprob == pytest.approx(rt.logprob / 0.7 - norm, abs=1e-4)
        assert p.logprob == pytest.approx(r.logprob / 0.7 - norm, abs=1e-4)


def test_n_samples_each_equal_their_single_runs_with_seed_plus_i(served, client):
    _, expected = served
    got = client.completions.create(model="any", prompt=PROMPT, n=3, **SEEDED)
    texts = [c.text for c in got.choices]
    assert texts == [expected[f"seed{SEEDED['seed'] + i}"].text for i in range(3)]
    assert len(set(texts)) > 1, texts
    assert got.usage.prompt_tokens == len(expected["greedy"].prompt_token_ids)  # counted once


def test_n_samples_of_each_prompt_in_a_list_take_seed_plus_i_per_prompt(served, client):
    """prompt=[P1, P2], n=2, seed=s: choice 2p + i is prompt p's single-sample run with seed
    s + i (issue 29, item 19: counting the offset over all jobs gave P2 seeds s + 2, s + 3)."""
    prompts = [PROMPT, "The little dog ran to the"]
    seeded = dict(max_tokens=16, temperature=1.5, seed=7)  # hot: each seed its own story
    got = client.completions.create(model="any", prompt=prompts, n=2, **seeded)
    choices = sorted(got.choices, key=lambda c: c.index)
    assert len(choices) == 4
    single = {}
    for p, prompt in enumerate(prompts):
        for i in range(4):  # seeds s .. s + 3: the wrong offsets would match these
            seed = seeded["seed"] + i
            one = client.completions.create(model="any", prompt=prompt, **{**seeded, "seed": seed})
            single[p, i] = one.choices[0].text
        assert len({single[p, i] for i in range(4)}) == 4  # every seed tells itself apart
    assert [c.text for c in choices] == [single[p, i] for p in range(2) for i in range(2)]


def test_logit_bias_forces_a_token(served, client):
    _, expected = served
    assert expected["bias"].token_ids == [300] * 5
    got = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=5, temperature=0, logit_bias={"300": 100}
    )
    assert got.choices[0].text == expected["bias"].text


def test_penalties_reach_the_engine_and_bad_ones_are_a_400(served, client):
    _, expected = served
    assert expected["penalized"].text != expected["long"].text  # they change this story
    got = client.completions.create(
        model="any",
        prompt=PROMPT,
        max_tokens=LONG["max_tokens"],
        temperature=0,
        presence_penalty=PENALTIES["presence_penalty"],
        frequency_penalty=PENALTIES["frequency_penalty"],
        extra_body=dict(ignore_eos=True, repetition_penalty=PENALTIES["repetition_penalty"]),
    )
    assert got.choices[0].text == expected["penalized"].text
    for name, value in [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="any", prompt=PROMPT, extra_body={name: value})
        assert err.value.body["param"] == name
        assert str(value) in err.value.message


def test_penalties_over_grpc_too(served):
    server, expected = served
    with server.client() as grpc_client:
        got = grpc_client.generate_unary(PROMPT, **LONG, **PENALTIES)
        assert list(got.token_ids) == expected["penalized"].token_ids
        with pytest.raises(grpc.RpcError) as err:
            grpc_client.generate_unary(PROMPT, presence_penalty=2.5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "presence_penalty=2.5" in err.value.details()


def test_chat_without_a_template_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}])
    assert "no chat template" in err.value.message
    assert err.value.body["param"] == "messages"


def test_chat_with_a_template_streams_what_the_rendered_prompt_generates(served, client, engine):
    server, expected = served
    want = expected["chat"]
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        got = client.chat.completions.create(
            model="any", messages=MESSAGES, max_completion_tokens=16, temperature=0
        )
        assert got.choices[0].message.content == want.text
        assert got.choices[0].message.role == "assistant"
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        chunks = list(
            client.chat.completions.create(
                model="any",
                messages=MESSAGES,
                max_tokens=16,
                temperature=0,
                stream=True,
                logprobs=True,
                top_logprobs=2,
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
        entries = [
            e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
        assert len(entries) == len(want.token_ids)
        assert all(len(e.top_logprobs) == 2 for e in entries)
        status, body = _post(server, "/tokenize", {"messages": MESSAGES})
        assert status == 200 and body["tokens"] == want.prompt_token_ids
    finally:
        engine.tokenizer.chat_template = None


# (body fields over the prompt PROMPT, the param named, parts of the message): the gRPC tests'
# bad inputs (tests/service/test_server.py BAD), as an OpenAI client would send them.
BAD = [
    (dict(prompt=""), "prompt", ["prompt=''", "empty"]),
    (dict(prompt=[]), "prompt", ["prompt=[]"]),
    (dict(prompt=PROMPT + " " + "Once upon a time " * 80), "prompt", ["tokens", "max_model_len"]),
    (dict(prompt=[1] * 256), "prompt", ["256 tokens", "max_model_len=256"]),
    (dict(prompt=[1, 600]), "prompt", ["prompt[1]=600", "[0, 512)"]),
    (dict(prompt=[[1, 2], [1, 600]]), "prompt[1]", ["prompt[1][1]=600"]),
    (dict(max_tokens=0), "max_tokens", ["max_tokens=0"]),
    (dict(max_tokens=252), "max_tokens", ["max_tokens=252", "room for 251"]),
    (dict(temperature=-0.5), "temperature", ["temperature=-0.5"]),
    (dict(temperature=float("nan")), "temperature", ["temperature=nan"]),
    (dict(temperature=float("inf")), "temperature", ["temperature=inf"]),
    (dict(top_p=0.0), "top_p", ["top_p=0.0", "(0, 1]"]),
    (dict(top_p=1.5), "top_p", ["top_p=1.5"]),
    (dict(top_k=-1), "top_k", ["top_k=-1"]),
    (dict(min_p=2.0), "min_p", ["min_p=2.0"]),
    (dict(logprobs=21), "logprobs", ["logprobs=21"]),
    (dict(seed=2**40), "seed", [f"seed={2**40}"]),
    (dict(stop=["."] * 17), "stop", ["stop has 17 strings", "16"]),
    (dict(stop=["x" * 300]), "stop", ["stop[0]=", "300 characters"]),
    (dict(stop=["ok", ""]), "stop", ["stop[1]=''"]),
    (dict(stop_token_ids=[9999]), "stop_token_ids", ["stop_token_ids[0]=9999"]),
    (dict(n=0), "n", ["n=0"]),
    (dict(logit_bias={"300": 500}), "logit_bias", ["logit_bias[300]=500"]),
    (dict(logit_bias={"9999": 1}), "logit_bias", ["9999", "vocabulary"]),
    (dict(min_tokens=30), "min_tokens", ["min_tokens=30", "max_tokens=16"]),
    (dict(logprobs_mode="logits"), "logprobs_mode", ["logprobs_mode='logits'", "processed"]),
    (dict(suffix="The end."), "suffix", ["suffix"]),
    (dict(temperature="hot"), "temperature", ["temperature='hot'"]),
    (dict(prompt=None), "prompt", ["prompt=None"]),
    (b'{"prompt": "On\xffe"}', None, ["not valid JSON"]),
    (b'{"prompt": "Once"', None, ["not valid JSON"]),
    # issue 29: each of these answered 500, or ran
    (dict(max_tokens=True), "max_tokens", ["max_tokens=True", "valid integer"]),
    (dict(max_tokens=2.5), "max_tokens", ["max_tokens=2.5"]),
    (dict(seed=-1, n=2), "seed", ["seed=-1"]),
    (dict(seed=2**32 + 5, n=3), "seed", [f"seed={2**32 + 5}"]),
    (dict(prompt="\ud800"), "prompt", ["prompt='\\ud800'", "lone surrogate"]),
    (dict(priority=10**30), "priority", [f"priority={10**30}"]),
    (dict(priority=-1), "priority", ["priority=-1", "--clients-may-raise-priority"]),
    (b"[" * 100_000, None, ["more than 32 levels deep"]),
    (b'{"a":' * 100_000, None, ["more than 32 levels deep"]),
    (dict(logit_bias={str(i): 1 for i in range(5000)}), "logit_bias", ["5000 tokens", "32"]),
]


@pytest.mark.parametrize("what,param,parts", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_400_naming_field_and_value(served, what, param, parts):
    server, _ = served
    body = what if isinstance(what, bytes) else {"model": "any", "prompt": PROMPT, **what}
    status, error = _post(server, "/v1/completions", body)
    assert status == 400, error
    error = error["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for part in parts:
        assert part in error["message"]
    assert 'jaxserve_http_requests_total{code="500"' not in _get(server, "/metrics")[1]


def test_full_waiting_queue_is_429_while_admitted_complete(served, client):
    """48 long requests at once: the 32 the queue holds and those in running slots complete."""
    server, expected = served
    want = expected["long"].text
    start = threading.Barrier(48)

    def run(_):
        start.wait()
        return _post(server, "/v1/completions", {"prompt": PROMPT, **LONG}, with_headers=True)

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(run, range(48)))
    refused = [body for status, body, _ in results if status == 429]
    done = [body for status, body, _ in results if status == 200]
    assert refused and len(done) >= 32 and len(refused) + len(done) == 48
    assert all("max_waiting_requests=32" in b["error"]["message"] for b in refused)
    # When to retry, as OpenAI's and vLLM's 429s say it (the official client reads it).
    assert all(h["Retry-After"] == "1" for status, _, h in results if status == 429)
    assert all(b["choices"][0]["text"] == want for b in done)


def _finished_by_reason(server) -> dict[str, float]:
    text = _get(server, "/metrics")[1]
    pattern = r'jaxserve_requests_finished_total\{reason="(\w+)"\} ([0-9.]+)'
    return {reason: float(count) for reason, count in re.findall(pattern, text)}


def test_disconnect_mid_stream_aborts_and_frees_pages(served, engine, monkeypatch):
    """A client that leaves mid-stream aborts its request. Each engine iteration is held 4 ms
    here: stories260k runs all 240 tokens in ~170 ms, within the event loop's occasional lag
    (50-170 ms measured), and the test is about the abort, not about that race."""
    server, _ = served
    async_engine = server.server.engine
    step_updates = engine.step_updates

    def held_step_updates():
        time.sleep(0.004)
        return step_updates()

    monkeypatch.setattr(engine, "step_updates", held_step_updates)
    before = _finished_by_reason(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    body = {"prompt": PROMPT, "stream": True, "max_tokens": 240, "temperature": 0}
    body["ignore_eos"] = True
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # generating now
    assert wait_until(lambda: async_engine.snapshot().kv_pages_used > 0)
    generated_before = async_engine.snapshot().iteration
    conn.sock.close()
    conn.close()
    wait_until(lambda: not async_engine.snapshot().request_ids, timeout=20)
    snap = async_engine.snapshot()
    assert snap.kv_pages_used == 0 and snap.slots_used == 0
    assert snap.iteration - generated_before < 200  # aborted, not run to its 240 tokens
    after = _finished_by_reason(server)
    assert after.get("abort", 0) == before.get("abort", 0) + 1
    assert after.get("length", 0) == before.get("length", 0)


def test_models_tokenize_detokenize_health_and_metrics(served, engine):
    server, _ = served
    status, body = _get(server, "/v1/models")
    assert status == 200 and strict_json.loads(body)["data"][0]["id"] == "stories260k"
    status, body = _post(server, "/tokenize", {"prompt": PROMPT})
    assert status == 200 and body["tokens"] == engine.encode(PROMPT)
    status, back = _post(server, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPT
    status, error = _post(server, "/detokenize", {"tokens": [1, 700]})
    assert status == 400 and "tokens[1]=700" in error["error"]["message"]
    assert _get(server, "/health") == (200, '{"status":"serving"}')
    status, text = _get(server, "/metrics")
    assert status == 200
    assert 'jaxserve_http_requests_total{code="200",route="tokenize"}' in text
    assert "jaxserve_generation_tokens_total" in text  # the engine's own registry


def test_bench_backend_openai_runs_against_the_http_port(served, tmp_path, capsys):
    """`jaxserve bench --backend openai` against this server: every request finishes with the
    exact output length (EOS ignored), counted from the server's usage."""
    import numpy as np

    from jaxserve.bench import report as report_module
    from jaxserve.cli import main

    server, _ = served
    url = f"http://127.0.0.1:{server.server.http_port}"
    out = tmp_path / "bench"
    argv = ["bench", "--backend", "openai", "--url", url, "--profile", "concurrency"]
    argv += ["--concurrency", "1,4", "--num-requests", "6", "--prompt-len", "12"]
    argv += ["--output-len", "9", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "bench.json").read_text())
    # The model by its name, as the plots' titles carry it, not the server's path to it.
    assert report["mode"] == "online" and report["model"] == "stories260k"
    runs = report["runs"]
    assert len(runs) == 2
    for run in runs:
        assert run["num_finished"] == run["num_requests"] == 6
        assert run["output_tokens"] == 6 * 9
        assert 0 < run["ttft"]["p50"] <= run["e2e"]["p50"]
        # Not visible over the OpenAI API: left out, not made up.
        assert set(run["queue_wait"].values()) == {None}
    printed = capsys.readouterr().out
    assert "online " + url in printed
    # The timeline of an online run is what the client saw: requests in flight at the load,
    # and every output token counted once over the run.
    _, summaries, results = report_module.load_json(out / "bench.json")
    t, in_flight, tokens_per_s = report_module.client_timeline(results[-1])
    assert 2 <= max(in_flight) <= 4 and min(in_flight) >= 0
    assert float(np.sum(tokens_per_s) * (t[-1] / len(t))) == pytest.approx(6 * 9)
    # Latencies keep two significant digits: a sub-millisecond TPOT does not read "0".
    assert report_module._ms(0.0004) == "0.4" and report_module._ms(0.0043) == "4.3"
    assert report_module._ms(0.043) == "43" and report_module._ms(None) == "-"
    table = report_module.format_table(summaries)
    tpot = summaries[-1]["tpot"]["p50"]
    assert f" {report_module._ms(tpot)} " in table and report_module._ms(tpot) != "0"


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client):
    # A prompt of two full pages (16 tokens each) and 9 tokens, sent twice: the second is
    # served from the first's pages (the full ones shared, the partial one forked) but its last
    # token, streamed or not.
    prompt = [1] + [400 + i % 50 for i in range(40)]
    first = client.completions.create(model="any", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="any", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens in (0, 40)  # 40 if run before
    assert again.usage.prompt_tokens_details.cached_tokens == 40
    chunks = list(
        client.completions.create(
            model="any",
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 40
