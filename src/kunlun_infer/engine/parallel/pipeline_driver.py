"""Rank 0 of a pipeline-parallel engine: the first stage's first rank, and the one that samples.

:class:`PipelineGroup` is a :class:`~kunlun_infer.engine.parallel.driver.TensorParallelGroup`
over all ``pipeline_size × tensor_size`` ranks (same start-up, heartbeat,
failure detection and shutdown) whose control messages travel the chain of
:mod:`~kunlun_infer.engine.parallel.pipeline` instead of broadcasts. Its
runner splits a step in two: :meth:`PipelineDriverRunner.submit` sends the
step down the chain and runs the first stage; :meth:`~PipelineDriverRunner.collect`
waits for the last stage's logits and samples. Between the two, the engine
may submit another batch (``parallel.pipeline_batches``), which is what lets
the stages work at the same time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig

from kunlun_infer.capabilities import has_point_to_point, point_to_point_missing
from kunlun_infer.dtypes import dtype_name
from kunlun_infer.engine.kv_cache import KVLayout
from kunlun_infer.engine.model_runner import ModelRunner, StepInputs, StepResult
from kunlun_infer.engine.parallel.control_plane import Kind, exchange_status, pack_step
from kunlun_infer.engine.parallel.driver import TensorParallelGroup, capture_on_every_rank
from kunlun_infer.engine.parallel.pipeline import PipelineLink, as_plugin_error, failure_detail
from kunlun_infer.engine.parallel.stages import Grid
from kunlun_infer.engine.scheduler import ScheduledBatch
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.errors import ConfigError, WorkerError
from kunlun_infer.models import load_model
from kunlun_infer.runtime import Runtime


class ChainPlane:
    """The control-plane interface of :class:`TensorParallelGroup`, carried by a :class:`PipelineLink`."""

    def __init__(self, link: PipelineLink) -> None:
        self.link = link

    def send_step(self, inputs: StepInputs) -> None:
        header, payload = pack_step(inputs)
        self.link.send_message(header, payload.to(self.link.device))

    def send_kv(self, num_blocks: int) -> None:
        self.link.send_message([Kind.KV, num_blocks])

    def send_load(self, spec: dict[str, Any]) -> None:
        self.link.send_message([Kind.LOAD])
        self.link.comm.broadcast_object(spec, 0)

    def send_capture(self, max_num_seqs: int) -> None:
        self.link.send_message([Kind.CAPTURE, max_num_seqs])

    def send_heartbeat(self) -> None:
        self.link.send_message([Kind.HEARTBEAT])

    def send_stop(self) -> None:
        self.link.send_message([Kind.STOP])
        # the workers must have the message before this process may go (and take its sockets with it)
        self.link.outbox.flush(5.0)
        self.link.outbox.check()


@dataclasses.dataclass
class Pending:
    """A step sent down the pipeline whose logits have not come back yet."""

    batch: ScheduledBatch
    inputs: StepInputs
    co_samples: Mapping[int, list[Sequence]] | None
    #: the first failure held back by rank 0 itself
    failure: dict[str, Any] | None


class PipelineGroup(TensorParallelGroup):
    """All ranks of a ``pipeline_size × tensor_size`` engine, seen from rank 0."""

    kind = "pipeline"

    def __init__(self, cfg: DictConfig, runtime: Runtime, grid: Grid) -> None:
        super().__init__(cfg, runtime)
        self.grid = grid
        self.size = grid.world_size
        self.link: PipelineLink | None = None
        #: the comm of rank 0's stage (its tensor-parallel group); the runtime's own with one rank per stage
        self.stage_comm: Any = None
        #: per rank after loading: (free bytes before loading, weight bytes, KV bytes per block)
        self.rank_memory: list[tuple[int, int, int]] = []

    @classmethod
    def start_pipeline(cls, cfg: DictConfig, runtime: Runtime, grid: Grid) -> PipelineGroup:
        if not has_point_to_point(runtime.comm):
            raise ConfigError(point_to_point_missing(runtime.comm))
        group = cls(cfg, runtime, grid)
        try:
            group._join(cfg)
            group.link = PipelineLink(runtime.comm, grid, runtime.device.torch_device)
            group.plane = ChainPlane(group.link)  # type: ignore[assignment]
            if grid.tensor_size > 1:
                with group.collective("forming the stages' tensor-parallel groups"):
                    group.stage_comm = runtime.comm.subgroup(grid.stage_ranks(0))
        except BaseException:
            group.close()
            raise
        return group

    def load_model(self, model_path: Any, *, dtype: torch.dtype, max_model_len: int, block_size: int,
                   quantization: Any = None) -> Any:
        """Every rank loads its stage's shard; returns rank 0's. Raises the first failure of any rank."""
        spec = {"model_path": str(model_path), "dtype": dtype_name(dtype),
                "max_model_len": int(max_model_len), "block_size": int(block_size),
                "quantization": None if quantization is None else quantization.as_dict(),
                "stage_layers": list(self.grid.stage_layers)}
        with self.collective("sending the load request"):
            self.plane.send_load(spec)
        model, failure, extra = None, None, (0, 0)
        free_before = self.runtime.device.mem_get_info()[0]
        try:
            model = load_model(model_path, runtime=self.runtime, dtype=dtype, tp_rank=0,
                               tp_size=self.grid.tensor_size, max_model_len=max_model_len,
                               quantization=quantization, span=self.grid.span(0), tp_comm=self.stage_comm,
                               defer_failures=True)
            extra = stage_memory(model, block_size)
        except Exception as exc:  # noqa: BLE001 - the workers must hear about it before it is raised
            failure = exc
        with self.collective("collecting the load results"):
            statuses = exchange_status(self.runtime.comm, self.runtime.device.torch_device, ok=failure is None,
                                       free_bytes=free_before, extra=extra,
                                       error=None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        failed = [s for s in statuses if not s.ok]
        if failed:
            raise WorkerError("; ".join(f"pipeline rank {s.rank} (stage {self.grid.stage_of(s.rank)}) could not "
                                        f"load its shard: {s.error}" for s in failed))
        self.rank_memory = [(s.free_bytes, *s.extra) for s in statuses]
        self.min_free_bytes = min(s.free_bytes for s in statuses)
        self._start_heartbeat()
        return model

    @property
    def runner_class(self) -> Callable[..., ModelRunner]:
        return functools.partial(PipelineDriverRunner, group=self)

    def close(self) -> None:
        super().close()
        if self.link is not None:
            self.link.close()


def stage_memory(model: Any, block_size: int) -> tuple[int, int]:
    """A stage's weight bytes and KV bytes per block (what the tightest stage is found by)."""
    return model.weight_nbytes(), KVLayout(model.num_layers, block_size, model.attention).bytes_per_block


class PipelineDriverRunner(ModelRunner):
    """Rank 0's runner: sends each step down the pipeline, runs the first stage, samples what comes back."""

    def __init__(self, model: torch.nn.Module, *, group: PipelineGroup, **kwargs: Any) -> None:
        self.group = group
        super().__init__(model, **kwargs)
        self.pending: collections.deque[Pending] = collections.deque()

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Hold ``num_blocks`` KV blocks here, then tell every other rank to hold as many for its layers."""
        super().resize_kv_cache(num_blocks)
        with self.group.collective(f"resizing the KV cache to {num_blocks} blocks"):
            self.group.plane.send_kv(num_blocks)

    def capture_step_graphs(self, max_num_seqs: int) -> int:
        return capture_on_every_rank(self, self.group, max_num_seqs)  # the message goes down the chain

    @torch.inference_mode()
    def submit(self, batch: ScheduledBatch, co_samples: Mapping[int, list[Sequence]] | None = None) -> Pending:
        """Send the step down the pipeline and run the first stage; its tokens come from :meth:`collect`."""
        inputs = self.prepare(batch)
        link = self.group.link
        with self.group.collective("a model step"):
            self.group.plane.send_step(inputs)
            hidden, residual = self.forward(inputs)
            failure = failure_detail(self.model.deferred_failures.take(), 0)
            link.send_status(link.next, failure)
            link.send_tensor(hidden, link.next)
            link.send_tensor(residual, link.next)
        pending = Pending(batch, inputs, co_samples, failure)
        self.pending.append(pending)
        return pending

    @torch.inference_mode()
    def collect(self, pending: Pending) -> StepResult:
        """Wait for the oldest submitted step's logits and sample; raises the step's plugin failure, if any."""
        if not self.pending or self.pending[0] is not pending:
            raise RuntimeError("pipeline steps are collected in the order they were submitted")
        self.pending.popleft()
        link, grid = self.group.link, self.group.grid
        num_rows = pending.inputs.logits_indices.numel()
        with self.group.collective("waiting for a step's logits from the last stage"):
            failures = [pending.failure]
            logits = None
            for rank in grid.last_stage_ranks():
                failures.append(link.recv_status(rank))
                if rank == grid.last_stage_ranks()[0] and num_rows:
                    logits = link.recv_tensor((num_rows, self.model.config.vocab_size), torch.float32, rank)
        failed = [f for f in failures if f is not None]
        if failed:
            raise as_plugin_error(failed[0])
        return self.sample(pending.batch, pending.inputs, logits, pending.co_samples)

    def execute(self, batch: ScheduledBatch, co_samples: Mapping[int, list[Sequence]] | None = None,
                drafts: Any = None) -> StepResult:
        """One step, start to end (nothing else in flight)."""
        return self.collect(self.submit(batch, co_samples))

    def drain(self) -> None:
        """Collect every step still in flight, dropping its tokens (before closing: the stages finish theirs)."""
        while self.pending:
            try:
                self.collect(self.pending[0])
            except Exception:  # noqa: BLE001 - a step being dropped; a broken group is reported elsewhere
                pass
