"""Op coverage of every registered ops option: where each op of the table would come from.

For each ``ops=<option>`` the provider is built (with its composed config
node and no device: an ops factory must not need hardware to say what it
covers) and the op table is resolved exactly as a run resolves it, so the
answer per op is the plugin that serves it or ``reference`` for a fallback —
including the rule that ``pack_linear_weight`` and ``linear`` come from one
source. A provider that cannot be built is reported with its error, never a
crash.

Attention is reported beside the ops: the name of the attention backend
(hook API 1.1) the provider gives a typical model (:data:`ATTENTION_PROBE`),
or ``reference`` when the framework's reference backend would serve it on
the table's ``store_kv`` and ``paged_attention``. A backend's name may say
which of its calls run where. Multi-head latent attention (hook API 1.4) is
reported the same way for a DeepSeek-V3-shaped probe (:data:`MLA_PROBE`):
the provider's MLA backend, or ``reference`` for the framework's plain-torch
one.
"""

from __future__ import annotations

from typing import Any

import torch

from kunlun_infer.ops import OP_SPECS
from kunlun_infer.ops.attention import MLA, AttentionSpec, MLAAttentionBackend, mla_spec
from kunlun_infer.runtime import compose_config
from kunlun_infer.runtime.optable import resolve

FALLBACK = "reference"
#: the attention the report asks each provider about: grouped-query heads of 128, bfloat16
ATTENTION_PROBE = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
#: the multi-head latent attention the report asks about: DeepSeek-V3's sizes, 16 heads (one of 8 ranks), bfloat16
MLA_PROBE = mla_spec(num_heads=16, qk_nope_head_dim=128, qk_rope_head_dim=64, kv_lora_rank=512, v_head_dim=128,
                     dtype=torch.bfloat16)


def ops_coverage(manager: Any) -> dict[str, dict[str, Any]]:
    """``{option: {"plugin", "sources": {op: plugin | "reference"}, "fallbacks": [...], "attention", "error"}}``."""
    coverage: dict[str, dict[str, Any]] = {}
    for option in manager.options("ops"):
        plugin, factory = manager.factory("ops", option)
        entry: dict[str, Any] = {"plugin": plugin, "sources": {}, "fallbacks": [], "attention": None,
                                 "mla_attention": None, "error": None}
        try:
            node = compose_config([f"ops={option}"], plugin_manager=manager).ops
            provider = factory(config=node, device=None)
            table = resolve(list(OP_SPECS), provider=provider, plugin=plugin, strict=False)
            entry["sources"] = {op: table.source(op) for op in OP_SPECS}
            entry["fallbacks"] = table.fallbacks
            entry["attention"] = attention_backend_name(provider)
            entry["mla_attention"] = attention_backend_name(provider, MLA_PROBE)
        except Exception as exc:  # noqa: BLE001 - one provider's failure is a cell of the report
            entry["error"] = f"{type(exc).__name__}: {exc}"
        coverage[option] = entry
    return coverage


def attention_backend_name(provider: Any, spec: AttentionSpec = ATTENTION_PROBE) -> str:
    """The name of ``provider``'s attention backend for ``spec``, or ``reference`` when it has none."""
    offer = getattr(provider, "attention_backend", None)
    backend = offer(spec) if offer is not None else None
    if spec.kind == MLA and not isinstance(backend, MLAAttentionBackend):
        backend = None  # e.g. a plugin from before MLA answering with its MHA backend: the reference serves
    return FALLBACK if backend is None else str(getattr(backend, "name", type(backend).__name__))


def coverage_table(coverage: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Rows ``[op, source per option…]`` with a header, for a text table."""
    options = list(coverage)
    rows = [["OP", *(f"ops={o}" for o in options)]]
    for op in OP_SPECS:
        row = [op]
        for option in options:
            entry = coverage[option]
            row.append("?" if entry["error"] else entry["sources"].get(op, FALLBACK))
        rows.append(row)
    return rows
