"""The simulated chip's attention kernels, shaped like a vendor library's: one head-major cache, split calls.

The chip keeps each layer's cache in ONE tensor ``(2, num_blocks,
num_kv_heads, block_size, head_dim)`` — keys at ``[0]``, values at ``[1]``,
each block head-major — as Kunlun's ``kunlun_ops`` kernels do. Like them, the
kernels take int32 slots, block tables and lengths, every length both as a
host tensor (for the launch) and a device tensor (for the kernel), keyword
arguments and an ``out`` tensor written in place; decode and prefill are
separate calls. They are written in torch (the chip is simulated) and they
check what they are given, so a call that swaps an argument, passes int64
lengths, or a cache in another layout fails instead of computing nonsense.
"""

from __future__ import annotations

import torch


def _check_int32(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {tensor.dtype}")


def _check_lengths(name: str, host: torch.Tensor, device: torch.Tensor) -> None:
    """A length tensor given twice: on the host for the launch, on the device for the kernel."""
    _check_int32(f"{name}_host", host)
    _check_int32(f"{name}_device", device)
    if host.device.type != "cpu":
        raise ValueError(f"{name}_host must be a host tensor, got one on {host.device}")
    if host.shape != device.shape or not torch.equal(host, device.cpu()):
        raise ValueError(f"{name}_host and {name}_device disagree: {host.tolist()} vs {device.tolist()}")


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[2] != num_kv_heads \
            or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be (2, num_blocks, {num_kv_heads} kv heads, block_size, {head_dim}), "
                         f"got {tuple(kv_cache.shape)}")


def reshape_and_cache(*, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hk, D]`` into their slots (int32 ``block * block_size + offset``)."""
    _check_int32("slot_mapping", slot_mapping)
    _check_cache(kv_cache, key.shape[1], key.shape[2])
    if key.shape != value.shape or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and {slot_mapping.shape[0]} slots "
                         f"do not match")
    block_size = kv_cache.shape[3]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, :, offsets] = key.to(kv_cache.dtype)  # [T, Hk, D] lands at (block, :, offset)
    kv_cache[1, blocks, :, offsets] = value.to(kv_cache.dtype)


def _gather(kv_cache: torch.Tensor, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values ``[Hk, length, D]`` from its blocks."""
    block_size = kv_cache.shape[3]
    ids = table[: -(-length // block_size)].long()
    k = kv_cache[0].index_select(0, ids).permute(1, 0, 2, 3).flatten(1, 2)[:, :length]
    v = kv_cache[1].index_select(0, ids).permute(1, 0, 2, 3).flatten(1, 2)[:, :length]
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int, scale: float) -> torch.Tensor:
    """``q`` ``[n, Hq, D]`` at positions ``first_position..`` over ``k``/``v`` ``[Hk, L, D]``, causal, float32."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hk, g, n, D]
    scores = torch.matmul(qf, k.float().unsqueeze(1).transpose(-1, -2)) * scale  # [Hk, g, n, L]
    q_pos = torch.arange(first_position, first_position + n, device=q.device).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(length, device=q.device).unsqueeze(0) > q_pos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float().unsqueeze(1))  # [Hk, g, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def paged_decode_attention(*, query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens_host: torch.Tensor, context_lens_device: torch.Tensor, scale: float,
                           out: torch.Tensor) -> None:
    """One query token per sequence ``[B, Hq, D]`` over its cached context (its own key included) → ``out``.

    ``context_lens``: tokens of each sequence in the cache, int32 host and device.
    ``block_tables``: int32 ``[B, max_blocks]``.
    """
    _check_int32("block_tables", block_tables)
    _check_lengths("context_lens", context_lens_host, context_lens_device)
    num_kv_heads = kv_cache.shape[2]
    _check_cache(kv_cache, num_kv_heads, query.shape[2])
    batch, num_heads, head_dim = query.shape
    if block_tables.shape[0] != batch or context_lens_host.shape[0] != batch or num_heads % num_kv_heads:
        raise ValueError(f"{batch} queries of {num_heads} heads, {block_tables.shape[0]} block tables, "
                         f"{context_lens_host.shape[0]} lengths and {num_kv_heads} kv heads do not match")
    block_size = kv_cache.shape[3]
    max_len = int(context_lens_host.max())
    ids = block_tables[:, : -(-max_len // block_size)].long()  # [B, nblk]
    k = kv_cache[0][ids].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :max_len]  # [B, Hk, L, D]
    v = kv_cache[1][ids].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :max_len]
    group = num_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, 1, head_dim)
    scores = torch.matmul(q, k.float().unsqueeze(2).transpose(-1, -2)).squeeze(3) * scale  # [B, Hk, g, L]
    valid = torch.arange(max_len, device=query.device).unsqueeze(0) < context_lens_device.long().unsqueeze(1)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    attended = torch.matmul(torch.softmax(scores, dim=-1).unsqueeze(3), v.float().unsqueeze(2))  # [B, Hk, g, 1, D]
    out.copy_(attended.reshape(batch, num_heads, head_dim))


def prefill_attention(*, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                      q_lod_host: torch.Tensor, q_lod_device: torch.Tensor, scale: float,
                      kv_cache: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
                      kv_lod_host: torch.Tensor | None = None, kv_lod_device: torch.Tensor | None = None) -> None:
    """Causal attention of prompt tokens laid end to end (``q_lod``: int32 cumulative offsets) → ``out``.

    Without ``kv_cache`` every sequence starts at position 0 and attends
    over its own ``key``/``value``. With it (prefix mode) sequence ``i``'s
    keys are the first ``kv_lod[i+1] - kv_lod[i]`` tokens of its blocks in
    the cache (a cached context, then this step's tokens, already stored).
    """
    _check_lengths("q_lod", q_lod_host, q_lod_device)
    starts = q_lod_host.tolist()
    if starts[0] != 0 or starts[-1] != query.shape[0] or key.shape[0] != query.shape[0]:
        raise ValueError(f"q_lod {starts} does not cover the {query.shape[0]} query tokens")
    prefix = kv_cache is not None
    if prefix:
        _check_int32("block_tables", block_tables)
        _check_lengths("kv_lod", kv_lod_host, kv_lod_device)
        _check_cache(kv_cache, key.shape[1], key.shape[2])
        kv_starts = kv_lod_host.tolist()
    for i in range(len(starts) - 1):
        start, end = starts[i], starts[i + 1]
        if prefix:
            length = kv_starts[i + 1] - kv_starts[i]
            k, v = _gather(kv_cache, block_tables[i], length)
        else:
            length = end - start
            k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
        out[start:end] = _attend(query[start:end], k, v, length - (end - start), scale).to(out.dtype)
