"""The MLA attention backend of the built-in ops options ``cpu`` and ``torch``: absorbed decode, SDPA prefill.

The cache is the reference layout (one ``[blocks, block_size, kv_lora_rank
+ qk_rope_head_dim]`` tensor per layer). Decode tokens of the whole batch
never decompress the cache: the key half of the up-projection is folded into
each query (``q_nope @ W_UK`` gives a query over the latent), so one
attention per step reads each cached row once, in place of per-head keys
and values — all heads of a sequence as rows of one matrix product with its
single latent "head", the latent itself serving as the value — and the
value half is applied to the attended latent afterwards
(``@ W_UV``), as DeepSeek does. Prompts and prompt chunks, where the
queries outnumber what decompression costs, decompress their sequence's
context with one matrix product and run one causal SDPA each. Low precision
is attended in float32, like the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kunlun_infer.ops.attention import MLA, AttentionSpec
from kunlun_infer.ops.reference_attention import AttentionMetadata
from kunlun_infer.ops.reference_mla import ReferenceMLABackend, context_rows, decompress


def absorbed_decode(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, kv_up: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence (``[B, H, dn]``, ``[B, H, dr]``) over a latent cache → ``[B, H, dv]`` float32."""
    batch, num_heads, nope = q_nope.shape
    rank = kv_up.shape[-1]
    w = kv_up.to(torch.float32)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, dn, r], [H, dv, r]
    q_latent = torch.bmm(q_nope.to(torch.float32).transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, r]
    query = torch.cat([q_latent, q_rope.to(torch.float32)], dim=-1)  # [B, H, r + dr]
    block_size = cache.shape[1]
    max_len = int(seq_lens.max())
    # entries past a sequence's own blocks may hold anything: clamp them into range, the mask hides them
    ids = block_tables[:, : -(-max_len // block_size)].long().clamp(0, cache.shape[0] - 1)
    rows = cache.index_select(0, ids.reshape(-1)).view(batch, -1, cache.shape[-1])[:, :max_len]
    rows = rows.to(torch.float32)  # [B, L, r + dr]
    # every head of a sequence against its one latent "head": two batched matrix products, no per-head copy
    scores = torch.bmm(query, rows.transpose(1, 2)).mul_(scale)  # [B, H, L]
    beyond = torch.arange(max_len, device=q_nope.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    probs = torch.softmax(scores.masked_fill_(beyond.unsqueeze(1), float("-inf")), dim=-1)
    latent_out = torch.bmm(probs, rows[..., :rank])  # [B, H, r]
    return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, dv]


def decompressed_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                         ctx: int, kv_up: torch.Tensor, scale: float) -> torch.Tensor:
    """The new tokens of one sequence with ``ctx`` tokens of context → ``[Lq, H, dv]`` float32."""
    nope, rope = q_nope.shape[-1], q_rope.shape[-1]
    kv, k_rope = decompress(context_rows(cache, table, ctx).to(torch.float32), kv_up.to(torch.float32), rope)
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    key = torch.cat([k_nope, k_rope.unsqueeze(1).expand(-1, k_nope.shape[1], -1)], dim=-1)  # [ctx, H, dn + dr]
    query = torch.cat([q_nope, q_rope], dim=-1).to(torch.float32)
    q_len = query.shape[0]
    q_pos = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
    mask = torch.arange(ctx, device=query.device).unsqueeze(0) <= q_pos  # bottom-right causal
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class TorchMLABackend(ReferenceMLABackend):
    """Latent cache of the reference layout; absorbed decode for the batch, decompressed SDPA per prompt."""

    name = "torch-mla"

    def attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, ...], metadata: AttentionMetadata, *, kv_up: torch.Tensor,
                      scale: float) -> torch.Tensor:
        cache = kv_cache[0]
        num_heads, dn_dv, _ = kv_up.shape
        out = q_nope.new_empty(q_nope.shape[0], num_heads, dn_dv - q_nope.shape[-1])
        qsl = metadata.query_start_loc.tolist()
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        if metadata.is_decode_only:
            return absorbed_decode(q_nope, q_rope, cache, metadata.block_tables, metadata.seq_lens, kv_up,
                                   scale).to(out.dtype)
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        if decode:
            rows = torch.tensor([qsl[i] for i in decode], device=q_nope.device)
            idx = torch.tensor(decode, device=q_nope.device)
            out[rows] = absorbed_decode(q_nope[rows], q_rope[rows], cache, metadata.block_tables[idx],
                                        metadata.seq_lens[idx], kv_up, scale).to(out.dtype)
        lens = metadata.seq_lens.tolist()
        for i, n in enumerate(q_lens):
            if n > 1:
                start = qsl[i]
                out[start:start + n] = decompressed_prefill(q_nope[start:start + n], q_rope[start:start + n], cache,
                                                            metadata.block_tables[i], lens[i], kv_up,
                                                            scale).to(out.dtype)
        return out


def torch_mla_backend(spec: AttentionSpec) -> TorchMLABackend | None:
    """The backend for an MLA ``spec``; ``None`` for other kinds (MHA keeps the reference backend on the table)."""
    return TorchMLABackend(spec) if spec.kind == MLA else None
