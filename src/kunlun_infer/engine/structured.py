"""Structured output in the engine: one logits processor, its compiled constraints, and each sequence's state.

:class:`StructuredOutputs` builds the logits processor named by
``structured.backend`` (a plugin's, see ``kunlun_infer_logits_processor_factories``)
when the first constrained request arrives, compiles each distinct
:class:`StructuredOutput` once (a small LRU cache) and gives every sample of
the request its own :class:`Constraint`. Before a step's logits are
sampled, :meth:`StructuredOutputs.apply` brings each constrained row's
state in step with its sequence's generated tokens and masks all those rows
in one call. The state follows the tokens rather than the schedule: a token
appended since the last step is accepted; tokens taken back (speculative
decoding) are rolled back; a recompute after preemption keeps the tokens
and so the state. A sample forked off an ``n > 1`` request starts from the same
compiled constraint with a state of its own.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from kunlun_infer.capabilities import ConstraintState, LogitsProcessor, LogitsProcessorContext
from kunlun_infer.engine.structured_output import StructuredOutput
from kunlun_infer.errors import KunlunInferError
from kunlun_infer.runtime.guard import guarded_call, plugin_failure

log = logging.getLogger("kunlun_infer.framework")

#: compiled constraints kept for reuse (a server sees the same few schemas again and again)
COMPILED_CACHE_SIZE = 64


class Constraint:
    """One sequence's constraint state and how many of its generated tokens the state has accepted."""

    def __init__(self, state: ConstraintState, owner: StructuredOutputs) -> None:
        self.state = state
        self.owner = owner
        self.accepted: list[int] = []

    def sync(self, token_ids: Sequence[int], start: int) -> None:
        """Accept the tokens ``token_ids[start:]`` gained since the last call; roll back ones taken back."""
        done, generated = len(self.accepted), len(token_ids) - start
        if generated < done or (done and token_ids[start + done - 1] != self.accepted[-1]):
            keep = 0
            while keep < min(done, generated) and token_ids[start + keep] == self.accepted[keep]:
                keep += 1
            self.state.rollback(done - keep)
            del self.accepted[keep:]
            done = keep
        for token in token_ids[start + done:]:
            if not self.state.accept(token):
                raise KunlunInferError(
                    f"logits processor '{self.owner.backend}' refused token {token} after {done} accepted "
                    f"tokens, though its own mask allowed it: the constraint and the tokens disagree")
            self.accepted.append(token)
            done += 1


class StructuredOutputs:
    """The engine's structured-output machinery (the processor is built lazily: it may be a heavy import)."""

    def __init__(self, *, config: Any, runtime: Any, tokenizer: Any, vocab_size: int,
                 eos_token_ids: tuple[int, ...], torch_device: torch.device) -> None:
        self.config = config
        self.runtime = runtime
        self.backend = str(config.backend)
        self.plugin = "?"
        self._context_args = dict(tokenizer=tokenizer, vocab_size=vocab_size, eos_token_ids=tuple(eos_token_ids),
                                  torch_device=torch_device)
        self.processor: LogitsProcessor | None = None
        self._compiled: collections.OrderedDict[StructuredOutput, Any] = collections.OrderedDict()
        #: a server compiles on its event-loop thread (to refuse a bad schema before answering) too
        self._lock = threading.RLock()

    def _processor(self) -> LogitsProcessor:
        if self.processor is not None:
            return self.processor
        with self._lock:
            if self.processor is not None:
                return self.processor
            self.plugin, factory = self.runtime.plugins.factory("logits_processor", self.backend)
            context = LogitsProcessorContext(config=self.config, ops=self.runtime.resolve_ops(["apply_token_bitmask"]),
                                             **self._context_args)
            self.processor = guarded_call(self.plugin, "kunlun_infer_logits_processor_factories", factory,
                                          context=context)
            log.info("structured output served by logits processor '%s' (plugin '%s')", self.backend, self.plugin)
            return self.processor

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled form of ``spec`` (cached); ``RequestError`` for one the backend cannot serve."""
        processor = self._processor()
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            compiled = guarded_call(self.plugin, "LogitsProcessor.compile", processor.compile, spec)
            self._compiled[spec] = compiled
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return compiled

    def constraints(self, spec: StructuredOutput, stop_token_ids: Sequence[frozenset[int]]) -> list[Constraint]:
        """One fresh :class:`Constraint` per sample, each ended by its own stop tokens."""
        compiled = self.compile(spec)
        processor = self._processor()
        return [Constraint(guarded_call(self.plugin, "LogitsProcessor.new_state", processor.new_state, compiled,
                                        stop_token_ids=stops), self)
                for stops in stop_token_ids]

    def apply(self, logits: torch.Tensor, targets: Sequence[Any]) -> bool:
        """Mask row ``i`` of ``logits`` (in place) by ``targets[i].constraint``, all rows in one call.

        ``targets[i]`` is the sequence sampled from row ``i``; rows without a
        constraint are left alone. Returns True when any row was masked.
        """
        rows, states = [], []
        for row, seq in enumerate(targets):
            constraint = getattr(seq, "constraint", None)
            if constraint is not None:
                try:
                    constraint.sync(seq.token_ids, seq.num_prompt_tokens)
                except Exception as exc:  # noqa: BLE001 - attributed to the plugin below
                    error = plugin_failure(exc, plugin=self.plugin, hook="ConstraintState.accept")
                    if error is exc:
                        raise
                    raise error from exc
                rows.append(row)
                states.append(constraint.state)
        if not rows:
            return False
        guarded_call(self.plugin, "LogitsProcessor.apply", self._processor().apply, logits, rows, states)
        return True

    def close(self) -> None:
        processor, self.processor = self.processor, None
        self._compiled.clear()
        if processor is not None:
            guarded_call(self.plugin, "LogitsProcessor.close", processor.close)
