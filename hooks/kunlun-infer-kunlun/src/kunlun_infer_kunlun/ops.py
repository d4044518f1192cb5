"""``ops=kunlun``: the op table on the vendor's kernels (``kunlun_ops``) where it has them, torch elsewhere.

Each op of :data:`VENDOR_OPS` calls the library's kernel when the library is
importable and has that function. Where it does not, the op is not offered:
the runtime runs it on the plain-torch reference, logs that once per run and
counts the calls, and ``kunlun-infer plugins`` shows it as ``reference`` —
op by op, so one missing function costs one op, not the table. Linear
layers and embeddings are torch expressions run by the vendor's torch build
(``kunlun_infer_cuda``'s kernels). Attention is the backend of
:mod:`kunlun_infer_kunlun.attention` (the library's cache layout and
kernels); where the library cannot serve it, the framework's reference
backend runs this table's torch ``store_kv`` and ``paged_attention``.

How each op of the table maps onto a kernel call (argument order, in-place
outputs and layouts as vLLM-Kunlun and sglang-kunlun call them; see the
plugin README for the files):

- ``rms_norm(x, w, eps)`` → ``rmsnorm(x, w, out, eps)``, ``out`` written in place;
- ``add_rms_norm(x, r, w, eps)`` → ``add_rmsnorm(x, r, weight=, output=, eps=,
  residual_output=)``: ``output`` receives the normalised sum and
  ``residual_output`` the sum itself;
- ``silu_and_mul(x)`` → ``swiglu(x=x, y=out)``;
- ``rotary_embedding(pos, q, k, table)`` → ``rotary_embedding(positions=,
  query=q2, key=k2, head_size=, cos_sin_cache=, is_neox=True)``, rotating
  ``q2``/``k2`` (``[T, heads * head_size]``) in place, with
  ``cos_sin_cache`` the ``[max_pos, rot_dim]`` table
  ``cat(cos, sin)`` over half the rotary dims in the query's dtype and the
  NeoX (rotate-half) layout. The framework's table is
  ``[max_pos, 2, head_dim]`` with each half repeated; it is converted once
  per table and dtype. A table whose halves differ is not a NeoX table: such
  a call takes the torch path (logged once).
- ``moe_route(logits, k, ...)`` → ``moe_softmax_topk_norm(x, normed_score,
  topk_index, None)`` (softmax, top-k, renormalised) or ``moe_softmax_topk``
  (not renormalised), float32 logits, int32 ids and float32 weights written
  in place; the grouped, biased and sigmoid routings (DeepSeek's) take the
  torch path, since no source shows a kernel call for them in ``kunlun_ops``.
- ``fused_moe(x, (w13, w2), weights, ids)`` →
  ``gen_block_statistic(ids, block_statistic)`` (``[12, E]`` int32),
  ``moe_pre_sorted(x=, topk_index=, block_statistic=, moe_expand=, moe_index=,
  expert_m=, sorted_tokens_num_lod=)`` (rows gathered in expert order),
  ``moe_fc(x=, x_perchannel_max=None, weight=w13, w_perchannel_max=None,
  sorted_tokens_num_lod=, sorted_tokens_idx=, moe_topk=, y=, topk_ids=,
  act=None)``, ``swiglu(x=, y=)``, ``moe_fc`` with ``w2``, then
  ``moe_post(x=, moe_index=, normed_scale=weights, dequant_scale=ones, y=)``
  — the unquantized expert path of vLLM-Kunlun and sglang-kunlun; ``w13`` is
  ``[E, 2I, H]`` with the gate rows first, as theirs. A negative id (an
  expert held elsewhere) is sorted as expert 0 and weighed by 0, so the
  kernels never see one.

Kernels take contiguous inputs; the wrappers copy a strided view (e.g. the
query cut out of a fused QKV projection) before the call, never after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.ops import reference
from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec
from kunlun_infer_cuda.ops import KERNELS as TORCH_KERNELS
from kunlun_infer_kunlun.attention import kunlun_attention
from kunlun_infer_kunlun.config import DEVICE
from kunlun_infer_kunlun.vendor import MODULE_NAME, VendorKernels, load_vendor_kernels

log = logging.getLogger("kunlun_infer.plugin.kunlun")

#: op of the table -> the library functions it calls; an op whose functions are missing is not offered
VENDOR_OPS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("rmsnorm",),
    "add_rms_norm": ("add_rmsnorm",),
    "silu_and_mul": ("swiglu",),
    "rotary_embedding": ("rotary_embedding",),
    "moe_route": ("moe_softmax_topk", "moe_softmax_topk_norm"),
    # the stacked weights stay as they are; offered with the kernels that use them
    "pack_moe_weights": ("gen_block_statistic", "moe_pre_sorted", "moe_fc", "swiglu", "moe_post"),
    "fused_moe": ("gen_block_statistic", "moe_pre_sorted", "moe_fc", "swiglu", "moe_post"),
}
#: rows of the routing statistics ``gen_block_statistic`` fills (as the vendor's integrations allocate them)
_BLOCK_STATISTIC_ROWS = 12


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``[rows, features]`` matrix (a copy only when it is strided)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _rms_norm(kernels: VendorKernels) -> Callable[..., torch.Tensor]:
    rmsnorm = kernels.get("rmsnorm")

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        out = torch.empty_like(rows)
        rmsnorm(rows, weight, out, float(eps))
        return out.view(x.shape)

    return rms_norm


def _add_rms_norm(kernels: VendorKernels) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    add_rmsnorm = kernels.get("add_rmsnorm")

    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows, res = _rows(x), _rows(residual)
        normed, summed = torch.empty_like(rows), torch.empty_like(rows)
        add_rmsnorm(rows, res, weight=weight, output=normed, eps=float(eps), residual_output=summed)
        return normed.view(x.shape), summed.view(x.shape)

    return add_rms_norm


def _silu_and_mul(kernels: VendorKernels) -> Callable[..., torch.Tensor]:
    swiglu = kernels.get("swiglu")

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        out = rows.new_empty(rows.shape[0], rows.shape[1] // 2)
        swiglu(x=rows, y=out)
        return out.view(*x.shape[:-1], out.shape[-1])

    return silu_and_mul


class _Rotary:
    """``rotary_embedding`` on the library's in-place NeoX kernel, with the converted tables it needs."""

    def __init__(self, kernels: VendorKernels) -> None:
        self.kernel = kernels.get("rotary_embedding")
        self._tables: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor | None] = {}
        self._warned = False

    def table(self, cos_sin_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The ``[max_pos, head_dim]`` ``cat(cos, sin)`` table in ``dtype``, or ``None`` for a non-NeoX table."""
        key = (cos_sin_cache.data_ptr(), tuple(cos_sin_cache.shape), dtype)
        if key not in self._tables:
            half = cos_sin_cache.shape[-1] // 2
            first, second = cos_sin_cache[..., :half], cos_sin_cache[..., half:]
            neox = cos_sin_cache.shape[-1] % 2 == 0 and torch.equal(first, second)
            self._tables[key] = torch.cat((first[:, 0], first[:, 1]), dim=-1).to(dtype).contiguous() if neox else None
        return self._tables[key]

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.table(cos_sin_cache, q.dtype)
        if table is None:
            if not self._warned:
                self._warned = True
                log.warning("ops=kunlun: the rotary table is not in the rotate-half (NeoX) layout %s's "
                            "rotary_embedding takes; those calls run on the torch path", MODULE_NAME)
            return reference.rotary_embedding(positions, q, k, cos_sin_cache)
        tokens, head_dim = q.shape[0], q.shape[-1]
        q_rows = q.reshape(tokens, -1).clone(memory_format=torch.contiguous_format)
        k_rows = k.reshape(tokens, -1).clone(memory_format=torch.contiguous_format)
        self.kernel(positions=positions.to(torch.int64), query=q_rows, key=k_rows, head_size=head_dim,
                    cos_sin_cache=table, is_neox=True)
        return q_rows.view(q.shape), k_rows.view(k.shape)


def _moe_route(kernels: VendorKernels) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    plain, normalized = kernels.get("moe_softmax_topk"), kernels.get("moe_softmax_topk_norm")

    def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
                  num_expert_group: int = 1, topk_group: int = 1, group_score: str = "max",
                  correction_bias: torch.Tensor | None = None,
                  routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        if scoring != "softmax" or num_expert_group > 1 or correction_bias is not None:
            return reference.moe_route(router_logits, top_k, scoring, renormalize, num_expert_group, topk_group,
                                       group_score, correction_bias, routed_scaling_factor)
        logits = _rows(router_logits).to(torch.float32)
        weights = logits.new_empty(logits.shape[0], top_k)
        ids = torch.empty(logits.shape[0], top_k, dtype=torch.int32, device=logits.device)
        (normalized if renormalize else plain)(logits, weights, ids, None)
        return (weights * routed_scaling_factor if routed_scaling_factor != 1.0 else weights), ids

    return moe_route


def _fused_moe(kernels: VendorKernels) -> Callable[..., torch.Tensor]:
    statistic, pre_sorted, fc = kernels.get("gen_block_statistic"), kernels.get("moe_pre_sorted"), kernels.get("moe_fc")
    swiglu, post = kernels.get("swiglu"), kernels.get("moe_post")

    def fused_moe(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = packed
        elsewhere = topk_ids < 0  # experts held by other ranks: sorted as expert 0, weighed by 0
        ids = topk_ids.masked_fill(elsewhere, 0).to(torch.int32).contiguous()
        tokens, top_k = ids.shape
        experts, hidden, device = w13.shape[0], x.shape[1], x.device
        rows = _rows(x)
        block_statistic = torch.empty(_BLOCK_STATISTIC_ROWS, experts, dtype=torch.int32, device=device)
        statistic(ids, block_statistic)
        expanded = rows.new_empty(tokens * top_k, hidden)
        order = torch.zeros(tokens * top_k, dtype=torch.int32, device=device)
        per_expert = torch.zeros(experts, dtype=torch.int32, device=device)
        lod = torch.zeros(experts + 1, dtype=torch.int32, device=device)
        pre_sorted(x=rows, topk_index=ids, block_statistic=block_statistic, moe_expand=expanded, moe_index=order,
                   expert_m=per_expert, sorted_tokens_num_lod=lod)
        gate_up = rows.new_empty(tokens, top_k, w13.shape[1])
        fc(x=expanded, x_perchannel_max=None, weight=w13, w_perchannel_max=None, sorted_tokens_num_lod=lod,
           sorted_tokens_idx=order, moe_topk=top_k, y=gate_up, topk_ids=ids, act=None)
        activated = rows.new_empty(tokens, top_k, w13.shape[1] // 2)
        swiglu(x=gate_up, y=activated)
        down = rows.new_empty(tokens, top_k, w2.shape[1])
        fc(x=activated.view(tokens * top_k, -1), x_perchannel_max=None, weight=w2, w_perchannel_max=None,
           sorted_tokens_num_lod=lod, sorted_tokens_idx=order, moe_topk=top_k, y=down, topk_ids=ids, act=None)
        out = rows.new_empty(tokens, w2.shape[1])
        weights = topk_weights.to(torch.float32).masked_fill(elsewhere, 0.0).contiguous()
        post(x=down, moe_index=order.view(tokens, top_k), normed_scale=weights,
             dequant_scale=torch.ones_like(weights), y=out)
        return out

    return fused_moe


_BUILDERS: dict[str, Callable[[VendorKernels], Callable[..., Any]]] = {
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "silu_and_mul": _silu_and_mul,
    "rotary_embedding": _Rotary,
    "moe_route": _moe_route,
    "pack_moe_weights": lambda kernels: reference.pack_moe_weights,
    "fused_moe": _fused_moe,
}


class KunlunOps(DictOpsProvider):
    """The op table on ``kunlun_ops`` kernels where the library has them; torch for the rest.

    ``vendor``: the library as :func:`~kunlun_infer_kunlun.vendor.load_vendor_kernels`
    finds it (the default); tests pass a stand-in.
    """

    def __init__(self, vendor: VendorKernels | None = None) -> None:
        self.vendor = load_vendor_kernels() if vendor is None else vendor
        kernels: dict[str, Callable[..., Any]] = {op: k for op, k in TORCH_KERNELS.items() if op not in VENDOR_OPS}
        #: op -> the library functions serving it, for the ops that run on the vendor's kernels
        self.vendor_ops: dict[str, tuple[str, ...]] = {}
        for op, functions in VENDOR_OPS.items():
            if self.vendor.has(*functions):
                kernels[op] = _BUILDERS[op](self.vendor)
                self.vendor_ops[op] = functions
        super().__init__(kernels, name=DEVICE)
        self._report()

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend | None:
        """The library's paged-attention layout and kernels (:mod:`kunlun_infer_kunlun.attention`), where it has them.

        ``None`` — the framework's reference backend on this table's torch
        ``store_kv``/``paged_attention`` — without the library, without any of
        its attention functions, or for a head size its kernels do not serve.
        """
        return kunlun_attention(spec, self.vendor)

    def kernel_source(self, op: str) -> str | None:
        """Where ``op`` runs: ``"kunlun_ops.<function>"``, ``"torch"``, or ``None`` (not offered: reference)."""
        if op in self.vendor_ops:
            return ", ".join(f"{MODULE_NAME}.{f}" for f in self.vendor_ops[op])
        return "torch" if self.supports(op) else None

    def _report(self) -> None:
        fallback = [op for op in VENDOR_OPS if op not in self.vendor_ops]
        if not fallback:
            log.info("ops=kunlun: %s %s serves %s", MODULE_NAME, self.vendor.version or "(version unknown)",
                     ", ".join(self.vendor_ops))
            return
        if self.vendor.module is None:
            level = logging.WARNING if self.vendor.broken else logging.INFO
            log.log(level, "ops=kunlun: %s; %s run on the plain-torch reference", self.vendor.reason,
                    ", ".join(fallback))
            return
        missing = sorted({f for op in fallback for f in self.vendor.missing(*VENDOR_OPS[op])})
        log.warning("ops=kunlun: %s %s has no %s; %s run on the plain-torch reference",
                    MODULE_NAME, self.vendor.version or "(version unknown)", ", ".join(missing), ", ".join(fallback))
