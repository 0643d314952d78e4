"""`jaxserve bench --backend openai --url URL`: the bench's traffic to any OpenAI-compatible server.

llama-server, vLLM and jaxserve's own HTTP port (`jaxserve serve --http-port`) all serve
/v1/completions, so one tool can compare them on the same workloads in one run. This client
has the shape `run_online` expects of `service.grpc.client.JaxServeClient` (generate, model_info,
close) and answers with the same fields, so the runner, the table and the plots are shared.

What crosses the wire: each request is a streaming /v1/completions call with the workload's
prompt (token ids, or its text), `max_tokens`, `temperature=0` and `ignore_eos=true` (vLLM's and
llama.cpp's extra field, which jaxserve accepts too), and `stream_options.include_usage`, so
the output token count is the server's own. The first streamed chunk with text is the first
token; a server's queue wait is not visible over this API and stays None. Plain `http.client`
(no dependency), one connection per request: the runner's threads each hold one.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import pathlib
import urllib.parse
from collections.abc import Iterator, Sequence

logger = logging.getLogger(__name__)

# Random-id prompts need the vocabulary's size; a server that does not say gets ids below this,
# which every vocabulary of a real model has.
FALLBACK_VOCAB = 256
_FINISH = {"stop": 1, "length": 2, "abort": 3}  # the proto's FinishReason numbers (runner.py)


@dataclasses.dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclasses.dataclass
class Chunk:
    """One streamed event, in the fields run_online reads from a GenerateResponse."""

    token_ids: list[int]  # placeholders, one per token the event carries (ids are not sent)
    finish_reason: int = 0  # 0 until the last event
    usage: _Usage = dataclasses.field(default_factory=_Usage)
    timings: None = None  # not visible over the OpenAI API


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What /v1/models says, in the fields `runner.server_info` reads."""

    model: str
    vocab_size: int
    context_length: int
    dtype: str = "unknown"
    limits: object = None


def model_name(model_id: str) -> str:
    """How the report names a served model: its id, or where the id is a path to its files
    (llama-server's is the .gguf file's), the last part of it. The plots' titles carry it,
    and a path says where the server keeps its files, not which model ran."""
    if model_id.startswith(("/", "~", "./", "../")) or "\\" in model_id:
        return pathlib.PurePath(model_id.replace("\\", "/")).name or model_id
    return model_id


class OpenAIError(RuntimeError):
    """The server answered an error status (the message carries its body)."""


class OpenAIBenchClient:
    """A blocking, thread-safe client of one OpenAI-compatible server (a connection per call)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0):
        parsed = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"url={url!r} must look like http://HOST:PORT.")
        self.url = url
        self._scheme, self._host = parsed.scheme, parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._base = parsed.path.rstrip("/")
        if self._base.endswith("/v1"):  # both http://h:p and http://h:p/v1 are accepted
            self._base = self._base[:-3]
        self._token = token
        self._timeout = timeout_s
        self._model: str | None = None

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _get_json(self, path: str, timeout: float) -> dict:
        conn = self._connection(timeout)
        try:
            conn.request("GET", self._base + path, headers=self._headers())
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise OpenAIError(f"GET {path}: HTTP {response.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def health(self, timeout: float = 10.0) -> str:
        """SERVING when /v1/models answers (every such server has it; /health varies)."""
        self.model_info(timeout=timeout)
        return "SERVING"

    def model_info(self, timeout: float = 10.0) -> ModelInfo:
        data = self._get_json("/v1/models", timeout)["data"]
        if not data:
            raise OpenAIError(f"{self.url} serves no model (/v1/models is empty).")
        entry = data[0]
        self._model = entry["id"]
        meta = entry.get("meta") or {}  # llama-server's
        vocab = entry.get("vocab_size") or meta.get("n_vocab")
        if vocab is None:
            logger.warning(
                "%s does not say its vocabulary's size; random prompts use ids below %d",
                self.url,
                FALLBACK_VOCAB,
            )
        context = entry.get("max_model_len") or meta.get("n_ctx_train") or 0
        return ModelInfo(
            model=model_name(str(entry["id"])),
            vocab_size=int(vocab or FALLBACK_VOCAB),
            context_length=int(context),
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        ignore_eos: bool = False,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Iterator[Chunk]:
        """Streams one completion; raises OpenAIError on an error status."""
        if self._model is None:
            self.model_info()
        body = {
            "model": self._model,
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if priority:  # vLLM refuses a priority unless it schedules by priority
            body["priority"] = priority
        if request_id:
            body["user"] = request_id
        return self._stream(body)

    def _stream(self, body: dict) -> Iterator[Chunk]:
        conn = self._connection(self._timeout)
        try:
            conn.request("POST", self._base + "/v1/completions", json.dumps(body), self._headers())
            response = conn.getresponse()
            if response.status != 200:
                raise OpenAIError(f"HTTP {response.status}: {response.read()[:300]!r}")
            finish, usage, seen = 0, None, 0
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise OpenAIError(f"error event: {event['error']}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason"):
                        finish = _FINISH.get(choice["finish_reason"], 4)
                    if choice.get("text"):
                        seen += 1
                        yield Chunk(token_ids=[0])  # one event per token on these servers
            total = usage["completion_tokens"] if usage else seen
            last = Chunk(token_ids=[0] * max(0, total - seen), finish_reason=finish or 4)
            if usage:
                last.usage = _Usage(usage.get("prompt_tokens", 0), total)
            yield last
        finally:
            conn.close()

    def close(self) -> None:
        pass

    def __enter__(self) -> OpenAIBenchClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(url: str, *, timeout_s: float = 10.0) -> OpenAIBenchClient:
    """A client of the server at `url`, checked to answer /v1/models; the bearer token is
    $JAXSERVE_AUTH_TOKEN or $OPENAI_API_KEY when set."""
    token = os.environ.get("JAXSERVE_AUTH_TOKEN") or os.environ.get("OPENAI_API_KEY") or None
    client = OpenAIBenchClient(url, token=token)
    client.model_info(timeout=timeout_s)
    return client
