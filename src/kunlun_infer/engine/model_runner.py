"""Run one scheduled step through the model: build the flat batch, forward, sample.

Every sequence's new tokens are laid end to end in one flat batch, in the
order the attention backend asks for (``order_batch``; e.g. decodes first);
the per-token tensors (positions, KV slots) are computed with a handful of
tensor ops from per-sequence numbers, not a loop over tokens. The step's
attention work is described neutrally (:class:`AttentionStep`, host lists)
and the backend builds its own metadata from it. Only sequences whose known
tokens are all computed after this step (a finished prompt, a decode) send
their last hidden state through the LM head and the sampler; a prompt chunk
in the middle just fills the cache. A request asking for ``prompt_logprobs``
also sends the rows that score its prompt through the LM head, chunk by
chunk (see ``engine/prompt_logprobs.py``). A sampled row can be drawn from
by more sequences than its own (``co_samples``: the samples of an ``n > 1``
request drawing their first token from its prompt, see
``engine/sample_group.py``). Batch rows are the scheduler's, whatever the
flat order.

The runner owns the KV cache: :meth:`ModelRunner.resize_kv_cache` allocates
it through the memory plugin in the backend's layout; nothing here looks
inside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any
from collections.abc import Sequence as Seq

import torch

from kunlun_infer.capabilities import MemoryAllocator
from kunlun_infer.engine.kv_cache import KVCaches, KVLayout, allocate_kv_caches, free_kv_caches
from kunlun_infer.engine.prompt_logprobs import (PromptSpan, ScoredPrompt, gather_prompt_logprobs, prompt_spans,
                                                span_indices)
from kunlun_infer.engine.sampler import Sampler
from kunlun_infer.engine.step_graph import StepGraphs
from kunlun_infer.engine.scheduler import ScheduledBatch
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.engine.rejection import verify
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.ops.upload import upload


@dataclasses.dataclass
class StepInputs:
    """The model's inputs for one step, on the device, and which batch rows are sampled."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    #: the step's attention work in flat-batch order, from which the backend builds its metadata
    attn: AttentionStep
    logits_indices: torch.Tensor
    sample_rows: list[int]
    #: rows scoring prompt tokens for ``prompt_logprobs``; their logits follow the sampled rows' in order
    prompt_spans: list[PromptSpan] = dataclasses.field(default_factory=list)
    #: batch row of a sequence checking drafts -> where the logits of its draft positions start (after the
    #: prompt spans'); its last position's logits are its sampled row's, as for any sequence
    draft_rows: dict[int, int] = dataclasses.field(default_factory=dict)
    #: the batch rows in the order their tokens are laid out
    order: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SampledToken:
    """A token drawn for ``seq`` in this step and, when it asked for them, the logprobs of that draw."""

    seq: Sequence
    token_id: int
    logprobs: dict[int, float] | None


@dataclasses.dataclass
class StepResult:
    """What a step produced for each sequence: the tokens drawn, and the prompt logprobs scored."""

    #: in batch order, a sequence's co-samples right after it
    sampled: list[SampledToken] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[ScoredPrompt] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LaunchedStep:
    """A step queued on the device whose tokens have not been read back (``scheduler.overlap_steps``).

    ``tokens``: one per sampled sequence, on the device (what the next step's inputs are taken from);
    ``host_tokens``: their non-blocking copy to the host, readable once ``ready`` (an event of the compute
    stream recorded behind that copy) has completed."""

    batch: ScheduledBatch
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    ready: Any
    #: ``seq_id`` -> row of ``tokens``, for the sequences the step samples (the others compute a prompt chunk)
    row_of: dict[int, int]
    #: ``seq_id`` -> the sequence's computed tokens once the step is done, for every sequence in it; for a
    #: sampled one also where in its ``token_ids`` the placeholder of its drawn token stands (set by the engine)
    computed_to: dict[int, int] = dataclasses.field(default_factory=dict)


def build_step_inputs(seqs: list[Sequence], num_new_tokens: list[int], block_size: int, device: torch.device,
                      order: Seq[int] | None = None, num_drafts: Mapping[int, int] | None = None) -> StepInputs:
    """The flat batch for ``seqs`` computing ``num_new_tokens`` tokens each (host work, then one copy).

    ``order``: the batch rows in the order their tokens are laid out (default:
    as given). ``sample_rows`` and ``prompt_spans`` speak of batch rows.
    ``num_drafts[seq_id]``: draft tokens ending that sequence's chunk, whose
    positions' logits are kept too (speculative decoding).
    """
    order = list(range(len(seqs))) if order is None else list(order)
    if not num_drafts and all(n == 1 for n in num_new_tokens) and all(
            seq.num_computed_tokens + 1 == len(seq.token_ids) for seq in seqs):
        return _decode_inputs(seqs, order, block_size, device)
    return _flat_inputs(seqs, num_new_tokens, block_size, device, order, num_drafts)


def _flat_inputs(seqs: list[Sequence], num_new_tokens: list[int], block_size: int, device: torch.device,
                 order: list[int], num_drafts: Mapping[int, int] | None) -> StepInputs:
    """:func:`build_step_inputs` of any step: per-token tensors from per-sequence numbers."""
    starts = [seqs[i].num_computed_tokens for i in order]
    counts = [num_new_tokens[i] for i in order]
    input_ids: list[int] = []
    for i, start, n in zip(order, starts, counts):
        input_ids.extend(seqs[i].token_ids[start:start + n])
    num_tokens = len(input_ids)
    new = torch.tensor(counts, dtype=torch.int64)
    start_t = torch.tensor(starts, dtype=torch.int64)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(new, 0, out=query_start_loc[1:])
    row_of_token = torch.repeat_interleave(torch.arange(len(seqs)), new, output_size=num_tokens)
    positions = torch.arange(num_tokens) + (start_t - query_start_loc[:-1]).index_select(0, row_of_token)
    tables = [list(seqs[i].block_table) for i in order]
    step = AttentionStep(block_size, counts, starts, tables, _slots(tables, starts, counts, block_size), device)
    row_starts = torch.empty(len(seqs), dtype=torch.int64)  # where each batch row's tokens start
    row_starts[torch.tensor(order, dtype=torch.int64)] = query_start_loc[:-1]
    computed = [s.num_computed_tokens for s in seqs]
    sample_rows = [i for i, s in enumerate(seqs) if computed[i] + num_new_tokens[i] == len(s)]
    rows = torch.tensor(sample_rows, dtype=torch.int64)
    logits_indices = row_starts.index_select(0, rows) + torch.tensor(num_new_tokens).index_select(0, rows) - 1
    spans = prompt_spans(seqs, computed, num_new_tokens)
    if spans:
        logits_indices = torch.cat([logits_indices, span_indices(spans, row_starts)])
    draft_rows: dict[int, int] = {}
    if num_drafts:
        extra = []
        for i in sample_rows:
            d = num_drafts.get(seqs[i].seq_id, 0)
            if d:
                last = int(row_starts[i]) + num_new_tokens[i] - 1
                draft_rows[i] = len(logits_indices) + len(extra)
                extra += range(last - d, last)
        if extra:
            logits_indices = torch.cat([logits_indices, torch.tensor(extra, dtype=torch.int64)])
    return StepInputs(upload(input_ids, device, torch.int64), upload(positions, device), step,
                      upload(logits_indices, device), sample_rows, spans, draft_rows, order)


def _decode_inputs(seqs: list[Sequence], order: list[int], block_size: int, device: torch.device) -> StepInputs:
    """:func:`build_step_inputs` of a step where every sequence computes its last token and samples the next
    (a decode step, the commonest): the same inputs from plain lists, without the tensor work chunks need."""
    starts = [seqs[i].num_computed_tokens for i in order]
    input_ids = [seqs[i].token_ids[start] for i, start in zip(order, starts)]
    tables = [list(seqs[i].block_table) for i in order]
    slots = [table[start // block_size] * block_size + start % block_size for table, start in zip(tables, starts)]
    step = AttentionStep(block_size, [1] * len(order), starts, tables, slots, device)
    flat_of_row = [0] * len(order)  # each batch row's one token, where it lies in the flat batch
    for flat, row in enumerate(order):
        flat_of_row[row] = flat
    return StepInputs(upload(input_ids, device, torch.int64), upload(starts, device, torch.int64), step,
                      upload(flat_of_row, device, torch.int64), list(range(len(order))), [], {}, order)


def _slots(tables: list[list[int]], starts: list[int], counts: list[int], block_size: int) -> list[int]:
    """The cache slot of every new token, sequence by sequence: one ``range`` per cache block touched (a decode
    token is one lookup), so the host never builds the batch's padded block table to index it."""
    slots: list[int] = []
    for table, pos, n in zip(tables, starts, counts):
        end = pos + n
        while pos < end:
            block, offset = divmod(pos, block_size)
            taken = min(end - pos, block_size - offset)
            first = table[block] * block_size + offset
            slots.extend(range(first, first + taken))
            pos += taken
    return slots


class ModelRunner:
    """Owns the model, its KV cache and the sampler; turns a scheduled batch into sampled tokens."""

    def __init__(self, model: torch.nn.Module, *, device: torch.device, block_size: int, sampler: Sampler | None,
                 memory: MemoryAllocator) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.sampler = sampler
        self.memory = memory
        #: the attention backend of the model's layers: it owns the cache layout and the step metadata
        self.attention = model.attention
        self.layout = KVLayout(model.num_layers, block_size, self.attention)
        self._kv_caches: KVCaches = []
        #: decode steps replayed from captures (``engine/step_graph.py``); ``None``: every step eager
        self.graphs: StepGraphs | None = None

    # ------------------------------------------------------------------ the KV cache

    @property
    def kv_caches(self) -> KVCaches:
        """One tuple of cache tensors per layer, in the backend's layout (empty when none is allocated)."""
        return self._kv_caches

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Hold exactly ``num_blocks`` KV blocks (0 = none): the old cache is freed, a zeroed one allocated."""
        self.release_kv_cache()
        if num_blocks > 0:
            self._kv_caches = allocate_kv_caches(self.memory, self.layout, num_blocks)

    def capture_step_graphs(self, max_num_seqs: int) -> int:
        """Capture now the decode steps of the ``ops.step_graph_sizes`` batch sizes that batches of up to
        ``max_num_seqs`` sequences run in, over the current cache (:meth:`StepGraphs.capture_sizes`); returns how
        many were captured."""
        if self.graphs is None or not self._kv_caches:
            return 0
        return self.graphs.capture_sizes(self._kv_caches, self.block_size, self.device, max_num_seqs)

    def release_kv_cache(self) -> None:
        """Give this process's cache back to the memory plugin (nothing is sent to other ranks)."""
        if self.graphs is not None:
            self.graphs.clear()  # their buffers point into this cache
        free_kv_caches(self.memory, self._kv_caches)

    # ------------------------------------------------------------------ steps


    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, co_samples: Mapping[int, list[Sequence]] | None = None,
                drafts: Mapping[int, tuple[list[int], torch.Tensor | None]] | None = None) -> StepResult:
        """Forward the batch and sample every sequence whose known tokens are now all computed.

        ``co_samples[seq_id]``: sequences that draw a token from the logits of
        the sequence with that id, when it is sampled, besides itself. Each
        draw uses the drawing sequence's params, history and ``generator``.
        ``drafts[seq_id]``: the draft tokens ending that sequence's chunk and
        their distribution; they are checked (:func:`rejection.verify`) and
        the sequence gets every token it keeps, in order.
        """
        num_drafts = {seq_id: len(d) for seq_id, (d, _) in (drafts or {}).items() if d}
        inputs = self.prepare(batch, num_drafts)
        return self.sample(batch, inputs, self.compute(inputs), co_samples, drafts)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, record_event: Callable[[], Any],
               previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue a step (decodes and prompt chunks, each sampled sequence drawing alone; no logprobs) and return
        without waiting for the device. With ``previous``, a sequence it sampled takes as its input token the
        one it drew there, still on the device (its place in ``token_ids`` holds a placeholder). :meth:`finish`
        reads the tokens."""
        inputs = self.prepare(batch)
        if inputs.prompt_spans or inputs.draft_rows:
            raise ValueError("a launched step scores no prompt logprobs and checks no drafts")
        if previous is not None and previous.row_of:
            self._take_drawn_tokens(inputs, batch, previous)
        logits = self.compute(inputs)
        seqs = [batch.seqs[i] for i in inputs.sample_rows]
        if logits is None:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        else:
            tokens, _ = self.sampler.draw(logits, [s.params for s in seqs], [s.generator for s in seqs], seqs)
        host_tokens = tokens.to("cpu", non_blocking=True)
        return LaunchedStep(batch, tokens, host_tokens, record_event(), {s.seq_id: j for j, s in enumerate(seqs)})

    def _take_drawn_tokens(self, inputs: StepInputs, batch: ScheduledBatch, previous: LaunchedStep) -> None:
        """Put in ``inputs`` the tokens ``previous`` drew, on the device, where the host holds placeholders: the
        one new token of every sequence ``previous`` sampled."""
        row_of = previous.row_of
        rows = [row_of.get(batch.seqs[i].seq_id, -1) for i in inputs.order]
        if -1 not in rows:  # every sequence decodes the token it drew: the step's whole input
            inputs.input_ids = previous.tokens.index_select(0, upload(rows, self.device, torch.int64))
            return
        starts = inputs.attn.query_start_loc
        at = [(starts[k], row) for k, row in enumerate(rows) if row >= 0]
        if at:
            flat, drawn = zip(*at)
            inputs.input_ids = inputs.input_ids.index_copy(
                0, upload(list(flat), self.device, torch.int64),
                previous.tokens.index_select(0, upload(list(drawn), self.device, torch.int64)))

    @staticmethod
    def finish(launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (only for them: steps queued after it go on running)."""
        launched.ready.synchronize()
        token_ids = launched.host_tokens.tolist()
        row_of = launched.row_of
        return StepResult([SampledToken(seq, token_ids[row], None) for seq in launched.batch.seqs
                           if (row := row_of.get(seq.seq_id)) is not None])

    def sample(self, batch: ScheduledBatch, inputs: StepInputs, logits: torch.Tensor | None,
               co_samples: Mapping[int, list[Sequence]] | None = None,
               drafts: Mapping[int, tuple[list[int], torch.Tensor | None]] | None = None) -> StepResult:
        """Draw the step's tokens (and score its prompt logprobs) from the logits of ``inputs``' rows."""
        num_drafts = {seq_id: len(d) for seq_id, (d, _) in (drafts or {}).items() if d}
        if logits is None:
            return StepResult()
        rows = inputs.sample_rows
        spans_end = len(logits) - sum(num_drafts.get(batch.seqs[i].seq_id, 0) for i in inputs.draft_rows)
        result = StepResult(prompt_logprobs=gather_prompt_logprobs(logits[len(rows):spans_end], batch.seqs,
                                                                   inputs.prompt_spans))
        if not rows:
            return result
        draws: list[Sequence] = []
        logits_rows: list[int] = []
        checked: dict[int, list[SampledToken]] = {}
        for j, i in enumerate(rows):
            seq = batch.seqs[i]
            if i in inputs.draft_rows:
                start = inputs.draft_rows[i]
                positions = torch.cat([logits[start:start + num_drafts[seq.seq_id]], logits[j:j + 1]])
                checked[j] = self._check_drafts(seq, positions, *drafts[seq.seq_id])  # type: ignore[index]
                continue
            drawing = [seq, *(co_samples or {}).get(seq.seq_id, ())]
            draws += drawing
            logits_rows += [j] * len(drawing)
        sampled: list[SampledToken] = []
        if draws:
            if logits_rows == list(range(len(rows))):
                draw_logits = logits[:len(rows)]
            else:
                draw_logits = logits.index_select(0, torch.tensor(logits_rows, device=logits.device))
            out = self.sampler(draw_logits, [s.params for s in draws], [s.generator for s in draws], draws)
            sampled = [SampledToken(*draw) for draw in zip(draws, out.token_ids, out.logprobs)]
        # batch order, a sequence's co-samples right after it, a checked sequence's tokens in order
        taken = iter(sampled)
        for j, i in enumerate(rows):
            if j in checked:
                result.sampled += checked[j]
            else:
                result.sampled += [next(taken) for _ in range(1 + len((co_samples or {}).get(batch.seqs[i].seq_id,
                                                                                              ())))]
        return result

    def _check_drafts(self, seq: Sequence, logits: torch.Tensor, draft_tokens: list[int],
                      draft_probs: torch.Tensor | None) -> list[SampledToken]:
        """The tokens ``seq`` keeps of its drafts (and the one after), from its chunk's logits, with logprobs."""
        kept = verify(logits, draft_tokens, draft_probs, seq.params, seq.generator, self.sampler)
        logprobs: list[dict[int, float] | None] = [None] * len(kept)
        if seq.params.logprobs is not None:
            rows = logits[:len(kept)]
            logprobs = self.sampler.logprobs(rows, rows, torch.tensor(kept, device=rows.device),
                                             [seq.params] * len(kept))
        return [SampledToken(seq, token, lp) for token, lp in zip(kept, logprobs)]

    def compute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Forward the flat batch; the logits of the rows in ``logits_indices`` (``None`` when there are none).

        Tensor-parallel ranks other than 0 call this alone (they do not sample).
        """
        return self.logits(inputs, self.forward(inputs))

    def forward(self, inputs: StepInputs, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """The model's forward over this rank's layers (a pipeline stage's, given the stage before's output)."""
        if self.graphs is not None:
            out = self.graphs.forward(inputs.input_ids, inputs.positions, inputs.attn, self._kv_caches, intermediate)
            if out is not None:
                return out
        metadata = self.attention.build_metadata(inputs.attn)
        return self.model(inputs.input_ids, inputs.positions, metadata, self._kv_caches, intermediate)

    def logits(self, inputs: StepInputs, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of the rows in ``logits_indices`` of the final hidden states (``None`` when there are none)."""
        if inputs.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    def prepare(self, batch: ScheduledBatch, num_drafts: Mapping[int, int] | None = None) -> StepInputs:
        """The flat batch of ``batch``, in the order the attention backend asks for."""
        order = self.attention.order_batch(batch.num_new_tokens, [s.num_computed_tokens for s in batch.seqs])
        return build_step_inputs(batch.seqs, batch.num_new_tokens, self.block_size, self.device, order,
                                 num_drafts)
