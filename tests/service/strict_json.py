"""Every HTTP response of the service tests parsed as strict JSON (RFC 8259), SSE lines too.

Python's `json.loads` reads NaN, Infinity and -Infinity, which are not JSON: a client in
another language (or `jq`) fails on them. `loads` refuses them; `StrictTransport` is the real
httpx2 transport of the `openai` client with every response body checked as it arrives (a
JSON body whole, each `data:` line of a server-sent event stream as it completes), so every
call a test makes through `ServerThread.openai()` fails at once on a body that is not JSON.
`checked` counts the bodies and events checked, so a test can see the check ran. `post` is a
raw POST whose answer, streamed or not, is parsed so too.
"""

from __future__ import annotations

import http.client
import json

import httpx2

checked = {"json": 0, "sse": 0}


def _refuse(name: str):
    raise ValueError(f"The response holds {name}, which is not JSON (RFC 8259).")


def loads(text: str | bytes):
    """`json.loads`, refusing NaN, Infinity and -Infinity (ValueError naming the constant)."""
    return json.loads(text, parse_constant=_refuse)


def check_event_line(line: bytes) -> None:
    """One line of a server-sent event stream: a `data:` line holds JSON or `[DONE]`."""
    line = line.rstrip(b"\r")
    if line.startswith(b"data:"):
        data = line[len(b"data:") :].strip()
        if data != b"[DONE]":
            loads(data)
            checked["sse"] += 1


class _CheckedStream(httpx2.SyncByteStream):
    def __init__(self, inner, content_type: str):
        self._inner = inner
        self._sse = content_type.startswith("text/event-stream")
        self._json = "json" in content_type

    def __iter__(self):
        pending = b""
        for part in self._inner:
            if self._sse:
                *lines, pending = (pending + part).split(b"\n")
                for line in lines:
                    check_event_line(line)
            elif self._json:
                pending += part
            yield part
        if self._sse:
            check_event_line(pending)
        elif self._json and pending:
            loads(pending)
            checked["json"] += 1

    def close(self) -> None:
        self._inner.close()


class StrictTransport(httpx2.BaseTransport):
    """httpx2's HTTP transport, each response body checked as strict JSON as it is read."""

    def __init__(self):
        self._inner = httpx2.HTTPTransport()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        content_type = response.headers.get("content-type", "")
        return httpx2.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_CheckedStream(response.stream, content_type),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._inner.close()


def post(port: int, path: str, body: dict, timeout: float = 300.0) -> tuple[int, object]:
    """POSTs `body` (JSON) to 127.0.0.1:`port`; (status, the answer parsed strictly), or for a
    stream (status, the list of its `data:` events, each parsed strictly, the last "[DONE]" when
    the stream ended well; any other line but blank ones fails)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
        streamed = response.getheader("content-type", "").startswith("text/event-stream")
    finally:
        conn.close()
    if not streamed:
        return response.status, loads(raw)
    events = []
    for line in raw.decode("utf-8").split("\n"):
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else loads(data))
        else:
            assert line == "", f"{line!r} is not a line of a server-sent event stream"
    return response.status, events
