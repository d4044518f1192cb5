"""Rotary position embedding: a float32 cos/sin table per position, applied by ``ops.rotary_embedding``.

The table is ``[max_positions, 2, head_dim]`` (cos, sin, each already
multiplied by the scaling's attention factor) and is computed with the same
float32 operations as Hugging Face ``transformers`` so that the rotation is
bit-for-bit the same. Scalings: ``linear``, ``dynamic`` (NTK), ``yarn``,
``llama3``; ``rope_scaling=None`` is plain RoPE.

Dynamic NTK in ``transformers`` recomputes the frequencies whenever a forward
pass reaches a longer sequence than before: up to
``max_position_embeddings`` the plain frequencies are used, and beyond it the
token at position ``p`` generated one at a time is rotated with the
frequencies for a sequence of ``p + 1`` tokens. A paged KV cache keeps each
key as it was rotated when written, so that is what row ``p`` of the table
holds. (A single ``transformers`` forward over a prompt longer than
``max_position_embeddings`` instead rotates all of its tokens with the
frequencies of the full length; cached keys cannot be rotated again, so that
case is not reproduced.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kunlun_infer.layers.context import LayerContext


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _plain(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim))


def _yarn(base: float, dim: int, s: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position_embeddings / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keep the ramp finite
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of each frequency left unscaled
    return interpolated * (1 - keep) + extrapolated * keep, attention_factor


def _llama3(base: float, dim: int, s: dict[str, Any]) -> torch.Tensor:
    inv_freq = _plain(base, dim)
    factor, low_ff, high_ff = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _dynamic_ntk_base(base: float, dim: int, factor: float, seq_len, max_position_embeddings: int):
    return base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))


def rope_cos_sin_cache(head_dim: int, max_positions: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                       max_position_embeddings: int) -> torch.Tensor:
    """The ``[max_positions, 2, head_dim]`` float32 cos/sin table (built on the host)."""
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    s = rope_scaling or {}
    positions = torch.arange(max_positions, dtype=torch.int64)
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _plain(rope_theta, head_dim)
    elif rope_type == "linear":
        inv_freq = _plain(rope_theta, head_dim) / s["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(rope_theta, head_dim, s)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(rope_theta, head_dim, s, max_position_embeddings)
    elif rope_type == "dynamic":
        inv_freq = _plain(_dynamic_ntk_base(rope_theta, head_dim, s["factor"], max_position_embeddings,
                                            max_position_embeddings), head_dim)
    else:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    freqs = positions[:, None].float() * inv_freq[None, :]
    # one position at a time, as transformers computes it: batched float32 math may round differently
    for p in range(max_position_embeddings, max_positions if rope_type == "dynamic" else 0):
        base = _dynamic_ntk_base(rope_theta, head_dim, s["factor"], torch.tensor(p + 1), max_position_embeddings)
        freqs[p] = positions[p].float() * (1.0 / (base ** _exponents(head_dim)))
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos() * attention_factor, emb.sin() * attention_factor), dim=1)


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by position with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                 max_position_embeddings: int, ctx: LayerContext):
        super().__init__()
        self.ctx = ctx
        self.max_positions = max_positions
        cache = rope_cos_sin_cache(head_dim, max_positions, rope_theta, rope_scaling, max_position_embeddings)
        self.register_buffer("cos_sin_cache", cache.to(ctx.device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``q``: ``[T, Hq, D]``, ``k``: ``[T, Hk, D]`` → rotated ``(q, k)``."""
        return self.ctx.ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
