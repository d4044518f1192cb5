"""``linear`` through the native GEMMs (``native/gemm*.c``): pack once at load, then one call per matmul.

Why kernels of our own: a decode step multiplies each weight with one to a
few rows, and there oneDNN streams a bf16 weight at about half the memory
bandwidth — and on a CPU without AVX512-BF16 torch's bf16 matmul falls back
to scalar code. The kernels read each weight once per step as a sequential
stream of tiles (32 output features on AVX-512, 16 on AVX2; the layouts are
described in the C sources) and, for prefill, reuse each tile from cache for
every block of rows; the ``amx`` set multiplies the same bf16 tiles on the
AMX tile unit. Weights in bf16 and float32 are packed here whenever
:func:`kunlun_infer.plugins.cpu_native.selection` loaded a kernel set.
"""

from __future__ import annotations

import torch

from kunlun_infer.plugins import cpu_memory, cpu_native

#: attribute holding the true output features of a weight packed here
PACKED_OUT_FEATURES = "_kunlun_gemm_out_features"
_KERNELS = {torch.bfloat16: ("kunlun_pack_bf16", "kunlun_gemm_bf16"),
            torch.float32: ("kunlun_pack_f32", "kunlun_gemm_f32")}


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether weights of ``dtype`` go to these kernels on this machine."""
    chosen = cpu_native.selection()
    if chosen.library is None or dtype not in _KERNELS:
        return False
    return dtype is not torch.bfloat16 or chosen.bf16_linear == "native"


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes this weight (2-D bf16 or float32 on the host, kernels present)."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[1] > 0
            and (weight.dtype is not torch.bfloat16 or weight.shape[1] % 2 == 0) and available(weight.dtype))


def weight_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty 1-D tensor for a packed weight, in huge pages where the system grants them
    (:func:`cpu_memory.host_buffer`).

    A decode step streams every weight once; in 4 KiB pages that is a TLB
    miss every 4 KiB (measured, same process, a 0.5B model's decode step:
    2-5% shorter with the weights in huge pages).
    """
    return cpu_memory.host_buffer(numel * dtype.itemsize).view(dtype)


#: attribute keeping a bias's float32 copy, with the version of the bias it was made from
_BIAS32 = "_kunlun_bias32"


def tile_n() -> int:
    """Output features per packed tile of the loaded kernel set."""
    return int(cpu_native.library().kunlun_gemm_tile_n())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the kernel's tiled layout: a new ``[ceil(N/tile)*tile, K]`` tensor."""
    n, k = weight.shape
    src = weight.detach().contiguous()
    packed = weight_buffer(-(-n // tile_n()) * tile_n() * k, weight.dtype).view(-1, k)
    getattr(cpu_native.library(), _KERNELS[weight.dtype][0])(src.data_ptr(), packed.data_ptr(), n, k)
    setattr(packed, PACKED_OUT_FEATURES, n)
    return packed


def is_packed(weight: object) -> bool:
    return hasattr(weight, PACKED_OUT_FEATURES)


def _bias32(bias: torch.Tensor | None) -> torch.Tensor | None:
    """``bias`` in float32, contiguous: converted once and kept on the bias (again only after it changes)."""
    if bias is None or (bias.dtype is torch.float32 and bias.is_contiguous()):
        return bias
    cached = getattr(bias, _BIAS32, None)
    if cached is None or cached[0] != bias._version:
        cached = (bias._version, bias.detach().to(torch.float32).contiguous())
        setattr(bias, _BIAS32, cached)
    return cached[1]


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from :func:`pack`, in its dtype with float32 accumulation."""
    n, k = getattr(packed, PACKED_OUT_FEATURES), packed.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"linear: input features {x.shape[-1]} do not match the weight's {k}")
    rows = x.reshape(-1, k).to(packed.dtype).contiguous()
    out = cpu_memory.host_empty((rows.shape[0], n), packed.dtype)
    if rows.shape[0]:
        bias32 = _bias32(bias)
        status = getattr(cpu_native.library(), _KERNELS[packed.dtype][1])(
            packed.data_ptr(), rows.data_ptr(), None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
            rows.shape[0], n, k)
        if status != 0:
            raise MemoryError(f"linear: no memory for the {rows.shape[0]} x {k} row buffer of the GEMM")
    return out.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------- int8 weights (``native/gemm_int8.c``)

#: attribute holding ``(out_features, in_features)`` of an int8 weight packed here
PACKED_INT8_SHAPE = "_kunlun_int8_shape"


def int8_available() -> bool:
    """Whether int8 weights go to the native int8 GEMM on this machine."""
    return cpu_native.library() is not None


def pack_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 ``[N, K]`` weight and its ``[N]`` scales in the kernel's layout (one flat int8 tensor holding the
    tiles, then the scales and the sums the unsigned dot products subtract, padded to the tiles)."""
    n, k = qweight.shape
    lib = cpu_native.library()
    packed = weight_buffer(int(lib.kunlun_int8_packed_bytes(n, k)), torch.int8)
    q = qweight.detach().to(torch.int8).contiguous()
    s = scale.detach().to(torch.float32).contiguous()
    lib.kunlun_pack_int8(q.data_ptr(), s.data_ptr(), packed.data_ptr(), n, k)
    setattr(packed, PACKED_INT8_SHAPE, (n, k))
    return packed


def is_packed_int8(weight: object) -> bool:
    return hasattr(weight, PACKED_INT8_SHAPE)


def linear_int8(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.reference.int8_linear`` for a weight from :func:`pack_int8`; ``x`` in bf16 or float32."""
    n, k = getattr(packed, PACKED_INT8_SHAPE)
    if x.shape[-1] != k:
        raise ValueError(f"int8_linear: input features {x.shape[-1]} do not match the weight's {k}")
    rows = x.reshape(-1, k).contiguous()
    out = cpu_memory.host_empty((rows.shape[0], n), x.dtype)
    if rows.shape[0]:
        bias32 = _bias32(bias)
        status = cpu_native.library().kunlun_gemm_int8(
            packed.data_ptr(), rows.data_ptr(), None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
            rows.shape[0], n, k, x.dtype is torch.bfloat16)
        if status != 0:
            raise MemoryError(f"int8_linear: no memory for the {rows.shape[0]} x {k} quantized rows")
    return out.view(*x.shape[:-1], n)
