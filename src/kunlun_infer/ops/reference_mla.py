"""The reference backend of multi-head latent attention (hook API 1.4): plain torch, any device.

Each layer's cache is one tensor ``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]``: per token the normalised latent followed by the rotated
shared key — ``(kv_lora_rank + qk_rope_head_dim) × dtype size`` bytes per
token and layer, against ``2 × heads × head_dim`` for per-head K/V. Attention
is the definition itself, one sequence at a time: the sequence's cached
latents are decompressed by the up-projection into per-head keys and values
and its new queries attend over them in float32. It is what serves MLA for
an ops plugin without an MLA backend of its own, and what the conformance
suite compares plugins' MLA backends with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kunlun_infer.ops.attention import MLA, AttentionSpec, CacheTensorSpec, MLAAttentionBackend
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.ops.reference_attention import AttentionMetadata, reference_metadata


def latent_cache_tensor(spec: AttentionSpec, num_blocks: int, block_size: int) -> CacheTensorSpec:
    """One layer's latent cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` in ``spec.dtype``."""
    if spec.kind != MLA:
        raise ValueError(f"a latent cache is for MLA attention, not kind {spec.kind!r}")
    return CacheTensorSpec((num_blocks, block_size, spec.kv_lora_rank + spec.qk_rope_head_dim), spec.dtype,
                           "latent")


def store_latent_rows(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``[latent, k_rope]`` of each token to its slot of a ``[blocks, block_size, r + dr]`` cache
    (negative slots are padding: not stored)."""
    rows = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    values = torch.cat([latent, k_rope], dim=-1).to(cache.dtype)
    if not bool(keep.all()):
        values, slot_mapping = values[keep], slot_mapping[keep]
    rows.index_copy_(0, slot_mapping.long(), values)


def context_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached rows of one sequence (``[length, r + dr]``), gathered through its blocks."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def decompress(rows: torch.Tensor, kv_up: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys ``[n, H, dn + dr]`` and values ``[n, H, dv]`` of cached rows ``[n, r + dr]``."""
    num_heads, dn_dv, rank = kv_up.shape
    latent, k_rope = rows.split([rank, rope_dim], dim=-1)
    kv = (latent @ kv_up.reshape(num_heads * dn_dv, rank).to(latent.dtype).t()).view(-1, num_heads, dn_dv)
    return kv, k_rope


def mla_attention_reference(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            kv_up: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal MLA of the flat batch over a latent cache, by decompressing each sequence's context.

    ``seq_lens[i]``: tokens of sequence ``i`` including its new ones (all
    stored). Returns ``[T, H, v_head_dim]`` in ``q_nope.dtype``.
    """
    num_heads, dn_dv, _ = kv_up.shape
    nope, rope = q_nope.shape[-1], q_rope.shape[-1]
    dv = dn_dv - nope
    out = q_nope.new_empty(q_nope.shape[0], num_heads, dv)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, ctx in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        rows = context_rows(cache, block_tables[i], ctx).to(torch.float32)
        kv, k_rope = decompress(rows, kv_up.to(torch.float32), rope)
        k_nope, v = kv.split([nope, dv], dim=-1)
        q_n = q_nope[start:end].to(torch.float32).transpose(0, 1)  # [H, q_len, dn]
        q_r = q_rope[start:end].to(torch.float32).transpose(0, 1)  # [H, q_len, dr]
        scores = (torch.matmul(q_n, k_nope.permute(1, 2, 0)) + torch.matmul(q_r, k_rope.t())) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q_nope.device).unsqueeze(1)
        k_pos = torch.arange(ctx, device=q_nope.device).unsqueeze(0)
        probs = torch.softmax(scores.masked_fill(k_pos > q_pos, float("-inf")), dim=-1)
        out[start:end] = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1).to(out.dtype)
    return out


class ReferenceMLABackend(MLAAttentionBackend):
    """One latent cache tensor per layer; attention by decompressing each sequence's context (plain torch)."""

    name = "reference-mla"

    def __init__(self, spec: AttentionSpec) -> None:
        if spec.kind != MLA:
            raise ValueError(f"ReferenceMLABackend serves MLA attention, not kind {spec.kind!r}")
        self.spec = spec

    def kv_cache_tensors(self, num_blocks: int, block_size: int) -> Sequence[CacheTensorSpec]:
        return (latent_cache_tensor(self.spec, num_blocks, block_size),)

    def build_metadata(self, step: AttentionStep) -> AttentionMetadata:
        return reference_metadata(step)

    def store_latent(self, latent: torch.Tensor, k_rope: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                     metadata: AttentionMetadata) -> None:
        store_latent_rows(latent, k_rope, kv_cache[0], metadata.slot_mapping)

    def attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, ...], metadata: AttentionMetadata, *, kv_up: torch.Tensor,
                      scale: float) -> torch.Tensor:
        return mla_attention_reference(q_nope, q_rope, kv_cache[0], metadata.block_tables, metadata.seq_lens,
                                       metadata.query_start_loc, kv_up, scale)
