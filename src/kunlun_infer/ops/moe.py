"""A helper for ops plugins serving ``fused_moe``: the (token, expert) pairs grouped by expert.

The reference :func:`kunlun_infer.ops.reference.fused_moe` is the definition
and visits every expert with a mask. A kernel written in torch or around
per-expert GEMMs wants the opposite shape of work: sort the ``T * k`` pairs
by expert once, gather the token rows in that order, run each *active*
expert once on its contiguous block of rows, scatter the results back and
combine them by the routing weights in float32. :func:`grouped_fused_moe`
does exactly that around an ``expert_mlp(expert, rows)`` the plugin supplies,
so a plugin only says how one expert multiplies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def grouped_fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      hidden_size: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fused_moe``'s result with one ``expert_mlp(e, rows)`` call per expert that any token chose.

    ``expert_mlp(e, rows)`` maps ``[n, H]`` rows of ``x`` (those routed to expert ``e``, in token order) to
    expert ``e``'s ``[n, hidden_size]`` output in ``x``'s dtype. Negative ids are skipped; an id of
    ``num_experts`` or more is a ``ValueError``. Sums in float32 in expert order, like the reference.
    """
    tokens, top_k = topk_ids.shape
    out = torch.zeros(tokens, hidden_size, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids.index_select(0, order)
    counts = torch.bincount(sorted_ids.clamp(min=-1) + 1, minlength=num_experts + 1).tolist()
    if len(counts) > num_experts + 1:
        raise ValueError(f"fused_moe: expert id {len(counts) - 2} is outside the {num_experts} experts of these "
                         "weights")
    pairs = order[counts[0]:]  # negative ids sort first: experts held elsewhere
    token_of = pairs // top_k
    rows = x.index_select(0, token_of)
    results = torch.empty(pairs.numel(), hidden_size, dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts[1:]):
        if count:
            results[start:start + count] = expert_mlp(expert, rows[start:start + count])
            start += count
    weights = topk_weights.reshape(-1).to(torch.float32).index_select(0, pairs)
    out.index_add_(0, token_of, results.to(torch.float32) * weights[:, None])
    return out.to(x.dtype)
