"""What the native GEMMs measure on the CPU that runs them instead of fixing it in the source.

The AVX2 kernel sets (``native/gemm.c``) can multiply a GEMM of many rows
two ways: each tile of the weight whole, block of rows after block of rows
(what a decode step of a few rows does, reading its weight once), or KC
reductions at a time, in float32 chunks that stay in the first-level cache
while every block of rows multiplies them (a bf16 weight widened once per
chunk). The results are the same bit for bit; which is faster, from how
many rows, depends on the microarchitecture. A whole 0.5B model's GEMMs,
both ways in turns: Zen 3 ran bf16 chunks faster from 10 rows (float32
within 2-5% at 8); Zen 4, capped to AVX2, ran them 1.25-1.5x slower at
10-24 bf16 rows and 1.4-1.5x slower at 8-32 float32 rows, faster only from
~48 bf16 rows.

So the first time a build of those kernels is loaded on a CPU,
:func:`apply` measures it. For each weight kind, GEMMs of a 0.5B model's
layer shapes (at least :data:`WEIGHT_BYTES` of weights, more than a
last-level cache holds, streamed as a step streams them) run both ways in
turns at each of :data:`CANDIDATE_ROWS`; tiles go in chunks from the row
count that makes the measured counts fastest together (:func:`choose`), or
never. The choice is written beside the library (``<library>.tuning.json``,
one entry per CPU model and thread count, measured again when
:data:`PROCEDURE` changes or the file is deleted), set into the library at
every load, and shown by ``kunlun-infer plugins`` and ``doctor``. Processes
that load the same build at once measure it once (a lock), the others wait
and read it.
Kernel sets with one way only (AVX-512) measure nothing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kunlun_infer.plugins.cpu_device import cpu_model

log = logging.getLogger("kunlun_infer.plugin.torch-ops")

#: row counts measured both ways: a decode step of a few rows up to one pass of MC = 96 rows over a weight, and a
#: prompt's 256 rows (three passes), so that the choice also rests on a count prompts run at
CANDIDATE_ROWS = (8, 10, 12, 16, 24, 32, 48, 64, 96, 256)
#: turns of both ways at each row count (the median of the ratios decides)
TURNS = 3
#: one layer of a 0.5B model (qkv, o, gate_up, down as [out, in]); copies of it make up WEIGHT_BYTES at least
LAYER_SHAPES = ((1152, 896), (896, 896), (9728, 896), (896, 4864))
WEIGHT_BYTES = 64 << 20
#: how the choice is measured and made; a record of another procedure (or of none: the first) is measured again
PROCEDURE = 2
#: what the C kernels take for "never in chunks"
NEVER = 2 ** 63 - 1
#: weight kinds: name -> (torch dtype, pack, GEMM, the kind's argument position in kunlun_gemm_set_chunk_rows)
KINDS = {"float32": (torch.float32, "kunlun_pack_f32", "kunlun_gemm_f32", 0),
         "bfloat16": (torch.bfloat16, "kunlun_pack_bf16", "kunlun_gemm_bf16", 1)}


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Rows from which each weight kind's GEMM takes its tiles in chunks (``None``: never), and what decided it:
    per kind and row count, the median time in chunks over the time whole."""

    chunk_rows: dict[str, int | None]
    ratios: dict[str, dict[int, float]]
    seconds: float

    def describe(self) -> str:
        return describe_chunk_rows(self.chunk_rows)


def describe_chunk_rows(chunk_rows: dict[str, int | None], how: str = "measured on this CPU") -> str:
    rows = ", ".join(f"{kind} {'never' if n is None else f'from {n} rows'}" for kind, n in chunk_rows.items())
    return f"GEMM tiles in chunks: {rows} ({how})"


def has_chunks(lib: ctypes.CDLL) -> bool:
    """Whether this build has a second way to measure (``False`` for AVX-512 builds and builds before it)."""
    return hasattr(lib, "kunlun_gemm_chunk_rows") and lib.kunlun_gemm_chunk_rows(0) >= 0


def choose(ratios: dict[int, float]) -> int | None:
    """The row count from which taking tiles in chunks makes the measured counts fastest together: the one whose
    counts at and above it have the smallest product of ratios (chunks / whole), below 1; ``None`` (never) where
    none is. A product, not a win at every count: near 96 rows the two ways are within a few per cent on Zen 4,
    and one count's noise had turned a win into "never" (bf16 GEMMs of 256 rows then 1-11% slower). Of equal
    products the larger count is taken (nothing measured for going further)."""
    chosen, best, product = None, 1.0, 1.0
    for rows in sorted(ratios, reverse=True):
        product *= ratios[rows]
        if product < best:
            chosen, best = rows, product
    return chosen


def chunk_rows_of(lib: ctypes.CDLL) -> dict[str, int | None]:
    """What ``lib`` is set to (a build with two ways, see :func:`has_chunks`)."""
    return {kind: None if (rows := lib.kunlun_gemm_chunk_rows(position)) == NEVER else rows
            for kind, (*_, position) in KINDS.items()}


def set_chunk_rows(lib: ctypes.CDLL, chunk_rows: dict[str, int | None]) -> None:
    """Set into ``lib`` from how many rows each weight kind's GEMMs take tiles in chunks (``None``: never)."""
    args = [0, 0]
    for kind, rows in chunk_rows.items():
        args[KINDS[kind][3]] = NEVER if rows is None else rows
    lib.kunlun_gemm_set_chunk_rows(*args)


def measure(lib: ctypes.CDLL, kind: str, rows_list=CANDIDATE_ROWS, turns: int = TURNS,
            clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Per row count, the median over ``turns`` of (GEMMs in chunks) / (GEMMs whole), for ``kind`` weights.
    The other kind's setting is kept; this kind's is left at the last way measured (:func:`apply` sets it)."""
    dtype, pack_name, gemm_name, _ = KINDS[kind]
    layer = sum(n * k for n, k in LAYER_SHAPES) * dtype.itemsize
    copies = -(-WEIGHT_BYTES // layer)
    g = torch.Generator().manual_seed(0)
    tile = int(lib.kunlun_gemm_tile_n())
    weights = []
    for _ in range(copies):
        for n, k in LAYER_SHAPES:
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            packed = torch.empty(-(-n // tile) * tile, k, dtype=dtype)
            getattr(lib, pack_name)(w.data_ptr(), packed.data_ptr(), n, k)
            weights.append((packed, n, k))
    gemm = getattr(lib, gemm_name)
    others = {other: rows for other, rows in chunk_rows_of(lib).items() if other != kind}
    x = {k: torch.randn(max(rows_list), k, generator=g).to(dtype) for k in sorted({k for _, k in LAYER_SHAPES})}
    out = torch.empty(max(rows_list) * max(n for n, _ in LAYER_SHAPES), dtype=dtype)

    def run(rows: int, chunk_from: int) -> float:
        set_chunk_rows(lib, {**others, kind: chunk_from})
        start = clock()
        for packed, n, k in weights:
            if gemm(packed.data_ptr(), x[k].data_ptr(), None, out.data_ptr(), rows, n, k):  # x[k]'s first rows
                raise MemoryError(f"no memory for the row buffer of a {rows}-row GEMM")
        return clock() - start

    ratios = {}
    for rows in rows_list:
        run(rows, rows)  # warm: the row buffer, the pages of the output
        samples = []
        for turn in range(turns):
            if turn % 2:  # each way goes first in every other turn
                whole, chunks = run(rows, rows + 1), run(rows, rows)
            else:
                chunks, whole = run(rows, rows), run(rows, rows + 1)
            samples.append(chunks / whole)
        ratios[rows] = statistics.median(samples)
    return ratios


def _key() -> str:
    return f"{cpu_model()}, {torch.get_num_threads()} threads"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _from_entry(entry: dict) -> Tuning:
    return Tuning({kind: entry["chunk_rows"][kind] for kind in KINDS},
                  {kind: {int(r): v for r, v in entry["ratios"][kind].items()} for kind in KINDS},
                  float(entry["seconds"]))


def tuning_file(library_path: Path) -> Path:
    return library_path.with_name(library_path.name + ".tuning.json")


def recorded(library_path: Path) -> Tuning | None:
    """The choice measured for the build at ``library_path`` on this CPU and thread count, if there is one."""
    entry = _read(tuning_file(library_path)).get(_key())
    try:
        return None if entry is None or entry.get("procedure") != PROCEDURE else _from_entry(entry)
    except (KeyError, TypeError, ValueError):
        return None


def apply(lib: ctypes.CDLL, library_path: Path,
          measure_kind: Callable[[ctypes.CDLL, str], dict[int, float]] | None = None) -> Tuning | None:
    """Set the measured choice into ``lib`` (built at ``library_path``), measuring it first (by ``measure_kind``,
    default :func:`measure`) if this CPU and thread count have none recorded; ``None`` for a build with nothing
    to choose."""
    if not has_chunks(lib):
        return None
    path = tuning_file(library_path)
    with open(library_path.with_name(library_path.name + ".tuning.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others then read what it wrote
        tuning = recorded(library_path)
        if tuning is None:
            log.info("measuring the native GEMMs' two ways on this CPU (once per build; a few seconds)")
            start = time.perf_counter()
            ratios = {kind: (measure_kind or measure)(lib, kind) for kind in KINDS}
            tuning = Tuning({kind: choose(r) for kind, r in ratios.items()}, ratios, time.perf_counter() - start)
            entries = _read(path)
            entries[_key()] = {**dataclasses.asdict(tuning), "procedure": PROCEDURE}
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1)
            os.replace(tmp, path)
            log.info("%s, in %.1f s", tuning.describe(), tuning.seconds)
    set_chunk_rows(lib, tuning.chunk_rows)
    return tuning
