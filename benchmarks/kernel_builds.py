"""Builds of the native CPU kernels against each other, in one process, in turns.

On a shared host the memory bandwidth and the FMA rate move within minutes,
so two builds measured one after the other can differ by more than the
change between them. This loads several builds of ``plugins/native`` at
once (each its own shared library: ``ctypes`` keeps their symbols apart)
and calls the same work on each in turn, so that every build meets the same
minutes of the host; the medians and their ratios to the first build are
printed with the CPU model, ISA flags, threads and kernel set.

A build is ``NAME=SOURCE``: a git revision (``HEAD``, ``main~3``, a
commit), whose ``src/kunlun_infer/plugins/native`` is taken from git; a
folder holding the sources; or the working tree's sources with some files
replaced, ``NAME=gemm.c:/tmp/gemm_variant.c[,simd.h:/tmp/simd.h]``; ``.``
is the working tree as it is. Each build is compiled for the kernel set
this process chooses (``KUNLUN_INFER_CPU_ISA=avx2`` takes the AVX2 one on a
newer CPU) with the flags ``cpu_native`` uses. Where the builds have the
AVX2 GEMMs' two ways, from how many rows they take chunks is measured as the
engine does (``cpu_tuning``) on the first build and set into every other
one, so that builds are compared on the same way rather than on two
measurements of near-equal ways on a noisy host (``--chunk-rows each``: every
build measures its own, as the engine would; ``--chunk-rows 64,32``: float32
and bf16 rows set into every build, ``never`` for either). A build from
before the setting keeps its compiled choice.

Work:

- ``gemm``: a whole Qwen2-shaped 0.5B model's layer GEMMs (every weight its
  own copy, packed by each build's own packing) at the given row counts, in
  ``--dtype`` (``int8``: int8 weights on bf16 rows); the outputs of each
  build are compared with the first's and the largest difference printed
  (0 for builds bit for bit the same);
- ``prompt-attention``: ``kunlun_paged_prefill_attention`` over the shapes,
  heads and head size of ``prompt_attention.py``;
- ``decode-attention``: ``kunlun_paged_decode_attention`` as one decode step
  calls it (24 layers each with a cache of its own, in huge pages as the
  engine's, blocks scattered, or with ``--blocks ordered`` each sequence's
  blocks one after another, as a fresh engine's cache holds them), at ``DECODE_SHAPES``: the 0.5B model's heads
  (14 query heads over 2 KV heads of 64, or ``--heads`` and ``--head-size``), and one sequence of a
  model with a single KV head, split among the threads; ``--warm`` runs every
  layer over one cache, so that where it fits the CPU's caches the kernel's
  own work is timed without the wait for memory.

Example::

    python benchmarks/kernel_builds.py --work gemm --dtype bfloat16 --rows 1,8,32,256 before=HEAD~1 after=.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kunlun_infer.ops import reference
from kunlun_infer.plugins import cpu_gemm, cpu_memory, cpu_native, cpu_tuning

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402  (a sibling file: what every benchmark records of the machine)
import perf_cpu  # noqa: E402  (the 0.5B model's shape)
import prompt_attention  # noqa: E402  (its shapes and inputs)

REPO = Path(__file__).resolve().parent.parent
NATIVE = "src/kunlun_infer/plugins/native"


def sources(spec: str, into: Path) -> Path:
    """The native sources a build spec names, written into the folder ``into``."""
    into.mkdir(parents=True)
    if spec == "." or ":" in spec:
        for path in cpu_native.SOURCES + cpu_native.HEADERS:
            shutil.copy(path, into / path.name)
        for pair in spec.split(",") if spec != "." else []:
            name, _, replacement = pair.partition(":")
            if not (into / name).exists():
                raise SystemExit(f"{spec}: {name} is not one of the native sources ({NATIVE})")
            shutil.copy(replacement, into / name)
    elif Path(spec).is_dir():
        for path in Path(spec).iterdir():
            if path.suffix in (".c", ".h"):
                shutil.copy(path, into / path.name)
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", spec, NATIVE], capture_output=True)
        if archive.returncode != 0:
            raise SystemExit(f"{spec}: neither a folder, nor NAME:PATH replacements, nor a git revision "
                             f"({archive.stderr.decode().strip()})")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    (into / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    return into


def build(name: str, spec: str, work: Path, chunk_rows: dict[str, int | None] | None = None) -> ctypes.CDLL:
    """Compile and load the build ``spec`` as ``name``; its GEMMs take chunks from ``chunk_rows`` (``None``:
    measured, as the engine does)."""
    kernel_set = cpu_native.selection().kernel_set
    if kernel_set is None:
        raise SystemExit(f"no native kernels here: {cpu_native.selection().reason}")
    cc, path = cpu_native.compiler()
    if path is None:
        raise SystemExit(f"no C compiler '{cc}' found (set $CC)")
    folder = sources(spec, work / name)
    target = work / f"{name}.so"
    cpu_native.compile_sources(path, kernel_set, tuple(sorted(folder.glob("*.c"))), target)
    lib = cpu_native.open_library(target, strict=False)
    if cpu_tuning.has_chunks(lib):
        if chunk_rows is None:  # what the engine measures on this CPU for a build of these sources
            print(f"{name}: {cpu_tuning.apply(lib, target).describe()}", flush=True)
        else:
            cpu_tuning.set_chunk_rows(lib, chunk_rows)
            print(f"{name}: {cpu_tuning.describe_chunk_rows(chunk_rows, 'set')}", flush=True)
    return lib


def chunk_rows_option(value: str) -> str | dict[str, int | None]:
    """``--chunk-rows``: ``first``, ``each``, or ``F32,BF16`` row counts (``never`` for either)."""
    if value in ("first", "each"):
        return value
    parts = value.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return {kind: None if part == "never" else int(part) for kind, part in zip(cpu_tuning.KINDS, parts)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give first, each, or two row counts FLOAT32,BF16 "
                                         f"(never for either), e.g. 64,32") from None


def heads_option(value: str) -> tuple[int, int]:
    """``--heads``: ``QUERY/KV`` head counts, the query heads a multiple of the KV heads (e.g. 32/4)."""
    hq, _, hk = value.partition("/")
    try:
        heads = int(hq), int(hk)
    except ValueError:
        heads = (0, 0)
    if min(heads) < 1 or heads[0] % heads[1]:
        raise argparse.ArgumentTypeError(f"{value!r}: give QUERY/KV head counts, the query heads a multiple of the "
                                         f"KV heads, e.g. 32/4")
    return heads


def build_all(named: dict[str, str], work: Path, chunk_rows: str | dict[str, int | None]) -> dict[str, ctypes.CDLL]:
    """Every build, loaded, with the chunk rows ``--chunk-rows`` says (``first``: the first build's measurement)."""
    libs = {}
    for name, spec in named.items():
        lib = libs[name] = build(name, spec, work, chunk_rows if isinstance(chunk_rows, dict) else None)
        if chunk_rows == "first" and cpu_tuning.has_chunks(lib):
            chunk_rows = cpu_tuning.chunk_rows_of(lib)
    return libs


# the GEMM (and packing) of each weight dtype
KINDS = {torch.bfloat16: "bf16", torch.float32: "f32", torch.int8: "int8"}


def gemm_inputs(shape: perf_cpu.Shape, dtype: torch.dtype, rows: int
                ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """A model's layer weights (each its own) and the rows for each input width, in the rows' dtype (bf16 for
    ``int8``: a bf16 model quantized at load, as ``model.quantization=int8`` runs it)."""
    rows_dtype = torch.bfloat16 if dtype is torch.int8 else dtype
    layer = shape.layer_linears()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(rows_dtype) for n, k in layer * shape.layers]
    return weights, {k: torch.randn(rows, k, generator=g).to(rows_dtype) for _, k in layer}


def gemm_work(lib: ctypes.CDLL, dtype: torch.dtype, rows: int, shape: perf_cpu.Shape = perf_cpu.SHAPES["0.5b"]
              ) -> tuple[Callable[[], None], torch.Tensor]:
    """One pass over a whole model's layer GEMMs at ``rows`` rows, and the output of the last one (``int8``:
    int8 weights, one scale per output, quantized by the engine's rule). The packed weights lie in huge pages, as
    the engine's do (``cpu_gemm.weight_buffer``)."""
    weights, xs = gemm_inputs(shape, dtype, rows)
    packed_weights = []
    for w in weights:
        n, k = w.shape
        if dtype is torch.int8:
            q, scale = reference.quantize_int8(w)
            packed = cpu_gemm.weight_buffer(lib.kunlun_int8_packed_bytes(n, k), torch.int8)
            lib.kunlun_pack_int8(q.data_ptr(), scale.data_ptr(), packed.data_ptr(), n, k)
        else:
            tile = lib.kunlun_gemm_tile_n()
            packed = cpu_gemm.weight_buffer(-(-n // tile) * tile * k, dtype)
            getattr(lib, f"kunlun_pack_{KINDS[dtype]}")(w.data_ptr(), packed.data_ptr(), n, k)
        packed_weights.append((packed, n, k))
    y = torch.empty(rows, max(w.shape[0] for w in weights), dtype=weights[0].dtype)
    gemm = getattr(lib, f"kunlun_gemm_{KINDS[dtype]}")
    extra = (1,) if dtype is torch.int8 else ()  # the int8 GEMM's rows are bf16

    def once() -> None:
        for packed, n, k in packed_weights:
            if gemm(packed.data_ptr(), xs[k].data_ptr(), None, y.data_ptr(), rows, n, k, *extra) != 0:
                raise MemoryError("GEMM row buffer")

    return once, y


def attention_work(lib: ctypes.CDLL, dtype: torch.dtype, ctx: int, new: int):
    (hq, hk), d, block_size = prompt_attention.HEADS, prompt_attention.HEAD_SIZE, prompt_attention.BLOCK_SIZE
    q, k_cache, v_cache, table, lens = prompt_attention.inputs(ctx, new, hq, hk, d, block_size, dtype)
    out = torch.empty_like(q)
    starts, counts = torch.tensor([0], dtype=torch.int32), torch.tensor([new], dtype=torch.int32)

    def once() -> None:
        status = lib.kunlun_paged_prefill_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], table.data_ptr(), table.shape[1],
            lens.data_ptr(), starts.data_ptr(), counts.data_ptr(), out.data_ptr(), 1, hq, hk, d, block_size,
            d ** -0.5, dtype is torch.bfloat16)
        if status != 0:
            raise RuntimeError(f"kunlun_paged_prefill_attention returned {status}")

    return once, out


#: decode-attention cases: (sequences in the step, tokens of context each, (query heads, KV heads))
DECODE_SHAPES = [(8, 256, prompt_attention.HEADS), (8, 1024, prompt_attention.HEADS),
                 (32, 1024, prompt_attention.HEADS), (1, 4096, prompt_attention.HEADS), (1, 4096, (8, 1))]


def decode_attention_work(lib: ctypes.CDLL, dtype: torch.dtype, batch: int, ctx: int, heads: tuple[int, int],
                          ordered: bool = False, warm: bool = False, head_size: int = prompt_attention.HEAD_SIZE):
    """One decode step's attention over every layer's own paged cache (as cold as a step finds it), its blocks
    scattered or (``ordered``) each sequence's one after another; ``warm``: every layer over one cache, which stays in
    the CPU's caches where it fits (the kernel's work without the wait for memory)."""
    (hq, hk), d, block_size = heads, head_size, prompt_attention.BLOCK_SIZE
    layers = perf_cpu.SHAPES["0.5b"].layers
    per_seq = -(-ctx // block_size)
    g = torch.Generator().manual_seed(batch * 31 + ctx)
    shape = (batch * per_seq + 4, block_size, hk, d)

    def cache() -> torch.Tensor:  # in huge pages, as the engine's cache (cpu_memory.host_buffer)
        buffer = cpu_memory.host_buffer(shape[0] * block_size * hk * d * dtype.itemsize).view(dtype).view(shape)
        return buffer.copy_(torch.randn(shape, generator=g))

    caches = [(cache(), cache()) for _ in range(1 if warm else layers)] * (layers if warm else 1)
    blocks = torch.arange(batch * per_seq) if ordered else torch.randperm(batch * per_seq + 4, generator=g)
    table = blocks[:batch * per_seq].to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    out = torch.empty_like(q)

    def once() -> None:
        for k_cache, v_cache in caches:
            status = lib.kunlun_paged_decode_attention(
                q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], table.data_ptr(),
                table.shape[1], lens.data_ptr(), out.data_ptr(), batch, hq, hk, d, block_size, d ** -0.5,
                dtype is torch.bfloat16)
            if status != 0:
                raise RuntimeError(f"kunlun_paged_decode_attention returned {status}")

    return once, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="+", help="NAME=SOURCE (see above); the first is the baseline")
    parser.add_argument("--work", choices=("gemm", "prompt-attention", "decode-attention"), default="gemm")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "int8"),
                        help="weights (int8: gemm only, on bf16 rows)")
    parser.add_argument("--rows", default="1,8,32,256", help="gemm: row counts")
    parser.add_argument("--blocks", choices=("scattered", "ordered"), default="scattered",
                        help="decode-attention: the cache's blocks scattered, or each sequence's in order")
    parser.add_argument("--warm", action="store_true",
                        help="decode-attention: every layer over one cache, warm in the CPU's caches")
    parser.add_argument("--heads", type=heads_option,
                        help="decode-attention: QUERY/KV heads for the 0.5B model's cases (14/2)")
    parser.add_argument("--head-size", type=int, default=prompt_attention.HEAD_SIZE,
                        help=f"decode-attention: every case's head size ({prompt_attention.HEAD_SIZE})")
    parser.add_argument("--turns", type=int, default=9, help="calls of each build per case, in turns (medians)")
    parser.add_argument("--chunk-rows", type=chunk_rows_option, default="first",
                        help="AVX2 GEMMs: from how many rows tiles go in chunks: first (measured on the first build, "
                             "set into the others), each (every build measures), or FLOAT32,BF16 (e.g. 64,32)")
    parser.add_argument("--json", help="also append the figures, as one JSON object, to this file")
    args = parser.parse_args()
    named = dict(b.split("=", 1) for b in args.builds)
    if len(named) != len(args.builds):
        raise SystemExit("each build is NAME=SOURCE, with names all different")
    if args.head_size < 1:
        raise SystemExit(f"--head-size {args.head_size}: give the heads' size, e.g. 128")
    dtype = getattr(torch, args.dtype)
    if dtype is torch.int8 and args.work != "gemm":
        raise SystemExit("--dtype int8 is for --work gemm (attention reads bf16 or float32 caches)")
    facts = machine.facts()
    print(machine.describe(facts))
    with tempfile.TemporaryDirectory(prefix="kunlun_builds-") as tmp:
        libs = build_all(named, Path(tmp), args.chunk_rows)
        if args.work == "gemm":
            cases = [(f"{rows} rows", lambda lib, r=rows: gemm_work(lib, dtype, r))
                     for rows in map(int, args.rows.split(","))]
        elif args.work == "prompt-attention":
            cases = [(f"context {ctx}, new {new}", lambda lib, c=ctx, n=new: attention_work(lib, dtype, c, n))
                     for ctx, new in prompt_attention.SHAPES]
        else:
            shapes = DECODE_SHAPES
            if args.heads:
                shapes = [(b, c, args.heads if h == prompt_attention.HEADS else h) for b, c, h in shapes]
            cases = [(f"{batch} x {ctx}, heads {hq}/{hk} of {args.head_size}",
                      lambda lib, b=batch, c=ctx, h=(hq, hk): decode_attention_work(lib, dtype, b, c, h,
                                                                                    args.blocks == "ordered",
                                                                                    args.warm, args.head_size))
                     for batch, ctx, (hq, hk) in shapes]
        results = []
        for label, make in cases:
            works = {name: make(lib) for name, lib in libs.items()}
            for once, _ in works.values():  # warm, and the outputs to compare
                once()
            first = next(iter(works.values()))[1].float()
            diff = {name: (out.float() - first).abs().max().item() for name, (_, out) in works.items()}
            times: dict[str, list[float]] = {name: [] for name in works}
            for _ in range(args.turns):
                for name, (once, _) in works.items():
                    start = time.perf_counter()
                    once()
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(t) for name, t in times.items()}
            base = next(iter(med.values()))
            results.append({"case": label, "ms": {n: 1e3 * t for n, t in med.items()},
                            "ratio": {n: t / base for n, t in med.items()}, "max_diff": diff})
            print(f"{args.dtype} {label:>22s}: " + "  ".join(
                f"{n} {1e3 * t:8.3f} ms ({t / base:.2f}, diff {diff[n]:.1e})" for n, t in med.items()), flush=True)
            del works
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"machine": facts, "work": args.work, "dtype": args.dtype, "blocks": args.blocks,
                                "warm": args.warm, "heads": "/".join(map(str, args.heads)) if args.heads else None,
                                "head_size": args.head_size,
                                "builds": named, "chunk_rows": args.chunk_rows, "turns": args.turns,
                                "results": results}) + "\n")


if __name__ == "__main__":
    main()
