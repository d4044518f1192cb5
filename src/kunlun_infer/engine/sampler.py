"""Pick the next token of every sequence from its logits, all rows at once.

Greedy rows take the argmax. Sampled rows are divided by their temperature,
filtered by top-k and top-p (one sort shared by both filters, only when a
row asks for them) and drawn with the exponential-race trick: the argmax of
``probs / q`` with ``q ~ Exp(1)`` is a draw from ``probs``. The noise ``q``
of a row with a ``seed`` comes from that request's own generator, so its
tokens do not depend on what else is in the batch; other rows share the
engine's generator. Logprobs are those of the model's raw distribution
(``log_softmax`` of the logits, before temperature and filters).
"""

from __future__ import annotations

import dataclasses

import torch

from kunlun_infer.engine.params import SamplingParams


@dataclasses.dataclass
class SamplerOutput:
    """Host-side results: one token per row and, for rows that asked, ``{token_id: logprob}``."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


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

    def __init__(self, generator: torch.Generator) -> None:
        #: noise for rows without a seed of their own
        self.generator = generator

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        device = logits.device
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            tokens = greedy_tokens
        else:
            tokens = self._sample(logits, params, generators, device, greedy_tokens)
        return SamplerOutput(tokens.tolist(), self._logprobs(logits, tokens, params))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], device: torch.device,
                greedy_tokens: torch.Tensor) -> torch.Tensor:
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                   dtype=logits.dtype, device=device)
        scaled = logits / temperature.unsqueeze(1)
        top_k = top_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
        if top_k is not None or top_p is not None:
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None and not params[row].greedy:
                noise[row].exponential_(generator=generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, sampled)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                  params: list[SamplingParams]) -> list[dict[int, float] | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(params)
        if not rows:
            return result
        index = torch.tensor(rows, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
        width = max(params[i].logprobs for i in rows)  # type: ignore[type-var]
        top_values, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0])
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        chosen_ids = tokens.index_select(0, index).tolist()
        for j, row in enumerate(rows):
            n = params[row].logprobs
            entry = dict(zip(top_ids[j][:n], top_values[j][:n]))
            entry[chosen_ids[j]] = chosen[j]
            result[row] = entry
        return result
