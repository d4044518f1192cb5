"""One thread drives the engine for every HTTP connection: continuous batching behind an asyncio server.

The engine is driven from one thread only (its contract), so HTTP handlers
never touch it: :meth:`EngineLoop.submit` and :meth:`EngineLoop.abort` put
work in a locked inbox and wake the loop thread, which adds and aborts
requests between steps, runs :meth:`LLMEngine.step` while anything is
unfinished, and hands each :class:`RequestOutput` to the asyncio queue of
the handler that owns the request (``call_soon_threadsafe``). Requests that
arrive while others run join the next step's batch. Handlers hand over
requests the engine already prepared (tokenized and checked) and get a
:class:`Submission` back; the engine names each request when the loop
thread adds it.

Admission is bounded: at most ``scheduler.max_num_seqs + server.max_queue``
requests are in flight; one more is refused at once with
:class:`ServerBusyError` (HTTP 429) instead of growing the queue without
limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.engine.intake import PreparedRequest
from kunlun_infer.errors import KunlunInferError, WorkerError

log = logging.getLogger("kunlun_infer.framework")

_IDLE_WAIT_S = 0.5


class ServerBusyError(KunlunInferError):
    """The bounded queue is full; the client should retry later."""


class EngineUnavailableError(KunlunInferError):
    """The engine loop has stopped (shutting down, or the engine failed)."""


class ReplicaFailedError(KunlunInferError):
    """A fleet's replica failed while serving a request that had streamed tokens (it is not repeated elsewhere)."""


@dataclasses.dataclass(eq=False)
class Submission:
    """One request handed to the loop; its outputs arrive in ``queue`` as ``(tag, output or exception)``."""

    request: PreparedRequest
    tag: Any
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    #: the engine's name for it, once the loop thread added it
    request_id: str | None = None
    #: samples not finished yet (loop thread only)
    samples_left: int = 0


def deliver(sub: Any, item: RequestOutput | BaseException) -> None:
    """Hand ``item`` to the handler waiting on ``sub`` (anything with its ``loop``, ``queue`` and ``tag``, as
    :class:`Submission`), from any thread."""
    deliver_all([(sub, item)])


def deliver_all(items: Iterable[tuple[Any, RequestOutput | BaseException]]) -> None:
    """:func:`deliver` each ``(sub, item)``, in order, waking each handler event loop once for all of them: a
    wake-up is a write to the loop's self-pipe, and a step of 64 streams would otherwise make 64."""
    by_loop: dict[Any, list[tuple[asyncio.Queue, Any]]] = {}
    for sub, item in items:
        by_loop.setdefault(sub.loop, []).append((sub.queue, (sub.tag, item)))
    for loop, puts in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:  # the handlers' event loop is closed: nobody is listening
            pass


def _put_all(puts: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, entry in puts:
        queue.put_nowait(entry)


class EngineLoop:
    """Steps ``engine`` in one thread; thread-safe ``submit``/``abort`` for the HTTP side.

    That thread is the loop's own (:meth:`start` starts it), or with ``thread=False`` the one that calls
    :meth:`run_here` (``kunlun-infer serve`` steps on its process's main thread: see ``server/runner.py``).
    """

    def __init__(self, engine: Any, *, max_queue: int, metrics: Any = None, thread: bool = True) -> None:
        self.engine = engine
        #: the engine's stats after the latest step (read by /metrics and /health; its limits by the handlers)
        self.stats: dict[str, Any] = dict(engine.stats())
        self.capacity = int(self.stats["max_num_seqs"]) + int(max_queue)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._inbox: deque[Submission] = deque()
        self._aborts: deque[Submission] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        #: requests accepted and not finished (touched under the lock)
        self._in_flight: set[Submission] = set()
        #: the requests the engine took, by the id it gave them (loop thread only)
        self._by_request_id: dict[str, Submission] = {}
        self._thread = threading.Thread(target=self._run, name="kunlun-infer-engine-loop", daemon=True) \
            if thread else None
        #: set by :meth:`start`, and once the loop has stopped stepping (it ran in :meth:`run_here`)
        self._started, self._finished = threading.Event(), threading.Event()
        #: why the loop stopped serving, if it failed
        self.failure: str | None = None
        #: the error of the latest failed step (its requests were aborted)
        self.last_step_error: str | None = None
        #: when the step now running began (``time.monotonic``); ``None`` between steps
        self.step_started: float | None = None

    # ------------------------------------------------------------------ the HTTP side (any thread)

    def start(self) -> None:
        """Start stepping: in the loop's own thread, or in the one waiting in :meth:`run_here`."""
        if self._thread is not None:
            self._thread.start()
        self._started.set()

    def run_here(self, keep_waiting: Any) -> None:
        """Step the engine in the calling thread (a loop made with ``thread=False``) from :meth:`start` until
        :meth:`shutdown`; returns at once, having stepped nothing, if ``keep_waiting()`` turns false first."""
        while not self._started.wait(0.2):
            if not keep_waiting():
                return
        try:
            self._run()
        finally:
            self._finished.set()

    @property
    def alive(self) -> bool:
        running = self._thread.is_alive() if self._thread is not None else \
            self._started.is_set() and not self._finished.is_set()
        return running and self.failure is None and not self._stopping

    @property
    def num_queued(self) -> int:
        """Requests accepted but not yet handed to the engine."""
        return len(self._inbox)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, request: PreparedRequest, queue: asyncio.Queue, tag: Any = None, *,
               replayable: bool = False) -> Submission:
        """Queue a request prepared by the engine; its outputs (or an exception) arrive in ``queue``.

        ``replayable``: its client sees nothing before it finishes, so a fleet
        may start it over on another replica; one engine has nowhere else to
        send it. Call from the event loop that awaits ``queue``. Raises
        :class:`ServerBusyError` when full, :class:`EngineUnavailableError`
        when the loop no longer serves.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self.alive:
                raise EngineUnavailableError(self.failure or "the server is shutting down")
            if len(self._in_flight) >= self.capacity:
                raise ServerBusyError(
                    f"the server is at capacity: {len(self._in_flight)} requests in flight (scheduler.max_num_seqs"
                    f" + server.max_queue = {self.capacity}); retry later")
            submission = Submission(request, tag, loop, queue)
            self._in_flight.add(submission)
            self._inbox.append(submission)
        self._wakeup.set()
        return submission

    def abort(self, submission: Submission) -> None:
        """Stop a request (its client went away); its KV blocks are freed before the next step."""
        with self._lock:
            if submission not in self._in_flight:
                return
            self._aborts.append(submission)
        self._wakeup.set()

    async def render_metrics(self, metrics: Any) -> str:
        """The ``/metrics`` text of a server over this loop (its :class:`ServerMetrics`)."""
        return metrics.render()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, stop the thread and wait for it. The engine itself stays open."""
        with self._lock:
            self._stopping = True
            self._aborts.extend(self._in_flight)
        self._wakeup.set()
        if self._thread is None:
            if self._started.is_set():
                self._finished.wait(timeout_s)
        elif self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while True:
                self._wakeup.clear()
                self._take_inbox()
                if self._stopping and not self.engine.has_unfinished():
                    break
                if not self.engine.has_unfinished():
                    self._wakeup.wait(_IDLE_WAIT_S)
                    continue
                self._step()
        except BaseException as exc:  # noqa: BLE001 - every waiting client must hear about it
            self.failure = f"the engine loop stopped: {type(exc).__name__}: {exc}"
            log.exception("engine loop failed")
            self._fail_all(EngineUnavailableError(self.failure))

    def _take_inbox(self) -> None:
        with self._lock:
            submissions, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = list(self._aborts), deque()
        for sub in submissions:
            try:
                sub.request_id = self.engine.add_request(sub.request)
            except Exception as exc:  # noqa: BLE001 - a bad request is refused alone
                self._done(sub)
                deliver(sub, exc)
            else:
                sub.samples_left = sub.request.params.n
                self._by_request_id[sub.request_id] = sub
        for sub in aborts:
            if sub.request_id is not None:
                self.engine.abort(sub.request_id)  # its "abort" outputs come with the next step

    @property
    def step_seconds(self) -> float:
        """How long the step now running has taken so far (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    def _step(self) -> None:
        self.step_started = started = time.monotonic()
        try:
            outputs = self.engine.step()
        except WorkerError:
            raise  # the engine cannot step any more
        except KunlunInferError as exc:  # the step's requests were ended; their outputs come next step
            log.error("engine step failed: %s", exc)
            self.last_step_error = str(exc)
            if getattr(exc, "shut_down", False):  # the engine closed itself: hand out what it ended, then stop
                self._dispatch(getattr(exc, "outputs", ()))
                raise
            return
        finally:
            self.step_started = None
        self.stats = self.engine.stats()
        if self.metrics is not None:
            # sequences that produced a token in this step: the batch as a client sees it
            self.metrics.observe_step(time.monotonic() - started,
                                      sum(1 for o in outputs if o.finish_reason != "abort"))
        self._dispatch(outputs)

    def _dispatch(self, outputs: Iterable[RequestOutput]) -> None:
        """Hand each output to the queue of the handler that owns its request."""
        handed: list[tuple[Submission, RequestOutput]] = []
        for output in outputs:
            sub = self._by_request_id.get(output.request_id)
            if sub is None:
                continue
            if output.finished:
                if self.metrics is not None:
                    self.metrics.observe_finished(output)
                sub.samples_left -= 1
                if sub.samples_left == 0:
                    self._done(sub)
            handed.append((sub, output))
        deliver_all(handed)

    def _done(self, sub: Submission) -> None:
        if sub.request_id is not None:
            self._by_request_id.pop(sub.request_id, None)
        with self._lock:
            self._in_flight.discard(sub)


    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            subs, self._in_flight = list(self._in_flight), set()
            self._inbox.clear()
        deliver_all((sub, exc) for sub in subs)
