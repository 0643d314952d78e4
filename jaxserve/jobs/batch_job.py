"""`jaxserve batch INPUT.jsonl OUTPUT.jsonl`: offline inference over large files, resumable.

Input: one JSON object a line, `{"id": ..., "prompt": "..."}` or `"prompt_token_ids": [...]`,
optionally `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
`stop_token_ids`, `ignore_eos`, `beam_width`, `length_penalty`, `lora` (the name of a LoRA
adapter the engine serves, `--lora NAME=PATH`; without it, the base model) and
`structured_outputs` (a constraint as vLLM spells it: `{"json": schema}`, `{"regex": ...}`,
`{"choice": [...]}`, `{"grammar": ...}`, `{"json_object": true}`; a bad one is a bad line). Its
grammar compiles when the line is added, on the job's thread, within
EngineConfig.grammar_compile_timeout_s.
A line without an id gets `line-N`, N its line number (stable as long as the file is).
Output: one JSON object a line as each request finishes, in completion order:
`{"id", "text", "prompt_tokens", "output_tokens", "finish_reason"}` (+ `token_ids` if asked).

Beam search: a line with `beam_width` > 1 runs a beam search (jaxserve/engine/beam_search.py) beside
the other lines' requests on the same engine. Its output line has the best beam in the usual
fields (`output_tokens` counts its tokens) and every beam, best first, in `beams`: `{"text",
"token_ids", "cumulative_logprob", "score", "finish_reason"}`. A search whose request failed has
no beams, its request's finish reason and an `error` saying why. The line is written, and so
counts as done for a rerun, once its search has ended, like any other line.

Durability: the output is opened O_APPEND and written one whole step's lines per `write`, each
line ending in "\\n", followed by `fsync`; a line counts only once its newline is on disk. A
SIGKILL or a crash can leave at most a torn last line without its newline; on resume that tail is
cut off (and its request runs again), every complete line's id is skipped, so each input id ends
up on exactly one line.

Streaming: the input is read lazily and only enough requests are queued to keep every slot busy
(`max_num_seqs` running plus as many waiting), so memory does not grow with the file. One pass
counts lines first, for the progress bar's total and ETA.

Bad lines (not JSON, no prompt, bad values, a duplicate id, a prompt the model cannot take) are
reported on stderr with their line numbers and skipped, or, with `stop_on_error`, end the job:
requests already running are finished and written first, so no work is thrown away.

The job is two parts so that `jaxserve batch --ray` (batch_ray.py) runs the same one over many
engines: `BatchRun` is the one writer's side (input, resume, output, progress) and `EngineFeed`
one engine's (lines in, result records out).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.engine import beam_search
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # not at run time: a Ray driver reads and writes without importing JAX
    from jaxserve.engine.core import Engine

_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "beam_width",
    "length_penalty",
)


class BatchInputError(ValueError):
    """A bad input line, in stop-on-error mode; the message names the line."""


class OutputCorrupt(ValueError):
    """A line in the middle of an existing output file is not a result: we did not write it."""


@dataclasses.dataclass
class BatchSummary:
    """What a batch job did; `bad_lines` lists (line number, reason)."""

    total_lines: int = 0
    already_done: int = 0
    completed: int = 0
    output_tokens: int = 0
    bad_lines: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    repaired_tail: bool = False
    elapsed_s: float = 0.0


@dataclasses.dataclass
class _Job:
    lineno: int
    id: str
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)


# ---- resume -------------------------------------------------------------------------------


def recover_output(path: Path) -> tuple[set[str], bool]:
    """Ids already written to `path`, after cutting off a torn last line (returned flag).

    Only the tail can be torn (see the module docstring); an unreadable line elsewhere means the
    file is not ours, and is refused rather than silently truncated.
    """
    if not path.exists():
        return set(), False
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
    lines = data[:keep].split(b"\n")[:-1]
    done: set[str] = set()
    for i, raw in enumerate(lines):
        try:
            obj = json.loads(raw)
            done.add(str(obj["id"]))
        except (ValueError, KeyError, TypeError):
            if i != len(lines) - 1:
                raise OutputCorrupt(
                    f"{path} line {i + 1} is not a batch result; refusing to resume into it."
                ) from None
            keep -= len(raw) + 1  # a complete but garbled last line: also from a crash
    repaired = keep != len(data)
    if repaired:
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return done, repaired


class _Output:
    """Appends whole lines with one write and an fsync per flush."""

    def __init__(self, path: Path):
        existed = path.exists()
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if not existed:  # make the new file's name durable too
            dir_fd = os.open(path.parent or ".", os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self.pending: list[bytes] = []

    def add(self, record: dict) -> None:
        self.pending.append(json.dumps(record, ensure_ascii=False).encode() + b"\n")

    def flush(self) -> None:
        if not self.pending:
            return
        view = memoryview(b"".join(self.pending))
        while view:  # a regular file takes it in one write; loop in case it does not
            view = view[os.write(self.fd, view) :]
        os.fsync(self.fd)
        self.pending = []

    def close(self) -> None:
        self.flush()
        os.close(self.fd)


# ---- input --------------------------------------------------------------------------------


def _count_lines(path: Path) -> int:
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def _read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        yield from enumerate(f, 1)


def parse_line(
    raw: bytes, lineno: int, defaults: SamplingParams
) -> tuple[str, str | list[int], SamplingParams, str | None]:
    """(id, prompt, params, LoRA adapter or None) of one input line; ValueError with a short
    reason if it is bad."""
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id", f"line-{lineno}")
    if not isinstance(rid, str | int) or isinstance(rid, bool) or rid == "":
        raise ValueError(f"id {rid!r} must be a non-empty string or an integer")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise ValueError("give exactly one of prompt, prompt_token_ids")
    prompt = obj["prompt"] if has_text else obj["prompt_token_ids"]
    if has_text and (not isinstance(prompt, str) or not prompt):
        raise ValueError("prompt must be a non-empty string")
    if has_ids and (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise ValueError("prompt_token_ids must be a non-empty list of integers")
    changes = {k: obj[k] for k in ("max_tokens", *_SAMPLING_KEYS) if k in obj}
    if "structured_outputs" in obj:  # vLLM's name on the line, SamplingParams' in the engine
        changes["structured_output"] = obj["structured_outputs"]
    try:
        params = dataclasses.replace(defaults, **changes) if changes else defaults  # validates
    except TypeError as e:  # e.g. "stop": 5, which is not a list of strings
        raise ValueError(f"bad sampling options {changes}: {e}") from None
    lora = obj.get("lora")
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise ValueError(f"lora {lora!r} must be the name of a LoRA adapter the engine serves")
    return str(rid), prompt, params, lora


# ---- the job ------------------------------------------------------------------------------


@dataclasses.dataclass
class Line:
    """One checked input line on its way to an engine (picklable: Ray ships it to replicas)."""

    lineno: int
    id: str
    prompt: str | list[int]
    params: SamplingParams
    lora: str | None = None  # the LoRA adapter it runs with; None: the base model


class EngineFeed:
    """One engine's share of a batch job: lines in, result records out as requests finish.

    Both the single-process job and each Ray replica drive their engine through this, so a line
    gives the same record wherever it runs.
    """

    def __init__(self, engine: Engine, include_token_ids: bool = False):
        if engine.has_unfinished():
            raise RuntimeError("A batch job needs an idle engine.")
        self.engine = engine
        self.include_token_ids = include_token_ids
        self.jobs: dict[str, _Job] = {}
        # Beam-search lines: each a search whose requests the driver adds, iteration by
        # iteration, and claims from the engine's outputs. Line id -> (search, arrival time).
        self.beams = beam_search.BeamDriver(engine)
        self.searches: dict[str, tuple[beam_search.BeamSearch, float]] = {}

    def __len__(self) -> int:
        return len(self.jobs) + len(self.searches)

    def add(self, line: Line) -> str | None:
        """Queues the line; the reason, without a final period, if the engine refuses it."""
        if line.params.beam_width > 1:
            return self._add_search(line)
        try:
            self.engine.add_request(
                line.prompt, line.params, request_id=_request_id(line.id), lora=line.lora
            )
        except ValueError as e:  # too long for the model, ids outside the vocab, ...
            return str(e).rstrip(".")
        self.jobs[_request_id(line.id)] = _Job(line.lineno, line.id)
        return None

    def _add_search(self, line: Line) -> str | None:
        engine = self.engine
        try:
            ids = engine.encode(line.prompt) if isinstance(line.prompt, str) else line.prompt
            search = beam_search.start_search(engine, ids, line.params, line.lora)
            self.beams.submit(search)  # its first request, checked as any other
        except ValueError as e:
            return str(e).rstrip(".")
        self.searches[line.id] = (search, time.monotonic())
        return None

    def step(self) -> list[dict]:
        """One engine step; the records of the requests (and beam searches) it finished."""
        records = []
        for o in self.engine.step():
            if self.beams.take(o):  # a beam's request: the search has it now
                continue
            job = self.jobs.get(o.request_id)
            if job is None:
                continue
            job.text.append(o.text_delta)
            job.token_ids += o.new_token_ids
            if o.finished:
                del self.jobs[o.request_id]
                record = {
                    "id": job.id,
                    "text": "".join(job.text),
                    "prompt_tokens": o.num_prompt_tokens,
                    "output_tokens": o.num_output_tokens,
                    "finish_reason": o.finish_reason,
                }
                if self.include_token_ids:
                    record["token_ids"] = job.token_ids
                records.append(record)
        for rid in [rid for rid, (search, _) in self.searches.items() if search.done]:
            records.append(self._search_record(rid, *self.searches.pop(rid)))
        return records

    def _search_record(self, rid: str, search: beam_search.BeamSearch, arrival: float) -> dict:
        """A finished search's line: the best beam where a request's result goes, all in beams."""
        found = [] if search.failure is not None else search.result()
        beams = beam_search.label(self.engine, search.prompt_token_ids, found)
        out = beam_search.best_output(rid, search, beams, arrival)
        record = {
            "id": rid,
            "text": out.text_delta,
            "prompt_tokens": out.num_prompt_tokens,
            "output_tokens": out.num_output_tokens,
            "finish_reason": out.finish_reason,
        }
        if self.include_token_ids:
            record["token_ids"] = out.new_token_ids
        record["beams"] = [
            {
                "text": b.text,
                "token_ids": b.token_ids,
                "cumulative_logprob": b.cumulative_logprob,
                "score": b.score,
                "finish_reason": b.finish_reason,
            }
            for b in beams
        ]
        if out.error is not None:
            record["error"] = out.error
        return record


def _request_id(line_id: str) -> str:
    """A line's engine request id: prefixed, so that no line id can be one of the engine's own
    ("req-N"), which beam searches' requests take."""
    return f"line:{line_id}"


class BatchRun:
    """The writer's side of a batch job, shared by `run_batch` and `run_ray`: resume, reading
    and checking the input lazily, bad-line reports, the durable output, the progress bar and
    the summary. Single-threaded: one writer per output file."""

    def __init__(
        self,
        input_path: str | Path,
        output_path: str | Path,
        *,
        defaults: SamplingParams | None = None,
        stop_on_error: bool = False,
        progress: bool = True,
        log=None,
        summary: BatchSummary | None = None,  # to fill: a subclass adds its own fields
    ):
        from tqdm import tqdm

        self.input_path, self.output_path = Path(input_path), Path(output_path)
        self.defaults = defaults or SamplingParams(max_tokens=256, temperature=0.0)
        self.stop_on_error = stop_on_error
        self.summary = summary or BatchSummary()
        self.summary.total_lines = _count_lines(self.input_path)
        self.done, self.summary.repaired_tail = recover_output(self.output_path)
        self.out = _Output(self.output_path)
        self.bar = tqdm(
            total=max(0, self.summary.total_lines - len(self.done)),
            unit="req",
            disable=not progress,
            dynamic_ncols=True,
            file=sys.stderr,
            smoothing=0.1,
        )
        self.say = log or (lambda msg: tqdm.write(msg, file=sys.stderr))
        if self.summary.repaired_tail:
            self.say(f"{self.output_path}: cut off a torn last line left by an interrupted run")
        if self.done:
            self.say(f"{self.output_path}: resuming, {len(self.done)} results already written")
        self.seen: dict[str, int] = {}  # id -> line, for ids queued in this run
        self.lines = _read_lines(self.input_path)
        self.reading = True  # False at the end of the input, or after a bad line that stops
        self.stop_error: BatchInputError | None = None
        self.start = time.perf_counter()

    def next_line(self) -> Line | None:
        """The next input line to run, skipping (and reporting) the others; None at the end."""
        while self.reading:
            item = next(self.lines, None)
            if item is None:
                self.reading = False
                break
            lineno, raw = item
            if not raw.strip():
                self.bar.update(1)  # blank lines carry no request
                continue
            try:
                rid, prompt, params, lora = parse_line(raw, lineno, self.defaults)
            except ValueError as e:
                self.bad(lineno, str(e))
                continue
            if rid in self.done:
                self.summary.already_done += 1
                continue
            if rid in self.seen:
                self.bad(lineno, f"duplicate id {rid!r} (first on line {self.seen[rid]})")
                continue
            self.seen[rid] = lineno
            return Line(lineno, rid, prompt, params, lora)
        return None

    def reject(self, line: Line, reason: str) -> None:
        """An engine refused the line: reported like a bad line; its id may come again."""
        del self.seen[line.id]
        self.bad(line.lineno, reason)

    def bad(self, lineno: int, reason: str) -> None:
        self.summary.bad_lines.append((lineno, reason))
        stop = self.stop_on_error
        self.say(f"{self.input_path}:{lineno}: {reason}; " + ("stopping" if stop else "skipped"))
        self.bar.update(1)
        if stop:
            self.reading = False
            self.stop_error = BatchInputError(f"{self.input_path} line {lineno}: {reason}.")

    def write(self, records: list[dict]) -> None:
        """Appends finished results and makes them durable before the caller goes on."""
        for record in records:
            self.out.add(record)
            self.summary.completed += 1
            self.summary.output_tokens += record["output_tokens"]
        self.out.flush()
        self.bar.update(len(records))

    def tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self.start
        return self.summary.output_tokens / elapsed if elapsed > 0 else 0.0

    def close(self) -> None:
        self.out.close()
        self.bar.close()
        self.summary.elapsed_s = time.perf_counter() - self.start


def run_batch(
    engine: Engine,
    input_path: str | Path,
    output_path: str | Path,
    *,
    defaults: SamplingParams | None = None,
    stop_on_error: bool = False,
    include_token_ids: bool = False,
    progress: bool = True,
    log=None,
) -> BatchSummary:
    """Runs every input line not yet in the output; see the module docstring.

    Raises BatchInputError on the first bad line when `stop_on_error` (after finishing and
    writing the requests already running), OutputCorrupt if the output is not resumable.
    """
    feed = EngineFeed(engine, include_token_ids)
    job = BatchRun(
        input_path,
        output_path,
        defaults=defaults,
        stop_on_error=stop_on_error,
        progress=progress,
        log=log,
    )
    target = 2 * engine.config.max_num_seqs  # running + as many waiting: slots never idle
    try:
        while True:
            while len(feed) < target and (line := job.next_line()) is not None:
                if (reason := feed.add(line)) is not None:
                    job.reject(line, reason)
            if not engine.has_unfinished():
                if not job.reading:
                    break
                continue
            job.write(feed.step())  # every result of this step, durable before the next step
            job.bar.set_postfix_str(f"{job.tokens_per_s():.1f} tok/s", refresh=False)
    finally:
        job.close()
    if job.stop_error is not None:
        raise job.stop_error
    return job.summary
