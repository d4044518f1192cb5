"""The host kernels written in C (``plugins/native``), one build per instruction set, chosen by what the CPU has.

A *kernel set* is the whole of ``native/*.c`` compiled for one instruction
set (``simd.h`` gives the sources one vector vocabulary): ``avx512-bf16``
(AVX-512 with the bf16 and VNNI dot products), ``amx`` (the same, its bf16
and int8 GEMMs on the AMX tiles), ``avx512-vnni`` (AVX-512 with the VNNI dot
products but none for bf16, as Cascade Lake and Ice Lake Xeons have: bf16
weights widened to float32 in registers), ``avx512-core`` (AVX-512 F/BW/VL
alone, as Skylake Xeons have: int8 without VNNI too), ``avx2-vnni`` and ``avx2``
(AVX2 + FMA + F16C, bf16 weights widened to float32 in registers; int8 dot
products through AVX-VNNI where the CPU has it). :func:`selection` — the one
place that decides — takes the best set this CPU runs
(:func:`~kunlun_infer.plugins.cpu_device.cpu_flags`, capped by
``$KUNLUN_INFER_CPU_ISA``), builds it with ``$CC`` (default ``cc``) into the
user's cache (``$XDG_CACHE_HOME/kunlun_infer/kernels``, keyed by sources,
flags and compiler) the first time a kernel is needed, and loads it (an
AVX2 build then measures once per CPU from how many rows its GEMMs take
tiles in chunks: :mod:`~kunlun_infer.plugins.cpu_tuning`).
With no set fitting the CPU, no compiler, or a failed build, the ops keep
to their torch implementations; the reason is logged once and shown by
``kunlun-infer plugins`` and ``doctor``. The kernels parallelise with
OpenMP on the runtime torch already loaded, so they follow
``torch.set_num_threads``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kunlun_infer.plugins import cpu_capture, cpu_tuning
from kunlun_infer.plugins.cpu_device import ISA_ENV, cpu_flags, cpu_vendor

log = logging.getLogger("kunlun_infer.plugin.torch-ops")

SOURCES = tuple(sorted((Path(__file__).parent / "native").glob("*.c")))
#: included by the sources; part of the build's cache key so an edit rebuilds
HEADERS = tuple(sorted((Path(__file__).parent / "native").glob("*.h")))
#: how each source becomes an object, and how the objects become one shared library (with the kernel set's flags)
COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The native sources built for one instruction set: what the CPU must have, how the compiler is told."""

    name: str
    requires: frozenset[str]
    flags: tuple[str, ...]
    summary: str


#: every kernel set, best first; the first whose ``requires`` the CPU has is chosen
KERNEL_SETS: tuple[KernelSet, ...] = (
    KernelSet("amx", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma", "amx_tile",
                                "amx_bf16", "amx_int8"}),
              ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx2", "-mfma",
               "-mf16c", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
              "AVX-512 kernels, bf16 and int8 GEMMs on the AMX tiles"),
    KernelSet("avx512-bf16", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma"}),
              ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx2", "-mfma",
               "-mf16c"),
              "AVX-512 kernels, bf16 dot products (VDPBF16PS) and int8 (VNNI)"),
    KernelSet("avx512-vnni", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma"}),
              ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
              "AVX-512 kernels, bf16 widened to float32 in registers, int8 (VNNI)"),
    KernelSet("avx512-core", frozenset({"avx512f", "avx512bw", "avx512vl", "fma"}),
              ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"),
              "AVX-512 kernels, bf16 widened to float32 in registers, int8 without VNNI"),
    KernelSet("avx2-vnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}), ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
              "AVX2 + FMA kernels, bf16 widened to float32 in registers, int8 through AVX-VNNI"),
    KernelSet("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c"),
              "AVX2 + FMA kernels, bf16 widened to float32 in registers"),
)

#: CPU vendors whose one-row GEMMs with AVX-512 ask for their weight ahead (into the second-level cache) where the
#: kernels otherwise ask for nothing (``UNPREFETCHED`` in ``native/simd.h``). On the Xeon with AMX capped to the
#: vector paths, 24 layers' and the head's GEMMs at one row in turns: bf16 by VDPBF16PS (the ``avx512-bf16`` set, a
#: Xeon whose OS grants no AMX) 0.88x the time, int8 by VNNI (``avx512-vnni``, a Cascade Lake or Ice Lake Xeon)
#: 0.96x; a batch-1 decode step in the engine, six turns each: bf16 48.8 -> 46.2 ms, int8 24.8 -> 24.4 (medians,
#: faster in every turn). On the Zen 4 a bf16 batch-1 step took 1.08x the time asking ahead, so AMD's CPUs ask
#: for nothing. Only the bf16 GEMMs by VDPBF16PS follow this now: int8 asks ahead at one row on every CPU since its
#: rows are packed as wide as a block's rows (``native/gemm_int8.c``).
ONE_ROW_PREFETCH_VENDORS = frozenset({"GenuineIntel"})

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
#: name -> (argument types, result type) of every exported kernel
SIGNATURES = {
    "kunlun_gemm_tile_n": ([], _I64),
    "kunlun_gemm_set_chunk_rows": ([_I64, _I64], ctypes.c_int),
    "kunlun_gemm_chunk_rows": ([ctypes.c_int], _I64),
    "kunlun_gemm_set_one_row_prefetch": ([ctypes.c_int], ctypes.c_int),
    "kunlun_gemm_one_row_prefetch": ([], ctypes.c_int),
    "kunlun_gemm_f32_chunk": ([_I64, _I64], _I64),
    "kunlun_pack_bf16": ([_P, _P, _I64, _I64], None),
    "kunlun_gemm_bf16": ([_P, _P, _P, _P, _I64, _I64, _I64], ctypes.c_int),
    "kunlun_pack_f32": ([_P, _P, _I64, _I64], None),
    "kunlun_gemm_f32": ([_P, _P, _P, _P, _I64, _I64, _I64], ctypes.c_int),
    "kunlun_fma_probe": ([_I64], ctypes.c_double),
    "kunlun_read_probe": ([_P, _I64], ctypes.c_double),
    "kunlun_int8_packed_bytes": ([_I64, _I64], _I64),
    "kunlun_pack_int8": ([_P, _P, _P, _I64, _I64], None),
    "kunlun_gemm_int8": ([_P, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int], ctypes.c_int),
    "kunlun_paged_decode_attention": ([_P, _P, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                       ctypes.c_float, ctypes.c_int], ctypes.c_int),
    "kunlun_decode_attention_on_tiles": ([ctypes.c_int, _I64, _I64, _I64], ctypes.c_int),
    "kunlun_prompt_attention_on_tiles": ([ctypes.c_int, _I64], ctypes.c_int),
    "kunlun_paged_prefill_attention": ([_P, _P, _P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                        ctypes.c_float, ctypes.c_int], ctypes.c_int),
    "kunlun_rms_norm": ([_P, _P, _P, _P, _P, _I64, _I64, ctypes.c_float, ctypes.c_int], None),
    "kunlun_silu_and_mul": ([_P, _P, _I64, _I64, ctypes.c_int], None),
    "kunlun_rotary": ([_P, _P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, ctypes.c_int],
                      ctypes.c_int),
    "kunlun_apply_token_bitmask": ([_P, _I64, _I64, _P, _I64, _P, _I64], None),
    "kunlun_greedy_tokens": ([_P, _I64, _I64, _I64, _P], None),
    "kunlun_sample_tokens": ([_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, ctypes.c_float, _I64, _P], ctypes.c_int),
    "kunlun_store_kv": ([_P, _I64, _P, _I64, _P, _P, _I64, _P, _I64, _I64], ctypes.c_int),
    "kunlun_replay_layout": ([_I64], _I64),
    "kunlun_replay": ([_P, _I64], _I64),
    "kunlun_host_arrive": ([_P, _I64], None),
    "kunlun_host_await": ([_P, _I64, _I64, _P, ctypes.c_double, ctypes.c_double, ctypes.c_double], _I64),
    "kunlun_host_all_reduce": ([_P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, ctypes.c_float], ctypes.c_int),
    "kunlun_host_all_to_all": ([_P, _I64, _I64, _P, _I64, _P, _P, _P, _P, _I64, _P, ctypes.c_float, _P], ctypes.c_int),
}


@dataclasses.dataclass(frozen=True)
class Selection:
    """What serves the host ops on this machine, and why.

    ``name``: the kernel set's (``amx``, ``avx512-bf16``, ``avx512-vnni``, ``avx512-core``, ``avx2-vnni``,
    ``avx2``) or ``torch`` (no native kernels). ``kernel_set``: the native build in use (``None`` for
    ``torch``); ``library``: it, loaded. ``bf16_linear``: who multiplies bf16 weights (``native``, ``onednn``
    — torch's, on a CPU with AMX — or ``torch``). ``reason``: one line a user can act on.
    """

    name: str
    kernel_set: KernelSet | None
    library: ctypes.CDLL | None
    bf16_linear: str
    reason: str

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for folder in (Path(base) / "kunlun_infer" / "kernels", Path(tempfile.gettempdir()) / "kunlun_infer_kernels"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        except OSError:
            continue
    raise OSError("no writable cache folder for the compiled kernels")


def compile_sources(cc: str, kernel_set: KernelSet, sources: tuple[Path, ...], target: Path) -> None:
    """Compile ``sources`` (with the headers beside them) for ``kernel_set`` into the shared library ``target``,
    which appears whole or not at all (built in a temporary folder and renamed: concurrent builders do not see
    half a library).

    Each source is compiled to an object of its own, one compiler a core at once, and the objects are linked:
    the build takes about as long as its longest source rather than their sum. Zen 5, 2 cores, the avx512-bf16
    set: 13.3 s one source after another (the decode attention 4.5 s, the int8 GEMM 4.3), ~7 s two at a time."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        objects = [Path(work) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]

        def run(command: list[str]) -> None:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(sources), _cores()))) as pool:
            # the largest sources (the longest to compile) first, so that the short ones fill in beside them
            order = sorted(range(len(sources)), key=lambda i: -sources[i].stat().st_size)
            builds = {i: pool.submit(run, [cc, *COMPILE_FLAGS, *kernel_set.flags, "-c", str(sources[i]), "-o",
                                           str(objects[i])]) for i in order}
            for i in range(len(sources)):  # the first source (in order) that failed raises, once all are done
                builds[i].result()
        library = Path(work) / target.name
        run([cc, *LINK_FLAGS, *kernel_set.flags, *map(str, objects), "-o", str(library)])
        os.replace(library, target)


def _cores() -> int:
    """Cores this process may run on (its affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.cache
def _digest(cc: str, kernel_set: KernelSet) -> str:
    """The build's key: its sources, flags and compiler (asked for its version once per process)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(" ".join((*COMPILE_FLAGS, *LINK_FLAGS, *kernel_set.flags)).encode() + version.encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _target(cc: str, kernel_set: KernelSet) -> Path:
    """Where the build of the sources for ``kernel_set`` by ``cc`` lives in the cache."""
    return _cache_dir() / f"kunlun_cpu-{kernel_set.name}-{_digest(cc, kernel_set)}.so"


def _build(cc: str, kernel_set: KernelSet) -> Path:
    """Compile the sources for ``kernel_set`` into the cache, once per sources, flags and compiler."""
    target = _target(cc, kernel_set)
    if not target.exists():
        compile_sources(cc, kernel_set, SOURCES, target)
    return target


def compiler() -> tuple[str, str | None]:
    """The C compiler the kernels are built with: ``$CC`` (default ``cc``), and its path (``None``: not found)."""
    name = os.environ.get("CC", "cc")
    return name, shutil.which(name)


def open_library(path: Path, strict: bool = True) -> ctypes.CDLL:
    """The built kernels at ``path``, loaded, with the argument and result types of every kernel in
    :data:`SIGNATURES` (``strict=False``: of those it exports, as an older build may lack the newest)."""
    torch.get_num_threads()  # torch's OpenMP runtime is loaded first, so the kernels share its threads
    lib = ctypes.CDLL(str(path))
    for function, (argtypes, restype) in SIGNATURES.items():
        if not strict and not hasattr(lib, function):
            continue
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = restype
    return lib


def _isa_note() -> str:
    cap = os.environ.get(ISA_ENV, "").strip()
    return f"; {ISA_ENV}={cap}" if cap and cap != "native" else ""


def planned() -> tuple[KernelSet | None, str]:
    """The kernel set this CPU gets and why, from its flags alone (nothing is built)."""
    flags = cpu_flags()
    for i, candidate in enumerate(KERNEL_SETS):
        if candidate.requires <= flags:
            better = KERNEL_SETS[:i]
            lacks = f"; the CPU lacks {', '.join(sorted(better[0].requires - flags))} for {better[0].name}" \
                if better else ""
            return candidate, f"{candidate.summary}{lacks}{_isa_note()}"
    weakest = KERNEL_SETS[-1]
    return None, f"the CPU lacks {', '.join(sorted(weakest.requires - flags))}{_isa_note()}"


@functools.cache
def load(kernel_set: KernelSet) -> ctypes.CDLL:
    """``kernel_set`` built (or found in the cache) and loaded; raises ``OSError``/``SubprocessError`` on failure."""
    name, path = compiler()
    if path is None:
        raise OSError(f"no C compiler '{name}' found (set $CC)")
    built = _build(path, kernel_set)
    lib = open_library(built)
    lib.kunlun_gemm_set_one_row_prefetch(int(cpu_vendor() in ONE_ROW_PREFETCH_VENDORS))
    try:
        cpu_tuning.apply(lib, built)
    except (OSError, MemoryError) as exc:  # no lock or record in the cache, no memory: the compiled defaults stay
        log.warning("the native GEMMs keep their default ways: could not record what this CPU measured (%s)", exc)
    return lib


@functools.cache
def selection() -> Selection:
    """Which kernels serve the host ops here (decided once per process; tests clear the cache)."""
    kernel_set, reason = planned()
    amx = "amx_bf16" in cpu_flags()  # without native kernels oneDNN multiplies bf16 weights on the tiles
    if kernel_set is None:
        log.info("native CPU kernels not used: %s; using torch's kernels", reason)
        return Selection("torch", None, None, "onednn" if amx else "torch", reason)
    try:
        lib = load(kernel_set)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
        why = f"the {kernel_set.name} kernels did not build: {detail[-1] if detail else exc}"
        log.info("native CPU kernels not used: %s; using torch's kernels", why)
        return Selection("torch", None, None, "onednn" if amx else "torch", why)
    if hasattr(lib, "kunlun_amx_tiles") and not lib.kunlun_amx_tiles():
        reason += "; the OS did not grant the AMX tile state (Linux 5.16 or later does), so the GEMMs use the " \
                  "AVX-512 dot products"
    chosen = Selection(kernel_set.name, kernel_set, lib, "native", reason + _measured_note(kernel_set))
    log.info("native CPU kernels: %s", chosen.describe())
    return chosen


def library() -> ctypes.CDLL | None:
    """The loaded kernels of :func:`selection`, or ``None`` when this machine cannot build or run them.

    While this thread captures a step (:mod:`kunlun_infer.plugins.cpu_capture`), the same kernels behind a
    recorder."""
    lib = selection().library
    return None if lib is None else cpu_capture.recorder(lib)


def describe_planned() -> str:
    """One line for ``kunlun-infer plugins`` / ``doctor``: the kernel set chosen here and why (builds nothing).

    It is the ops plugin's ``cpu_kernels`` stack entry, which the version matrix compares between doctor runs, so
    it holds what decides the code that runs and nothing this CPU measured: a doctor run recorded before the
    kernels first loaded (and measured, :mod:`cpu_tuning`), or at another thread count, had made the same install
    a "new" config to ``plugins --matrix``. What was measured is in the selection's reason and logged as the
    kernels load."""
    kernel_set, reason = planned()
    if kernel_set is None:
        return f"torch ({reason})"
    cc, path = compiler()
    if path is None:
        return f"torch (no C compiler '{cc}' to build the {kernel_set.name} kernels)"
    return f"{kernel_set.name} ({reason})"


def _measured_note(kernel_set: KernelSet) -> str:
    """``"; "`` and what the build of ``kernel_set`` measured on this CPU (:mod:`cpu_tuning`), or ``""``."""
    _, path = compiler()
    try:
        tuning = None if path is None else cpu_tuning.recorded(_target(path, kernel_set))
    except (OSError, subprocess.SubprocessError):
        tuning = None
    return f"; {tuning.describe()}" if tuning else ""
