"""Decode steps replayed from a capture, one per batch size: the engine's side of ``OpsProvider.capture``.

A decode step of a small model on a host CPU spends milliseconds in Python:
a few hundred kernel launches, each through a module, the op table and a
wrapper that checks its inputs and allocates its output. :class:`StepGraphs`
runs the first decode-only step of each batch size through the ops plugin's
capture (hook API 1.5) over buffers of its own: the hidden states after the
token embedding, the positions, and the attention metadata built for block
tables as wide as a sequence may grow. A later step of that size writes its
inputs into those buffers (the metadata through
``AttentionBackendBase.update_metadata``) and replays the captured kernels.
The token embedding runs before each replay (:meth:`CausalLM.embed`), the LM
head and the sampler after it, as in any step.

A tensor-parallel rank captures its decode steps where its group's comm
says its all-reduces are captured with the kernels (``Comm.capturable``,
hook API 1.9) and the streams plugin runs them inline: every rank of the
group meets the same steps, so all capture, refuse or replay the same ones,
their recorded all-reduces meeting each other in the replays. A kernel that
fails in one rank's replay alone makes that rank run the step eagerly while
the others replay it, and the group's collectives then time out, as a rank
whose kernel fails mid-step always did.

A pipeline stage's runner captures its layers the same way. The first
stage's capture starts from the embedding and ends with the ``(hidden,
residual)`` it sends on; a later stage's starts from buffers the stage
before's ``(hidden, residual)`` is copied into (``stage_dtype`` says what they
hold). The outputs are the capture's own buffers, rewritten by the next
replay: a caller that keeps them past it (a send queued for later) copies
them first.

With ``ops.step_graph_sizes`` only those batch sizes are captured: a step of
another size runs in the capture of the next larger one, padded with
sequences that store nothing (:meth:`AttentionStep.padded_to`; token id 0 at
position 0), and the padding rows of the result are dropped. A GPU wants
this (a capture per size would cost hundreds of captures); the host CPU,
whose padding rows cost GEMM rows, captures every size as it is met. Those
sizes are captured when the engine starts (:meth:`StepGraphs.capture_sizes`,
steps of padding sequences only), so no request waits in the middle of
serving for a capture, or for the first compile of a kernel it runs.

Everything else runs eagerly, as before: steps with prompt tokens or
drafts, batches larger than ``ops.step_graphs``, a batch
size whose capture the plugin refused (``None``), a backend that cannot
update its metadata. A replay whose kernel reports a failure makes the step
run again eagerly, which raises that kernel's own error; the cache writes
the replay made are the ones the eager step makes again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from kunlun_infer.config import setting
from kunlun_infer.ops.attention_step import AttentionStep

log = logging.getLogger("kunlun_infer.engine")


@dataclasses.dataclass
class _Graph:
    hidden: torch.Tensor
    positions: torch.Tensor
    metadata: Any
    captured: Any
    #: the stage before's residual, on a pipeline stage after the first (``None`` on the first)
    residual: torch.Tensor | None = None


def _rows(result: Any, batch: int) -> Any:
    """The first ``batch`` rows of a capture's result: the hidden states, or a stage's ``(hidden, residual)``."""
    if isinstance(result, tuple):
        return tuple(t[:batch] for t in result)
    return result[:batch]


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))


class StepGraphs:
    """The captured decode steps of one model runner, by batch size.

    ``capture``: the runtime's ``capture_step``; ``max_batch``: the largest
    batch captured (``ops.step_graphs``); ``max_blocks``: the most cache
    blocks one sequence can hold (the width of the captured block tables);
    ``stage_dtype``: on a pipeline stage after the first, the dtype of the
    ``(hidden, residual)`` it receives.
    """

    def __init__(self, capture: Callable[[Callable[[], Any]], Any], model: Any, attention: Any, *,
                 max_batch: int, max_blocks: int, sizes: list[int] | None = None,
                 stage_dtype: torch.dtype | None = None) -> None:
        self._capture = capture
        self.stage_dtype = stage_dtype
        #: the batch sizes captured, ascending (``None``: every size up to ``max_batch``)
        self.sizes = None if sizes is None else sorted({int(n) for n in sizes if 1 <= int(n) <= max_batch})
        self.model = model
        self.attention = attention
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self._graphs: dict[int, _Graph] = {}
        #: batch sizes that run eagerly, and why
        self.refused: dict[int, str] = {}
        #: steps served by a replay / by a capture (counters for ``stats`` and tests)
        self.replays = 0
        self.captures = 0

    def clear(self) -> None:
        """Forget every capture (their buffers point into a KV cache that is about to go)."""
        self._graphs.clear()
        self.refused.clear()

    def captured_step(self, batch: int) -> Any:
        """The ops plugin's captured step serving ``batch`` sequences (``KeyError`` when none is)."""
        return self._graphs[batch].captured

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes captured so far."""
        return sorted(self._graphs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep,
                kv_caches: list[tuple[torch.Tensor, ...]],
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """What the model's forward returns for a decode step (the final hidden states; a pipeline stage's
        ``(hidden, residual)`` before the last), from a replay or the capture that serves its batch size; ``None``
        when the caller must run it eagerly. ``intermediate``: the stage before's output, after the first."""
        batch = step.num_seqs
        if not step.is_decode_only or not kv_caches or (intermediate is not None) != (self.stage_dtype is not None):
            return None
        size = self.size_for(batch)
        if size is None or size in self.refused:
            return None
        if size != batch:
            step = step.padded_to(size)
            input_ids = _padded(input_ids, size)
            positions = _padded(positions, size)
            if intermediate is not None:
                intermediate = (_padded(intermediate[0], size), _padded(intermediate[1], size))
        graph = self._graphs.get(size)
        if graph is None:
            result = self._first(input_ids, positions, step, kv_caches, intermediate)
            return None if result is None else _rows(result, batch)
        if not self.attention.update_metadata(graph.metadata, step):
            return None
        if intermediate is None:
            graph.hidden.copy_(self.model.embed(input_ids))
        else:
            graph.hidden.copy_(intermediate[0])
            graph.residual.copy_(intermediate[1])
        graph.positions.copy_(positions)
        try:
            graph.captured.replay()
        except Exception as exc:  # noqa: BLE001 - the eager step raises the kernel's own error
            log.debug("replay of a %d-sequence step failed (%s); running it eagerly", size, exc)
            return None
        self.replays += 1
        return _rows(graph.captured.result, batch)

    def capture_sizes(self, kv_caches: list[tuple[torch.Tensor, ...]], block_size: int, device: torch.device,
                      max_num_seqs: int) -> int:
        """Capture every size of ``ops.step_graph_sizes`` that a batch of up to ``max_num_seqs`` sequences can
        run in and that is not captured yet, each from a step of padding sequences (nothing stored); returns how
        many were captured (0 without explicit sizes).

        One eager step of padding sequences runs first: a kernel's first call may build what it keeps in torch
        (the cpu ops widen a bias to float32 once), which a capture refuses, and a runner captures here before
        any step of its own has run (a pipeline stage's worker does)."""
        before = self.captures
        largest = self.size_for(max_num_seqs) or max(self.sizes or [0])
        todo = [n for n in self.sizes or () if n <= largest and n not in self._graphs and n not in self.refused]
        for index, size in enumerate(todo):
            step = AttentionStep(block_size, [], [], [], [], device).padded_to(size)  # padding sequences only
            zeros = torch.zeros(size, dtype=torch.int64, device=device)  # token ids and positions alike
            received = None if self.stage_dtype is None else tuple(
                torch.zeros(size, self.model.config.hidden_size, dtype=self.stage_dtype, device=device)
                for _ in range(2))
            if index == 0:
                start = received if received is not None else (self.model.embed(zeros), None)
                self.model(zeros, zeros, self.attention.build_metadata(step), kv_caches, start)
            self.forward(zeros, zeros, step, kv_caches, received)
        return self.captures - before

    def size_for(self, batch: int) -> int | None:
        """The captured batch size that serves ``batch`` sequences (``None``: the step runs eagerly)."""
        if self.sizes is None:
            return batch if batch <= self.max_batch else None
        return next((n for n in self.sizes if n >= batch), None)

    def _refuse(self, batch: int, reason: str) -> None:
        self.refused[batch] = reason
        log.info("decode steps of %d sequence(s) run eagerly: %s", batch, reason)

    def _first(self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep,
               kv_caches: list[tuple[torch.Tensor, ...]],
               intermediate: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        batch = step.num_seqs
        if any(len(t) > self.max_blocks for t in step.block_tables):
            return None
        wide = AttentionStep(step.block_size, step.query_lens, step.context_lens,
                             step.padded_block_tables(self.max_blocks), step.slot_mapping, step.device)
        metadata = self.attention.build_metadata(wide)
        if not self.attention.update_metadata(metadata, step):
            self._refuse(batch, f"attention backend '{self.attention.name}' cannot update its metadata in place")
            return None
        if intermediate is None:
            hidden, residual = self.model.embed(input_ids).clone(), None
        else:
            hidden, residual = intermediate[0].clone(), intermediate[1].clone()
        static_positions = positions.clone()
        captured = self._capture(lambda: self.model(input_ids, static_positions, metadata, kv_caches,
                                                    (hidden, residual)))
        # a rank that holds its kernels' failures back (engine/parallel) held them back in the capture too: a
        # refusal is no failure of the step (the eager run that follows records any real one again); a capture
        # that met a failing kernel is not kept, and its step fails as an eager one would, having taken its turn
        # in every collective of the group
        deferred = getattr(self.model, "deferred_failures", None)
        failed = deferred.take() if deferred is not None else None
        if captured is None:
            self._refuse(batch, "the ops plugin did not capture it")
            return None
        if failed is not None:
            deferred.record(failed)
            return captured.result
        self._graphs[batch] = _Graph(hidden, static_positions, metadata, captured, residual)
        self.captures += 1
        return captured.result


def step_graphs(runtime: Any, model: Any, *, max_model_len: int, block_size: int,
                dtype: torch.dtype | None = None) -> StepGraphs | None:
    """The captured steps of a runner of ``model`` under ``runtime``'s ``ops.step_graphs`` (``None``: 0, or a
    tensor-parallel group whose collectives are not captured); ``dtype``: the model's activations (what a later
    pipeline stage receives)."""
    max_batch = int(setting(runtime.config, "ops.step_graphs"))
    if max_batch <= 0:
        return None
    ctx = getattr(model, "ctx", None)
    if ctx is not None and ctx.tp_size > 1 and not (ctx.comm.capturable and ctx.streams is None
                                                    and ctx.ep_size == 1):
        return None  # its collectives (all-to-alls too, with experts split) would run outside: every step eager
    sizes = setting(runtime.config, "ops.step_graph_sizes")
    span = getattr(model, "span", None)
    return StepGraphs(runtime.capture_step, model, model.attention, max_batch=max_batch,
                      max_blocks=-(-max_model_len // block_size), sizes=None if sizes is None else list(sizes),
                      stage_dtype=dtype if span is not None and not span.is_first else None)
