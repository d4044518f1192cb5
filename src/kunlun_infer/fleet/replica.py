"""One replica of a fleet: an engine and its :class:`EngineLoop` inside a Ray actor.

:class:`ReplicaServer` is the actor's class (made remote by the fleet when
it starts, so importing this module needs no Ray). Its constructor composes
the replica's config *where it runs* — from the command line's overrides
and the replica's own, so a node needs only the plugins its replicas name —
and starts the engine behind the same :class:`EngineLoop` a single-engine
server uses (admission, aborts, failures, per-replica :class:`ServerMetrics`).

The fleet's dispatcher talks to it in batches: :meth:`submit` hands over
requests by token ids (each named by the dispatcher), :meth:`pull` waits
until outputs are ready and returns every one gathered since the last
call together with the engine's stats, :meth:`abort` stops requests.
Errors cross the process boundary as ``(kind, message, field)`` so that
no exception class has to unpickle on the other side.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from kunlun_infer.engine import heap
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.errors import KunlunInferError, RequestError
from kunlun_infer.runtime import compose_config
from kunlun_infer.server.engine_loop import EngineLoop, EngineUnavailableError, ServerBusyError
from kunlun_infer.server.metrics import ServerMetrics

log = logging.getLogger("kunlun_infer.framework")

#: what a refusal or failure is called on the wire
ErrorInfo = tuple[str, str, "str | None"]


def error_info(exc: BaseException) -> ErrorInfo:
    """``(kind, message, field)`` of an exception: ``request`` (the request is at fault), ``busy`` (the replica is
    full), ``unavailable`` (its engine stopped) or ``error``."""
    if isinstance(exc, RequestError):
        return "request", str(exc), exc.field
    if isinstance(exc, ServerBusyError):
        return "busy", str(exc), None
    if isinstance(exc, EngineUnavailableError):
        return "unavailable", str(exc), None
    return "error", f"{type(exc).__name__}: {exc}", None


class ReplicaServer:
    """The body of a replica's Ray actor. Methods are coroutines: they run on the actor's event loop while the
    engine steps in its own thread."""

    def __init__(self, name: str, overrides: Sequence[str]) -> None:
        self.name = name
        self.started = time.time()
        self.config = compose_config(list(overrides))
        self.engine = LLMEngine.from_config(self.config)
        self.metrics = ServerMetrics(lambda: self.loop.stats, lambda: self.loop.num_queued)
        self.loop = EngineLoop(self.engine, max_queue=int(self.config.server.max_queue), metrics=self.metrics)
        self.loop.start()
        heap.hold()  # the actor's process serves this engine: its start-up objects are left out of collections
        self._holds_heap = True
        #: ``(dispatcher's id, output or ErrorInfo)`` as the engine loop hands them over
        self._outbox: asyncio.Queue | None = None
        self._submissions: dict[str, Any] = {}

    def _queue(self) -> asyncio.Queue:
        if self._outbox is None:  # created on the actor's event loop, where the engine loop delivers to it
            self._outbox = asyncio.Queue()
        return self._outbox

    async def describe(self) -> dict[str, Any]:
        """Who and where it is, what it serves, and its limits."""
        import ray

        context = ray.get_runtime_context()
        engine, stats = self.engine, self.loop.stats
        return {
            "name": self.name, "pid": os.getpid(), "host": socket.gethostname(), "node_id": context.get_node_id(),
            "plugins": {c: engine.runtime.plugin_for(c) for c in ("device", "memory", "ops", "comm", "streams")},
            "model_path": str(engine.model_path), "vocab_size": engine.vocab_size,
            "max_model_len": engine.max_model_len, "max_request_tokens": int(stats["max_request_tokens"]),
            "max_num_seqs": int(stats["max_num_seqs"]), "capacity": self.loop.capacity,
            "kv_tokens": int(stats["kv_blocks_total"]) * int(stats["block_size"]), "stats": stats,
        }

    async def health(self, timeout_s: float) -> bool:
        """True when the engine loop serves and generates one token within ``timeout_s``."""
        if not self.loop.alive:
            return False
        probe: asyncio.Queue = asyncio.Queue()
        request = self.engine.prepare_request([0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        try:
            self.loop.submit(request, probe)
            _, output = await asyncio.wait_for(probe.get(), timeout_s)
        except (KunlunInferError, asyncio.TimeoutError):
            return False
        return not isinstance(output, BaseException) and output.finish_reason == "length"

    async def submit(self, items: Sequence[tuple[str, Sequence[int], SamplingParams]]) -> list[tuple[str, ErrorInfo]]:
        """Queue requests ``(id, prompt token ids, params)``; the ones refused, with why."""
        refused = []
        for request_id, token_ids, params in items:
            try:
                if params.structured is not None:  # compiling a grammar may take a while: off the event loop
                    prepared = await asyncio.to_thread(self.engine.prepare_request, list(token_ids), params)
                else:
                    prepared = self.engine.prepare_request(list(token_ids), params)
                self._submissions[request_id] = self.loop.submit(prepared, self._queue(), tag=request_id)
            except Exception as exc:  # noqa: BLE001 - each refusal is reported, the rest go on
                refused.append((request_id, error_info(exc)))
        return refused

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            submission = self._submissions.get(request_id)
            if submission is not None:
                self.loop.abort(submission)

    async def pull(self, wait_s: float) -> dict[str, Any]:
        """Outputs gathered since the last call (waiting up to ``wait_s`` for the first), and the engine's state."""
        queue = self._queue()
        items = []
        try:
            items.append(await asyncio.wait_for(queue.get(), wait_s))
        except asyncio.TimeoutError:
            pass
        while not queue.empty():
            items.append(queue.get_nowait())
        outputs = []
        for request_id, item in items:
            if isinstance(item, BaseException):
                self._submissions.pop(request_id, None)
                outputs.append((request_id, error_info(item)))
                continue
            if item.finished and request_id in self._submissions and self._submissions[request_id].samples_left == 0:
                del self._submissions[request_id]
            outputs.append((request_id, item))
        return {"outputs": outputs, "stats": self.loop.stats, "alive": self.loop.alive, "failure": self.loop.failure,
                "last_step_error": self.loop.last_step_error, "step_s": self.loop.step_seconds}

    async def check_structured(self, spec: Any) -> ErrorInfo | None:
        """Whether this replica's grammar backend can serve ``spec`` (compiled once, then cached)."""
        try:
            await asyncio.to_thread(self.engine.structured.compile, spec)
        except Exception as exc:  # noqa: BLE001 - the refusal goes back to the client
            return error_info(exc)
        return None

    async def metrics_text(self) -> str:
        return self.metrics.render()

    async def close(self) -> None:
        """Stop the engine loop (aborting what is left) and release the engine."""
        await asyncio.to_thread(self.loop.shutdown)
        self.engine.close()
        if self._holds_heap:
            self._holds_heap = False
            heap.release()
