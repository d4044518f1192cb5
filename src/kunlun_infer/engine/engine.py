"""``LLMEngine``: the online API — add requests, step, abort — over scheduler, runner and sampler.

Each :meth:`LLMEngine.step` asks the scheduler for a batch, runs it through
the model runner, records the sampled tokens and returns one
:class:`RequestOutput` per request that progressed (aborted ones included).
Requests are tokenized and checked once (``engine/intake.py``), in
:meth:`add_request` or ahead of it by :meth:`prepare_request`, before
anything is scheduled; a bad one is refused alone. The engine is driven from one thread. Plugins
that implement the observability hooks hear about start, steps, finished
requests and stop. A request for ``n`` samples gives one output per sample
(``RequestOutput.index``); its samples share the prompt's KV blocks (one
:class:`SampleGroup` per request, see ``engine/sample_group.py``).

With pipeline stages (``parallel.pipeline_size``) a step sends a new batch
down the pipeline and, once ``parallel.pipeline_batches`` are out (or nothing
new can be scheduled), takes back the oldest; its outputs come with that
step. A sequence is in at most one batch in flight.

A step that fails (a plugin raises in an op or a collective, the framework
trips) ends the requests of that step with ``finish_reason="abort"`` and
``error`` naming the plugin, hook and layer, frees their KV blocks and raises
:class:`EngineStepError`. Then ``scheduler.on_step_error`` decides:
``recover`` serves the next requests (the ended ones' outputs come with the
next step, as an abort's do), ``shutdown`` ends every other request the same
way and closes the engine. An observability plugin that fails is logged and
never stops a step.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from kunlun_infer.config import StructuredConfig, check_ranges, overlap_choice, setting
from kunlun_infer.dtypes import dtype_name
from kunlun_infer.engine.block_manager import BlockManager
from kunlun_infer.engine.failures import describe_failure
from kunlun_infer.engine.intake import PreparedRequest, Prompt, RequestIntake
from kunlun_infer.engine.kv_cache import KVBudget, size_kv_cache
from kunlun_infer.engine.model_runner import LaunchedStep, ModelRunner, SampledToken
from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.engine.overlap import PLACEHOLDER, drop_placeholders, overlap_enabled, overlappable
from kunlun_infer.engine.parallel.driver import TensorParallelGroup
from kunlun_infer.engine.parallel.pipeline_driver import PipelineGroup
from kunlun_infer.engine.parallel.stages import Grid
from kunlun_infer.engine.parallel.placement import local_rank, resolve_parallel_config
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sample_group import SampleGroup
from kunlun_infer.engine.sampler import Sampler
from kunlun_infer.engine.scheduler import ScheduledBatch, Scheduler
from kunlun_infer.engine.step_graph import step_graphs
from kunlun_infer.engine.startup import (choose_dtype, choose_max_model_len, measure_activation_bytes, model_dir,
                                        model_tokenizer)
from kunlun_infer.engine.draft_model import DraftModelProposer
from kunlun_infer.engine.speculative import CacheGeometry, SpeculationStats, Speculator, load_proposer
from kunlun_infer.engine.structured import StructuredOutputs
from kunlun_infer.errors import ConfigError, EngineStepError, KunlunInferError, RequestError, WorkerError
from kunlun_infer.layers.quantization import Quantization
from kunlun_infer.models import load_model, load_model_config
from kunlun_infer.runtime import Runtime

log = logging.getLogger("kunlun_infer.framework")


class LLMEngine:
    """Continuous-batching inference over one runtime. Build with :meth:`from_config`."""

    def __init__(self, config: DictConfig, *, runtime: Runtime | None = None) -> None:
        self.config = config = resolve_parallel_config(config)
        self._owns_runtime = runtime is None
        self.runtime = Runtime.from_config(config, local_rank=local_rank()) if runtime is None else runtime
        #: the other tensor-parallel ranks (``None`` with ``parallel.tensor_size=1``)
        self.parallel: Any = None
        #: speculative decoding (``speculative.method``); ``None`` when off
        self.speculator: Speculator | None = None
        self._closed = False
        #: request id -> its samples, while any of them is unfinished
        self._requests: dict[str, SampleGroup] = {}
        self._aborted_outputs: list[RequestOutput] = []
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()
        self._num_steps = 0
        self._num_finished = 0
        self._num_generated_tokens = 0
        self._num_computed_tokens = 0
        #: why the engine closed itself after a failed step (``None`` while it serves)
        self._shut_down_by: str | None = None
        try:
            self._start()
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_config(cls, config: DictConfig) -> LLMEngine:
        """An engine with its own runtime (closed again by :meth:`close`)."""
        return cls(config)

    # ------------------------------------------------------------------ start-up

    def _start(self) -> None:
        cfg, rt = self.config, self.runtime
        check_ranges(cfg)  # composition checked them; a config built by hand did not go through it
        self.on_step_error = str(setting(cfg, "scheduler.on_step_error"))
        tensor_size = int(cfg.parallel.tensor_size)
        expert_size = int(setting(cfg, "parallel.expert_size"))
        if expert_size not in (1, tensor_size):
            raise ConfigError(f"parallel.expert_size={expert_size} must be 1 (experts split over the "
                              f"tensor-parallel ranks) or parallel.tensor_size={tensor_size} (each rank holds "
                              "whole experts)")
        self.model_path = model_dir(cfg.model.path)
        self.model_config = arch = load_model_config(self.model_path)
        self.dtype = choose_dtype(str(cfg.model.dtype), getattr(arch, "torch_dtype", None), rt.device)
        self.quantization = Quantization.from_config(cfg.model)
        self.max_model_len = choose_max_model_len(cfg.model.max_model_len, arch.max_context_len)
        arch.check_max_model_len(self.max_model_len)
        self.tokenizer = model_tokenizer(cfg.model.tokenizer, self.model_path)
        self.eos_token_ids = tuple(arch.eos_token_ids or getattr(self.tokenizer, "eos_token_ids", ()) or ())
        self.device = rt.device.torch_device
        free_before_weights = rt.device.mem_get_info()[0]
        self.block_size = int(cfg.cache.block_size)
        pipeline_size = int(cfg.parallel.get("pipeline_size", 1))
        #: the pipeline's stages and ranks (``None`` without pipeline parallelism)
        self.grid = Grid.from_config(cfg, arch.num_hidden_layers) if pipeline_size > 1 else None
        if self.grid is not None:
            if cfg.get("speculative") is not None and cfg.speculative.method is not None:
                raise ConfigError("speculative.method with parallel.pipeline_size > 1 is not supported; "
                                  "turn one of them off")
            if expert_size > 1:
                raise ConfigError("parallel.expert_size > 1 with parallel.pipeline_size > 1 is not supported; "
                                  "leave parallel.expert_size=1 (experts split over each stage's tensor-parallel "
                                  "ranks)")
            self.parallel = PipelineGroup.start_pipeline(cfg, rt, self.grid)
            model = self.parallel.load_model(self.model_path, dtype=self.dtype, max_model_len=self.max_model_len,
                                             block_size=self.block_size, quantization=self.quantization)
        elif tensor_size > 1:
            self.parallel = TensorParallelGroup.start(cfg, rt)
            model = self.parallel.load_model(self.model_path, dtype=self.dtype, max_model_len=self.max_model_len,
                                             block_size=self.block_size, quantization=self.quantization,
                                             expert_size=expert_size)
            free_before_weights = self.parallel.min_free_bytes  # the tightest rank sizes the cache of all
        else:
            model = load_model(self.model_path, runtime=rt, dtype=self.dtype, max_model_len=self.max_model_len,
                               quantization=self.quantization)
        self.structured = StructuredOutputs(
            config=cfg.get("structured") or OmegaConf.structured(StructuredConfig), runtime=rt,
            tokenizer=self.tokenizer.backend if self.tokenizer is not None else None, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids, torch_device=self.device)
        sampler = Sampler.for_runtime(rt, torch.Generator(device=self.device).manual_seed(int(cfg.model.seed)),
                                      self.structured)
        runner_class = ModelRunner if self.parallel is None else self.parallel.runner_class
        self.runner = runner_class(model, device=self.device, block_size=self.block_size, sampler=sampler,
                                   memory=rt.memory)
        # decode steps may replay captures (engine/step_graph.py), every rank's alike
        self.runner.graphs = step_graphs(rt, model, max_model_len=self.max_model_len, block_size=self.block_size,
                                         dtype=self.dtype)
        layout = self.runner.layout
        proposer = load_proposer(cfg.get("speculative"), runtime=rt, dtype=self.dtype,
                                 max_model_len=self.max_model_len, block_size=self.block_size,
                                 vocab_size=self.vocab_size, tensor_size=tensor_size, seed=int(cfg.model.seed))
        draft = proposer if isinstance(proposer, DraftModelProposer) else None
        self._draft = draft  # its cache is released with the model's
        budget, chunked = int(cfg.scheduler.max_num_batched_tokens), bool(cfg.scheduler.chunked_prefill)
        if not chunked and budget < self.max_model_len:
            log.warning("scheduler.chunked_prefill=false: raising scheduler.max_num_batched_tokens from %d to "
                        "model.max_model_len=%d so every prompt fits one step", budget, self.max_model_len)
            budget = self.max_model_len
        max_num_seqs = int(cfg.scheduler.max_num_seqs)
        warm_tokens = min(budget, self.max_model_len)
        activation_bytes = measure_activation_bytes(self.runner, rt.device, arch, self.dtype,
                                                    num_tokens=warm_tokens, num_seqs=max_num_seqs)
        #: how the KV cache was sized from memory (``None`` when ``cache.num_blocks`` fixes it)
        self.kv_budget: KVBudget | None = None
        if cfg.cache.num_blocks is not None:
            num_blocks = int(cfg.cache.num_blocks)
        elif self.grid is not None:
            # each rank holds the KV of its stage's layers: the tightest rank decides the count for all
            budgets = [size_kv_cache(
                CacheGeometry(self.block_size, per_block), device_memory=free, weight_bytes=weights,
                memory_fraction=float(cfg.cache.memory_fraction), activation_bytes=activation_bytes,
                comm_bytes=rt.comm.buffer_bytes(), max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
                for free, weights, per_block in self.parallel.rank_memory]
            self.kv_budget = min(budgets, key=lambda b: (b.num_blocks, b.blocks_by_memory))
            num_blocks = self.kv_budget.num_blocks
        else:
            # a draft model's weights and cache (in the same blocks) come out of the same memory
            geometry = layout if draft is None else CacheGeometry(
                self.block_size, layout.bytes_per_block + draft.bytes_per_block)
            self.kv_budget = size_kv_cache(
                geometry, device_memory=free_before_weights, memory_fraction=float(cfg.cache.memory_fraction),
                weight_bytes=model.weight_nbytes() + (draft.weight_nbytes() if draft else 0),
                activation_bytes=activation_bytes,
                comm_bytes=rt.comm.buffer_bytes(), max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
            num_blocks = self.kv_budget.num_blocks
        self.runner.resize_kv_cache(num_blocks)  # on every tensor-parallel rank
        started = time.monotonic()
        if captured := self.runner.capture_step_graphs(max_num_seqs):
            log.info("captured decode steps of %d batch size(s) in %.2f s", captured, time.monotonic() - started)
        if draft is not None:
            draft.allocate(num_blocks)
        self.block_manager = BlockManager(num_blocks, self.block_size, bool(cfg.cache.prefix_caching))
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   chunked_prefill=chunked)
        #: batches sent down the pipeline and not yet back, oldest first (pipeline parallelism only)
        self._in_flight: collections.deque[tuple[ScheduledBatch, Any]] = collections.deque()
        self.pipeline_batches = int(cfg.parallel.pipeline_batches) if self.grid is not None else 1
        #: each batch in flight takes its share of the running sequences, so that there is one for each
        self._batch_seqs = -(-max_num_seqs // self.pipeline_batches)
        overlap = overlap_choice(setting(cfg, "scheduler.overlap_steps"))
        if overlap == "on" and (self.parallel is not None or proposer is not None):
            raise ConfigError("scheduler.overlap_steps=on needs one rank without speculative decoding (parallel "
                              "sizes 1, speculative.method unset); set it to auto or off")
        #: steps launched before the one in flight comes back (``engine/overlap.py``)
        self.overlap = (self.parallel is None and proposer is None
                        and overlap_enabled(overlap, bool(rt.streams.asynchronous)))
        self._record_event = rt.streams.compute_stream().record_event
        #: the step in flight (overlapped steps only)
        self._launched: LaunchedStep | None = None
        self.speculator = None if proposer is None else Speculator(
            proposer, num_tokens=int(cfg.speculative.num_tokens), max_model_len=self.max_model_len,
            block_manager=self.block_manager)
        self.intake = RequestIntake(tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                    max_model_len=self.max_model_len, max_kv_tokens=num_blocks * self.block_size,
                                    max_num_seqs=max_num_seqs, structured=self.structured)
        self._observe_steps = rt.plugins.has_observers("kunlun_infer_engine_step")
        rt.plugins.engine_start({
            "model": str(self.model_path), "dtype": dtype_name(self.dtype),
            "kv_blocks_total": num_blocks, "block_size": self.block_size, "tensor_size": tensor_size,
            "pipeline_size": pipeline_size,
            "plugins": {c: rt.plugin_for(c) for c in ("device", "memory", "ops", "comm", "streams")},
        })
        log.info("engine ready: %s (%s), max_model_len=%d, %d KV blocks%s", self.model_path, self.dtype,
                 self.max_model_len, num_blocks,
                 ", steps overlapped (scheduler.overlap_steps)" if self.overlap else "")

    # ------------------------------------------------------------------ requests

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.vocab_size)

    def prepare_request(self, prompt: Prompt, params: SamplingParams | None = None) -> PreparedRequest:
        """Tokenize and check a request without queuing it (``RequestError`` naming the field at fault).

        :meth:`add_request` takes the result as it is. Safe to call from
        another thread than the one driving the engine: it reads only the
        tokenizer and the engine's fixed limits.
        """
        return self.intake.prepare(prompt, params)

    def add_request(self, prompt: Prompt | PreparedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, *, final_only: bool = False) -> str:
        """Queue a request (text, token ids, or one from :meth:`prepare_request`); returns its id.

        It joins the running batch at the next step. Without ``request_id``
        the engine names it ``req-N``. With ``final_only``, :meth:`step`
        returns its samples' outputs only as they finish, and no snapshot is
        built for each token (what :meth:`LLM.generate` asks for: at hundreds
        of sequences those snapshots are a large part of a step's host time).
        """
        self._check_open()
        request = self.intake.accept(prompt, params)
        if request_id is None:
            request_id = self._new_request_id()
        elif not isinstance(request_id, str) or not request_id or self._in_use(request_id):
            raise RequestError(f"request_id must be a non-empty string no unfinished or still unreported "
                               f"request uses, got {request_id!r}", field="request_id")
        group = SampleGroup(request_id, request.prompt, list(request.prompt_token_ids), request.params,
                            self._seq_ids, eos_token_ids=self.eos_token_ids, decoder=self.tokenizer,
                            device=self.device, final_only=final_only)
        if request.params.structured is not None:
            samples = [state.seq for state in group.samples]
            for sample, constraint in zip(samples, self.structured.constraints(
                    request.params.structured, [sample.stop_token_ids for sample in samples])):
                sample.constraint = constraint
        self._requests[request_id] = group
        self.scheduler.add(group.leader)
        return request_id

    def _new_request_id(self) -> str:
        """The next free ``req-N``: the one place requests are named (a caller may have taken one already)."""
        while True:
            request_id = f"req-{next(self._request_ids)}"
            if not self._in_use(request_id):
                return request_id

    def _in_use(self, request_id: str) -> bool:
        """True while ``request_id`` is unfinished or its abort is still to be reported."""
        return request_id in self._requests or any(o.request_id == request_id for o in self._aborted_outputs)

    def abort(self, request_id: str) -> bool:
        """End a request now and free its KV blocks; its final output comes with the next step."""
        return bool(self._end(request_id))

    def _end(self, request_id: str, error: str | None = None) -> list[RequestOutput]:
        """Abort every sample of ``request_id`` (with ``error`` set when a failure ended it); their outputs."""
        group = self._requests.pop(request_id, None)
        if group is None:
            return []
        for state in group.samples:
            drop_placeholders(state.seq)  # tokens of a step in flight are not the request's
        ended = group.abort(self.scheduler, time.monotonic(), error)
        if self.speculator is not None:
            for state in group.samples:
                self.speculator.forget(state.seq)
        for output in ended:
            self._finished(output, self._aborted_outputs)
        self._num_finished += 1
        return ended

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running (or an abort is still to be reported)."""
        return bool(self._requests) or bool(self._aborted_outputs)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one batch; one output per request that progressed (and per request aborted since)."""
        self._check_open()
        started = time.monotonic()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        try:
            if self.grid is not None:
                batch = self._pipelined_step(started, outputs)
            elif self.overlap:
                batch = self._overlapped_step(started, outputs)
            else:
                batch = self._step(started, outputs)
        except BaseException as exc:
            # what this step was to return is not lost: it comes with the next step, or with the error
            if isinstance(exc, EngineStepError) and exc.shut_down:
                exc.outputs[:0] = outputs
            else:
                self._aborted_outputs[:0] = outputs
            raise
        self._num_steps += 1
        if self._observe_steps:
            self.runtime.plugins.engine_step({
                "step": self._num_steps, "num_prefill_tokens": batch.num_prefill_tokens,
                "num_decode_tokens": batch.num_decode_tokens, "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting), "kv_blocks_free": self.block_manager.num_free_blocks,
                "duration_s": time.monotonic() - started})
        return outputs

    def _step(self, started: float, outputs: list[RequestOutput]) -> ScheduledBatch:
        """Schedule a batch and run it to the end (no pipeline); the batch it ran."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.fit(batch, [*self.scheduler.running, *self.scheduler.waiting])
        if batch.seqs:
            self._run(batch, started, outputs)
        return batch

    def _overlapped_step(self, started: float, outputs: list[RequestOutput]) -> ScheduledBatch:
        """Launch the next step behind the one in flight, then record the one in flight; or, when the next step
        cannot be launched so, record the one in flight and schedule as :meth:`_step` does (launching the step
        rather than running it when its sequences allow)."""
        launched = self._launched
        if launched is not None:
            queued = self._schedule_behind(launched, started)
            if queued is not None:
                self._launch(queued, launched)
                self._land(launched, outputs, queued)
                return queued
            self._launched = None
            self._land(launched, outputs)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return batch
        co_samples = self._co_samples(batch, started)
        if not co_samples and all(overlappable(seq) for seq in batch.seqs):
            self._launch(batch)
        else:
            self._run(batch, started, outputs, co_samples)
        return batch

    def _schedule_behind(self, launched: LaunchedStep, started: float) -> ScheduledBatch | None:
        """The step to launch behind ``launched``: its sequences but those it takes to ``max_tokens``, the other
        running ones and newcomers, all :func:`overlappable`; ``None`` when the engine must take ``launched``
        back first (a sequence that cannot overlap is running or first in line for a free slot, or the KV
        blocks run short)."""
        scheduler = self.scheduler
        in_flight = launched.computed_to
        if any(seq.seq_id not in in_flight and not overlappable(seq) for seq in scheduler.running):
            return None
        if scheduler.can_admit() and not overlappable(scheduler.waiting[0]):
            return None
        row_of = launched.row_of
        ending = {seq.seq_id for seq in launched.batch.seqs
                  if seq.seq_id in row_of and seq.num_generated_tokens >= seq.params.max_tokens}
        batch = scheduler.schedule_behind(ending, overlappable)
        if batch is not None:
            for seq in batch.seqs:
                if seq.seq_id not in in_flight:  # (a newcomer: its request leaves the queue now)
                    self._requests[seq.request_id].mark_scheduled(started)
        return batch

    def _launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> None:
        """Queue ``batch`` on the device (its drawn inputs from ``previous``'s tokens there) and hold a
        placeholder for each sampled sequence's token; a failure ends the requests of both steps."""
        try:
            launched = self.runner.launch(batch, self._record_event, previous)
        except Exception as exc:
            self._launched = None
            raise self._step_failed(self._merged(batch, previous), exc) from exc
        self.scheduler.advance(batch)
        computed_to, row_of = launched.computed_to, launched.row_of
        for seq in batch.seqs:
            computed_to[seq.seq_id] = seq.num_computed_tokens
            if seq.seq_id in row_of:
                seq.token_ids.append(PLACEHOLDER)
        self._launched = launched

    def _land(self, launched: LaunchedStep, outputs: list[RequestOutput], queued: ScheduledBatch | None = None) -> None:
        """Wait for a launched step's tokens (``queued``, launched after it, runs on) and record them in place of
        their placeholders, as :meth:`_apply` records a step's; a failure ends the requests of both steps."""
        try:
            result = self.runner.finish(launched)
            now = time.monotonic()
            self._num_computed_tokens += launched.batch.num_tokens
            computed_to, commit = launched.computed_to, self.block_manager.commit
            if launched.batch.num_prefill_tokens:  # (only a prompt chunk is not sampled)
                for seq in launched.batch.seqs:
                    if not seq.is_finished and seq.seq_id not in launched.row_of:
                        commit(seq, computed_to[seq.seq_id])  # a prompt chunk: the blocks it filled, as update does
            for sampled in result.sampled:
                seq = sampled.seq
                if seq.is_finished:
                    continue  # aborted while in flight
                at = computed_to[seq.seq_id]
                commit(seq, at)  # the blocks its known tokens filled
                later = seq.token_ids[at + 1:]  # the placeholder of the step queued behind, if any
                del seq.token_ids[at:]
                self._record(sampled, now, outputs)
                if not seq.is_finished:
                    seq.token_ids += later
        except Exception as exc:
            self._launched = None
            error = self._step_failed(self._merged(launched.batch, queued), exc)
            if isinstance(exc, WorkerError) and not error.shut_down:
                raise
            raise error from exc

    @staticmethod
    def _merged(batch: ScheduledBatch, other: ScheduledBatch | LaunchedStep | None) -> ScheduledBatch:
        """One batch of the sequences of ``batch`` and ``other`` (two steps failing together)."""
        if isinstance(other, LaunchedStep):
            other = other.batch
        if other is None:
            return batch
        return ScheduledBatch([*batch.seqs, *other.seqs], [*batch.num_new_tokens, *other.num_new_tokens])

    def _pipelined_step(self, started: float, outputs: list[RequestOutput]) -> ScheduledBatch:
        """Send a new batch down the pipeline if one can be formed; take back the oldest when enough are out.

        A sequence in a batch still in flight is not scheduled again (nor
        preempted) until that batch is back: its tokens are not known yet.
        """
        busy = {seq.seq_id for batch, _ in self._in_flight for seq in batch.seqs}
        batch = self.scheduler.schedule(busy=busy, max_seqs=self._batch_seqs)
        if batch.seqs:
            self._submit(batch, started)
        if self._in_flight and (len(self._in_flight) >= self.pipeline_batches or not batch.seqs):
            done, pending = self._in_flight.popleft()
            result = self._in_pipeline(done, lambda: self.runner.collect(pending))
            self._apply(done, result, None, outputs)
        return batch

    def _submit(self, batch: ScheduledBatch, started: float) -> None:
        pending = self._in_pipeline(batch, lambda: self.runner.submit(batch, self._co_samples(batch, started)))
        self._in_flight.append((batch, pending))

    def _in_pipeline(self, batch: ScheduledBatch, call: Callable[[], Any]) -> Any:
        """``call()`` (sending ``batch`` into the pipeline or collecting it), its failure ending ``batch``: a lost
        rank ends every batch in flight with it."""
        try:
            return call()
        except WorkerError as exc:
            error = self._pipeline_broke(batch, exc)
            if error is exc:
                raise
            raise error from exc
        except Exception as exc:
            raise self._step_failed(batch, exc) from exc

    def _pipeline_broke(self, batch: ScheduledBatch, exc: WorkerError) -> Exception:
        """A rank is gone: every batch in flight fails with the one at hand."""
        merged = ScheduledBatch([], [])
        for done, _ in self._in_flight:
            merged.seqs += done.seqs
            merged.num_new_tokens += done.num_new_tokens
        self._in_flight.clear()
        merged.seqs += batch.seqs
        merged.num_new_tokens += batch.num_new_tokens
        error = self._step_failed(merged, exc)
        return error if error.shut_down else exc

    def _co_samples(self, batch: ScheduledBatch, started: float) -> dict[int, list[Any]]:
        co_samples = {}
        for seq in batch.seqs:
            group = self._requests[seq.request_id]
            group.mark_scheduled(started)
            if drawing := group.co_samples(seq):
                co_samples[seq.seq_id] = drawing
        return co_samples

    def _run(self, batch: ScheduledBatch, started: float, outputs: list[RequestOutput],
             co_samples: dict[int, list[Any]] | None = None) -> None:
        if co_samples is None:
            co_samples = self._co_samples(batch, started)
        speculator = self.speculator
        drafts = {seq.seq_id: speculator.drafts_of(seq) for seq in batch.seqs
                  if speculator.num_drafts(seq)} if speculator is not None else None
        try:
            result = self.runner.execute(batch, co_samples, drafts)
        except WorkerError as exc:  # a tensor-parallel rank is gone: no later step can run either
            error = self._step_failed(batch, exc)
            if error.shut_down:
                raise error from exc
            raise
        except Exception as exc:
            raise self._step_failed(batch, exc) from exc
        self._apply(batch, result, drafts, outputs)

    def _apply(self, batch: ScheduledBatch, result: Any, drafts: Any, outputs: list[RequestOutput]) -> None:
        """Record a step's computed tokens, its prompt logprobs and its drawn tokens."""
        speculator = self.speculator
        try:
            now = time.monotonic()
            self._num_computed_tokens += batch.num_tokens
            carried = speculator.settle(batch) if speculator is not None else {}
            self.scheduler.update(batch)
            for scored in result.prompt_logprobs:
                if not scored.seq.is_finished:  # (aborted while its step was in the pipeline)
                    self._requests[scored.seq.request_id].add_prompt_logprobs(scored.first, scored.logprobs)
            kept: dict[int, int] = {}
            for sampled in result.sampled:
                if sampled.seq.is_finished:
                    continue  # a stop among a sequence's kept drafts ended it: the tokens after it are dropped
                kept[sampled.seq.seq_id] = kept.get(sampled.seq.seq_id, 0) + 1
                self._record(sampled, now, outputs)
                if sampled.seq.is_finished and speculator is not None:
                    speculator.forget(sampled.seq)
            for seq in batch.seqs:
                if seq.seq_id in carried:
                    speculator.keep(seq, carried[seq.seq_id], kept.get(seq.seq_id, 1) - 1)  # type: ignore[union-attr]
        except WorkerError as exc:  # a tensor-parallel rank is gone: no later step can run either
            error = self._step_failed(batch, exc)
            if error.shut_down:
                raise error from exc
            raise
        except Exception as exc:
            raise self._step_failed(batch, exc) from exc

    def _record(self, sampled: SampledToken, now: float, outputs: list[RequestOutput]) -> None:
        """Hand a drawn token to its request's samples and add the sample's new output."""
        group = self._requests[sampled.seq.request_id]
        self._num_generated_tokens += 1
        output = group.add_token(sampled.seq, sampled.token_id, sampled.logprobs, now, self.scheduler)
        if output is None:  # a final-only request's sample goes on
            return
        if not output.finished:
            outputs.append(output)
            return
        if group.finished:
            del self._requests[group.request_id]
            self._num_finished += 1
        self._finished(output, outputs)

    def _finished(self, output: RequestOutput, outputs: list[RequestOutput]) -> None:
        outputs.append(output)
        self.runtime.plugins.request_finished(output)

    # ------------------------------------------------------------------ failed steps

    def _step_failed(self, batch: ScheduledBatch, exc: Exception) -> EngineStepError:
        """End the failed step's requests with the error, then recover or shut down (``scheduler.on_step_error``)."""
        step = self._num_steps + 1
        if self.speculator is not None:
            self.speculator.settle(batch)  # drafts come off before the requests end
        cause, plugin, hook, layer = describe_failure(exc)
        error = f"step {step} failed: {cause}"
        request_ids = list(dict.fromkeys(seq.request_id for seq in batch.seqs))
        outputs = [o for request_id in request_ids for o in self._end(request_id, error)]
        shut_down = self.on_step_error == "shutdown"
        if shut_down:
            for request_id in list(self._requests):
                outputs += self._end(request_id, f"the engine shut down after {error}")
            self._shut_down_by = error
            try:
                self.close()
            except Exception as close_exc:  # noqa: BLE001 - the step's failure is the one to report
                log.error("closing the engine after a failed step also failed: %s", close_exc)
            then = "the engine shut down (scheduler.on_step_error=shutdown); start a new one"
        else:
            then = ("the engine serves on (scheduler.on_step_error=recover); their final outputs come with the "
                    "next step")
        log.error("%s; %d request(s) ended%s", error, len(request_ids), "; engine closed" if shut_down else "")
        return EngineStepError(f"{error}; its {len(request_ids)} request(s) ended with this error and {then}",
                               outputs=outputs, plugin=plugin, hook=hook, layer=layer, shut_down=shut_down)

    # ------------------------------------------------------------------ facts and lifecycle

    def stats(self) -> dict[str, Any]:
        """Counters of the KV cache, the queues and the work done so far, and the limits requests meet.

        ``max_num_seqs``: sequences (samples) that run side by side;
        ``max_request_tokens``: the most tokens, prompt and output together,
        one request may reach (``model.max_model_len``, or less when the KV
        cache holds fewer).
        """
        bm, sched = self.block_manager, self.scheduler
        return {
            "kv_blocks_total": bm.num_blocks, "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_cached": bm.num_cached_blocks, "block_size": bm.block_size,
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions, "prefix_cache_hit_tokens": sched.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": sched.prefix_cache_query_tokens, "num_steps": self._num_steps,
            "num_requests_finished": self._num_finished, "num_generated_tokens": self._num_generated_tokens,
            "num_computed_tokens": self._num_computed_tokens, "max_model_len": self.max_model_len,
            **(self.speculator.stats if self.speculator is not None else SpeculationStats()).as_dict(),
            "max_num_seqs": sched.max_num_seqs, "max_request_tokens": self.intake.max_request_tokens,
        }

    def _check_open(self) -> None:
        if self._closed:
            why = f" after {self._shut_down_by}" if self._shut_down_by else ""
            raise KunlunInferError(f"the engine is closed{why}; create a new one")

    def close(self) -> None:
        """Abort what is left, free the KV cache and, if the engine made it, close the runtime. Idempotent."""
        if self._closed:
            return
        for request_id in list(self._requests):
            self.abort(request_id)
        self._aborted_outputs.clear()
        try:
            self.runtime.plugins.engine_stop(self.stats())
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        runner = getattr(self, "runner", None)
        structured = getattr(self, "structured", None)
        draft = getattr(self, "_draft", None)
        if draft is not None:
            draft.close()
        try:
            if structured is not None:
                structured.close()
        except Exception as exc:  # noqa: BLE001 - freeing the cache and the runtime matters more
            log.error("closing the structured-output processor failed: %s", exc)
        try:
            if runner is not None:
                if getattr(self, "_in_flight", None):
                    self._in_flight.clear()
                    runner.drain()  # the stages finish what they were given before they are stopped
                if getattr(self, "_launched", None) is not None:
                    self._launched = None
                    self.runtime.device.synchronize()  # no kernel of it still writes the cache freed next
                runner.release_kv_cache()
        finally:
            self._closed = True
            try:
                if self.parallel is not None:
                    self.parallel.close()
            finally:
                if self._owns_runtime:
                    self.runtime.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
