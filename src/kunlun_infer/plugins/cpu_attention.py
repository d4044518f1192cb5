"""``paged_attention`` for the host CPU: decode straight from the paged cache, long prompts through SDPA.

Decode tokens of the whole batch go to the C kernel of
``native/paged_decode_attention.c``, which reads each cached key and value
once, in place, through the block tables (no gathered copy), for all query
heads sharing a KV head, in float32. Without it (no native library, fp16,
head size not a multiple of 16) they run as one SDPA over their
block-gathered K/V (``index_select`` of the blocks in use) in the cache's
dtype — the CPU SDPA kernel accumulates low precision in float32 itself —
with the ``Hq / Hk`` query heads of a KV head folded into the query-length
axis, so K/V are never repeated per query head. Prompts of up to
``NATIVE_PROMPT_CONTEXT`` tokens of context go to the same kernel with the
decode rows, in one call, each of their rows a one-token query over the
prefix it may see (its position + 1 tokens: causal by construction, a
cached prefix included). Longer prompts run one SDPA each: plain causal
without a cached prefix, bottom-right causal mask with one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kunlun_infer.plugins import cpu_native


#: prompts with at most this many tokens of context run row by row through the native decode kernel (each row a
#: one-token query over its own prefix), longer ones through SDPA. Measured (2 threads, 14 query heads over 2 KV
#: heads, head size 64): the rows are 2x faster than SDPA at 32-256 tokens in bf16 and 1.2-1.6x in float32, and
#: no faster at 1024 (slower with AVX2), where SDPA's blocked kernel reuses each key for many queries.
NATIVE_PROMPT_CONTEXT = 512


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Blocks ``block_ids`` (``[rows, n]``) of a ``[blocks, bs, Hk, D]`` cache as ``[rows, Hk, n*bs, D]``."""
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(rows, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)


def native_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Decode attention by ``native/paged_decode_attention.c``, reading K/V in place through the block
    tables; ``None`` when that kernel does not apply (library, dtype or head size)."""
    dtype = k_cache.dtype
    lib = cpu_native.library()
    if (lib is None or dtype not in (torch.bfloat16, torch.float32) or v_cache.dtype != dtype
            or q.shape[-1] % 16 or q.shape[-1] != k_cache.shape[-1] or k_cache.shape != v_cache.shape
            or q.shape[1] % k_cache.shape[2] or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
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


def _native_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 qsl: list[int], lens: list[int], seqs: list[int], scale: float) -> torch.Tensor | None:
    """The query rows of sequences ``seqs`` through the native kernel, each row as its own one-token query over
    the context it may see (its position + 1 tokens): ``[rows, Hq, D]`` in the order of ``seqs``, or ``None``
    when the kernel does not apply."""
    counts = [qsl[i + 1] - qsl[i] for i in seqs]
    if len(seqs) == len(lens) and qsl[0] == 0:  # every row of the batch, in order: no gather
        rows = q
    else:
        rows = q.index_select(0, torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in seqs]).to(q.device))
    ids = torch.tensor(seqs, device=q.device).repeat_interleave(torch.tensor(counts, device=q.device))
    row_lens = torch.cat([torch.arange(lens[i] - n + 1, lens[i] + 1, dtype=torch.int32)
                          for i, n in zip(seqs, counts)]).to(q.device)
    used = -(-max(lens[i] for i in seqs) // k_cache.shape[1])  # a row's table: only the blocks any row reads
    return native_decode_attention(rows, k_cache, v_cache, block_tables[:, :used].index_select(0, ids), row_lens,
                                   scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over paged K/V; same contract as the reference ``paged_attention``."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    q_lens = [qsl[i + 1] - qsl[i] for i in range(num_seqs)]
    if all(n == 1 for n in q_lens):  # decode only: one query per sequence, rows in sequence order
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max(lens), scale).to(q.dtype)
    out = torch.empty_like(q)
    # decode rows and prompts of up to NATIVE_PROMPT_CONTEXT tokens of context: one native call, row by row
    short = [i for i, n in enumerate(q_lens) if n == 1 or lens[i] <= NATIVE_PROMPT_CONTEXT]
    native = _native_rows(q, k_cache, v_cache, block_tables, qsl, lens, short, scale) if short else None
    if native is not None:
        if len(short) == num_seqs:
            return native.to(q.dtype)
        rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in short]).to(q.device)
        out[rows] = native.to(q.dtype)
        done = set(short)
    else:
        done = {i for i, n in enumerate(q_lens) if n == 1}
        if done:
            decode = sorted(done)
            rows = torch.tensor([qsl[i] for i in decode], device=q.device)
            idx = torch.tensor(decode, device=q.device)
            out[rows] = decode_attention(q.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, idx),
                                         seq_lens.index_select(0, idx), max(lens[i] for i in decode),
                                         scale).to(q.dtype)
    for i, n in enumerate(q_lens):
        if i not in done:
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = prefill_attention(q[start:end], k_cache, v_cache, block_tables[i], lens[i],
                                               scale).to(q.dtype)
    return out
