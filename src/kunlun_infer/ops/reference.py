"""Plain-torch reference implementations of every op in the op table.

These are the definition of each op's meaning: correct first, fast never.
Every ops plugin is checked against them by the conformance suite, and the
runtime falls back to them for ops a plugin does not cover. Numerics follow
Hugging Face ``transformers`` (e.g. RMSNorm normalises in float32 and applies
the weight in the input dtype) so that models match it token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim, normalised in float32."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual``; returns ``(rms_norm(residual'), residual')``."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary position embedding (rotate-half layout) to ``q`` and ``k``.

    ``positions``: ``[T]`` int64; ``q``: ``[T, Hq, D]``; ``k``: ``[T, Hk, D]``;
    ``cos_sin_cache``: ``[max_pos, 2, D]`` float32 holding cos and sin (already
    multiplied by any attention scaling). Returns new ``(q, k)``.
    """
    cs = cos_sin_cache.index_select(0, positions)
    cos = cs[:, 0].to(q.dtype).unsqueeze(1)
    sin = cs[:, 1].to(q.dtype).unsqueeze(1)
    q_out = q * cos + _rotate_half(q) * sin
    k_out = k * cos + _rotate_half(k) * sin
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` with ``n = x.shape[-1] // 2`` (SwiGLU)."""
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """Prepare a ``[out, in]`` weight for ``linear``; the reference keeps it as is.

    A provider may return any object (a prepacked layout); the framework only
    passes it back to the same provider's ``linear``.
    """
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` where ``weight`` came from ``pack_linear_weight``."""
    return F.linear(x, weight, bias)


#: reduction length whose int8 x int8 sums float32 still holds exactly (1024 * 127 * 127 < 2**24)
_EXACT_FP32_CHUNK = 1024


def quantize_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of a 2-D tensor: ``(q, scale)`` with ``t ≈ q * scale[:, None]``.

    ``scale = max|row| / 127`` in float32 (1 for an all-zero row) and ``q = round(row / scale)`` (half to
    even) in ``[-127, 127]``. It quantizes linear weights at load (one scale per output channel) and,
    inside ``int8_linear``, each row of activations at run time.
    """
    t = t.to(torch.float32)
    amax = t.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(t / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_int8_linear_weight(qweight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare an int8 ``[out, in]`` weight and its ``[out]`` float32 scales (``quantize_int8`` of a weight)
    for ``int8_linear``; the reference keeps the pair. A provider may return any object."""
    return qweight, scale


def int8_linear(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor],
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for an int8 weight from ``pack_int8_linear_weight`` (W8A8, dynamic per token).

    Each row of ``x`` is quantized like a weight row (``quantize_int8``), the integer products are summed
    exactly, and ``sum * (x_scale * w_scale)`` (+ ``bias``) is computed in float32, returned in ``x``'s dtype.
    """
    qweight, w_scale = packed
    rows = x.reshape(-1, x.shape[-1])
    qx, x_scale = quantize_int8(rows)
    total = torch.zeros(rows.shape[0], qweight.shape[0], dtype=torch.int32, device=x.device)
    for start in range(0, qweight.shape[1], _EXACT_FP32_CHUNK):  # exact partial sums, added as integers
        part = slice(start, start + _EXACT_FP32_CHUNK)
        total += (qx[:, part].to(torch.float32) @ qweight[:, part].to(torch.float32).T).to(torch.int32)
    out = total.to(torch.float32) * (x_scale[:, None] * w_scale[None, :])
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` selected by ``ids``."""
    return F.embedding(ids, weight)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` (``[T, Hk, D]``) into the paged caches in place.

    Caches are ``[num_blocks, block_size, Hk, D]``; ``slot_mapping[t]`` is the
    flat slot ``block * block_size + offset`` of token ``t``; negative slots are
    skipped (padding).
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of new query tokens over each sequence's paged K/V.

    ``q``: ``[T, Hq, D]`` — the new tokens of ``B`` sequences laid end to end,
    sequence ``i`` owning rows ``query_start_loc[i]:query_start_loc[i+1]``.
    ``seq_lens[i]``: tokens of context of sequence ``i`` *including* its new
    tokens, whose K/V are already stored. ``block_tables``: ``[B, max_blocks]``
    int32 block ids (unused entries arbitrary). Query token ``j`` of sequence
    ``i`` sits at position ``seq_lens[i] - q_len_i + j`` and sees keys
    ``0..`` that position. ``Hq`` must be a multiple of ``Hk`` (GQA).
    Softmax in float32. Returns ``[T, Hq, D]`` in ``q.dtype``.
    """
    block_size = k_cache.shape[1]
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        nblocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[i, :nblocks].long()
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx]  # [ctx, Hk, D]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].transpose(0, 1).to(torch.float32)  # [Hq, q_len, D]
        ki = k.transpose(0, 1).to(torch.float32)  # [Hq, ctx, D]
        vi = v.transpose(0, 1).to(torch.float32)
        scores = torch.matmul(qi, ki.transpose(1, 2)) * scale  # [Hq, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, vi).transpose(0, 1).to(q.dtype)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to ``-inf`` (in place) the logits of the tokens a bitmask forbids.

    ``logits``: ``[N, V]``. ``bitmask``: ``[R, W]`` int32 with ``32 * W >= V``;
    bit ``j`` of word ``w`` of row ``r`` is 1 when token ``32 * w + j`` is
    allowed. ``rows``: ``[R]`` int64, the logits row each bitmask row applies
    to (distinct). Rows not listed are left alone.
    """
    vocab = logits.shape[-1]
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"the bitmask covers {bitmask.shape[-1] * 32} tokens, fewer than the {vocab} logits")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, masked)


# ---------------------------------------------------------------------- mixture of experts (hook API 1.4)

#: scoring functions ``moe_route`` takes, and how it scores a group of experts for grouped top-k
MOE_SCORING = ("softmax", "sigmoid")
MOE_GROUP_SCORES = ("max", "top2_sum")


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
              num_expert_group: int = 1, topk_group: int = 1, group_score: str = "max",
              correction_bias: torch.Tensor | None = None,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``top_k`` experts per token from ``router_logits`` ``[T, E]``: ``(weights, ids)``, both ``[T, top_k]``.

    In float32: ``scores = softmax(logits)`` or ``sigmoid(logits)`` (``scoring``). Experts are *chosen* by
    ``scores + correction_bias`` (``[E]``, DeepSeek-V3's ``e_score_correction_bias``; none by default); with
    ``num_expert_group > 1`` the ``E`` experts form that many equal groups, each group is scored by the ``max``
    of its choice scores or the sum of its two best (``group_score="top2_sum"``), and only experts of the
    ``topk_group`` best groups may be chosen. The *weights* are the unbiased ``scores`` of the chosen experts,
    divided by their sum (+1e-20) when ``renormalize``, then multiplied by ``routed_scaling_factor``.
    ``weights`` are float32, ``ids`` int32, in descending order of the choice score.
    """
    if scoring not in MOE_SCORING:
        raise ValueError(f"moe_route: scoring={scoring!r}; use one of {', '.join(MOE_SCORING)}")
    logits = router_logits.to(torch.float32)
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    if num_expert_group > 1:
        if group_score not in MOE_GROUP_SCORES:
            raise ValueError(f"moe_route: group_score={group_score!r}; use one of {', '.join(MOE_GROUP_SCORES)}")
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_expert_group, experts // num_expert_group)
        if group_score == "max":
            per_group = grouped.max(dim=-1).values
        else:
            per_group = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = per_group.topk(topk_group, dim=-1).indices
        allowed = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(experts // num_expert_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prepare the stacked expert weights for ``fused_moe``; the reference keeps the pair.

    ``w13``: ``[E, 2 * I, H]``, each expert's gate projection (rows ``:I``) over its up projection (rows
    ``I:``); ``w2``: ``[E, H, I]``, each expert's down projection. A provider may return any object; the
    framework only passes it back to the same provider's ``fused_moe``.
    """
    return w13, w2


def fused_moe(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' SiLU-gated MLPs, combined: ``[T, H]`` → ``[T, H]`` in ``x``'s dtype.

    ``packed`` came from ``pack_moe_weights(w13, w2)``; ``topk_ids`` ``[T, k]`` (int32 or int64) are
    expert rows of those weights, a negative id contributes nothing (an expert held elsewhere);
    ``topk_weights`` ``[T, k]`` float32. For each (token, expert): ``h = silu(x @ gate.T) * (x @ up.T)``,
    ``y = h @ down.T`` — each matmul accumulated in float32 and rounded to ``x``'s dtype, like ``linear`` —
    and the output is ``sum_k weight * y`` summed in float32, rounded once.
    """
    w13, w2 = packed
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_weights = topk_weights.reshape(-1).to(torch.float32)
    for expert in range(w13.shape[0]):  # one expert at a time, only the tokens routed to it
        rows = (flat_ids == expert).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        tokens = token_of[rows]
        hidden = silu_and_mul(F.linear(x[tokens], w13[expert]))
        y = F.linear(hidden, w2[expert])
        out.index_add_(0, tokens, y.to(torch.float32) * flat_weights[rows, None])
    return out.to(x.dtype)


# ---------------------------------------------------------------------- sampling (hook API 1.8, 1.10)

def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below ``min_p`` (``[N]``) times each row's largest one (in place)."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill_(probs < threshold, 0.0)


def row_sums(weights: torch.Tensor) -> torch.Tensor:
    """Each row's sum (``[n]``), added up by blocks of ``DRAW_BLOCK`` then across them, so that a row's sum is
    the same bits in any batch (one reduction over a long row may split it between threads)."""
    return _block_sums(weights).sum(dim=-1)


#: the lowest exponent a weight is computed from (relative to its row's top token): below it, weight 0.
#: torch's exp on a CPU takes 12-30x longer for arguments under ~-87.3 (results subnormal or 0) than above,
#: and masked tokens (-inf), low temperatures and wide logit ranges put most of a vocabulary there; exp(-87)
#: is still a normal float, and a token 1.6e-38 times as likely as the top one was never drawn anyway
EXP_FLOOR = -87.0
_FLOOR_WEIGHT = float(torch.tensor(EXP_FLOOR).exp())


#: a draw over a wider row first picks a block of this many tokens by their sums, then a token in it: float32
#: running sums over a block stay exact to ~1e-7 of its share, where one over a 150k vocabulary would not
DRAW_BLOCK = 1024


def _pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of non-negative ``weights`` (``[n, w]``), index ``i`` with probability ``weights[i]`` over
    the row's sum, as ``u`` (``[n]``, uniform in [0, 1)) falls in its running sum; never an index of weight 0
    (rounding that pushes ``u`` to the end takes the last positive one)."""
    # the running sums never fall, so how many of them lie at or below a value is where it falls: the search
    # counted by comparisons, which every device's torch has (torch.searchsorted was not verified on all)
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    index = (cdf <= u.unsqueeze(1) * total).sum(dim=-1)
    last = (cdf < total).sum(dim=-1)  # the first index reaching the total: the last positive weight
    return torch.minimum(index, last).clamp_(max=weights.shape[-1] - 1)


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """``[n, ceil(vocab / DRAW_BLOCK)]``: each row's sums over consecutive blocks of ``DRAW_BLOCK`` tokens."""
    n, vocab = weights.shape
    full = vocab // DRAW_BLOCK  # whole blocks; the last, shorter one is summed on its own
    sums = weights[:, :full * DRAW_BLOCK].reshape(n, full, DRAW_BLOCK).sum(dim=-1)
    if full * DRAW_BLOCK < vocab:
        sums = torch.cat([sums, weights[:, full * DRAW_BLOCK:].sum(dim=-1, keepdim=True)], dim=1)
    return sums


def draw_from(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of ``weights`` (``[n, vocab]``, non-negative, any scale), drawn with probability
    proportional to its entry, by inverse transform from two uniforms per row (``[n, 2]``): the first picks a
    block of ``DRAW_BLOCK`` tokens by their sums, the second a token within it. Nothing waits for the device."""
    vocab = weights.shape[1]
    if vocab <= DRAW_BLOCK:
        return _pick(weights, uniforms[:, 0])
    block = _pick(_block_sums(weights), uniforms[:, 0])
    index = block.unsqueeze(1) * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)
    within = weights.gather(1, index.clamp(max=vocab - 1)) * (index < vocab)  # past the vocabulary: weight 0
    return block * DRAW_BLOCK + _pick(within, uniforms[:, 1])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dimension (int64, on the logits' device): the first index of its largest
    value, a NaN counted largest (the first NaN), as ``argmax(dim=-1)`` gives it.

    Through ``max(dim=-1)``, whose reduction runs several times faster on a
    CPU than ``argmax``'s (the Xeon with AMX, 2 threads, torch 2.13, float32
    rows of 151936 logits: 1 row 0.22 -> 0.08 ms, 8 rows 1.0 -> 0.44, 32
    rows 6.8 -> 1.8).
    """
    return logits.max(dim=-1).indices


def sampling_weights(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``[N, vocab]`` weights proportional to ``softmax(logits / temperature)`` (``temperature``: ``[N]``, > 0),
    a new tensor in one pass: ``exp((logits - max) / temperature)``, so each row's heaviest weighs 1, and 0 where
    the exponent is at or below ``EXP_FLOOR`` (a row of nothing but ``-inf``: all 0, never NaN)."""
    finite = torch.finfo(logits.dtype).max
    # a temperature past the dtype's range (1e300 is a valid request) would be inf, and inf / inf is NaN; a logit
    # pushed to +inf by a huge penalty weighs what the largest finite one does
    temperature = temperature.to(logits.dtype).clamp(max=finite)
    top = logits.amax(dim=-1, keepdim=True).clamp_(min=-finite, max=finite)
    weights = torch.sub(logits, top).div_(temperature.unsqueeze(1)).clamp_(min=EXP_FLOOR, max=0.0).exp_()
    return torch.threshold_(weights, _FLOOR_WEIGHT, 0.0)  # what lay at or below the floor weighs nothing


def keep_top_k_top_p(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``weights`` (``[N, vocab]``, non-negative) zeroed outside each row's top-k / top-p nucleus, by one stable
    sort, heaviest first (a new tensor): top-k (``[N]`` int, 0 = off) keeps the weights from the k-th heaviest up,
    its ties too; top-p (``[N]`` float, 1 = off) then the heaviest while the mass before them, in that order (ties
    in column order), is short of ``top_p`` of what top-k kept. The heaviest token always stays."""
    vocab = weights.shape[-1]
    ordered, order = weights.sort(dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ordered = ordered * (ordered >= ordered.gather(1, k.sub(1).unsqueeze(1)))
    before = ordered.cumsum(dim=-1) - ordered
    keep = (before < top_p.to(weights.dtype).unsqueeze(1) * ordered.sum(dim=-1, keepdim=True)) \
        | (top_p >= 1).unsqueeze(1)
    keep[:, 0] = True
    return torch.empty_like(weights).scatter_(1, order, ordered * keep)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's next token (int64 ``[N]``, on the logits' device): the argmax (:func:`greedy_tokens`) of a row
    whose ``temperature`` is 0; else drawn from ``softmax(logits / temperature)`` (float32 ``[N, vocab]``
    logits; :func:`sampling_weights`) kept to its top-k / top-p nucleus (:func:`keep_top_k_top_p`; ``top_k``
    int64 ``[N]``, 0 = off; ``top_p`` ``[N]``, 1 = off) and to the tokens at least ``min_p`` (``[N]``, 0 = off)
    times its likeliest, by inverse transform with the row's two ``uniforms`` (``[N, 2]``, in [0, 1);
    :func:`draw_from`): the first picks a block of ``DRAW_BLOCK`` tokens by the sums of their weights, the second
    a token in it (a row of at most ``DRAW_BLOCK`` tokens: the first picks the token). A row with nothing to
    draw (every logit ``-inf``) gives token 0.

    A kernel may sum in another order than this one's float32 sums: a
    uniform falling within rounding of where one token's share ends and the
    next begins may then pick the neighbour. A row holding a NaN logit has
    no defined draw (here its weights turn NaN; the ``cpu`` kernel weighs
    such a token 0).
    """
    drawn = draw_from(kept_weights(logits, temperature, top_k, top_p, min_p), uniforms)
    return torch.where(temperature <= 0, greedy_tokens(logits), drawn)


def kept_weights(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """The weights :func:`sample_tokens` draws each row from (same arguments; a greedy row's at temperature 1):
    :func:`sampling_weights`, kept to the top-k / top-p nucleus and to ``min_p`` times the likeliest."""
    temperature = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    weights = sampling_weights(logits, temperature)
    return apply_min_p(keep_top_k_top_p(weights, top_k, top_p), min_p.to(weights.dtype))
