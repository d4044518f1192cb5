"""The fleet's dispatcher: the engine-loop surface of the server, over replicas in Ray actors.

:class:`FleetLoop` offers what :class:`~kunlun_infer.server.engine_loop.EngineLoop`
offers the HTTP handlers and :class:`~kunlun_infer.server.generation.Generation`
(``submit``, ``abort``, ``stats``, ``alive`` …), so the one server serves a
fleet as it serves an engine. ``submit`` routes the request at once
(:mod:`kunlun_infer.fleet.router`) and refuses it with
:class:`ServerBusyError` (HTTP 429) when every replica in rotation is full.

A thread runs an asyncio loop that talks to the actors: per replica a
sender (batches of new requests and aborts) and a pump (a long poll that
brings back every output since the last one, and the engine's stats). A
replica whose poll fails (its actor died), stays unanswered for
``fleet.health_timeout_s`` or reports a step running longer than
``fleet.step_timeout_s`` (it hangs; then its actor is killed so that Ray
restarts it) leaves the rotation. Its requests that have not streamed a
token yet go to another replica (or wait for one); the others end with
:class:`ReplicaFailedError` — so every request is answered once, completed
or with a clear error, never twice. A watcher waits for Ray to restart the
actor, asks it for a one-token generation, and puts it back in rotation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from kunlun_infer.engine.intake import PreparedRequest
from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.errors import KunlunInferError, RequestError
from kunlun_infer.fleet.router import (PREFIX_BLOCK_TOKENS, Policy, PrefixIndex, ReplicaLoad, choose, loads,
                                       prefix_hashes)
from kunlun_infer.server.engine_loop import (EngineUnavailableError, ReplicaFailedError, ServerBusyError, deliver,
                                            deliver_all)
from kunlun_infer.server.metrics import Counter, ServerMetrics, merge_labelled

log = logging.getLogger("kunlun_infer.framework")

#: how long a replica's poll waits for outputs before it answers with none
PULL_WAIT_S = 0.25
#: pause between attempts to reach a replica Ray is restarting
REJOIN_POLL_S = 0.5
#: seconds a replica may take to answer a metrics scrape
SCRAPE_TIMEOUT_S = 5.0
#: the server's own metric families; every other one comes from the replicas, labelled
FRONT_FAMILIES = ("http_requests_total", "requests_rejected_total")


@dataclasses.dataclass
class ReplicaSpec:
    """One replica to run: its name, its actor handle, and the Ray restarts it is allowed."""

    name: str
    handle: Any
    max_restarts: int


@dataclasses.dataclass(eq=False)
class FleetSubmission:
    """One request handed to the fleet; its outputs arrive in ``queue`` as ``(tag, output or exception)``."""

    request: PreparedRequest
    tag: Any
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_id: str
    hashes: list[int]
    replica: Replica | None = None
    sent: bool = False
    #: an output with tokens reached the handler
    streamed: bool = False
    #: its client sees only the final outputs (not a stream), so it may start over while no sample finished
    replayable: bool = False
    aborted: bool = False
    samples_left: int = 0
    #: tokens it still adds to its replica's load
    cost: float = 0.0
    #: tokens generated so far, by sample
    generated: dict[int, int] = dataclasses.field(default_factory=dict)
    since: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def samples(self) -> int:
        return self.request.params.n

    @property
    def movable(self) -> bool:
        """Whether another replica may take it over: its client has seen none of its tokens."""
        return not self.streamed or (self.replayable and self.samples_left == self.samples)

    def remaining_cost(self, cached_tokens: int = 0) -> float:
        params = self.request.params
        prefill = 0 if self.generated else len(self.request.prompt_token_ids) - cached_tokens
        return prefill + sum(params.max_tokens - self.generated.get(i, 0) for i in range(params.n))


class Replica:
    """A replica's actor and the dispatcher's view of it (touched under the dispatcher's lock)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.name = spec.name
        self.handle = spec.handle
        self.max_restarts = spec.max_restarts
        self.load = ReplicaLoad(spec.name, capacity=0, index=PrefixIndex(1))
        #: starting | up | down (out of rotation, waiting for Ray's restart) | dead
        self.state = "starting"
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.requests: dict[str, FleetSubmission] = {}
        self.outgoing: list[FleetSubmission] = []
        self.aborts: list[str] = []
        self.wake: asyncio.Event | None = None
        #: bumped each time it leaves rotation; its tasks of an older epoch stop
        self.epoch = 0
        self.restarts = 0
        self.failure: str | None = None


class FleetLoop:
    """Routes requests to replicas and brings their outputs back; thread-safe ``submit``/``abort``."""

    def __init__(self, replicas: Sequence[ReplicaSpec], policy: Policy, *, health_timeout_s: float,
                 step_timeout_s: float, start_timeout_s: float, max_queue: int) -> None:
        self.replicas = [Replica(spec) for spec in replicas]
        self.policy = policy
        self.health_timeout_s = health_timeout_s
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        #: requests accepted but waiting for a replica (theirs failed and none had room)
        self.max_queue = max_queue
        self._pending: deque[FleetSubmission] = deque()
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._aloop.run_forever, name="kunlun-infer-fleet", daemon=True)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        #: why the fleet stopped serving, if every replica is gone for good
        self.failure: str | None = None
        self.last_step_error: str | None = None
        self.routed = Counter("fleet_requests_routed_total",
                              "Requests sent to a replica, by replica and reason (prefix, load, resend).")
        self.resent = Counter("fleet_requests_resent_total",
                              "Requests moved off a failed replica before they streamed a token, by that replica.")
        self.failed = Counter("fleet_requests_failed_total",
                              "Requests ended with an error because their replica failed after they streamed.")

    # ------------------------------------------------------------------ lifecycle (any thread)

    def start(self) -> None:
        """Start the dispatcher thread and join every replica (:meth:`wait_joined` waits for them)."""
        if self._thread.is_alive():
            return
        self._thread.start()
        for replica in self.replicas:
            self._call(self._join(replica, first=True))

    def wait_joined(self, timeout_s: float) -> None:
        """Wait until every replica joined; :class:`KunlunInferError` naming those that did not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                states = {r.name: r.state for r in self.replicas}
            if "starting" not in states.values():
                break
            time.sleep(0.1)
        with self._lock:
            bad = [f"{r.name}: {r.failure or 'did not start within fleet.start_timeout_s=' + str(timeout_s)}"
                   for r in self.replicas if r.state != "up"]
        if bad:
            raise KunlunInferError("fleet replicas failed to start — " + "; ".join(bad))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """End what is in flight (with an error), stop the thread. The actors stay up (the fleet closes them)."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            subs = [s for r in self.replicas for s in r.requests.values()] + list(self._pending)
            for replica in self.replicas:
                replica.requests.clear()
            self._pending.clear()
        for sub in subs:
            if not sub.aborted:
                deliver(sub, EngineUnavailableError("the server is shutting down"))
        if self._thread.is_alive():
            async def stop() -> None:
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                self._aloop.stop()

            asyncio.run_coroutine_threadsafe(stop(), self._aloop)
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        with self._lock:
            return (self._thread.is_alive() and not self._stopping and self.failure is None
                    and any(r.state == "up" for r in self.replicas))

    # ------------------------------------------------------------------ what the server reads

    @property
    def stats(self) -> dict[str, Any]:
        """Counters summed over the replicas in rotation; the limits every replica meets."""
        with self._lock:
            up = [r for r in self.replicas if r.state == "up" and r.stats]
            total: dict[str, Any] = {}
            for replica in up:
                for key, value in replica.stats.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        total[key] = total.get(key, 0) + value
            infos = [r.info for r in self.replicas if r.info]
            if infos:
                total["max_request_tokens"] = min(i["max_request_tokens"] for i in infos)
                total["max_num_seqs"] = min(i["max_num_seqs"] for i in infos)
                total["max_model_len"] = min(i["max_model_len"] for i in infos)
            return total

    @property
    def num_queued(self) -> int:
        with self._lock:
            return len(self._pending) + sum(len(r.outgoing) for r in self.replicas)

    @property
    def capacity(self) -> int:
        with self._lock:
            return sum(r.load.capacity for r in self.replicas if r.state == "up")

    def replica_states(self) -> list[dict[str, Any]]:
        """Each replica: name, state, where it runs, its load and how often Ray restarted it."""
        with self._lock:
            load = loads([r.load for r in self.replicas])
            return [{"name": r.name, "state": r.state, "pid": r.info.get("pid"), "node_id": r.info.get("node_id"),
                     "plugins": r.info.get("plugins"), "in_flight": r.load.in_flight,
                     "outstanding_tokens": r.load.outstanding_tokens, "load": load[r.name],
                     "tokens_per_s": r.load.meter.rate, "restarts": r.restarts, "failure": r.failure,
                     "stats": dict(r.stats)} for r in self.replicas]

    # ------------------------------------------------------------------ the HTTP side (any thread)

    def submit(self, request: PreparedRequest, queue: asyncio.Queue, tag: Any = None, *,
               replayable: bool = False) -> FleetSubmission:
        """Route a request prepared by the fleet's front; its outputs (or an exception) arrive in ``queue``.

        ``replayable``: the client sees only the final outputs, so the request
        may start over on another replica until a sample finished. Raises :class:`ServerBusyError` when every replica in rotation is
        full, :class:`EngineUnavailableError` when none serves.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self.alive:
                states = ", ".join(f"{r.name} {r.state}" for r in self.replicas)
                raise EngineUnavailableError(self.failure or f"no replica of the fleet serves now ({states})")
            self._drain_pending()
            sub = FleetSubmission(request, tag, loop, queue, f"fleet-{next(self._ids)}",
                                  prefix_hashes(request.prompt_token_ids), replayable=replayable)
            if not self._route(sub, "load"):
                raise ServerBusyError(
                    f"the fleet is at capacity: every replica in rotation holds its scheduler.max_num_seqs + "
                    f"server.max_queue requests ({self.capacity} in all); retry later")
        return sub

    def abort(self, sub: FleetSubmission) -> None:
        """Stop a request (its client went away)."""
        with self._lock:
            if sub.aborted:
                return
            sub.aborted = True
            replica = sub.replica
            if replica is None:  # waiting for a replica
                if sub in self._pending:
                    self._pending.remove(sub)
                return
            if not sub.sent:
                replica.outgoing.remove(sub)
                self._done(sub)
                return
            replica.aborts.append(sub.request_id)
            self._wake(replica)

    # ------------------------------------------------------------------ routing (under the lock)

    def _route(self, sub: FleetSubmission, reason: str) -> bool:
        """Send ``sub`` to the replica the router picks; False when every one is full."""
        route = choose([r.load for r in self.replicas], sub.hashes, len(sub.request.prompt_token_ids), self.policy)
        if route is None:
            return False
        sub.generated.clear()  # a request that moves starts over
        replica = next(r for r in self.replicas if r.load is route.replica)
        sub.replica, sub.sent = replica, False
        sub.cost = sub.remaining_cost(route.cached_tokens)
        sub.samples_left = sub.samples
        replica.requests[sub.request_id] = sub
        replica.outgoing.append(sub)
        replica.load.in_flight += 1
        replica.load.outstanding_tokens += sub.cost
        replica.load.index.insert(sub.hashes)
        self.routed.inc(replica=replica.name, reason=route.reason if reason == "load" else reason)
        self._wake(replica)
        return True

    def _drain_pending(self) -> None:
        while self._pending:
            if not self._route(self._pending[0], "resend"):
                return
            self._pending.popleft()

    def _done(self, sub: FleetSubmission) -> None:
        replica = sub.replica
        if replica is not None and replica.requests.pop(sub.request_id, None) is sub:
            replica.load.in_flight -= 1
            replica.load.outstanding_tokens = max(0.0, replica.load.outstanding_tokens - sub.cost)
        sub.cost = 0.0

    def _wake(self, replica: Replica) -> None:
        if replica.wake is not None:
            self._aloop.call_soon_threadsafe(replica.wake.set)

    # ------------------------------------------------------------------ the dispatcher thread

    def _call(self, coro: Any) -> Future:
        """Run ``coro`` on the dispatcher's loop as a task the shutdown cancels."""
        async def tracked() -> Any:
            task = asyncio.current_task()
            self._tasks.add(task)  # type: ignore[arg-type]
            try:
                return await coro
            finally:
                self._tasks.discard(task)  # type: ignore[arg-type]

        return asyncio.run_coroutine_threadsafe(tracked(), self._aloop)

    def _spawn(self, coro: Any) -> None:
        task = self._aloop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _join(self, replica: Replica, *, first: bool) -> None:
        """Wait for the replica's actor to answer and to generate a token, then put it in rotation."""
        import ray

        deadline = time.monotonic() + self.start_timeout_s
        while not self._stopping:
            try:
                info = await asyncio.wait_for(replica.handle.describe.remote(), max(1.0, deadline - time.monotonic()))
                healthy = await asyncio.wait_for(replica.handle.health.remote(self.health_timeout_s),
                                                 self.health_timeout_s + 5)
                if healthy:
                    break
                reason = "its engine did not generate a token (health check)"
            except asyncio.TimeoutError:
                reason = f"it did not come up within fleet.start_timeout_s={self.start_timeout_s:g}"
            except ray.exceptions.ActorDiedError as exc:
                reason = _actor_error(exc)
                if first or (replica.max_restarts >= 0 and replica.restarts >= replica.max_restarts):
                    self._set_dead(replica, reason)
                    return
            except ray.exceptions.RayError as exc:  # restarting: try again
                reason = _actor_error(exc)
            if time.monotonic() >= deadline:
                self._set_dead(replica, reason)
                return
            await asyncio.sleep(REJOIN_POLL_S)
        else:
            return
        with self._lock:
            if not first:
                replica.restarts += 1
            replica.info, replica.stats = info, dict(info["stats"])
            replica.load.capacity = int(info["capacity"])
            replica.load.index = PrefixIndex(int(info["kv_tokens"]) // PREFIX_BLOCK_TOKENS)
            replica.load.meter.reset()
            replica.load.up, replica.state, replica.failure = True, "up", None
            replica.wake = asyncio.Event()
            epoch = replica.epoch
            self._drain_pending()
        log.info("fleet replica %s serves (pid %s, %s)", replica.name, info["pid"], info["plugins"])
        self._spawn(self._sender(replica, epoch))
        self._spawn(self._pump(replica, epoch))

    def _set_dead(self, replica: Replica, reason: str) -> None:
        with self._lock:
            replica.state, replica.failure, replica.load.up = "dead", reason, False
            log.error("fleet replica %s is out for good: %s", replica.name, reason)
            if all(r.state == "dead" for r in self.replicas):
                self.failure = "every replica of the fleet failed: " + "; ".join(
                    f"{r.name}: {r.failure}" for r in self.replicas)
                pending, self._pending = list(self._pending), deque()
            else:
                pending = []
        for sub in pending:
            deliver(sub, EngineUnavailableError(self.failure or reason))

    async def _sender(self, replica: Replica, epoch: int) -> None:
        import ray

        assert replica.wake is not None
        while replica.epoch == epoch and not self._stopping:
            await replica.wake.wait()
            replica.wake.clear()
            with self._lock:
                if replica.epoch != epoch:
                    return
                batch, replica.outgoing = replica.outgoing, []
                aborts, replica.aborts = replica.aborts, []
                for sub in batch:
                    sub.sent = True
            try:
                if aborts:
                    await replica.handle.abort.remote(aborts)
                if batch:
                    items = [(s.request_id, s.request.prompt_token_ids, s.request.params) for s in batch]
                    refused = await asyncio.wait_for(replica.handle.submit.remote(items), self.health_timeout_s)
                    with self._lock:
                        for request_id, info in refused:
                            self._refused(replica, epoch, request_id, info)
            except asyncio.TimeoutError:
                self._failed(replica, epoch, f"it did not take new requests within fleet.health_timeout_s="
                                             f"{self.health_timeout_s:g}", kill=True)
                return
            except ray.exceptions.RayError as exc:
                self._failed(replica, epoch, _actor_error(exc), kill=False)
                return

    async def _pump(self, replica: Replica, epoch: int) -> None:
        import ray

        while replica.epoch == epoch and not self._stopping:
            try:
                result = await asyncio.wait_for(replica.handle.pull.remote(PULL_WAIT_S),
                                                PULL_WAIT_S + self.health_timeout_s)
            except asyncio.TimeoutError:
                self._failed(replica, epoch, f"it left a poll unanswered for fleet.health_timeout_s="
                                             f"{self.health_timeout_s:g}", kill=True)
                return
            except ray.exceptions.RayError as exc:
                self._failed(replica, epoch, _actor_error(exc), kill=False)
                return
            with self._lock:
                if replica.epoch != epoch:
                    return
                replica.stats = dict(result["stats"])
                replica.load.meter.observe(float(replica.stats.get("num_computed_tokens", 0)),
                                           busy=replica.load.in_flight > 0)
                if result["last_step_error"]:
                    self.last_step_error = result["last_step_error"]
                handed: list[tuple[FleetSubmission, RequestOutput]] = []
                for request_id, item in result["outputs"]:
                    if isinstance(item, tuple):
                        self._refused(replica, epoch, request_id, item)
                    elif (sub := self._output(replica, request_id, item)) is not None:
                        handed.append((sub, item))
                deliver_all(handed)  # one wake-up of each handler event loop for the poll's outputs
                self._drain_pending()
            if not result["alive"]:
                self._failed(replica, epoch, f"its engine stopped: {result['failure']}", kill=True)
                return
            if result["step_s"] > self.step_timeout_s:  # the actor answers, but its engine is stuck in a step
                self._failed(replica, epoch, f"its engine has been in one step for {result['step_s']:.0f} s "
                                             f"(fleet.step_timeout_s={self.step_timeout_s:g})", kill=True)
                return

    def _output(self, replica: Replica, request_id: str, output: RequestOutput) -> FleetSubmission | None:
        """Account ``output`` to its request; the request's submission to hand it to, or ``None``."""
        sub = replica.requests.get(request_id)
        if sub is None or sub.replica is not replica:
            return None  # it moved on (its replica failed before): what comes late is dropped, never delivered twice
        if output.token_ids or output.delta_text:
            sub.streamed = True
        sub.generated[output.index] = len(output.token_ids)
        cost = sub.remaining_cost()
        replica.load.outstanding_tokens = max(0.0, replica.load.outstanding_tokens - (sub.cost - cost))
        sub.cost = cost
        if output.finished:
            sub.samples_left -= 1
            if sub.samples_left <= 0:
                self._done(sub)
        return sub

    def _refused(self, replica: Replica, epoch: int, request_id: str, info: tuple[str, str, str | None]) -> None:
        """A replica refused a request or could not run it: the request's fault ends it, a full replica moves it."""
        sub = replica.requests.get(request_id)
        if sub is None or sub.replica is not replica:
            return
        kind, message, field = info
        self._done(sub)
        if kind in ("busy", "unavailable") and sub.movable:  # full, or stopping: another replica takes it
            if not self._route(sub, "resend"):
                self._pending.append(sub)
            return
        if kind == "request":
            deliver(sub, RequestError(message, field=field))
        else:
            deliver(sub, KunlunInferError(f"replica '{replica.name}': {message}"))

    def _failed(self, replica: Replica, epoch: int, reason: str, *, kill: bool) -> None:
        """Take a replica out of rotation; move its requests that have not streamed, end the others."""
        import ray

        with self._lock:
            if replica.epoch != epoch or self._stopping:
                return
            replica.epoch += 1
            replica.state, replica.failure, replica.load.up = "down", reason, False
            subs = list(replica.requests.values())
            for sub in subs:
                self._done(sub)
            replica.outgoing.clear()
            replica.aborts.clear()
            replica.load.index.clear()
            replica.load.outstanding_tokens, replica.load.in_flight = 0.0, 0
            moved = failed = 0
            for sub in subs:
                if sub.aborted:
                    continue
                if sub.movable:
                    moved += 1
                    self.resent.inc(replica=replica.name)
                    sub.replica = None
                    if not self._route(sub, "resend"):
                        self._pending.append(sub)
                else:
                    failed += 1
                    self.failed.inc(replica=replica.name)
                    what = "while this request was streaming" if not sub.replayable else \
                        "after some of this request's samples had finished"
                    deliver(sub, ReplicaFailedError(
                        f"replica '{replica.name}' failed {what} ({reason}); a request whose client has seen "
                        f"tokens is not repeated elsewhere: send it again"))
        log.error("fleet replica %s left rotation: %s; %d request(s) moved to other replicas, %d ended with an "
                  "error", replica.name, reason, moved, failed)
        if kill:
            try:
                ray.kill(replica.handle, no_restart=False)  # Ray restarts it (fleet.max_restarts)
            except Exception as exc:  # noqa: BLE001 - it may be gone already
                log.warning("killing fleet replica %s failed: %s", replica.name, exc)
        self._spawn(self._join(replica, first=False))

    # ------------------------------------------------------------------ metrics

    async def render_metrics(self, front: ServerMetrics) -> str:
        """The server's families, the fleet's, and every replica's labelled ``replica="<name>"``."""
        texts = await asyncio.wrap_future(self._call(self._scrape()))
        with self._lock:
            lines = [self.routed, self.resent, self.failed]
            fleet = []
            for metric in lines:
                fleet += [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}",
                          *metric.samples()]
            load = loads([r.load for r in self.replicas])
            for name, help_, kind, value in (
                    ("fleet_replica_up", "1 while the replica is in rotation.", "gauge",
                     lambda r: float(r.state == "up")),
                    ("fleet_replica_restarts_total", "Times Ray restarted the replica's actor.", "counter",
                     lambda r: float(r.restarts)),
                    ("fleet_replica_in_flight", "Requests the replica holds.", "gauge",
                     lambda r: float(r.load.in_flight)),
                    ("fleet_replica_outstanding_tokens", "Prompt tokens to compute plus tokens to generate.",
                     "gauge", lambda r: r.load.outstanding_tokens),
                    ("fleet_replica_load_tokens", "Outstanding tokens scaled by the replica's measured speed.",
                     "gauge", lambda r: load[r.name]),
                    ("fleet_replica_tokens_per_second", "Tokens the replica computes per second while busy.",
                     "gauge", lambda r: r.load.meter.rate or 0.0)):
                full = f"kunlun_infer_{name}"
                fleet += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
                fleet += [f'{full}{{replica="{r.name}"}} {value(r):g}' for r in self.replicas]
        return merge_labelled(front.render(only=FRONT_FAMILIES) + "\n".join(fleet) + "\n", texts, label="replica")

    async def _scrape(self) -> dict[str, str]:
        with self._lock:
            up = [r for r in self.replicas if r.state == "up"]

        async def one(replica: Replica) -> str | None:
            try:
                return await asyncio.wait_for(replica.handle.metrics_text.remote(), SCRAPE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a replica failing now is reported by its pump
                return None

        texts = await asyncio.gather(*(one(r) for r in up))
        return {r.name: t for r, t in zip(up, texts) if t is not None}


def _actor_error(exc: BaseException) -> str:
    """The first line of a Ray actor error, which names why the actor died."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
