"""bf16 ``linear`` through the GEMM of ``native/gemm_bf16.c``: pack once at load, then one call per matmul.

Why a kernel of our own: oneDNN's bf16 inner product streams a weight at
about half the memory bandwidth when a decode step multiplies it with one
to a few rows, and that is where a CPU spends a decode step. The kernel
reads each weight once per step as a sequential stream and uses every
64-byte load for 16 outputs (the layout is described in the C source).
It is used where :func:`kunlun_infer.plugins.cpu_native.library` loads and
the CPU has no AMX (there oneDNN's tile kernels are the faster choice).
"""

from __future__ import annotations

import functools

import torch

from kunlun_infer.plugins import cpu_native
from kunlun_infer.plugins.cpu_device import cpu_flags

#: output features per packed tile (``TILE_N`` in the C source)
TILE_N = 32
#: attribute holding the true output features of a weight packed here
PACKED_OUT_FEATURES = "_kunlun_gemm_out_features"


@functools.cache
def available() -> bool:
    """Whether bf16 weights go to this kernel on this machine."""
    return cpu_native.library() is not None and "amx_bf16" not in cpu_flags()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes this weight (2-D bf16 on the host, even in-features, library present)."""
    return (weight.dtype is torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.shape[1] > 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the kernel's tiled layout: a new ``[ceil(N/32)*32, K]`` tensor."""
    n, k = weight.shape
    src = weight.detach().contiguous()
    packed = torch.empty(-(-n // TILE_N) * TILE_N, k, dtype=torch.bfloat16)
    cpu_native.library().kunlun_pack_bf16(src.data_ptr(), packed.data_ptr(), n, k)
    setattr(packed, PACKED_OUT_FEATURES, n)
    return packed


def is_packed(weight: object) -> bool:
    return hasattr(weight, PACKED_OUT_FEATURES)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from :func:`pack`, in bf16 with float32 accumulation."""
    n, k = getattr(packed, PACKED_OUT_FEATURES), packed.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"linear: input features {x.shape[-1]} do not match the weight's {k}")
    rows = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        bias32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
        cpu_native.library().kunlun_gemm_bf16(packed.data_ptr(), rows.data_ptr(),
                                              None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
                                              rows.shape[0], n, k)
    return out.view(*x.shape[:-1], n)
