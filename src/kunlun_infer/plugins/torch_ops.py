"""Built-in ops plugin ``torch-ops``: option ``torch`` (plain torch, any device) and ``cpu`` (tuned host kernels).

Option ``torch`` is every op of the table in plain torch, correct first.

Most kernels are the references themselves. ``paged_attention`` is
vectorised: decode tokens (one query per sequence) of the whole batch run as
one padded, masked scaled-dot-product attention; prefill and chunked-prefill
sequences run one SDPA call each with a bottom-right causal mask. Low
precision inputs are attended in float32, like the reference.

Option ``cpu`` (the default config's choice) serves the host CPU with the
kernels of :mod:`kunlun_infer.plugins.cpu_kernels` (native GEMMs, decode
attention from the paged cache, fused norms, in the kernel set chosen for
this CPU — the plugin's ``cpu_kernels`` stack entry says which and why); on a
device whose tensors do not live on the host it is option ``torch``.

Option ``cpu`` also captures decode steps (``OpsProvider.capture``, hook
API 1.5; :mod:`kunlun_infer.plugins.cpu_capture`): the engine replays a
batch size's native kernel calls without the Python that made them.

Both options serve multi-head latent attention (hook API 1.4) with the
backend of :mod:`kunlun_infer.plugins.torch_mla` (decode attends over the
latent itself, with the up-projection folded into the queries); per-head
attention keeps the reference backend over their ``paged_attention``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from kunlun_infer.version import __version__
from kunlun_infer.capabilities import Device, DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.ops import OP_SPECS
from kunlun_infer.ops.attention import AttentionBackendBase, AttentionSpec
from kunlun_infer.plugins import cpu_capture, cpu_kernels, cpu_native
from kunlun_infer.plugins.cpu_device import stack_versions
from kunlun_infer.plugins.torch_mla import torch_mla_backend

PLUGIN_NAME = "torch-ops"
log = logging.getLogger(f"kunlun_infer.plugin.{PLUGIN_NAME}")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    """SDPA over ``[B, H, Lq, D]`` inputs in float32, GQA heads expanded by SDPA itself."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: ``q`` ``[B, Hq, D]`` → ``[B, Hq, D]``."""
    block_size = k_cache.shape[1]
    max_len = int(lens.max())
    nblocks = -(-max_len // block_size)
    ids = tables[:, :nblocks].long().clamp(0, k_cache.shape[0] - 1)  # unused entries may hold anything
    k = k_cache[ids].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, Hk, L, D]
    v = v_cache[ids].flatten(1, 2)[:, :max_len].transpose(1, 2)
    mask = (torch.arange(max_len, device=q.device).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
    return _sdpa(q.unsqueeze(2), k, v, mask, scale).squeeze(2)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
             ctx: int, scale: float) -> torch.Tensor:
    """The new tokens ``q`` ``[Lq, Hq, D]`` of one sequence with ``ctx`` tokens of context."""
    block_size = k_cache.shape[1]
    blocks = table[: -(-ctx // block_size)].long()
    k = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)  # [1, Hk, ctx, D]
    v = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
    q_len = q.shape[0]
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)
    mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos  # bottom-right causal
    return _sdpa(q.transpose(0, 1).unsqueeze(0), k, v, mask, scale)[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over paged K/V; same contract as the reference ``paged_attention``."""
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = torch.tensor([qsl[i] for i in decode], device=q.device)
        idx = torch.tensor(decode, device=q.device)
        out[rows] = _decode(q[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale).to(q.dtype)
    lens = seq_lens.tolist()
    for i, n in enumerate(q_lens):
        if n > 1:
            start = qsl[i]
            out[start:start + n] = _prefill(q[start:start + n], k_cache, v_cache, block_tables[i], lens[i],
                                            scale).to(q.dtype)
    return out


#: ops of the table this plugin leaves to the engine: ``sample_tokens``' reference suits every device, where the
#: engine's sampler, without the op, draws in the way that suits the one it runs on (on a CPU: no sort of the
#: vocabulary)
LEFT_TO_THE_ENGINE = ("sample_tokens",)


def kernels() -> dict[str, Any]:
    """Every op of the table but those :data:`LEFT_TO_THE_ENGINE`: the references, with the vectorised
    ``paged_attention``."""
    table = {name: spec.reference for name, spec in OP_SPECS.items() if name not in LEFT_TO_THE_ENGINE}
    table["paged_attention"] = paged_attention
    return table


class TorchOps(DictOpsProvider):
    """An op table of this plugin, with its MLA attention backend (MHA: the reference backend on the table)."""

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackendBase | None:
        return torch_mla_backend(spec)


class CpuOps(TorchOps):
    """Option ``cpu``: the host kernels, whose decode steps are captured and replayed (hook API 1.5)."""

    def capture(self, fn: Any) -> cpu_capture.CapturedStep | None:
        if cpu_native.library() is None:
            return None
        captured, reason = cpu_capture.capture_or_reason(fn)
        if captured is None:
            log.info("step not captured, it runs eagerly: %s", reason)
        return captured


def make_torch_ops(*, config: Any, device: Device) -> DictOpsProvider:
    return TorchOps(kernels(), name="torch")


def make_cpu_ops(*, config: Any, device: Device | None) -> DictOpsProvider:
    # device is None when only coverage is asked for: answer for the host CPU this option targets
    if device is not None and device.torch_device.type != "cpu":
        log.info("ops=cpu on device '%s' (tensors on %s): using the plain torch kernels", device.name,
                 device.torch_device)
        return make_torch_ops(config=config, device=device)
    return CpuOps(cpu_kernels.kernels(), name="cpu")


@hookimpl
def kunlun_infer_plugin_info() -> PluginInfo:
    # which native kernel set ops=cpu uses here, and why: shown by `kunlun-infer plugins` and `doctor`
    return PluginInfo(name=PLUGIN_NAME, version=__version__, api=">=1.0,<2", capabilities=("ops",),
                      stack={**stack_versions(), "cpu_kernels": cpu_native.describe_planned()},
                      description="every op in plain torch (any torch device); tuned host-CPU kernels (cpu)")


@hookimpl
def kunlun_infer_ops_factories() -> dict[str, Any]:
    return {"torch": make_torch_ops, "cpu": make_cpu_ops}
