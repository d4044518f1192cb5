"""The ranks other than 0: load a shard of the model, then run every step rank 0 sends, in lockstep.

A worker builds its own :class:`~kunlun_infer.runtime.Runtime` (device index =
its local rank), joins the comm group, and serves control messages (see
:mod:`kunlun_infer.engine.parallel.control_plane`) until ``STOP``: ``LOAD`` loads its
shard and reports back, ``KV`` (re)allocates its part of the paged cache,
``STEP`` runs the forward and the logits gather. It never samples.

Two ways in: :func:`serve_torchrun_worker` (a process torchrun started, e.g.
``torchrun … -m kunlun_infer generate …`` on a rank above 0) and
``python -m kunlun_infer.engine.parallel.worker`` (a process the engine spawned,
reading its place and config as JSON on stdin; see :mod:`.spawn`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, TextIO

import torch
from omegaconf import DictConfig, OmegaConf

from kunlun_infer.dtypes import DTYPES
from kunlun_infer.engine import heap
from kunlun_infer.engine.model_runner import ModelRunner
from kunlun_infer.engine.parallel.cores import bind_process
from kunlun_infer.engine.parallel.control_plane import ControlPlane, Kind, exchange_status, exchange_step_failures
from kunlun_infer.engine.parallel.pipeline import PipelineLink, run_stage
from kunlun_infer.engine.parallel.pipeline_driver import stage_memory
from kunlun_infer.engine.parallel.placement import Place, resolve_parallel_config, torchrun_place
from kunlun_infer.engine.parallel.stages import Grid
from kunlun_infer.engine.step_graph import step_graphs
from kunlun_infer.layers.quantization import Quantization
from kunlun_infer.models import load_model
from kunlun_infer.runtime import Runtime

log = logging.getLogger("kunlun_infer.framework")


class Worker:
    """One rank's model shard, KV cache and message loop."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.rank = runtime.comm.rank
        self.plane = ControlPlane(runtime.comm, runtime.device.torch_device)
        self.runner: ModelRunner | None = None
        #: the heap is frozen (``engine/heap.py``) from the load until the loop ends
        self.holds_heap = False

    def serve(self) -> None:
        """Handle messages until ``STOP``; a failed collective raises (rank 0 died, hung or stopped talking)."""
        try:
            while True:
                message = self.plane.receive()
                if message.kind is Kind.STOP:
                    return
                if message.kind is Kind.LOAD:
                    if not self.load(message.spec or {}):
                        return
                    self._hold_heap()
                elif message.kind is Kind.KV:
                    self.resize_kv(message.num_blocks)
                elif message.kind is Kind.CAPTURE:  # as rank 0 does now: the same sizes, their all-reduces met
                    self.runner.capture_step_graphs(message.max_num_seqs)
                elif message.kind is Kind.STEP:
                    with torch.inference_mode():
                        self.runner.compute(message.inputs)
                    # a plugin failure held back during the step is reported; the group serves on
                    exchange_step_failures(self.runtime.comm, self.runtime.device.torch_device,
                                           self.runner.model.deferred_failures.take())
        finally:
            if self.runner is not None:
                self.runner.release_kv_cache()
            self._release_heap()

    def _hold_heap(self) -> None:
        """The shard is in: its start-up objects are left out of collections while this rank serves."""
        if not self.holds_heap:
            heap.hold()
            self.holds_heap = True

    def _release_heap(self) -> None:
        if self.holds_heap:
            self.holds_heap = False
            heap.release()

    def load(self, spec: dict[str, Any]) -> bool:
        """Load this rank's shard; every rank then learns who succeeded. True when all did."""
        error = None
        free_before = self.runtime.device.mem_get_info()[0]
        try:
            dtype = DTYPES[spec["dtype"]]
            quantization = spec.get("quantization")
            model = load_model(spec["model_path"], runtime=self.runtime, dtype=dtype, tp_rank=self.rank,
                               tp_size=self.runtime.comm.world_size, max_model_len=spec["max_model_len"],
                               quantization=None if quantization is None else Quantization(**quantization),
                               expert_size=spec.get("expert_size", 1))
            self.runner = ModelRunner(model, device=self.runtime.device.torch_device,
                                      block_size=spec["block_size"], sampler=None, memory=self.runtime.memory)
            self.runner.graphs = step_graphs(self.runtime, model, max_model_len=spec["max_model_len"],
                                             block_size=spec["block_size"], dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
            log.error("rank %d could not load the model: %s", self.rank, exc)
            error = f"{type(exc).__name__}: {exc}"
        statuses = exchange_status(self.runtime.comm, self.runtime.device.torch_device, ok=error is None,
                                   free_bytes=free_before, error=error)
        return all(s.ok for s in statuses)

    def resize_kv(self, num_blocks: int) -> None:
        """Hold exactly ``num_blocks`` KV blocks (the same number as rank 0)."""
        self.runner.resize_kv_cache(num_blocks)


class PipelineWorker(Worker):
    """A rank of a pipeline stage: messages come down the chain, activations from the stage before."""

    def __init__(self, runtime: Runtime, pipeline_size: int, tensor_size: int) -> None:
        super().__init__(runtime)
        self.grid = Grid(pipeline_size, tensor_size, (1,) * pipeline_size)  # the layers come with LOAD
        self.link = PipelineLink(runtime.comm, self.grid, runtime.device.torch_device)
        self.stage_comm = None
        if tensor_size > 1:
            self.stage_comm = runtime.comm.subgroup(self.grid.stage_ranks(self.grid.stage_of(self.rank)))

    def serve(self) -> None:
        try:
            while True:
                message = self.link.receive_message()
                if message.kind is Kind.STOP:
                    self.link.outbox.flush(5.0)
                    return
                if message.kind is Kind.LOAD:
                    if not self.load(self.runtime.comm.broadcast_object(None, 0)):
                        return
                    self._hold_heap()
                elif message.kind is Kind.KV:
                    self.resize_kv(message.num_blocks)
                elif message.kind is Kind.CAPTURE:
                    self.runner.capture_step_graphs(message.max_num_seqs)
                elif message.kind is Kind.STEP:
                    run_stage(self.runner, self.link, message.inputs, tp_rank=self.grid.tp_rank_of(self.rank),
                              hidden_size=self.runner.model.config.hidden_size, dtype=self.dtype)
                self.link.outbox.check()
        finally:
            self.link.close()
            if self.runner is not None:
                self.runner.release_kv_cache()
            self._release_heap()

    def load(self, spec: dict[str, Any]) -> bool:
        error, extra = None, (0, 0)
        free_before = self.runtime.device.mem_get_info()[0]
        try:
            self.grid = Grid(self.grid.pipeline_size, self.grid.tensor_size, tuple(spec["stage_layers"]))
            self.dtype = DTYPES[spec["dtype"]]
            quantization = spec.get("quantization")
            model = load_model(spec["model_path"], runtime=self.runtime, dtype=self.dtype,
                               tp_rank=self.grid.tp_rank_of(self.rank), tp_size=self.grid.tensor_size,
                               max_model_len=spec["max_model_len"], span=self.grid.span(self.grid.stage_of(self.rank)),
                               tp_comm=self.stage_comm, defer_failures=True,
                               quantization=None if quantization is None else Quantization(**quantization))
            self.runner = ModelRunner(model, device=self.runtime.device.torch_device,
                                      block_size=spec["block_size"], sampler=None, memory=self.runtime.memory)
            self.runner.graphs = step_graphs(self.runtime, model, max_model_len=spec["max_model_len"],
                                             block_size=spec["block_size"], dtype=self.dtype)
            extra = stage_memory(model, spec["block_size"])
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
            log.error("rank %d could not load its pipeline stage: %s", self.rank, exc)
            error = f"{type(exc).__name__}: {exc}"
        statuses = exchange_status(self.runtime.comm, self.runtime.device.torch_device, ok=error is None,
                                   free_bytes=free_before, error=error, extra=extra)
        return all(s.ok for s in statuses)


def serve_rank(cfg: DictConfig, place: Place, init_method: str | None) -> None:
    """Build this rank's runtime, join the group, serve until ``STOP``, release everything."""
    runtime = Runtime.from_config(cfg, local_rank=place.local_rank)
    try:
        runtime.init_comm(rank=place.rank, world_size=place.world_size, init_method=init_method)
        pipeline_size = int(cfg.parallel.get("pipeline_size", 1))
        if pipeline_size > 1:
            PipelineWorker(runtime, pipeline_size, int(cfg.parallel.tensor_size)).serve()
        else:
            Worker(runtime).serve()
    finally:
        runtime.close()


def serve_torchrun_worker(cfg: DictConfig) -> bool:
    """On a rank above 0 that torchrun started, serve as a worker and return True; else return False.

    Commands that start an engine call this first, so that
    ``torchrun --nproc-per-node N -m kunlun_infer generate …`` runs the engine
    on rank 0 only, with every other rank serving its shard.
    """
    place = torchrun_place()
    if place is None or place.rank == 0 or place.world_size == 1:
        return False
    serve_rank(resolve_parallel_config(cfg, place), place, None)
    return True


# ---------------------------------------------------------------------- spawned by the engine


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned worker never outlives the engine that started it, even if that one was killed."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="kunlun-infer-parent-watch", daemon=True).start()


def _report(status: TextIO, text: str) -> None:
    try:
        status.write(text.replace("\n", " ") + "\n")
        status.flush()
    except OSError:
        pass


def main() -> int:
    """Entry of a spawned worker: place and config as JSON on stdin, one status line on stdout at failure."""
    status = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed goes to stderr; stdout is the status channel
    sys.stdout = sys.stderr
    try:
        job = json.load(sys.stdin)
        _exit_with_parent(int(job["parent_pid"]))
        logging.basicConfig(level=int(job.get("log_level", logging.WARNING)),
                            format=f"%(levelname)s rank {job['rank']} %(name)s: %(message)s")
        if job.get("cpus"):
            bind_process(job["cpus"])
        if job.get("num_threads"):
            torch.set_num_threads(int(job["num_threads"]))
        place = Place(int(job["rank"]), int(job["world_size"]), int(job["local_rank"]))
        serve_rank(OmegaConf.create(job["config"]), place, job["init_method"])
    except BaseException as exc:  # noqa: BLE001 - the engine reads this line when it sees the exit code
        _report(status, f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
