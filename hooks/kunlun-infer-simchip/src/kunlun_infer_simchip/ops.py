"""``ops=simchip``: the simulated chip's kernels — a deliberately partial op set, and its own attention.

The chip implements the element-wise and matrix ops (``rms_norm``,
``add_rms_norm``, ``silu_and_mul``, ``pack_linear_weight`` + ``linear``,
``embedding``, ``store_kv``) and the structured-output mask
(``apply_token_bitmask``, hook API 1.2) but has no kernel for
``rotary_embedding``, nor the op table's ``paged_attention``. A model
therefore runs on simchip only through the runtime's fallback to the
reference ``rotary_embedding`` (logged and counted), and ``ops.strict=true``
refuses, listing it: both paths get exercised without hardware. Attention is
served by the chip's own attention backend (hook API 1.1,
:mod:`kunlun_infer_simchip.attention`): a Kunlun-style cache layout and split
decode/prefill kernels.

The kernels are written the way a chip with a 2-D matrix unit and float32
vector lanes would do them: leading dims are flattened before a matmul, and
normalisation runs in float32. Their numerics follow the references in
:mod:`kunlun_infer.ops.reference` so models still match transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.ops.attention import MHA, AttentionBackend, AttentionSpec

from kunlun_infer_simchip import CHIP_NAME
from kunlun_infer_simchip.attention import SimchipAttentionBackend

#: ops of the op table the simulated chip has no kernel for (the fallback and strict paths need some;
#: its attention backend serves attention instead of ``paged_attention``)
MISSING_OPS = ("paged_attention", "rotary_embedding")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    lanes = x.to(torch.float32)
    inv_rms = torch.rsqrt(lanes.square().mean(dim=-1, keepdim=True) + eps)
    return weight * (lanes * inv_rms).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    # the matrix unit streams weights row-major in their [out, in] layout: packing makes them dense
    return weight.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # the matrix unit takes 2-D operands only
    out = F.linear(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = weight.index_select(0, ids.reshape(-1).long())
    return rows.view(*ids.shape, weight.shape[-1])


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    valid = (slot_mapping >= 0).nonzero().squeeze(-1)
    slots = slot_mapping.index_select(0, valid).long()
    k_slots = k_cache.view(-1, *k_cache.shape[2:])
    v_slots = v_cache.view(-1, *v_cache.shape[2:])
    k_slots.index_put_((slots,), key.index_select(0, valid).to(k_cache.dtype))
    v_slots.index_put_((slots,), value.index_select(0, valid).to(v_cache.dtype))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    # one 32-lane compare per bitmask word: lane j tests bit j, then a select writes -inf where it is clear
    lanes = torch.tensor([1 << j for j in range(31)] + [-(1 << 31)], dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) & lanes) != 0
    selected = logits.index_select(0, rows)
    allowed = allowed.reshape(rows.numel(), -1)[:, :logits.shape[-1]]
    logits.index_copy_(0, rows, torch.where(allowed, selected, torch.full_like(selected, float("-inf"))))


KERNELS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "pack_linear_weight": pack_linear_weight,
    "linear": linear,
    "embedding": embedding,
    "store_kv": store_kv,
    "apply_token_bitmask": apply_token_bitmask,
}


class SimchipOps(DictOpsProvider):
    """The simulated chip's op table (see :data:`MISSING_OPS` for what it lacks) and attention backend."""

    def __init__(self) -> None:
        super().__init__(KERNELS, name=CHIP_NAME)

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend | None:
        if spec.kind != MHA:
            return None  # other kinds of attention: the framework's reference
        return SimchipAttentionBackend(spec)
