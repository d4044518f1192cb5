"""``paged_attention`` for the host CPU: decode and prompts straight from the paged cache, in native kernels.

Decode tokens of the whole batch go to the C kernel of
``native/paged_decode_attention.c``, which reads each cached key and value
once, in place, through the block tables (no gathered copy), for all query
heads sharing a KV head, in float32. The new tokens of the other sequences
(prompts, prompt chunks after a cached prefix, speculative drafts) go, all
in one call, to ``native/paged_prefill_attention.c``: blocks of queries
against blocks of keys as two small GEMMs with an online softmax, so each
cached key and value is read once per block of queries. Measured in turns
(``benchmarks/prompt_attention.py``; 2-core AMD EPYC Zen 4, 14 query heads
over 2 KV heads, head size 64) at 64-2048 tokens: 1.1-2.5x faster with
AVX-512 and 1.1-2.6x with AVX2 than running each prompt row as a decode
query (what served prompts of up to 512 tokens before), 1.5-4.1x and
1.3-2.4x faster than torch's SDPA (what served longer ones); a 16-token
prompt takes 7-12 us more per layer than as rows.
Where the OS grants the AMX tiles, bf16 prompts multiply on them
(:func:`prompts_on_tiles`): on the Xeon with AMX, 2.0-4.6x faster at
64-2048 tokens than on VDPBF16PS, and 1.5-3.6x faster than torch's SDPA,
whose flash attention multiplies on the tiles too and which took long bf16
prompts there before (a bf16 prefill of the 0.5B model in the engine, in
turns against that: 1.04x at 256 tokens, 1.10x at 1024, 1.23x at 2048).
bf16 decode rows multiply there as well where a KV head has enough query
heads for the tiles to win (:func:`decode_on_tiles`: 6 or more; a head
size that is a multiple of 32): a
decode step's attention 0.71-0.75x the time at 8 x 1024 and 32 x 1024
tokens.
Without the native kernels (no library, fp16, head size not a multiple of
16) decode rows run as one SDPA over their block-gathered K/V (``index_select``
of the blocks in use) in the cache's dtype — the CPU SDPA kernel accumulates
low precision in float32 itself — with the ``Hq / Hk`` query heads of a KV
head folded into the query-length axis, so K/V are never repeated per query
head; and each prompt runs one SDPA: plain causal without a cached prefix,
bottom-right causal mask with one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kunlun_infer.plugins import cpu_native


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Blocks ``block_ids`` (``[rows, n]``) of a ``[blocks, bs, Hk, D]`` cache as ``[rows, Hk, n*bs, D]``."""
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(rows, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def _native_library(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Any:
    """The native kernels if both attention kernels apply to these tensors (dtype, head size, layout), else
    ``None``."""
    dtype = k_cache.dtype
    lib = cpu_native.library()
    if (lib is None or dtype not in (torch.bfloat16, torch.float32) or v_cache.dtype != dtype
            or q.shape[-1] % 16 or q.shape[-1] != k_cache.shape[-1] or k_cache.shape != v_cache.shape
            or q.shape[1] % k_cache.shape[2] or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return None
    return lib


def native_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Decode attention by ``native/paged_decode_attention.c``, reading K/V in place through the block
    tables; ``None`` when that kernel does not apply (library, dtype or head size)."""
    dtype = k_cache.dtype
    lib = _native_library(q, k_cache, v_cache)
    if lib is None:
        return None
    batch, num_q_heads, head_dim = q.shape
    query = q.to(dtype).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    status = lib.kunlun_paged_decode_attention(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), out.data_ptr(), batch, num_q_heads, k_cache.shape[2], head_dim,
        k_cache.shape[1], scale, dtype is torch.bfloat16)
    if status == -2:
        raise IndexError(f"paged_attention: a sequence's context ({seq_lens.tolist()}) reaches past its block table "
                         f"or a block id is outside the cache's {k_cache.shape[0]} blocks")
    if status != 0:
        raise MemoryError(f"paged decode attention could not allocate its scratch for {batch} sequences")
    return out


def prompts_on_tiles(dtype: torch.dtype, head_size: int) -> bool:
    """Whether the native prompt kernel multiplies prompts of this dtype and head size on the AMX tiles here (the
    kernels decide: bf16, a head size that is a multiple of 32, the ``amx`` set, the OS's grant of the tile state)."""
    lib = cpu_native.selection().library
    return lib is not None and bool(lib.kunlun_prompt_attention_on_tiles(dtype is torch.bfloat16, head_size))


def decode_on_tiles(dtype: torch.dtype, head_size: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether the native decode kernel multiplies decode rows of this dtype, head size and heads on the AMX tiles here
    (bf16, a head size that is a multiple of 32, enough query heads a KV head for the tiles to win, the ``amx`` set,
    the OS's grant of the tile state; the kernel decides, see ``kunlun_decode_attention_on_tiles``)."""
    lib = cpu_native.selection().library
    return lib is not None and bool(lib.kunlun_decode_attention_on_tiles(dtype is torch.bfloat16, head_size,
                                                                         num_q_heads, num_kv_heads))


def native_prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, q_starts: list[int], q_lens: list[int],
                            out: torch.Tensor, scale: float) -> bool:
    """The rows ``q_starts[i] .. + q_lens[i]`` of ``q`` (``[T, Hq, D]``, in the cache's dtype, contiguous) of the
    sequences whose tables and context lengths are given, written into the same rows of ``out`` by
    ``native/paged_prefill_attention.c`` (K/V read in place, once per block of queries); ``False``, having done
    nothing, when that kernel does not apply."""
    lib = _native_library(q, k_cache, v_cache)
    if lib is None:
        return False
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = torch.tensor(q_starts, dtype=torch.int32)
    counts = torch.tensor(q_lens, dtype=torch.int32)
    status = lib.kunlun_paged_prefill_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), starts.data_ptr(), counts.data_ptr(), out.data_ptr(), len(q_lens), q.shape[1],
        k_cache.shape[2], q.shape[2], k_cache.shape[1], scale, k_cache.dtype is torch.bfloat16)
    if status == -2:
        raise IndexError(f"paged_attention: a sequence's context ({seq_lens.tolist()}) is shorter than its new tokens "
                         f"({q_lens}), reaches past its block table, or a block id is outside the cache's "
                         f"{k_cache.shape[0]} blocks")
    if status != 0:
        raise MemoryError(f"paged prompt attention could not allocate its scratch for {len(q_lens)} sequences")
    return True


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """One query token per sequence: ``q`` ``[B, Hq, D]`` → ``[B, Hq, D]``, without copying K/V where the
    native kernel applies, else one SDPA for the batch over block-gathered K/V."""
    native = native_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if native is not None:
        return native
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_blocks = -(-max_len // block_size)
    # entries past a sequence's own blocks may hold anything: clamp them into range, the mask hides them
    ids = block_tables[:, :num_blocks].long().clamp_(0, k_cache.shape[0] - 1)
    k = _gather(k_cache, ids, batch)
    v = _gather(v_cache, ids, batch)
    width = num_blocks * block_size
    mask = (torch.arange(width, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
    grouped = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).to(k.dtype)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_q_heads, head_dim)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      ctx: int, scale: float) -> torch.Tensor:
    """The new tokens ``q`` ``[Lq, Hq, D]`` of one sequence with ``ctx`` tokens of context."""
    block_size = k_cache.shape[1]
    ids = table[: -(-ctx // block_size)].long().unsqueeze(0)
    k = _gather(k_cache, ids, 1)[:, :, :ctx]
    v = _gather(v_cache, ids, 1)[:, :, :ctx]
    q_len = q.shape[0]
    query = q.transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, Hq, Lq, D]
    gqa = q.shape[1] != k.shape[1]
    if q_len == ctx:  # no cached prefix: plain causal
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos  # bottom-right causal
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over paged K/V; same contract as the reference ``paged_attention``."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    if all(n == 1 for n in q_lens):  # decode only: one query per sequence, rows in sequence order
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max(lens), scale).to(q.dtype)
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    prompts = [i for i, n in enumerate(q_lens) if n > 1]
    rows = torch.tensor([qsl[i] for i in decode], dtype=torch.long, device=q.device)
    ids = torch.tensor(decode, dtype=torch.long, device=q.device)
    if _native_library(q, k_cache, v_cache) is not None:
        query = q.to(k_cache.dtype).contiguous()
        out = torch.empty_like(query)
        if prompts:
            chosen = torch.tensor(prompts, dtype=torch.long, device=q.device)
            native_prompt_attention(query, k_cache, v_cache, block_tables.index_select(0, chosen),
                                    seq_lens.index_select(0, chosen), [qsl[i] for i in prompts],
                                    [q_lens[i] for i in prompts], out, scale)
        if decode:
            out[rows] = native_decode_attention(query.index_select(0, rows), k_cache, v_cache,
                                                block_tables.index_select(0, ids), seq_lens.index_select(0, ids),
                                                scale)
        return out.to(q.dtype)
    out = torch.empty_like(q)
    if decode:
        out[rows] = decode_attention(q.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, ids),
                                     seq_lens.index_select(0, ids), max(lens[i] for i in decode), scale).to(q.dtype)
    for i in prompts:
        out[qsl[i]:qsl[i + 1]] = prefill_attention(q[qsl[i]:qsl[i + 1]], k_cache, v_cache, block_tables[i], lens[i],
                                                   scale).to(q.dtype)
    return out
