"""The host kernels written in C (``plugins/native/*.c``): built once per machine, loaded with ctypes.

:func:`library` compiles every source with ``$CC`` (default ``cc``) into one
shared library in the user's cache (``$XDG_CACHE_HOME/kunlun_infer/kernels``,
keyed by the sources, flags and compiler), the first time a kernel is
needed, and loads it. It returns ``None`` — and the ops keep to their torch
implementations — when the CPU lacks AVX512-BF16, no compiler is found or
the build fails; the reason is logged once. The kernels parallelise with
OpenMP on the runtime torch already loaded, so they follow
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

SOURCES = tuple(sorted((Path(__file__).parent / "native").glob("*.c")))
#: included by the sources; part of the build's cache key so an edit rebuilds
HEADERS = tuple(sorted((Path(__file__).parent / "native").glob("*.h")))
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
#: name -> (argument types, result type) of every exported kernel
SIGNATURES = {
    "kunlun_pack_bf16": ([_P, _P, _I64, _I64], None),
    "kunlun_gemm_bf16": ([_P, _P, _P, _P, _I64, _I64, _I64], None),
    "kunlun_paged_decode_attention": ([_P, _P, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                       ctypes.c_float, ctypes.c_int], ctypes.c_int),
    "kunlun_rms_norm": ([_P, _P, _P, _P, _P, _I64, _I64, ctypes.c_float, ctypes.c_int], None),
    "kunlun_silu_and_mul": ([_P, _P, _I64, _I64, ctypes.c_int], None),
    "kunlun_rotary": ([_P, _P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int],
                      ctypes.c_int),
}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for folder in (Path(base) / "kunlun_infer" / "kernels", Path(tempfile.gettempdir()) / "kunlun_infer_kernels"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        except OSError:
            continue
    raise OSError("no writable cache folder for the compiled kernels")


def _build(compiler: str) -> Path:
    """Compile the sources into the cache (once; concurrent builders each write a temp file, then rename)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(" ".join(FLAGS).encode() + version.encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    target = _cache_dir() / f"kunlun_cpu-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], check=True, capture_output=True,
                           text=True, timeout=300)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or ``None`` when this machine cannot build or run them."""
    flags = cpu_flags()
    if not REQUIRED_CPU_FLAGS <= flags:
        log.debug("native CPU kernels not used: the CPU lacks %s", ", ".join(sorted(REQUIRED_CPU_FLAGS - flags)))
        return None
    name = os.environ.get("CC", "cc")
    compiler = shutil.which(name)
    if compiler is None:
        log.info("native CPU kernels not built: no C compiler (%s) found; using torch's kernels", name)
        return None
    torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so the kernels share its threads
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
        log.info("native CPU kernels not built (%s); using torch's kernels", detail[-1] if detail else exc)
        return None
    for function, (argtypes, restype) in SIGNATURES.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib
