"""Run the tiny model with a chosen mix of plugin and reference ops, and compare the logits.

A scripted batch — three prompts prefilled in two chunks, then decode steps
on fixed tokens — goes through the engine's own flat-batch builder and the
paged KV cache (allocated by the memory plugin in the attention backend's
layout), so plugin and reference runs see identical inputs. Attention is
served by the ops plugin's own backend when it has one and the run asks for
it, else by the reference backend over the op table. When the plugin
disagrees with the reference, :func:`find_culprit` swaps in one plugin op
(or coupled pair, or the attention backend) at a time to name the part at
fault, and captures the inputs of an op's first call that differs from the
reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.engine.kv_cache import KVLayout, allocate_kv_caches, free_kv_caches
from kunlun_infer.engine.model_runner import build_step_inputs
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.sequence import Sequence
from kunlun_infer.models import load_model, load_model_config, model_class
from kunlun_infer.ops import OP_SPECS
from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec
from kunlun_infer.runtime import Runtime
from kunlun_infer.runtime.optable import COUPLED_OPS, OpTable, resolve
from kunlun_infer.testing.compare import ConformanceError, assert_matches

#: the unit :func:`find_culprit` names when the plugin's attention backend is at fault
ATTENTION_UNIT = ("attention backend",)
PROMPT_LENGTHS = (5, 19, 40)
DECODE_STEPS = 3
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
#: (rtol, atol) for float32 logits of the whole model: looser than one op, errors add up over layers
MODEL_TOLERANCE = (2e-3, 2e-3)


class OpsRuntime:
    """A runtime whose ``resolve_ops`` hands out a fixed op table; everything else is the real runtime's.

    ``plugin_attention``: whether the ops plugin's attention backend (if it has
    one) serves; otherwise the reference backend over the fixed table does.
    """

    def __init__(self, runtime: Runtime, table: OpTable, *, plugin_attention: bool = False) -> None:
        self._runtime = runtime
        self._table = table
        self._plugin_attention = plugin_attention

    def resolve_ops(self, ops: Iterable[str]) -> OpTable:
        return self._table

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend | None:
        return self._runtime.attention_backend(spec) if self._plugin_attention else None

    def capture_step(self, fn: Any) -> None:
        """Every step eager: the fixed table's ops (the references among them) are not written to be captured
        (a CUDA graph of the reference ``store_kv``, which reads its mask on the host, fails to capture)."""

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._runtime, attr)


def op_units(ops: list[str]) -> list[tuple[str, ...]]:
    """``ops`` grouped so that coupled ops (``pack_linear_weight`` + ``linear``) stay together."""
    units, seen = [], set()
    for op in ops:
        if op in seen:
            continue
        group = next((tuple(sorted(g)) for g in COUPLED_OPS if op in g), (op,))
        units.append(tuple(o for o in group if o in ops) or (op,))
        seen.update(group)
    return units


def mixed_table(runtime: Runtime, plugin_ops: tuple[str, ...], wrap: Any = None) -> OpTable:
    """The op table with ``plugin_ops`` from the runtime's ops plugin and every other op from the reference."""
    plugin = runtime.plugin_for("ops")
    kernels = {op: runtime.ops.get(op) for op in plugin_ops}
    if wrap is not None:
        kernels = {op: wrap(op, k) for op, k in kernels.items()}
    return resolve(list(OP_SPECS), provider=DictOpsProvider(kernels, name=plugin), plugin=plugin, strict=False)


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def plugin_serves_attention(runtime: Runtime, folder: Path) -> bool:
    """True when the runtime's ops plugin serves the model in ``folder`` with an attention backend of its own."""
    arch = load_model_config(folder)
    return runtime.attention_backend(model_class(arch).attention_spec(arch, dtype=torch.float32)) is not None


def _batch_rows(counts: list[int], order: Any) -> torch.Tensor:
    """Flat-batch row indices that put a step's tokens back in batch-row order."""
    order = list(range(len(counts))) if order is None else list(order)
    starts, at = {}, 0
    for i in order:
        starts[i] = at
        at += counts[i]
    return torch.tensor([starts[i] + j for i in range(len(counts)) for j in range(counts[i])], dtype=torch.int64)


def run_logits(runtime: Runtime, folder: Path, table: OpTable, *, seed: int = 0,
               plugin_attention: bool = False) -> list[torch.Tensor]:
    """Float32 logits of every token of every step of the scripted batch (host tensors, batch-row order)."""
    model = load_model(folder, runtime=OpsRuntime(runtime, table, plugin_attention=plugin_attention),
                       dtype=torch.float32, max_model_len=MAX_MODEL_LEN)
    device = runtime.device.torch_device
    vocab = model.config.vocab_size
    seqs, next_block = [], 0
    for i, prompt in enumerate(_prompts(seed, vocab)):
        seq = Sequence(i, f"doctor-{i}", prompt, SamplingParams(max_tokens=DECODE_STEPS + 1))
        blocks = -(-(len(prompt) + DECODE_STEPS) // BLOCK_SIZE)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    attention = model.attention
    caches = allocate_kv_caches(runtime.memory, KVLayout(model.num_layers, BLOCK_SIZE, attention), next_block)
    logits = []
    try:
        first = [len(s) // 2 for s in seqs]
        steps = [first, [len(s) - n for s, n in zip(seqs, first)]] + [[1] * len(seqs)] * DECODE_STEPS
        with torch.inference_mode():
            for step, counts in enumerate(steps):
                if step >= 2:  # decode: feed fixed tokens so every run sees the same inputs
                    for i, s in enumerate(seqs):
                        s.token_ids.append((7 * step + 13 * i) % vocab)
                order = attention.order_batch(counts, [s.num_computed_tokens for s in seqs])
                inputs = build_step_inputs(seqs, counts, BLOCK_SIZE, device, order)
                hidden = model(inputs.input_ids, inputs.positions, attention.build_metadata(inputs.attn), caches)
                logits.append(model.compute_logits(hidden).float().cpu().index_select(0, _batch_rows(counts, order)))
                for s, n in zip(seqs, counts):
                    s.num_computed_tokens += n
    finally:
        free_kv_caches(runtime.memory, caches)
        del model
    return logits


def compare_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
    """``None`` when every step agrees within :data:`MODEL_TOLERANCE`, else what differs and by how much."""
    rtol, atol = MODEL_TOLERANCE
    for step, (g, w) in enumerate(zip(got, want)):
        bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        if bool(bad.any()):
            err = (g - w).abs().nan_to_num(float("inf"))
            kind = "prefill chunk" if step < 2 else "decode step"
            return (f"logits of {kind} {step + 1 if step < 2 else step - 1} differ from the reference-op run in "
                    f"{int(bad.sum())} of {bad.numel()} values (max abs error {float(err.max()):.3g}, tolerance "
                    f"rtol={rtol} atol={atol})")
    return None


@dataclasses.dataclass
class Capture:
    """The first call of an op whose result differs from the reference: its inputs and the difference."""

    op: str
    args: list[Any]
    message: str

    def tensors_and_spec(self) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        tensors, spec = {}, []
        for i, a in enumerate(self.args):
            if isinstance(a, torch.Tensor):
                tensors[f"arg{i}"] = a
                spec.append({"tensor": f"arg{i}"})
            else:
                spec.append({"value": a})
        return tensors, spec


def _clone(args: tuple[Any, ...]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def capturing(captured: list[Capture]) -> Any:
    """A kernel wrapper that checks each call against the reference and keeps the first that differs."""

    def wrap(op: str, kernel: Any) -> Any:
        spec = OP_SPECS[op]
        if any(op in group for group in COUPLED_OPS):
            return kernel  # a packed weight means something only to its own provider's linear

        def run(*args: Any) -> Any:
            if captured:
                return kernel(*args)
            saved, ref_args = _clone(args), _clone(args)
            out = kernel(*args)
            want = spec.reference(*ref_args)
            dtype = next((a.dtype for a in saved if isinstance(a, torch.Tensor) and a.is_floating_point()),
                         torch.float32)
            try:
                if spec.in_place_arg is None:
                    assert_matches(out, want, what=f"op '{op}'", dtype=dtype)
                else:
                    i = spec.in_place_arg
                    assert_matches(args[i], ref_args[i], what=f"op '{op}'", dtype=dtype, path=f"argument {i}")
            except ConformanceError as exc:
                captured.append(Capture(op, saved, str(exc)))
            return out

        return run

    return wrap


def find_culprit(runtime: Runtime, folder: Path, want: list[torch.Tensor], served: list[str], *, seed: int = 0,
                 plugin_attention: bool = False) -> tuple[tuple[str, ...] | None, str | None, Capture | None]:
    """The unit whose plugin part alone makes the logits differ, its difference, and a captured op call.

    Units are the served ops (coupled ones together) and, with
    ``plugin_attention``, :data:`ATTENTION_UNIT`: the plugin's attention
    backend over reference ops.
    """
    for unit in op_units(served):
        captured: list[Capture] = []
        got = run_logits(runtime, folder, mixed_table(runtime, unit, capturing(captured)), seed=seed)
        difference = compare_logits(got, want)
        if difference is not None:
            return unit, difference, (captured[0] if captured else None)
    if plugin_attention:
        got = run_logits(runtime, folder, mixed_table(runtime, ()), seed=seed, plugin_attention=True)
        difference = compare_logits(got, want)
        if difference is not None:
            return ATTENTION_UNIT, difference, None
    return None, None, None
