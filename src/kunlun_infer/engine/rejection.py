"""Checking drafts against the model's own distribution: which drafted tokens a sequence keeps.

See :mod:`kunlun_infer.engine.speculative` for where drafts come from and
how a step carries them.
"""

from __future__ import annotations

from typing import Any

import torch

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sampler import draw_row


def verify(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None, sampler: Any) -> list[int]:
    """The tokens a sequence keeps from ``len(drafts) + 1`` positions' logits (``[d + 1, vocab]``).

    Greedy: the drafts that are the argmax, then the argmax. Sampled:
    rejection sampling against the target distribution (the sampler's own,
    temperature and filters included), then a draw from the leftover or,
    when every draft was kept, from the last position.
    """
    d = len(drafts)
    if params.greedy:
        targets = sampler.greedy(logits).tolist()
        kept = 0
        while kept < d and drafts[kept] == targets[kept]:
            kept += 1
        return drafts[:kept] + [targets[kept]]
    probs = sampler.distribution(logits, [params] * (d + 1))
    generator = generator if generator is not None else sampler.generator
    uniforms = torch.rand(d, generator=generator, device=logits.device).tolist() if d else []
    for j, token in enumerate(drafts):
        q = float(draft_probs[j, token]) if draft_probs is not None else 1.0
        p = float(probs[j, token])
        if uniforms[j] * q <= p and p > 0:  # kept with probability min(1, p / q)
            continue
        leftover = probs[j] - (draft_probs[j] if draft_probs is not None else _point_mass(probs[j], token))
        leftover = leftover.clamp_(min=0)
        if float(leftover.sum()) <= 0:
            leftover = probs[j]
        return drafts[:j] + [draw_row(leftover, generator)]
    return drafts + [draw_row(probs[d], generator)]


def _point_mass(row: torch.Tensor, token: int) -> torch.Tensor:
    mass = torch.zeros_like(row)
    mass[token] = 1.0
    return mass

