"""`AsyncEngine`: the engine loop on a background thread, an asyncio stream per request.

Concurrency:
- One engine thread owns the `Engine` and is the only thread that changes its state. It runs
  `step_updates()` (schedule, dispatch, take the last step's tokens in) while there is work and
  sleeps on a condition variable when idle.
- One output thread makes the outputs of each iteration's updates (`engine.outputs`:
  detokenizing, stop strings, logprobs) and delivers them, in order, while the engine thread
  runs the next iteration. A stop string it finds ends the request's stream at once and asks
  the engine thread, as a command, to finish the request (free its slot and pages) at its next
  iteration; the tokens the request samples meanwhile are dropped, never sent. It yields the
  GIL between chunks of rows, so the engine thread, back from the device, waits for it at most
  a chunk.
- asyncio callers never touch the engine: `generate()` posts an add command (and `abort` an
  abort command) to a lock-protected list the engine thread drains between iterations, so a
  request joins or leaves only at an iteration boundary.
- Outputs travel back into one unbounded asyncio.Queue per request, a step's outputs in one
  `loop.call_soon_threadsafe` per event loop; each queue holds at most the tokens of one
  request, so memory is bounded by the requests.
- A consumer that stops iterating (break, cancel, disconnect) aborts its request.
- Identity: each admitted call gets an internal id that is never reused (`<user id>#<n>`); the
  engine and the output routing know only that id, and a stream sees its outputs with the
  caller's id put back. A caller's id stays reserved until the engine has finished with its
  request (an abort takes an iteration or two), so a stream can never receive the leftovers of an
  earlier request that used the same id; reusing an id before then is a ValueError.
- `snapshot()` is an immutable `EngineSnapshot` the engine thread replaces after every
  iteration, so any thread may read the gauges without touching the engine.
- If the engine thread dies, every open stream (including one whose add is still pending)
  receives the error at once and new requests are refused. `shutdown()` aborts the requests
  left (so the engine is idle, its pages free, and it can be reused) and ends open streams the
  same way. Nothing hangs.
- Multi-host (jaxserve/runtime/multihost.py): each step the engine thread runs also goes to the
other
  processes. An AsyncEngine that built its Engine releases them (`runner.stop_followers()`, a
  no-op on one host) from the engine thread as it ends, after closing the streams; given an
  Engine, the caller owns it and releases them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence

from jaxserve.engine.build import build_engine
from jaxserve.engine.calibration import save_served_scale
from jaxserve.engine.core import Engine
from jaxserve.engine.info import EngineInfo
from jaxserve.engine_config import EngineConfig
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Rows of updates the output thread makes into outputs before it lets the engine thread run.
_OUTPUT_CHUNK = 64


class EngineDeadError(RuntimeError):
    """The engine thread failed (or was shut down); no request can run any more."""


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges after an iteration; safe to read from any thread."""

    iteration: int  # step() calls run so far
    request_ids: frozenset[str]  # requests the scheduler holds (waiting or running)
    num_running: int
    num_waiting: int
    slots_used: int
    kv_pages_used: int
    kv_pages_total: int


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future  # settled by the engine thread once add_request ran (or failed)
    user_id: str  # the caller's id, put back on every output this stream yields


class AsyncEngine:
    """Thread-backed engine with per-request async iterators."""

    def __init__(self, config: EngineConfig | None = None, *, engine: Engine | None = None):
        self._owns_engine = engine is None  # built here: its followers are released here
        self.engine = engine or build_engine(config)
        self._lock = threading.Condition()
        self._commands: list[tuple] = []
        # Calls that wait for the engine to drain (update_weights, sleep), and the adds sent
        # after them, held back until they have run (engine thread only).
        self._barriers: list[tuple] = []
        self._held: list[tuple] = []
        self._streams: dict[str, _Stream] = {}  # by internal id
        # Caller id -> internal id, from generate() until the engine has finished with it.
        self._reserved: dict[str, str] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._closed = False  # set (under the lock) once the engine thread has ended
        self.error: BaseException | None = None
        self._live: set[str] = set()  # added and not yet reported finished (engine thread only)
        # The snapshot's request ids, rebuilt only after an iteration that added, aborted or
        # finished a request: most iterations change none, and the rebuild walks them all.
        self._live_ids: frozenset[str] = frozenset()
        self._ids_stale = True
        self._iteration = 0
        self._publish_lock = threading.Lock()  # both threads publish snapshots
        self._publish()
        # Each iteration's updates, in order, to the output thread; None ends it.
        self._updates: queue.SimpleQueue = queue.SimpleQueue()
        self.engine.outputs.finish_request = self._finish_from_outputs
        self._output_thread = threading.Thread(
            target=self._run_outputs, name="jaxserve-outputs", daemon=True
        )
        self._output_thread.start()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises what add_request raises (bad input, full queue,
        an adapter `lora` that is not loaded).

        `request_id` is the caller's name for the request (unique among requests the engine
        still holds); outputs carry it, but the engine sees a fresh internal id.
        """
        spec = sampling_params.structured_output if sampling_params is not None else None
        if spec is not None:  # compiled here, off the engine thread, within its bound
            await self.engine.grammars.compile_async(spec)
        n = next(self._ids)
        user_id = request_id or f"async-{n}"
        internal_id = f"{user_id}#{n}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future(), user_id)
        with self._lock:
            # Checked under the lock the engine thread closes under: a stream registered here
            # is either refused now or reached by _close().
            if self._closed:
                raise EngineDeadError(self._dead_message())
            if user_id in self._reserved:
                raise ValueError(
                    f"request_id {user_id!r} belongs to a request the engine has not finished "
                    "(running, or cancelled and not yet aborted); reuse an id only after its "
                    "earlier request has ended."
                )
            self._reserved[user_id] = internal_id
            self._streams[internal_id] = stream
            self._commands.append(
                ("add", stream, internal_id, prompt, sampling_params, priority, lora)
            )
            self._lock.notify()
        try:
            await stream.accepted  # add_request's ValueError / QueueFull surface here
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item  # already under the caller's id (_deliver)
                if item.finished:
                    return
        finally:
            with self._lock:
                if self._streams.pop(internal_id, None) is not None and not self._closed:
                    self._commands.append(("abort", internal_id))
                    self._lock.notify()

    async def add_lora(self, name: str, source) -> None:
        """Registers adapter `name` (a PEFT folder) on the engine thread, between iterations;
        raises its ValueError (a bad adapter, a name in use)."""
        await self._on_engine_thread(self.engine.add_lora, name, source)

    async def remove_lora(self, name: str) -> None:
        """Unregisters adapter `name` on the engine thread; ValueError while requests use it."""
        await self._on_engine_thread(self.engine.remove_lora, name)

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, source) of every registered adapter (any thread: a copy of the registry)."""
        return [(name, adapter.source) for name, adapter in self.engine.adapters.items()]

    # ---- the rollout API over the engine thread (docs/rl.md) -------------------------------

    async def update_weights(self, source) -> int:
        """Serves the weights of `source` (a checkpoint folder, Hugging Face-named arrays, or a
        param tree: Engine.update_weights) from the next step on; returns the new weights'
        version. The folder is read and placed off the engine thread while it serves; then the
        engine drains: requests added before the call finish on the old weights, those added
        after it wait and run on the new ones. Raises ValueError (from the read, nothing
        changed) naming what is wrong."""
        new = await asyncio.to_thread(self.engine.read_weights, source)
        await self._when_drained(self.engine.swap_weights, new)
        return self.engine.weights_version

    async def sleep(self, level: int = 1) -> int:
        """Drains (as update_weights does), then frees the KV pool (level 2: the weights too):
        Engine.sleep; returns the bytes freed. Requests sent while asleep are refused with
        EngineAsleep until `wake_up`."""
        return await self._when_drained(self.engine.sleep, level)

    async def wake_up(self) -> None:
        """Allocates what `sleep` freed again; serving resumes with no compile."""
        await self._on_engine_thread(self.engine.wake_up)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def _when_drained(self, fn, *args):
        """Runs fn(*args) on the engine thread once every request added before this call has
        finished (no work left); requests added meanwhile wait, in order, until it has run."""
        future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._dead_message())
            self._commands.append(("drained", fn, args, future))
            self._lock.notify()
        return await asyncio.wrap_future(future)

    async def _on_engine_thread(self, fn, *args):
        """Runs fn(*args) on the engine thread between iterations; returns or raises its result."""
        future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._dead_message())
            self._commands.append(("call", fn, args, future))
            self._lock.notify()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Ends the caller's request `request_id` at the next iteration (no-op if unknown)."""
        with self._lock:
            internal_id = self._reserved.get(request_id)
            if internal_id is not None:
                self._commands.append(("abort", internal_id))
                self._lock.notify()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the engine thread after the iteration in progress, aborting what is left; open
        streams end with EngineDeadError."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)

    def _dead_message(self) -> str:
        if self.error is not None:
            return f"The engine has failed: {self.error!r}"
        return "The engine was shut down."

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # every open stream must learn that the engine died
            logger.exception("engine thread failed")
            self.error = e
        # The outputs of every iteration that ran reach their streams before the rest close.
        self._updates.put(None)
        self._output_thread.join()
        self.engine.outputs.finish_request = self.engine.scheduler.finish_request
        self._close()
        try:  # the serving scale the SLO policy measured, for the next start (slo_policy.py)
            save_served_scale(self.engine)
        except Exception:
            logger.exception("saving the cost model's serving scale failed")
        if self._owns_engine:
            self._release_followers()
            self.engine.close()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._commands and not self.engine.has_work() and not self._barriers:
                    if self._stopping:
                        return
                    self._lock.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] == "drained":
                    self._barriers.append(command)
                elif command[0] == "add" and self._barriers:  # after the barrier's call
                    self._held.append(command)
                else:
                    self._apply(command)
            if self._barriers and not self.engine.has_work():
                self._run_barriers()
            if self.engine.has_work():
                self._step()
        # Stopping with requests left: abort them so the engine is idle and its pages free
        # (aborts finish within two iterations; the bound only guards against a bug). Those
        # their outputs ended already are finished as asked.
        with self._lock:
            finishes = [c for c in self._commands if c[0] == "finish"]
        for command in finishes:
            self._apply(command)
        for request_id in tuple(self._live):
            self.engine.abort(request_id)
        for _ in range(16):
            if not self.engine.has_work():
                break
            self._step()

    def _run_barriers(self) -> None:
        """The engine has drained: runs the calls that waited for it, then the adds held back
        behind them (before any command that came later)."""
        while self._barriers:
            _, fn, args, future = self._barriers.pop(0)
            try:
                future.set_result(fn(*args))
            except Exception as e:  # the caller's error (a bad tree, asleep), not the engine's
                future.set_exception(e)
        for command in self._held:
            self._apply(command)
        self._held = []

    def _release_followers(self) -> None:
        try:
            self.engine.runner.stop_followers()
        except Exception:  # the streams are closed already; the followers end with the cluster
            logger.exception("could not release the multi-host followers")

    def _step(self) -> None:
        updates = self.engine.step_updates()
        self._iteration += 1
        if any(update.finished for update in updates):
            self._ids_stale = True
        # Published before the outputs are made: a caller that sees its request end then reads
        # a snapshot without it (its slot and pages already back), never the one before.
        self._publish()
        self._updates.put(updates)

    def _finish_from_outputs(self, request_id: str, reason) -> None:
        """The output thread ended a request (its stop string, a failure): the engine thread
        finishes it at its next iteration."""
        with self._lock:
            self._commands.append(("finish", request_id, reason))
            self._lock.notify()

    # ---- output thread --------------------------------------------------------------------

    def _run_outputs(self) -> None:
        """Makes and delivers each iteration's outputs until the engine thread ends."""
        try:
            while (updates := self._updates.get()) is not None:
                outputs = []
                for start in range(0, len(updates), _OUTPUT_CHUNK):
                    if start:
                        time.sleep(0)  # the engine thread may be back from the device
                    outputs += self.engine.outputs.process(updates[start : start + _OUTPUT_CHUNK])
                ended = [out.request_id for out in outputs if out.finished]
                for request_id in ended:  # released first: a caller that sees it may reuse it
                    self._live.discard(request_id)
                    self._release(request_id)
                if ended:  # and gone from the snapshot before its caller sees the end
                    self._ids_stale = True
                    self._publish()
                self._deliver(outputs)
        except BaseException as e:  # the engine thread stops, and every open stream learns why
            logger.exception("output thread failed")
            self.error = e
            with self._lock:
                self._stopping = True
                self._lock.notify()

    def _close(self) -> None:
        """Ends every open stream, pending adds included, with EngineDeadError."""
        with self._lock:
            self._closed = True
            streams = list(self._streams.values())
            calls = [c[3] for c in self._commands + self._barriers if c[0] in ("call", "drained")]
            self._commands = []
            held, self._held, self._barriers = self._held, [], []
        for command in held:  # their streams are closed below with the rest
            self._release(command[2])
        for future in calls:  # adapter loads never applied: their callers must not hang
            if not future.done():
                future.set_exception(EngineDeadError(self._dead_message()))
        error = EngineDeadError(self._dead_message())
        for stream in streams:
            self._resolve(stream.accepted, error)
            self._put(stream, error)

    def _publish(self) -> None:
        with self._publish_lock:
            self._publish_locked()

    def _publish_locked(self) -> None:
        s = self.engine.scheduler
        if self._ids_stale:
            self._ids_stale = False  # before the walk: a finish meanwhile publishes again
            live = (r for r in tuple(self._live) if s.get_request(r) is not None)
            self._live_ids = frozenset(_user_id(r) for r in live)
        self._snapshot = EngineSnapshot(
            iteration=self._iteration,
            request_ids=self._live_ids,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            slots_used=s.num_slots_used,
            kv_pages_used=s.num_pages_used,
            kv_pages_total=self.engine.runner.config.num_pages,
        )

    def _apply(self, command: tuple) -> None:
        self._ids_stale = True
        if command[0] == "abort":
            self.engine.abort(command[1])
            return
        if command[0] == "finish":
            self.engine.finish(command[1], command[2])
            return
        if command[0] == "call":
            _, fn, args, future = command
            try:
                future.set_result(fn(*args))
            except Exception as e:  # the caller's error (a bad adapter), not the engine's
                future.set_exception(e)
            return
        _, stream, request_id, prompt, params, priority, lora = command
        with self._lock:
            if self._streams.get(request_id) is not stream:  # its consumer left before the add
                self._release(request_id)
                return
        try:
            self.engine.add_request(
                prompt, params, request_id=request_id, priority=priority, lora=lora
            )
        except Exception as e:  # bad input ends this request alone
            self._release(request_id)
            self._resolve(stream.accepted, e)
            return
        self._live.add(request_id)
        self._resolve(stream.accepted, None)

    def _release(self, internal_id: str) -> None:
        """The engine is done with `internal_id`: its caller's id may be used again."""
        with self._lock:
            user_id = _user_id(internal_id)
            if self._reserved.get(user_id) == internal_id:
                del self._reserved[user_id]

    def _resolve(self, future: asyncio.Future, error: BaseException | None) -> None:
        def settle():
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        self._call_soon(future.get_loop(), settle)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their streams: one wake-up per event loop, not per output.

        Each `call_soon_threadsafe` writes to the loop's wake-up pipe (a system call) and queues
        a callback, and every one of them is work under the GIL that the next step waits for:
        with 256 streams, one per output made up much of the host's time per step. The outputs
        are the engine's fresh objects, so the caller's id is put on them here, in place.
        """
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    out.request_id = stream.user_id
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            self._call_soon(loop, _put_all, items)

    def _put(self, stream: _Stream, item) -> None:
        self._call_soon(stream.loop, stream.queue.put_nowait, item)

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            logger.debug("dropped an output for a closed event loop")

    # ---- what front ends read -------------------------------------------------------------

    @functools.cached_property
    def info(self) -> EngineInfo:
        """The model and the engine's limits as plain values (jaxserve/engine/info.py), for the
        service to read instead of reaching into the engine; fixed once built, any thread."""
        return EngineInfo.of(self.engine)

    @property
    def tokenizer(self):
        """The model's tokenizer, None without one. Front ends tokenize on their own threads
        while the output thread decodes; the Rust tokenizer takes shared borrows for both."""
        return self.engine.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt, as `add_request` would make them (any thread)."""
        return self.engine.encode(text)

    @property
    def num_compiles(self) -> int:
        """Step compilations so far: the server logs it once serving (compiles after warm-up
        should stay at this number)."""
        return self.engine.runner.num_compiles

    @property
    def metrics_registry(self):
        """The engine's prometheus registry, for the server to expose beside its own."""
        return self.engine.metrics.registry


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the consumers' event loop: each item into its stream's queue."""
    for stream_queue, item in items:
        stream_queue.put_nowait(item)


def _user_id(internal_id: str) -> str:
    """The caller's id inside an internal id `<user id>#<n>`."""
    return internal_id.rpartition("#")[0]
