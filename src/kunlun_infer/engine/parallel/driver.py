"""Rank 0 of a tensor-parallel engine: start the group, load the shards, drive every step, notice failures.

:meth:`TensorParallelGroup.start` brings up ranks ``1 .. N-1`` — spawned here
as child processes, or already started by torchrun — and joins the comm group
with them. :meth:`~TensorParallelGroup.load_model` has every rank load its
shard and report back; :class:`DriverRunner` broadcasts each step's flat
batch before running rank 0's own forward, and its explicit
:meth:`~DriverRunner.resize_kv_cache` resizes the workers' caches alike.
While the engine is idle a heartbeat keeps the workers' collective timeout
from firing.

Failure: a plugin that raises during a step, on any rank, fails that step
alone: the rank holds the error back, finishes the forward on the op's
reference so the ranks stay in step, and every rank learns of it in a small
exchange after the forward; rank 0 raises it as a ``PluginError`` naming the
rank, the engine ends that step's requests, and the group serves on. A worker
that dies makes the next collective fail at once (its connection closes) and
the child's exit is noticed before each step; one that hangs makes it fail
after ``comm.timeout_s``. Either way the step raises
:class:`~kunlun_infer.errors.WorkerError` and the group refuses further steps.
:meth:`~TensorParallelGroup.close` stops the workers and reaps the children.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from kunlun_infer.dtypes import dtype_name
from kunlun_infer.engine.model_runner import ModelRunner, StepInputs
from kunlun_infer.engine.parallel import cores
from kunlun_infer.engine.parallel.control_plane import ControlPlane, exchange_status, exchange_step_failures
from kunlun_infer.engine.parallel.placement import free_loopback_port, torchrun_place
from kunlun_infer.engine.parallel.spawn import WorkerProcesses
from kunlun_infer.errors import ConfigError, PluginError, WorkerError
from kunlun_infer.models import load_model
from kunlun_infer.runtime import Runtime

log = logging.getLogger("kunlun_infer.framework")

_POLL_S = 0.05
_RESTART = "close this engine and start a new one"


class TensorParallelGroup:
    """The ``parallel.tensor_size`` ranks of one engine, seen from rank 0."""

    #: how errors name the group and its ranks
    kind = "tensor-parallel"

    def __init__(self, cfg: DictConfig, runtime: Runtime) -> None:
        self.size = int(cfg.parallel.tensor_size)
        self.timeout_s = float(cfg.comm.timeout_s)
        self.worker_timeout_s = float(cfg.parallel.worker_timeout_s)
        self.runtime = runtime
        self.plane = ControlPlane(runtime.comm, runtime.device.torch_device)
        self.workers: WorkerProcesses | None = None
        #: free device memory before loading, on the rank with the least
        self.min_free_bytes = 0
        self._lock = threading.RLock()
        self._broken: str | None = None
        self._last_message = time.monotonic()
        self._stopping = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._closed = False
        #: this process's torch threads and CPUs before the spawned ranks took their share of them
        self._own_threads: int | None = None
        self._own_cpus: set[int] | None = None

    @classmethod
    def start(cls, cfg: DictConfig, runtime: Runtime) -> TensorParallelGroup:
        """Bring up the other ranks and join the comm group with them (rank 0)."""
        group = cls(cfg, runtime)
        try:
            group._join(cfg)
        except BaseException:
            group.close()
            raise
        return group

    def _join(self, cfg: DictConfig) -> None:
        place = torchrun_place()
        if place is not None and place.world_size > 1:
            if place.rank != 0:
                raise ConfigError(f"the engine runs on rank 0; rank {place.rank} must serve as a worker "
                                  "(kunlun_infer.engine.parallel.worker.serve_torchrun_worker)")
            self.runtime.init_comm(rank=0, world_size=self.size, init_method=cfg.parallel.init_method)
            return
        init_method = cfg.parallel.init_method or f"tcp://127.0.0.1:{free_loopback_port()}"
        config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        # the ranks share this host's cores (see cores), where each taking them all had every core run several
        # ranks' threads, spinning against each other
        threads = torch.get_num_threads()
        share, shares = cores.rank_shares(threads, self.size)
        if share != threads:
            self._own_threads = threads
            torch.set_num_threads(share)
        if shares is not None:
            self._own_cpus = os.sched_getaffinity(0)
            cores.bind_process(shares[0])
        log.info("the %d %s ranks on this host take %d torch threads each%s", self.size, self.kind, share,
                 "" if shares is None else ", on CPUs " + " | ".join(map(cores.format_cpu_list, shares)))
        self.workers = WorkerProcesses(config=config, world_size=self.size, init_method=init_method,
                                       num_threads=share, cpus=shares)
        self._watching(lambda: self.runtime.init_comm(rank=0, world_size=self.size, init_method=init_method),
                       f"joining the {self.size} ranks at {init_method}", self.worker_timeout_s)

    def _watching(self, fn: Callable[[], Any], what: str, timeout_s: float) -> Any:
        """Run ``fn`` while watching the children; ``WorkerError`` if one dies or ``timeout_s`` passes."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=run, name="kunlun-infer-tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(_POLL_S)
            dead = self.workers.dead() if self.workers is not None else []
            if dead:
                raise WorkerError(f"{self.kind} start-up failed while {what}: {'; '.join(dead)}")
            if time.monotonic() > deadline and thread.is_alive():
                raise WorkerError(f"{self.kind} start-up: {what} took longer than "
                                  f"parallel.worker_timeout_s={self.worker_timeout_s:g}s")
        if "error" in result:
            raise result["error"]
        return result.get("value")

    # ------------------------------------------------------------------ loading

    def load_model(self, model_path: Any, *, dtype: torch.dtype, max_model_len: int, block_size: int,
                   quantization: Any = None, expert_size: int = 1) -> Any:
        """Every rank loads its shard; returns rank 0's. Raises the first failure of any rank."""
        spec = {"model_path": str(model_path), "dtype": dtype_name(dtype),
                "max_model_len": int(max_model_len), "block_size": int(block_size),
                "quantization": None if quantization is None else quantization.as_dict(),
                "expert_size": int(expert_size)}
        with self.collective("sending the load request"):
            self.plane.send_load(spec)
        model, failure = None, None
        free_before = self.runtime.device.mem_get_info()[0]
        try:
            model = load_model(model_path, runtime=self.runtime, dtype=dtype, tp_rank=0, tp_size=self.size,
                               max_model_len=max_model_len, quantization=quantization, expert_size=expert_size)
        except Exception as exc:  # noqa: BLE001 - the workers must hear about it before it is raised
            failure = exc
        with self.collective("collecting the load results"):
            statuses = exchange_status(self.runtime.comm, self.runtime.device.torch_device, ok=failure is None,
                                       free_bytes=free_before,
                                       error=None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        failed = [s for s in statuses if not s.ok]
        if failed:
            raise WorkerError("; ".join(f"{self.kind} rank {s.rank} could not load its shard: {s.error}"
                                        for s in failed))
        self.min_free_bytes = min(s.free_bytes for s in statuses)
        self._start_heartbeat()
        return model

    @property
    def runner_class(self) -> Callable[..., ModelRunner]:
        """Builds rank 0's runner (``ModelRunner`` arguments) bound to this group."""
        return functools.partial(DriverRunner, group=self)

    # ------------------------------------------------------------------ steps

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Hold the control plane for one exchange; failures there become ``WorkerError``."""
        with self._lock:
            self._check(what)
            try:
                yield
            except BaseException as exc:
                # the ranks may now be out of step: nothing more may be sent
                self._broken = f"{what} failed: {type(exc).__name__}: {exc}"
                error = self._as_worker_error(exc, what)
                if error is None:
                    raise
                raise error from exc
            finally:
                self._last_message = time.monotonic()

    def _check(self, what: str) -> None:
        if self._closed:
            raise WorkerError(f"the {self.kind} group is closed; cannot go on {what}")
        dead = self.workers.dead() if self.workers is not None else []
        if dead and self._broken is None:
            self._broken = "; ".join(dead)
        if self._broken is not None:
            raise WorkerError(f"the {self.kind} group is out of service ({self._broken}); {_RESTART}")

    def _as_worker_error(self, exc: BaseException, what: str) -> WorkerError | None:
        """The ``WorkerError`` for ``exc``, or ``None`` when rank 0 itself failed (not a peer)."""
        from_comm = isinstance(exc, PluginError) and exc.plugin == self.runtime.plugin_for("comm")
        timed_out = from_comm and _is_timeout(exc)
        # a peer's closed connection can be seen a moment before its exit is: give the exit time to show
        dead = self._dead_workers(wait_s=2.0 if from_comm and not timed_out else 0.0)
        if dead:
            return WorkerError(f"{'; '.join(dead)} (during {what}); {_RESTART}")
        cause = exc.__cause__ or exc
        if timed_out:
            return WorkerError(f"a {self.kind} rank did not answer within comm.timeout_s={self.timeout_s:g}s "
                               f"during {what} (hung, or far slower than rank 0): {cause}; {_RESTART}")
        if from_comm:
            return WorkerError(f"a {self.kind} exchange failed during {what} ({cause}); a peer rank "
                               f"probably died; {_RESTART}")
        return None

    def _dead_workers(self, wait_s: float) -> list[str]:
        if self.workers is None:
            return []
        deadline = time.monotonic() + wait_s
        while True:
            dead = self.workers.dead()
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(_POLL_S)

    def _start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name="kunlun-infer-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        interval = max(0.05, min(self.timeout_s / 4, 10.0))
        while not self._stopping.wait(interval / 2):
            if not self._lock.acquire(timeout=interval):
                continue
            try:
                if self._broken is None and time.monotonic() - self._last_message >= interval:
                    with contextlib.suppress(WorkerError):
                        with self.collective("a heartbeat"):
                            self.plane.send_heartbeat()
            except Exception:  # noqa: BLE001 - recorded in _broken; the next step reports it
                pass
            finally:
                self._lock.release()

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the workers (a ``STOP`` message when the group still works), reap spawned ones. Idempotent."""
        if self._closed:
            return
        self._stopping.set()
        stopped = False
        if self._lock.acquire(timeout=self.timeout_s + 1.0):
            try:
                if self._broken is None and self.runtime.comm.joined and not self._closed:
                    try:
                        with self.collective("stopping the workers"):
                            self.plane.send_stop()
                        stopped = True
                    except Exception as exc:  # noqa: BLE001 - the workers are reaped below anyway
                        log.warning("could not stop the %s workers cleanly: %s", self.kind, exc)
            finally:
                self._closed = True
                self._lock.release()
        self._closed = True
        if self.workers is not None:
            self.workers.close(grace_s=self.worker_timeout_s if stopped else 0.0)
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=1.0)
        if self._own_threads is not None:
            torch.set_num_threads(self._own_threads)
            self._own_threads = None
        if self._own_cpus is not None:
            cores.bind_process(self._own_cpus)
            self._own_cpus = None


def capture_on_every_rank(runner: ModelRunner, group: TensorParallelGroup, max_num_seqs: int) -> int:
    """Rank 0's :meth:`ModelRunner.capture_step_graphs`: tell every rank (``Kind.CAPTURE``) to capture its
    ``ops.step_graph_sizes`` steps and capture them here meanwhile, holding the group: the same sizes in the same
    order, so that the ranks' all-reduces meet each other's (and no heartbeat's)."""
    if runner.graphs is None or not runner.graphs.sizes:
        return 0
    with group.collective("capturing decode steps"):
        group.plane.send_capture(max_num_seqs)
        return ModelRunner.capture_step_graphs(runner, max_num_seqs)


def _is_timeout(exc: BaseException) -> bool:
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return "timed out" in text or "timeout" in text


class DriverRunner(ModelRunner):
    """Rank 0's model runner: every step and every KV resize is first sent to the other ranks."""

    def __init__(self, model: torch.nn.Module, *, group: TensorParallelGroup, **kwargs: Any) -> None:
        self.group = group
        super().__init__(model, **kwargs)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Hold ``num_blocks`` KV blocks here, then tell every other rank to hold as many (a broadcast)."""
        super().resize_kv_cache(num_blocks)
        with self.group.collective(f"resizing the KV cache to {num_blocks} blocks"):
            self.group.plane.send_kv(num_blocks)

    def capture_step_graphs(self, max_num_seqs: int) -> int:
        return capture_on_every_rank(self, self.group, max_num_seqs)

    def compute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Every rank runs the step; a plugin failure on any of them fails the step alone, the group serves on."""
        with self.group.collective("a model step"):
            self.group.plane.send_step(inputs)
            logits = super().compute(inputs)
            failure = exchange_step_failures(self.group.runtime.comm, self.group.runtime.device.torch_device,
                                             self.model.deferred_failures.take())
        if failure is not None:
            raise failure
        return logits
