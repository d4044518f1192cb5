"""The AVX512-BF16 GEMM of ``cpu_gemm.c``: built once per machine with the C compiler, called through ctypes.

Why a kernel of our own: oneDNN's bf16 inner product streams a weight at
about half the memory bandwidth when a decode step multiplies it with one
to a few rows, and that is where a CPU spends a decode step. The kernel
here reads each weight once per step as a sequential stream and uses
every 64-byte load for 16 outputs (see the C file for the layout).

:func:`gemm_library` compiles the source with ``$CC`` (default ``cc``) into
the user's cache (``$XDG_CACHE_HOME/kunlun_infer/kernels``, keyed by the
source, flags and compiler) the first time it is needed, and loads it. It
returns ``None`` — and the caller keeps to oneDNN or ``F.linear`` — when the
CPU lacks AVX512-BF16, has AMX (where oneDNN's tile kernels are faster),
no compiler is found or the build fails; the reason is logged once.
The OpenMP runtime is the one torch already loaded, so the kernel follows
``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kunlun_infer.plugins.cpu_device import cpu_flags

log = logging.getLogger("kunlun_infer.plugin.torch-ops")

SOURCE = Path(__file__).with_name("cpu_gemm.c")
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
#: output features per packed tile (``TILE_N`` in the C source)
TILE_N = 32
#: attribute holding the true output features of a weight packed here
PACKED_OUT_FEATURES = "_kunlun_gemm_out_features"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base) / "kunlun_infer" / "kernels"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except OSError:
        folder = Path(tempfile.gettempdir()) / "kunlun_infer_kernels"
        folder.mkdir(parents=True, exist_ok=True)
        return folder


def _build(compiler: str) -> Path:
    """Compile the source into the cache (once; concurrent builders each write a temp file, then rename)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_gemm-{key}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def gemm_library() -> ctypes.CDLL | None:
    """The loaded kernel library, or ``None`` when this machine should not (or cannot) use it."""
    flags = cpu_flags()
    if not REQUIRED_CPU_FLAGS <= flags:
        log.debug("bf16 GEMM kernel not used: the CPU lacks %s", ", ".join(sorted(REQUIRED_CPU_FLAGS - flags)))
        return None
    if "amx_bf16" in flags:
        log.debug("bf16 GEMM kernel not used: the CPU has AMX, which oneDNN uses")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("bf16 GEMM kernel not built: no C compiler (%s) found; using oneDNN", os.environ.get("CC", "cc"))
        return None
    torch.get_num_threads()  # torch's OpenMP runtime is loaded before the kernel's, so both share it
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log.info("bf16 GEMM kernel not built (%s); using oneDNN", str(detail).strip().splitlines()[-1:])
        return None
    lib.kunlun_pack_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    lib.kunlun_gemm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
    lib.kunlun_pack_bf16.restype = lib.kunlun_gemm_bf16.restype = None
    return lib


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes this weight (2-D bf16 on the host, even in-features, library present)."""
    return (weight.dtype is torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and weight.shape[1] > 0 and gemm_library() is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the kernel's tiled layout: a new ``[ceil(N/32)*32, K]`` tensor."""
    n, k = weight.shape
    src = weight.detach().contiguous()
    packed = torch.empty(-(-n // TILE_N) * TILE_N, k, dtype=torch.bfloat16)
    gemm_library().kunlun_pack_bf16(src.data_ptr(), packed.data_ptr(), n, k)
    setattr(packed, PACKED_OUT_FEATURES, n)
    return packed


def is_packed(weight: object) -> bool:
    return hasattr(weight, PACKED_OUT_FEATURES)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight from :func:`pack`, in bf16 with float32 accumulation."""
    n, k = getattr(packed, PACKED_OUT_FEATURES), packed.shape[1]
    rows = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    if rows.shape[0]:
        bias32 = None if bias is None else bias.detach().to(torch.float32).contiguous()
        gemm_library().kunlun_gemm_bf16(packed.data_ptr(), rows.data_ptr(),
                                        None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
                                        rows.shape[0], n, k)
    return out.view(*x.shape[:-1], n)
