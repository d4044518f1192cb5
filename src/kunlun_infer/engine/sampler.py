"""Pick the next token of every sequence from its logits, all rows at once.

First the logits are reshaped for the rows that ask: penalties over the
tokens each sequence has seen (repetition: prompt and output; presence and
frequency: output), counted with one scatter over all rows, and EOS/stop
tokens masked while a row is short of ``min_tokens``. Greedy rows take the
argmax. Sampled rows are divided by their temperature,
filtered by top-k and top-p (one sort shared by both filters, only when a
row asks for them) and drawn with the exponential-race trick: the argmax of
``probs / q`` with ``q ~ Exp(1)`` is a draw from ``probs``; ``min_p`` drops
tokens below ``min_p`` times a row's top probability just before the draw. The noise ``q``
of a row with a ``seed`` comes from that request's own generator, so its
tokens do not depend on what else is in the batch; other rows share the
engine's generator. Rows whose sequence carries a structured-output
constraint are masked after the penalties (every such row in one call of the
engine's logits processor), so only tokens their grammar allows can be drawn.
Logprobs are those of the model's raw distribution (``log_softmax`` of the
logits, before penalties, masks, temperature and filters), or with
``logprobs_mode="processed"`` of the penalized and masked logits (tokens a
mask forbids are left out of the top alternatives).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.ops.upload import upload


@dataclasses.dataclass
class SamplerOutput:
    """Host-side results: one token per row and, for rows that asked, ``{token_id: logprob}``."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class TokenHistory(Protocol):
    """What the sampler reads of a sequence: its tokens so far and which of them are the prompt."""

    token_ids: list[int]
    num_prompt_tokens: int
    #: tokens that end the sequence (masked while ``min_tokens`` is not reached)
    stop_token_ids: frozenset[int]
    #: the structured-output state (``engine.structured.Constraint``) or ``None``
    constraint: Any


def token_counts(id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[len(id_lists), vocab_size]`` float counts of each id per row, from one scatter."""
    counts = torch.zeros(len(id_lists), vocab_size, device=device)
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    total = int(lengths.sum())
    if total:
        rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths, output_size=total)
        ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
        counts.index_put_((upload(rows, device), upload(ids, device)), torch.ones(total, device=device),
                          accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, histories: Sequence[TokenHistory],
                    params: Sequence[SamplingParams]) -> torch.Tensor:
    """Logits with each row's repetition, presence and frequency penalties applied (a new tensor).

    Repetition (``transformers``' definition): a token seen in the prompt or
    the output has its logit divided by the penalty if positive, multiplied
    if negative. Presence and frequency (OpenAI's): ``logit -= presence *
    (count > 0) + frequency * count`` over the output tokens.
    """
    device, vocab = logits.device, logits.shape[-1]
    output_ids = [h.token_ids[h.num_prompt_tokens:] for h in histories]
    output_counts = token_counts(output_ids, vocab, device)
    if any(p.repetition_penalty != 1 for p in params):
        prompt_counts = token_counts([h.token_ids[:h.num_prompt_tokens] for h in histories], vocab, device)
        seen = (prompt_counts + output_counts) > 0
        penalty = upload([p.repetition_penalty for p in params], device, logits.dtype).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    presence = upload([p.presence_penalty for p in params], device, logits.dtype)
    frequency = upload([p.frequency_penalty for p in params], device, logits.dtype)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * (output_counts > 0)


def mask_stop_tokens(logits: torch.Tensor, rows: list[int], stop_ids: list[frozenset[int]]) -> torch.Tensor:
    """``logits`` with ``stop_ids[i]`` set to ``-inf`` in row ``rows[i]`` (in place)."""
    row_index = [r for r, ids in zip(rows, stop_ids) for _ in ids]
    col_index = [t for ids in stop_ids for t in ids]
    if row_index:
        logits[upload(row_index, logits.device), upload(col_index, logits.device)] = float("-inf")
    return logits


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below ``min_p`` (``[N]``) times each row's largest one (in place)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to ``-inf``.

    ``top_k``: ``[N]`` int (0 = off); ``top_p``: ``[N]`` float (1 = off).
    At least the most likely token of each row always survives.
    """
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        threshold = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Turns a ``[N, vocab]`` float32 logits tensor into tokens for N requests."""

    def __init__(self, generator: torch.Generator, structured: Any = None) -> None:
        #: noise for rows without a seed of their own
        self.generator = generator
        #: the engine's :class:`~kunlun_infer.engine.structured.StructuredOutputs` (masks constrained rows)
        self.structured = structured

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: Sequence[TokenHistory] | None = None) -> SamplerOutput:
        """``histories[i]`` (the sequence of row ``i``) is needed for penalties, ``min_tokens`` and constraints."""
        tokens, processed = self.draw(logits, params, generators, histories)
        return SamplerOutput(tokens.tolist(), self.logprobs(logits, processed, tokens, params))

    def draw(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
             histories: Sequence[TokenHistory] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn tokens, left on the logits' device (nothing waits for them), and the processed logits
        they were drawn from (``logits`` itself when nothing reshaped them)."""
        device = logits.device
        processed = self._process(logits, params, histories)
        if histories is not None and any(p.structured is not None for p in params):
            if processed is logits and any(p.logprobs is not None and p.logprobs_mode == "raw" for p in params):
                processed = logits.clone()  # the raw logits are still needed for logprobs
            if self.structured is None:
                raise ValueError("the sampler needs the engine's structured outputs to mask constrained rows")
            self.structured.apply(processed, histories)
        greedy_tokens = processed.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens, processed
        return self._sample(processed, params, generators, device, greedy_tokens), processed

    @staticmethod
    def _process(logits: torch.Tensor, params: list[SamplingParams],
                 histories: Sequence[TokenHistory] | None) -> torch.Tensor:
        """Penalties and the ``min_tokens`` mask; ``logits`` itself when no row asks for them."""
        penalized = any(p.has_penalties for p in params)
        if not penalized and not any(p.min_tokens for p in params):
            return logits
        if histories is None:
            raise ValueError("the sampler needs each row's token history for penalties and min_tokens")
        if penalized:
            logits = apply_penalties(logits, histories, params)
        short = [i for i, (p, h) in enumerate(zip(params, histories))
                 if len(h.token_ids) - h.num_prompt_tokens < p.min_tokens]
        if short:
            logits = mask_stop_tokens(logits if penalized else logits.clone(), short,
                                      [histories[i].stop_token_ids for i in short])
        return logits

    @staticmethod
    def distribution(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The probabilities a sampled row draws from: temperature, then top-k/top-p, then ``min_p``.

        Greedy rows get their softmax at temperature 1 (they are drawn by argmax).
        """
        device = logits.device
        temperature = upload([p.temperature if not p.greedy else 1.0 for p in params], device, logits.dtype)
        # a huge penalty or a tiny temperature can push logits to +inf, and softmax of inf is NaN
        scaled = (logits / temperature.unsqueeze(1)).clamp_(max=torch.finfo(logits.dtype).max)
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[-1]  # a larger top_k keeps everything (and may not fit an int64)
            top_k = upload([min(p.top_k, vocab) for p in params], device, torch.int64)
        if any(p.top_p < 1 for p in params):
            top_p = upload([p.top_p for p in params], device, logits.dtype)
        if top_k is not None or top_p is not None:
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            probs = apply_min_p(probs, upload([p.min_p for p in params], device, probs.dtype))
        return probs

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], device: torch.device,
                greedy_tokens: torch.Tensor) -> torch.Tensor:
        is_greedy = upload([p.greedy for p in params], device)
        probs = self.distribution(logits, params)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None and not params[row].greedy:
                noise[row].exponential_(generator=generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, sampled)

    @staticmethod
    def logprobs(logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor,
                 params: list[SamplingParams]) -> list[dict[int, float] | None]:
        """For each row that asks: ``{token: logprob}`` of the chosen token and the ``logprobs`` likeliest.

        From ``logits`` (``logprobs_mode="raw"``) or ``processed`` (penalized and masked) per row.
        """
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(params)
        if not rows:
            return result
        index = torch.tensor(rows, device=logits.device)
        source = logits.index_select(0, index)
        if processed is not logits:
            use_processed = [params[i].logprobs_mode == "processed" for i in rows]
            if any(use_processed):
                chosen_rows = torch.tensor(use_processed, device=logits.device).unsqueeze(1)
                source = torch.where(chosen_rows, processed.index_select(0, index), source)
        logprobs = torch.log_softmax(source, dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
        width = max(params[i].logprobs for i in rows)  # type: ignore[type-var]
        top_values, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0])
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        chosen_ids = tokens.index_select(0, index).tolist()
        for j, row in enumerate(rows):
            n = params[row].logprobs
            entry = {t: v for t, v in zip(top_ids[j][:n], top_values[j][:n]) if v != float("-inf")}
            entry[chosen_ids[j]] = chosen[j]
            result[row] = entry
        return result
