"""Conformance of an ops plugin's attention backend, against the reference backend on the reference ops.

Three scripted steps drive both backends with the same queries, keys and
values, each step laid out in the order the plugin's backend asks for:

1. prefills: a prompt of two blocks and a bit, a one-token prompt, and the
   first chunk of a long prompt;
2. a mixed batch in scrambled order: decodes, the long prompt's second chunk
   (chunked prefill), and a new prompt whose first block is a prefix-cache
   hit on another sequence's block;
3. decodes only.

After every step the plugin's ``attend`` output must equal the reference's
within the dtype's tolerance — which also proves what ``store_kv`` wrote,
since later steps read it back through the plugin's own layout. The cache
must take the same number of bytes per block whatever the block count.

Multi-head latent attention (hook API 1.4) runs the same script through
``store_latent`` and ``attend_latent`` against the reference MLA backend
(:func:`check_mla_backend`), with random latents, rotary keys, queries and
up-projection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from kunlun_infer.ops import OP_SPECS, TOLERANCES
from kunlun_infer.ops.attention import (MLA, AttentionBackend, AttentionBackendBase, AttentionSpec,
                                        MLAAttentionBackend, kv_cache_bytes, mla_spec)
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.ops.reference_attention import REFERENCE_ATTENTION_OPS, ReferenceAttentionBackend
from kunlun_infer.ops.reference_mla import ReferenceMLABackend
from kunlun_infer.testing.compare import ConformanceError, assert_matches, tolerance

#: (query heads, key/value heads, head size): grouped-query and plain multi-head attention
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = ((8, 2, 64), (4, 4, 32))
#: MLA (heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim): V2-Lite-like and small odd sizes
DEFAULT_MLA_SHAPES: tuple[tuple[int, int, int, int, int], ...] = ((4, 32, 16, 64, 32), (3, 16, 8, 40, 24))
DEFAULT_BLOCK_SIZE = 16
NUM_BLOCKS = 24


@dataclasses.dataclass
class _Seq:
    """One sequence of the script: its tokens' count so far and its blocks."""

    cached: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)


def _script(block_size: int) -> list[list[tuple[str, int]]]:
    """Steps of ``(sequence, new tokens)`` in scheduler order (``"D"`` starts with a prefix-cache hit on ``"A"``)."""
    return [
        [("A", 2 * block_size + 3), ("B", 1), ("C", block_size + 2)],
        [("C", 2 * block_size - 1), ("A", 1), ("D", 5), ("B", 1)],
        [("B", 1), ("D", 1), ("C", 1), ("A", 1)],
    ]


class _Script:
    """Hands out blocks and builds each step's neutral description."""

    def __init__(self, block_size: int, num_blocks: int, generator: torch.Generator, device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self.free = torch.randperm(num_blocks, generator=generator).tolist()
        self.seqs: dict[str, _Seq] = {}

    def admit(self, work: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
        """Give the step's sequences their blocks; their query and context lengths in scheduler order."""
        for name, n in work:
            seq = self.seqs.get(name)
            if seq is None:
                seq = self.seqs[name] = _Seq()
                if name == "D":  # a prefix-cache hit: D's first block is A's full first block
                    seq.blocks, seq.cached = [self.seqs["A"].blocks[0]], self.block_size
            while len(seq.blocks) * self.block_size < seq.cached + n:
                seq.blocks.append(self.free.pop())
        return [n for _, n in work], [self.seqs[name].cached for name, _ in work]

    def step(self, work: list[tuple[str, int]], order: Sequence[int] | None) -> AttentionStep:
        """The neutral description of ``work`` laid out in ``order``; the sequences advance."""
        order = list(range(len(work))) if order is None else list(order)
        laid_out = [work[i] for i in order]
        slots, query_lens, context_lens, tables = [], [], [], []
        for name, n in laid_out:
            seq = self.seqs[name]
            for pos in range(seq.cached, seq.cached + n):
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(n)
            context_lens.append(seq.cached)
            tables.append(list(seq.blocks))
        for name, n in laid_out:
            self.seqs[name].cached += n
        return AttentionStep(self.block_size, query_lens, context_lens, tables, slots, self.device)


def _reference_ops() -> Any:
    return type("ReferenceOps", (), {op: staticmethod(OP_SPECS[op].reference) for op in REFERENCE_ATTENTION_OPS})


def _zeros(backend: AttentionBackend, num_blocks: int, block_size: int, device: torch.device) -> tuple:
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=device)
                 for t in backend.kv_cache_tensors(num_blocks, block_size))


def _check_bytes_per_block(backend: AttentionBackendBase, block_size: int, what: str) -> None:
    one, several = (kv_cache_bytes(backend.kv_cache_tensors(n, block_size)) for n in (1, NUM_BLOCKS))
    if one <= 0 or several != NUM_BLOCKS * one:
        raise ConformanceError(f"{what}: kv_cache_tensors take {one} bytes for 1 block and {several} for "
                               f"{NUM_BLOCKS}; a cache must take the same positive bytes per block")


def _steps(backend: AttentionBackendBase, script: _Script, block_size: int,
           what: str) -> Iterator[tuple[AttentionStep, str]]:
    """The conformance script's steps, each admitted in the order ``backend.order_batch`` asks for (which must be
    a permutation): ``(step, label naming it for an error)``."""
    for number, work in enumerate(_script(block_size), start=1):
        order = backend.order_batch(*script.admit(work))
        if order is not None and sorted(order) != list(range(len(work))):
            raise ConformanceError(f"{what}: order_batch returned {list(order)}, not a permutation of "
                                   f"{len(work)} sequences")
        step = script.step(work, order)
        kinds = ", ".join(f"{kind.value} of {n}" for kind, n in zip(step.kinds, step.query_lens))
        yield step, f"{what}, step {number} ({kinds})"


def check_backend(backend: AttentionBackendBase, spec: AttentionSpec, device: torch.device, *,
                  block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> None:
    """Raise :class:`ConformanceError` when ``backend`` attends differently from the reference backend."""
    if spec.kind == MLA:
        check_mla_backend(backend, spec, device, block_size=block_size, seed=seed)
        return
    rtol, atol = tolerance(spec.dtype)
    what = (f"attention backend '{backend.name}' ({spec.num_heads} query / {spec.num_kv_heads} kv heads of "
            f"{spec.head_dim}, {spec.dtype}, block_size={block_size}, tolerance rtol={rtol} atol={atol})")
    if not isinstance(backend, AttentionBackend):
        raise ConformanceError(f"{what}: a {type(backend).__name__} is not an AttentionBackend")
    _check_bytes_per_block(backend, block_size, what)
    reference = ReferenceAttentionBackend(spec, _reference_ops())
    g = torch.Generator().manual_seed(seed)
    script = _Script(block_size, NUM_BLOCKS, g, device)
    mine_cache = _zeros(backend, NUM_BLOCKS, block_size, device)
    ref_cache = _zeros(reference, NUM_BLOCKS, block_size, device)
    for step, label in _steps(backend, script, block_size, what):
        shape = (step.num_tokens, spec.num_heads, spec.head_dim)
        q = torch.randn(shape, generator=g).to(spec.dtype).to(device)
        k, v = (torch.randn(step.num_tokens, spec.num_kv_heads, spec.head_dim, generator=g).to(spec.dtype).to(device)
                for _ in range(2))
        scale = spec.head_dim ** -0.5
        ref_meta = reference.build_metadata(step)
        reference.store_kv(k.clone(), v.clone(), ref_cache, ref_meta)
        want = reference.attend(q.clone(), k.clone(), v.clone(), ref_cache, ref_meta, scale=scale)
        meta = backend.build_metadata(step)
        backend.store_kv(k.clone(), v.clone(), mine_cache, meta)
        got = backend.attend(q.clone(), k.clone(), v.clone(), mine_cache, meta, scale=scale)
        assert_matches(got, want, what=label, dtype=spec.dtype, path="attend output")


def check_mla_backend(backend: AttentionBackendBase, spec: AttentionSpec, device: torch.device, *,
                      block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> None:
    """Raise :class:`ConformanceError` when an MLA ``backend`` attends differently from the reference MLA backend."""
    rtol, atol = tolerance(spec.dtype)
    what = (f"MLA attention backend '{backend.name}' ({spec.num_heads} heads, nope {spec.qk_nope_head_dim} + rope "
            f"{spec.qk_rope_head_dim}, latent {spec.kv_lora_rank}, value {spec.v_head_dim}, {spec.dtype}, "
            f"block_size={block_size}, tolerance rtol={rtol} atol={atol})")
    if not isinstance(backend, MLAAttentionBackend):
        raise ConformanceError(f"{what}: a {type(backend).__name__} is not an MLAAttentionBackend")
    _check_bytes_per_block(backend, block_size, what)
    reference = ReferenceMLABackend(spec)
    g = torch.Generator().manual_seed(seed)
    script = _Script(block_size, NUM_BLOCKS, g, device)
    mine_cache = _zeros(backend, NUM_BLOCKS, block_size, device)
    ref_cache = _zeros(reference, NUM_BLOCKS, block_size, device)
    heads, nope, rope, rank = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=g)).to(spec.dtype).to(device)

    kv_up = randn(heads, nope + spec.v_head_dim, rank, std=rank ** -0.5)
    scale = spec.head_dim ** -0.5
    for step, label in _steps(backend, script, block_size, what):
        t = step.num_tokens
        q_nope, q_rope, latent, k_rope = randn(t, heads, nope), randn(t, heads, rope), randn(t, rank), randn(t, rope)
        ref_meta = reference.build_metadata(step)
        reference.store_latent(latent.clone(), k_rope.clone(), ref_cache, ref_meta)
        want = reference.attend_latent(q_nope.clone(), q_rope.clone(), latent.clone(), k_rope.clone(), ref_cache,
                                       ref_meta, kv_up=kv_up, scale=scale)
        meta = backend.build_metadata(step)
        backend.store_latent(latent.clone(), k_rope.clone(), mine_cache, meta)
        got = backend.attend_latent(q_nope.clone(), q_rope.clone(), latent.clone(), k_rope.clone(), mine_cache,
                                    meta, kv_up=kv_up.clone(), scale=scale)
        assert_matches(got, want, what=label, dtype=spec.dtype, path="attend_latent output")


def mla_specs(shapes: Iterable[tuple[int, int, int, int, int]], dtype: torch.dtype) -> list[AttentionSpec]:
    """MLA specs for ``(heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim)`` shapes."""
    return [mla_spec(num_heads=h, qk_nope_head_dim=dn, qk_rope_head_dim=dr, kv_lora_rank=r, v_head_dim=dv,
                     dtype=dtype) for h, dn, dr, r, dv in shapes]


def check_attention_backend(provider: Any, device: Any, *, dtypes: Iterable[torch.dtype] | None = None,
                            shapes: Iterable[tuple[int, int, int]] = DEFAULT_SHAPES,
                            mla_shapes: Iterable[tuple[int, int, int, int, int]] = DEFAULT_MLA_SHAPES,
                            block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> list[AttentionSpec]:
    """Check ``provider``'s attention backends for each head shape and dtype; returns the specs checked.

    ``device`` is the plugin's :class:`~kunlun_infer.capabilities.Device`. A
    spec for which the provider offers no backend (``None``: the reference
    serves it) is not checked, nor an MLA spec answered with a backend of
    another kind (the framework does not use it either).
    """
    if dtypes is None:
        dtypes = [d for d in TOLERANCES if d in device.supported_dtypes()]
    checked = []
    dtypes = list(dtypes)
    specs = [AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
             for heads, kv_heads, head_dim in shapes for dtype in dtypes]
    specs += [spec for shape in mla_shapes for dtype in dtypes for spec in mla_specs([shape], dtype)]
    for spec in specs:
        backend = provider.attention_backend(spec)
        if backend is None or (spec.kind == MLA and not isinstance(backend, MLAAttentionBackend)):
            continue
        check_backend(backend, spec, device.torch_device, block_size=block_size, seed=seed)
        checked.append(spec)
    return checked
