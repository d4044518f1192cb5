"""Speculative decoding: guess a few tokens cheaply, check them all in one forward pass of the model.

Before a step, the :class:`Speculator` asks its proposer for up to
``speculative.num_tokens`` draft tokens for each decoding sequence that can
use them and appends them to the sequence, so the scheduler, the block
manager and the model runner see an ordinary chunk: the last sampled token
and the drafts go through the model together, through the paged cache, and
the runner keeps the logits of every position of the chunk.
:func:`~kunlun_infer.engine.rejection.verify` then walks the drafts: greedy rows keep each draft that is the argmax and
take the argmax where the first one is not, so the text is exactly what
one-token-at-a-time decoding writes; sampled rows accept draft ``x`` with
probability ``min(1, p(x) / q(x))`` and, at the first rejection, draw from
the leftover ``max(p - q, 0)`` (rejection sampling: every token is still a
draw from the target distribution ``p``). Either way one more token than the
drafts accepted comes out. Rejected drafts are taken off the sequence; the
KV blocks only they used go back to the free queue (:meth:`Speculator.settle`).

Proposers: ``ngram`` (prompt lookup) finds the sequence's last few tokens
earlier in its own text and proposes what followed them there — no extra
model, and strong on text that repeats (code edits, extraction, JSON).
``draft`` runs a small model that shares the tokenizer
(:mod:`kunlun_infer.engine.draft_model`).

Sequences whose next token depends on more than its raw logits — penalties,
``min_tokens``, ``logit_bias``, structured output — decode one token at a time,
beside the speculated ones in the same batch.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from kunlun_infer.engine.draft_model import DraftModelProposer
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sequence import Sequence, SequenceStatus
from kunlun_infer.errors import ConfigError


class Proposer(Protocol):
    """Guesses what a sequence writes next."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ``num_tokens[i]`` draft tokens for ``seqs[i]``, and the draft distribution each was drawn from.

        The distribution (``[len(drafts), vocab]``) is ``None`` when the drafts
        are certain guesses (a point mass on each), as prompt lookup's are.
        """

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished or lost its KV blocks: drop what the proposer keeps for it."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    Tries ``n = max_n`` down to ``min_n``; the first (longest) match wins.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        return [(self._lookup(seq.token_ids, k), None) for seq, k in zip(seqs, num_tokens)]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        # searched as bytes (4 per token), so the scan runs at memory speed rather than token by token
        data = array.array("I", tokens).tobytes()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = data[-4 * n:]
            # the latest earlier occurrence: it must end before the last token, so that something follows it
            end = 4 * (len(tokens) - 1)
            at = data.rfind(tail, 0, end)
            while at >= 0 and at % 4:  # a match across token boundaries: look further back
                at = data.rfind(tail, 0, at + 4 * n - 1)
            if at >= 0:
                start = at // 4 + n
                return tokens[start:start + k]
        return []

    def forget(self, seq: Sequence) -> None:
        pass


def speculates(params: SamplingParams) -> bool:
    """Whether a request's tokens can be checked in bulk: its next token depends on its raw logits alone."""
    return params.structured is None and not params.has_penalties and params.min_tokens == 0 and not params.logit_bias


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """What sizes the KV cache when a draft model's cache shares its blocks: bytes of one block in both."""

    block_size: int
    bytes_per_block: int


@dataclasses.dataclass
class SpeculationStats:
    """Counters of one engine's speculation."""

    #: sequence-steps that checked drafts
    verifications: int = 0
    #: draft tokens checked, and kept
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_verifications": self.verifications, "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            # tokens a checked sequence gained per step (1 without speculation)
            "spec_tokens_per_step": (self.accepted + self.verifications) / self.verifications
            if self.verifications else 0.0,
        }


class Speculator:
    """Puts drafts on the sequences before a step and takes the rejected ones off after it."""

    def __init__(self, proposer: Proposer, *, num_tokens: int, max_model_len: int, block_manager: Any) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.stats = SpeculationStats()
        #: sequences carrying drafts this step -> how many
        self._drafts: dict[int, int] = {}
        self._draft_probs: dict[int, torch.Tensor | None] = {}

    # ------------------------------------------------------------------ before the step

    def propose(self, running: Seq[Sequence]) -> None:
        """Append drafts to every running sequence that decodes next and may speculate."""
        seqs, counts = [], []
        for seq in running:
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1 \
                    or seq.num_generated_tokens < 1 or not speculates(seq.params):
                continue
            # a step keeps at most drafts + 1 tokens: stay within max_tokens and the model's length
            room = min(self.num_tokens, seq.params.max_tokens - seq.num_generated_tokens - 1,
                       self.max_model_len - len(seq) - 1)
            # the drafts' KV slots are reserved now: a draft model writes there while it drafts
            while room > 0 and not self.block_manager.can_allocate(seq, 1 + room):
                room -= 1
            if room > 0:
                self.block_manager.allocate(seq, 1 + room)
                seqs.append(seq)
                counts.append(room)
        if not seqs:
            return
        for seq, (drafts, probs) in zip(seqs, self.proposer.propose(seqs, counts)):
            if drafts:
                seq.token_ids.extend(drafts)
                self._drafts[seq.seq_id] = len(drafts)
                self._draft_probs[seq.seq_id] = probs
            self.block_manager.trim(seq, len(seq))  # slots no draft came for

    def fit(self, batch: Any, seqs: Seq[Sequence]) -> None:
        """After scheduling: a sequence that does not run all its drafts this step keeps only those it runs."""
        scheduled = {seq.seq_id: n for seq, n in zip(batch.seqs, batch.num_new_tokens)}
        for seq in seqs:
            d = self._drafts.get(seq.seq_id)
            if not d:
                continue
            n = scheduled.get(seq.seq_id, 0)
            real = seq.num_uncomputed_tokens - d if seq.status is SequenceStatus.RUNNING else 0
            keep = max(0, min(d, n - real)) if seq.status is SequenceStatus.RUNNING else 0
            if keep < d:
                self._take_back(seq, d - keep)
                if keep:
                    self._drafts[seq.seq_id] = keep
                    probs = self._draft_probs.get(seq.seq_id)
                    self._draft_probs[seq.seq_id] = probs[:keep] if probs is not None else None

    def drafts_of(self, seq: Sequence) -> tuple[list[int], torch.Tensor | None]:
        """The drafts ``seq`` carries this step (at the end of its tokens) and their distribution."""
        d = self._drafts.get(seq.seq_id, 0)
        return (seq.token_ids[len(seq.token_ids) - d:] if d else []), self._draft_probs.get(seq.seq_id)

    def num_drafts(self, seq: Sequence) -> int:
        return self._drafts.get(seq.seq_id, 0)

    # ------------------------------------------------------------------ after the step

    def settle(self, batch: Any) -> dict[int, int]:
        """Take every draft off its sequence before the step is recorded; ``{seq_id: drafts it carried}``.

        The batch then counts each such sequence's real tokens only, so the
        scheduler commits (and prefix-caches) real tokens only; the engine
        appends the kept tokens and calls :meth:`keep`.
        """
        carried = {}
        for i, seq in enumerate(batch.seqs):
            d = self._drafts.pop(seq.seq_id, 0)
            self._draft_probs.pop(seq.seq_id, None)
            if d:
                del seq.token_ids[len(seq.token_ids) - d:]
                batch.num_new_tokens[i] -= d
                carried[seq.seq_id] = d
        for seq_id in list(self._drafts):  # sequences that were not in the batch carry none by now
            self._drafts.pop(seq_id)
            self._draft_probs.pop(seq_id, None)
        return carried

    def keep(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """``seq`` appended ``accepted`` of its ``drafted`` drafts (and one more token): their KV is already
        written, so they count as computed; blocks only the rejected drafts needed are freed."""
        self.stats.verifications += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        if seq.status is not SequenceStatus.RUNNING:
            return
        seq.num_computed_tokens += min(accepted, len(seq) - 1 - seq.num_computed_tokens)
        self.block_manager.commit(seq)
        self.block_manager.trim(seq, len(seq))

    def _take_back(self, seq: Sequence, count: int) -> None:
        del seq.token_ids[len(seq.token_ids) - count:]
        self._drafts[seq.seq_id] -= count
        if not self._drafts[seq.seq_id]:
            self._drafts.pop(seq.seq_id)
            self._draft_probs.pop(seq.seq_id, None)
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.trim(seq, len(seq))

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished: nothing is kept for it."""
        self._drafts.pop(seq.seq_id, None)
        self._draft_probs.pop(seq.seq_id, None)
        self.proposer.forget(seq)



def load_proposer(config: Any, *, runtime: Any, dtype: torch.dtype, max_model_len: int, block_size: int,
                  vocab_size: int, tensor_size: int, seed: int) -> Proposer | None:
    """The proposer ``speculative.method`` asks for (``None`` when speculation is off); a draft model is loaded
    (its KV cache is allocated by the engine, beside the model's, in the same blocks)."""
    if config is None or config.get("method") is None:
        return None
    if config.ngram_min > config.ngram_max:
        raise ConfigError(f"speculative.ngram_min={config.ngram_min} must be <= speculative.ngram_max="
                          f"{config.ngram_max}")
    if config.method == "ngram":
        return NgramProposer(int(config.ngram_min), int(config.ngram_max))
    if not config.get("draft_model"):
        raise ConfigError("speculative.method=draft needs speculative.draft_model=<folder of a small model that "
                          "shares the model's tokenizer>")
    if tensor_size > 1:
        raise ConfigError("speculative.method=draft runs with parallel.tensor_size=1 only; use "
                          "speculative.method=ngram with tensor parallelism")
    return DraftModelProposer.load(config.draft_model, runtime=runtime, dtype=dtype, max_model_len=max_model_len,
                                   block_size=block_size, vocab_size=vocab_size, seed=seed)
