"""``ops=cuda``: the whole op table, paged attention read in place, fused norms, and decode steps as CUDA graphs.

Where Triton imports and the tensors are on a GPU (``ops.attention`` and
``ops.fused_kernels`` left at ``auto``), attention goes through the plugin's
own backend (:mod:`kunlun_infer_cuda.attention`: the KV cache read in place
through the block tables, decode split over the context), and RMS norm, the
residual-add RMS norm, rotary embedding (queries and keys together) and
SwiGLU run as one Triton kernel each instead of several torch kernels.
:meth:`TorchCudaOps.capture` records a decode step as a CUDA graph (hook API
1.5), so a replay launches its few hundred kernels without Python; the
engine captures the batch sizes of ``ops.step_graph_sizes`` when it starts
and pads a step to the next one.

The torch kernels below remain the table where Triton is absent
(``ops.attention=sdpa``, ``ops.fused_kernels=off``): ``paged_attention`` gathers every sequence's K/V blocks into a padded batch
and runs ``torch.nn.functional.scaled_dot_product_attention`` once for all
sequences (prefills, chunked prefills and decodes alike) with a mask that is
causal from each sequence's own offset and hides padding; grouped-query
heads are handled by SDPA itself. The other kernels are short torch
expressions with the references' numerics. Nothing here names a device, so
the kernels also run (and are tested) on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kunlun_infer.capabilities import CapturedStep, DictOpsProvider
from kunlun_infer.ops import reference
from kunlun_infer.ops.attention import MHA, AttentionSpec
from kunlun_infer.ops.moe import grouped_fused_moe


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions.long()].to(q.dtype)  # [T, 2, D]
    cos, sin = cos_sin[:, :1], cos_sin[:, 1:]  # [T, 1, D], broadcast over heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0  # negative slots are padding
    slots = slot_mapping[keep].long()
    for cache, new in ((k_cache, key), (v_cache, value)):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, slots, new[keep].to(cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    ctx = seq_lens.long()
    batch = ctx.shape[0]
    max_q, max_ctx = int(q_lens.max()), int(ctx.max())
    blocks_needed = -(-max_ctx // block_size)
    device = q.device

    # queries: [B, max_q, Hq, D], padding rows point at row 0 and are dropped at the end
    q_pos = torch.arange(max_q, device=device)
    q_valid = q_pos.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, max_q]
    q_rows = torch.where(q_valid, starts.unsqueeze(1) + q_pos, 0)
    q_batch = q[q_rows].transpose(1, 2)  # [B, Hq, max_q, D]

    # keys/values: gather each sequence's blocks, [B, Hk, max_ctx, D]
    tables = block_tables[:, :blocks_needed].long().clamp(0, num_blocks - 1)  # unused entries are arbitrary
    k = k_cache[tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :max_ctx].transpose(1, 2)

    # query j of sequence i sits at position ctx_i - q_len_i + j and sees keys 0..that position
    k_pos = torch.arange(max_ctx, device=device)
    q_abs = (ctx - q_lens).unsqueeze(1) + q_pos  # [B, max_q]
    mask = k_pos.view(1, 1, -1) <= q_abs.unsqueeze(-1)  # [B, max_q, max_ctx]
    mask = mask | ~q_valid.unsqueeze(-1)  # padding rows see everything: no NaN, dropped anyway
    out = F.scaled_dot_product_attention(q_batch, k, v, attn_mask=mask.unsqueeze(1), scale=scale,
                                         enable_gqa=q.shape[1] != k_cache.shape[2])
    return out.transpose(1, 2)[q_valid].to(q.dtype)  # [T, Hq, D] in sequence order


def fused_moe(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Tokens grouped by expert (one host sync for the counts), two matmuls per expert that has any."""
    w13, w2 = packed

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(rows, w13[expert])), w2[expert])

    return grouped_fused_moe(x, topk_weights, topk_ids, w13.shape[0], w2.shape[1], expert_mlp)


KERNELS = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
    "pack_linear_weight": pack_linear_weight,
    "linear": linear,
    "embedding": embedding,
    "store_kv": store_kv,
    "paged_attention": paged_attention,
    # structured output: the reference's shifts and masked fill are element-wise, fast as they are on a GPU
    "apply_token_bitmask": reference.apply_token_bitmask,
    # mixture of experts: routing is a handful of element-wise ops and a top-k; the stacked weights stay as they are
    "moe_route": reference.moe_route,
    "pack_moe_weights": reference.pack_moe_weights,
    "fused_moe": fused_moe,
}


#: the ops ``ops.fused_kernels`` replaces by one Triton kernel each
FUSED_OPS = ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul")
#: values of ``ops.attention`` / ``ops.fused_kernels``
ATTENTION_CHOICES = ("auto", "triton", "sdpa")
FUSED_CHOICES = ("auto", "on", "off")

log = logging.getLogger("kunlun_infer.cuda")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


class CudaGraphStep(CapturedStep):
    """A decode step recorded as a CUDA graph; ``replay`` relaunches it on the same buffers."""

    def __init__(self, graph: Any, result: Any) -> None:
        self.graph = graph
        self.result = result

    def replay(self) -> Any:
        self.graph.replay()
        return self.result


class TorchCudaOps(DictOpsProvider):
    """Every op of the table; Triton attention and fused kernels where they apply; CUDA-graph capture.

    ``attention`` / ``fused_kernels``: ``auto`` uses Triton when it imports and
    ``torch_device`` is a GPU; ``triton`` / ``on`` use it on any device (CPU
    tensors run in Triton's interpreter: how the kernels are tested without a
    GPU); ``sdpa`` / ``off`` keep the torch kernels.
    """

    def __init__(self, name: str = "cuda", *, torch_device: torch.device | None = None, attention: str = "auto",
                 fused_kernels: str = "auto") -> None:
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"ops.attention={attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
        if fused_kernels not in FUSED_CHOICES:
            raise ValueError(f"ops.fused_kernels={fused_kernels!r}: choose one of {', '.join(FUSED_CHOICES)}")
        on_gpu = torch_device is not None and torch_device.type == "cuda"
        have_triton = triton_available()
        for option, value in (("ops.attention", attention), ("ops.fused_kernels", fused_kernels)):
            if value in ("triton", "on") and not have_triton:
                raise ValueError(f"{option}={value} needs the triton package, which does not import here; install "
                                 f"it or set {option}=auto")
        self.torch_device = torch_device
        self.triton_attention = attention == "triton" or (attention == "auto" and on_gpu and have_triton)
        self.fused = fused_kernels == "on" or (fused_kernels == "auto" and on_gpu and have_triton)
        kernels: dict[str, Callable[..., Any]] = dict(KERNELS)
        if self.fused:
            from kunlun_infer_cuda import triton_kernels

            kernels.update({op: getattr(triton_kernels, op) for op in FUSED_OPS})
        super().__init__(kernels, name=name)
        #: the memory pool the live captures share, and those captures: once every capture is gone (an engine's
        #: KV cache was resized, which drops them), a new pool is taken, since torch refuses to capture into a
        #: pool whose graphs were all destroyed while a tensor of theirs is still referenced
        self._pool: Any = None
        self._captures: weakref.WeakSet[CudaGraphStep] = weakref.WeakSet()

    def attention_backend(self, spec: AttentionSpec) -> Any:
        if spec.kind != MHA or not self.triton_attention:
            return None  # the reference backend over paged_attention (SDPA) above
        from kunlun_infer_cuda.attention import TritonAttentionBackend

        return TritonAttentionBackend(spec)

    def describe(self) -> dict[str, str]:
        """What serves attention and the norms, for ``plugins`` and the benchmark's records."""
        return {"attention": "triton-paged" if self.triton_attention else "sdpa-gather",
                "norms_rotary_swiglu": "triton-fused" if self.fused else "torch"}

    def capture(self, fn: Callable[[], Any]) -> CudaGraphStep | None:
        """``fn`` run once on a side stream (Triton compiles, cuBLAS chooses, the allocator grows), then recorded
        as a CUDA graph in a memory pool shared by every capture, and replayed once so its result is the graph's.
        ``None`` off a GPU, or when the region cannot be captured (logged)."""
        device = self.torch_device
        if device is None or device.type != "cuda":
            return None
        try:
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(device).wait_stream(side)
            if self._pool is None or not self._captures:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                result = fn()
            graph.replay()
        except Exception as exc:  # noqa: BLE001 - the step then runs eagerly, as without capture
            log.warning("ops=%s: a decode step could not be captured as a CUDA graph (%s); it runs eagerly",
                        self.name, exc)
            return None
        step = CudaGraphStep(graph, result)
        self._captures.add(step)
        return step
