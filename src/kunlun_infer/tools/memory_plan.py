"""The memory plan: where a device's memory goes, and the KV blocks and concurrency that leaves.

Weights are parameters (per tensor-parallel rank) × bytes per parameter,
counted from ``config.json`` alone; KV bytes per block are what the attention
backend of the chosen ops plugin lays out per layer, times the layers (with
the reference backend: ``2 × layers × kv_heads/tp × head_dim × bytes`` per
token), through the same :class:`~kunlun_infer.engine.kv_cache.KVLayout` the
engine allocates with; the activation peak is measured by the
engine's own warm-up step when the weights are present and the plan is for
this device, estimated from the model's shapes otherwise; comm buffers come
from the comm plugin. The rest of ``cache.memory_fraction × device memory``
becomes KV blocks through :func:`kunlun_infer.engine.kv_cache.size_kv_cache`,
the very function the engine sizes its cache with.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from kunlun_infer.config import setting
from kunlun_infer.dtypes import dtype_name
from kunlun_infer.engine.kv_cache import KVBudget, KVLayout, size_kv_cache
from kunlun_infer.engine.model_runner import ModelRunner
from kunlun_infer.engine.parallel.stages import Grid
from kunlun_infer.engine.sampler import Sampler
from kunlun_infer.engine.startup import (choose_dtype, choose_max_model_len, estimate_activation_bytes,
                                         measure_activation_bytes, model_dir)
from kunlun_infer.layers.quantization import Quantization, estimate_weight_bytes
from kunlun_infer.models import load_model, load_model_config, model_class, resolve_dtype
from kunlun_infer.models.base import LayerSpan
from kunlun_infer.ops.attention import MLA, AttentionBackendBase, AttentionSpec
from kunlun_infer.runtime import PluginManager, Runtime
from kunlun_infer.runtime.attention import plugin_attention_backend, reference_backend
from kunlun_infer.runtime.guard import guarded_call
from kunlun_infer.tools.model_shapes import ModelShapes, meta_model, model_shapes

log = logging.getLogger("kunlun_infer.framework")


@dataclasses.dataclass
class MemoryPlan:
    """Every figure of a plan; :meth:`to_dict` is what ``plan --json`` prints."""

    model: str
    shapes: ModelShapes
    dtype: torch.dtype
    tensor_size: int
    device: str
    device_memory_source: str  #: "command line" or "free memory of device '<name>'"
    weight_bytes: int
    weight_source: str  #: "config" (params × bytes) or "loaded" (what the loaded model holds)
    activation_source: str  #: "measured" or "estimated"
    warm_up_tokens: int
    comm: str
    layout: KVLayout
    budget: KVBudget
    notes: list[str] = dataclasses.field(default_factory=list)
    #: ``model.quantization`` when the weights are quantized (``None``: full precision)
    quantization: str | None = None
    #: with pipeline parallelism: the stages' layers and ranks (``Grid.describe``), and each stage's figures
    pipeline: str | None = None
    stages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the attention the model asked the backend for (its kind and, for MLA, the latent's sizes)
    attention: AttentionSpec | None = None

    @property
    def bytes_per_param(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layout.bytes_per_block // self.layout.block_size

    @property
    def fits(self) -> bool:
        return self.budget.num_blocks >= 1

    def to_dict(self) -> dict[str, Any]:
        b, s = self.budget, self.shapes
        return {
            "model": self.model, "architecture": s.architecture, "dtype": dtype_name(self.dtype),
            "tensor_size": self.tensor_size, "device": self.device,
            "device_memory": b.device_memory, "device_memory_source": self.device_memory_source,
            "memory_fraction": b.memory_fraction, "usable": b.usable_bytes, "reserve": b.reserve_bytes,
            "num_params": s.num_params, "params_per_rank": s.params_per_rank,
            "bytes_per_param": self.bytes_per_param, "weights": b.weight_bytes, "weight_source": self.weight_source,
            "activations": b.activation_bytes, "activation_source": self.activation_source,
            "warm_up_tokens": self.warm_up_tokens, "comm": self.comm, "comm_buffers": b.comm_bytes,
            "kv_cache": max(0, b.kv_bytes),
            "kv": {"num_layers": self.layout.num_layers, "num_kv_heads_per_rank": s.num_kv_heads,
                   "head_dim": s.head_dim, "bytes_per_token": self.kv_bytes_per_token,
                   "block_size": self.layout.block_size, "bytes_per_block": self.layout.bytes_per_block,
                   "attention_backend": self.layout.backend.name,
                   "kind": self.attention.kind if self.attention is not None else "mha",
                   **({"kv_lora_rank": self.attention.kv_lora_rank,
                       "qk_rope_head_dim": self.attention.qk_rope_head_dim,
                       "num_heads_per_rank": self.attention.num_heads}
                      if self.attention is not None and self.attention.kind == MLA else {}),
                   "layer_tensors": [{"name": t.name, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
                                     for t in self.layout.layer_tensors(max(b.num_blocks, 1))]},
            "blocks_by_memory": b.blocks_by_memory, "blocks_by_concurrency": b.blocks_by_concurrency,
            "num_blocks": b.num_blocks, "kv_tokens": b.num_blocks * self.layout.block_size,
            "max_model_len": b.max_model_len, "max_num_seqs": b.max_num_seqs,
            "max_concurrency": b.max_concurrency, "fits": self.fits, "notes": list(self.notes),
            "quantization": self.quantization, "pipeline": self.pipeline, "stages": list(self.stages),
        }


def _warm_up_tokens(cfg: DictConfig, max_model_len: int) -> int:
    """The step size the engine warms up with (its token budget per step, at most one full context)."""
    budget = int(cfg.scheduler.max_num_batched_tokens)
    if not bool(cfg.scheduler.chunked_prefill):
        budget = max(budget, max_model_len)
    return min(budget, max_model_len)


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def plan_attention_backend(cfg: DictConfig, spec: AttentionSpec, *, runtime: Runtime | None = None,
                           plugin_manager: Any = None) -> AttentionBackendBase:
    """The attention backend a run of ``cfg`` uses for ``spec`` (sizing only: no op table behind a reference one).

    Asks ``runtime``'s ops plugin, or — without a runtime — the ops provider
    built without a device, as ``kunlun-infer plugins`` does.
    """
    if runtime is not None:
        backend = runtime.attention_backend(spec)
    else:
        manager = plugin_manager if plugin_manager is not None else PluginManager.load()
        plugin, factory = manager.factory("ops", str(cfg.ops.name))
        provider = guarded_call(plugin, f"ops factory '{cfg.ops.name}'", factory, config=cfg.ops, device=None)
        backend = plugin_attention_backend(provider, plugin, spec)
    return backend if backend is not None else reference_backend(spec)


def _pipeline_plan(cfg: DictConfig, grid: Grid, *, device_memory: int | None, runtime: Runtime | None,
                   plugin_manager: Any) -> MemoryPlan:
    """The plan of each pipeline stage (estimated, for one rank of it): the tightest one is the engine's.

    Every stage gets the same number of KV blocks (a sequence's blocks are
    the same on every stage), so the stage whose memory holds the fewest
    decides; the returned plan is that stage's, with every stage's figures
    in ``stages``.
    """
    plans = []
    for stage in range(grid.pipeline_size):
        span = grid.span(stage)
        plan = make_plan(with_overrides(cfg, parallel__pipeline_size=1, parallel__pipeline_layers=None),
                         device_memory=device_memory, runtime=runtime, measure=False,
                         plugin_manager=plugin_manager, span=span)
        plans.append((stage, span, plan))
    tightest = min(plans, key=lambda p: (p[2].budget.num_blocks, p[2].budget.blocks_by_memory))[2]
    tightest.pipeline = grid.describe()
    tightest.stages = [{"stage": stage, "layers": [span.start, span.end - 1], "weights": plan.weight_bytes,
                        "kv_bytes_per_block": plan.layout.bytes_per_block, "num_blocks": plan.budget.num_blocks}
                       for stage, span, plan in plans]
    tightest.notes.append(f"parallel.pipeline_size={grid.pipeline_size}: every stage holds the same number of KV "
                          f"blocks for its own layers; the tightest stage decides (figures above are its)")
    return tightest


def make_plan(cfg: DictConfig, *, device_memory: int | None = None, runtime: Runtime | None = None,
              measure: bool = True, plugin_manager: Any = None, span: LayerSpan | None = None) -> MemoryPlan:
    """Plan ``cfg``'s model on ``device_memory`` bytes per rank, or on ``runtime``'s device when ``None``.

    ``runtime`` (optional when ``device_memory`` is given) supplies the
    device's free memory, its dtypes, the comm plugin's buffers and, when
    ``measure`` and the weights are present at ``parallel.tensor_size=1``,
    the warm-up that measures the activation peak. Without a runtime, the
    ops plugin (for the KV layout) comes from ``plugin_manager``.
    """
    if device_memory is None and runtime is None:
        raise ValueError("make_plan needs device_memory or a runtime")
    folder = model_dir(cfg.model.path)
    arch = load_model_config(folder)
    tp = int(cfg.parallel.tensor_size)
    grid = Grid.from_config(cfg, arch.num_hidden_layers)
    if grid.pipeline_size > 1:
        return _pipeline_plan(cfg, grid, device_memory=device_memory, runtime=runtime, plugin_manager=plugin_manager)
    shapes = model_shapes(folder, tensor_size=tp, span=span,
                          expert_size=int(setting(cfg, "parallel.expert_size")))
    notes: list[str] = []
    if device_memory is None:
        dtype = choose_dtype(str(cfg.model.dtype), arch.torch_dtype, runtime.device)
        memory, memory_source = runtime.device.mem_get_info()[0], f"free memory of device '{cfg.device.name}'"
    else:
        dtype = resolve_dtype(str(cfg.model.dtype), arch)
        memory, memory_source = device_memory, "command line"
    max_model_len = choose_max_model_len(cfg.model.max_model_len, arch.max_context_len)
    block_size, max_num_seqs = int(cfg.cache.block_size), int(cfg.scheduler.max_num_seqs)
    spec = model_class(arch).attention_spec(arch, dtype=dtype, tp_size=tp)
    backend = plan_attention_backend(cfg, spec, runtime=runtime, plugin_manager=plugin_manager)
    layout = KVLayout(shapes.num_layers, block_size, backend)
    quantization = Quantization.from_config(cfg.model)
    weight_bytes = shapes.params_per_rank * torch.empty((), dtype=dtype).element_size()
    if quantization is not None:  # int8 weights: counted module by module on the model's shapes
        weight_bytes = estimate_weight_bytes(meta_model(arch, tensor_size=tp, max_model_len=1, span=span),
                                             torch.empty((), dtype=dtype).element_size(), quantization)
    warm_tokens = _warm_up_tokens(cfg, max_model_len)
    activations = estimate_activation_bytes(arch, dtype, warm_tokens, max_num_seqs)
    weight_source, activation_source = "config", "estimated"
    can_measure = measure and runtime is not None and device_memory is None and tp == 1 and _has_weights(folder)
    if can_measure:
        weight_bytes, activations = _measure(runtime, folder, arch, dtype, block_size, max_model_len,
                                             warm_tokens, max_num_seqs, quantization)
        weight_source, activation_source = "loaded", "measured"
    elif measure and runtime is not None and device_memory is None:
        notes.append("activation peak estimated: " + ("the folder has no weights" if tp == 1 else
                                                      "warm-up measurement runs at parallel.tensor_size=1 only"))
    comm_bytes = int(runtime.comm.buffer_bytes()) if runtime is not None else 0
    if runtime is None:
        notes.append("no runtime built: comm buffers not consulted (0)")
    budget = size_kv_cache(layout, device_memory=memory, memory_fraction=float(cfg.cache.memory_fraction),
                           weight_bytes=weight_bytes, activation_bytes=activations, comm_bytes=comm_bytes,
                           max_num_seqs=max_num_seqs, max_model_len=max_model_len, strict=False)
    if budget.num_blocks >= 1 and budget.blocks_by_memory < budget.blocks_per_seq:
        notes.append(f"the KV cache holds fewer tokens than model.max_model_len={max_model_len}: longer requests "
                     f"are refused")
    if budget.num_blocks >= 1 and budget.max_concurrency < max_num_seqs:
        notes.append(f"memory holds {budget.max_concurrency} full-length sequences, fewer than "
                     f"scheduler.max_num_seqs={max_num_seqs}: long requests will be preempted")
    return MemoryPlan(model=str(folder), shapes=shapes, dtype=dtype, tensor_size=tp,
                      device=str(cfg.device.name) if device_memory is None else "given", 
                      device_memory_source=memory_source, weight_bytes=weight_bytes, weight_source=weight_source,
                      activation_source=activation_source, warm_up_tokens=warm_tokens, comm=str(cfg.comm.name),
                      layout=layout, budget=budget, notes=notes,
                      quantization=None if quantization is None else quantization.method, attention=spec)


def _measure(runtime: Runtime, folder: Path, arch: Any, dtype: torch.dtype, block_size: int, max_model_len: int,
             warm_tokens: int, max_num_seqs: int, quantization: Quantization | None = None) -> tuple[int, int]:
    """Load the model and run the engine's warm-up: ``(weight bytes, activation peak)``; frees it all."""
    model = load_model(folder, runtime=runtime, dtype=dtype, max_model_len=max_model_len, quantization=quantization)
    try:
        device = runtime.device.torch_device
        runner = ModelRunner(model, device=device, block_size=block_size, memory=runtime.memory,
                             sampler=Sampler(torch.Generator(device=device).manual_seed(0)))
        activations = measure_activation_bytes(runner, runtime.device, arch, dtype, num_tokens=warm_tokens,
                                               num_seqs=max_num_seqs)
        return model.weight_nbytes(), activations
    finally:
        del model
        runtime.memory.empty_cache()


def with_overrides(cfg: DictConfig, **keys: Any) -> DictConfig:
    """A copy of ``cfg`` with dotted keys set (``parallel__tensor_size=2``)."""
    from omegaconf import OmegaConf

    copy = cfg.copy()
    with open_dict(copy):
        for key, value in keys.items():
            OmegaConf.update(copy, key.replace("__", "."), value, merge=False)
    return copy
