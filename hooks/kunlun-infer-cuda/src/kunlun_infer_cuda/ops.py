"""``ops=cuda``: the whole op table in torch, with paged attention through one SDPA call per step.

``paged_attention`` gathers every sequence's K/V blocks into a padded batch
and runs ``torch.nn.functional.scaled_dot_product_attention`` once for all
sequences (prefills, chunked prefills and decodes alike) with a mask that is
causal from each sequence's own offset and hides padding; grouped-query
heads are handled by SDPA itself. The other kernels are short torch
expressions with the references' numerics. Nothing here names a device, so
the kernels also run (and are tested) on CPU tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.ops import reference
from kunlun_infer.ops.moe import grouped_fused_moe


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions.long()].to(q.dtype)  # [T, 2, D]
    cos, sin = cos_sin[:, :1], cos_sin[:, 1:]  # [T, 1, D], broadcast over heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0  # negative slots are padding
    slots = slot_mapping[keep].long()
    for cache, new in ((k_cache, key), (v_cache, value)):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, slots, new[keep].to(cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    ctx = seq_lens.long()
    batch = ctx.shape[0]
    max_q, max_ctx = int(q_lens.max()), int(ctx.max())
    blocks_needed = -(-max_ctx // block_size)
    device = q.device

    # queries: [B, max_q, Hq, D], padding rows point at row 0 and are dropped at the end
    q_pos = torch.arange(max_q, device=device)
    q_valid = q_pos.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
    q_rows = torch.where(q_valid, starts.unsqueeze(1) + q_pos, 0)
    q_batch = q[q_rows].transpose(1, 2)  # [B, Hq, max_q, D]

    # keys/values: gather each sequence's blocks, [B, Hk, max_ctx, D]
    tables = block_tables[:, :blocks_needed].long().clamp(0, num_blocks - 1)  # unused entries are arbitrary
    k = k_cache[tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2)

    # query j of sequence i sits at position ctx_i - q_len_i + j and sees keys 0..that position
    k_pos = torch.arange(max_ctx, device=device)
    q_abs = (ctx - q_lens).unsqueeze(1) + q_pos  # [B, max_q]
    mask = k_pos.view(1, 1, -1) <= q_abs.unsqueeze(-1)  # [B, max_q, max_ctx]
    mask = mask | ~q_valid.unsqueeze(-1)  # padding rows see everything: no NaN, dropped anyway
    out = F.scaled_dot_product_attention(q_batch, k, v, attn_mask=mask.unsqueeze(1), scale=scale,
                                         enable_gqa=q.shape[1] != k_cache.shape[2])
    return out.transpose(1, 2)[q_valid].to(q.dtype)  # [T, Hq, D] in sequence order


def fused_moe(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Tokens grouped by expert (one host sync for the counts), two matmuls per expert that has any."""
    w13, w2 = packed

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(rows, w13[expert])), w2[expert])

    return grouped_fused_moe(x, topk_weights, topk_ids, w13.shape[0], w2.shape[1], expert_mlp)


KERNELS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "pack_linear_weight": pack_linear_weight,
    "linear": linear,
    "embedding": embedding,
    "store_kv": store_kv,
    "paged_attention": paged_attention,
    # structured output: the reference's shifts and masked fill are element-wise, fast as they are on a GPU
    "apply_token_bitmask": reference.apply_token_bitmask,
    # mixture of experts: routing is a handful of element-wise ops and a top-k; the stacked weights stay as they are
    "moe_route": reference.moe_route,
    "pack_moe_weights": reference.pack_moe_weights,
    "fused_moe": fused_moe,
}


class TorchCudaOps(DictOpsProvider):
    """Every op of the table; paged attention through SDPA."""

    def __init__(self, name: str = "cuda") -> None:
        super().__init__(KERNELS, name=name)
