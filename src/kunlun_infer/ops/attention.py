"""The attention-backend contract (hook API 1.1): an ops plugin's own KV-cache layout and attention kernels.

A chip's attention kernels fix more than one op's signature: the layout of
the paged KV cache, the per-step bookkeeping they read (lengths as host and
device tensors, int32 or int64, batches ordered decodes first …) and how
prefill and decode are split into calls. An ops provider that has such
kernels returns an :class:`AttentionBackend` from
:meth:`kunlun_infer.capabilities.OpsProvider.attention_backend`; a provider
that does not (every 1.0 plugin) gets the reference backend, which keeps the
1.0 layout and calls the op table's ``store_kv`` and ``paged_attention``
(:mod:`kunlun_infer.ops.reference_attention`).

How the framework uses a backend, per run and per step:

1. At load: ``provider.attention_backend(spec)`` with the model's
   :class:`AttentionSpec` (heads and head size on this tensor-parallel
   rank, cache dtype).
2. Sizing and allocation: :meth:`AttentionBackend.kv_cache_tensors` says
   which tensors one layer's cache is made of for ``num_blocks`` blocks of
   ``block_size`` tokens. The engine allocates exactly those, for every
   layer, through the memory plugin, zeroes them, and never reads, writes or
   indexes them itself: the block manager deals in block ids only, and the
   memory plan sizes the cache from the same shapes.
3. Each step: the engine asks :meth:`AttentionBackend.order_batch` in which
   order the step's sequences go into the flat batch, lays the batch out in
   that order, and describes it neutrally as an
   :class:`~kunlun_infer.ops.attention_step.AttentionStep` (host lists).
   :meth:`AttentionBackend.build_metadata` turns that into whatever the
   kernels need — once per step, shared by every layer (a FlashInfer-style
   *plan*).
4. Each layer: :meth:`AttentionBackend.store_kv` writes the step's new keys
   and values into the layer's cache, then :meth:`AttentionBackend.attend`
   computes the attention output of the step's queries (the *run*).

Growth: other kinds of attention (``AttentionSpec.kind``, e.g. a latent
``"mla"`` cache) get their own calls in a later minor version; a provider
returns ``None`` for a kind it does not serve and the framework uses its
reference for that kind.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from kunlun_infer.ops.attention_step import AttentionStep

#: the kind of attention of Llama / Qwen style decoders: per-head keys and values, grouped queries
MHA = "mha"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention layers need, on one tensor-parallel rank.

    ``num_heads``: query heads of this rank. ``num_kv_heads``: key/value heads
    of this rank (``num_heads`` is a multiple of it: grouped-query
    attention). ``head_dim``: size of one head. ``dtype``: the dtype of the
    keys and values the layers produce, and of the cache unless the backend
    chooses another. ``kind``: :data:`MHA` (more kinds may come).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kind: str = MHA


@dataclasses.dataclass(frozen=True)
class CacheTensorSpec:
    """One tensor of a layer's KV cache: its shape and dtype (``name`` is for messages only)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str = "kv"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class AttentionBackend(abc.ABC):
    """A paged-attention implementation: cache layout, per-step metadata, store and attend.

    Built by an ops provider for one :class:`AttentionSpec`; used from the
    engine's thread. Creating it must not touch hardware (``kunlun-infer
    plan`` builds backends without a device to size caches).
    """

    #: a short name for logs and ``kunlun-infer plugins``
    name: str = "attention"

    @abc.abstractmethod
    def kv_cache_tensors(self, num_blocks: int, block_size: int) -> Sequence[CacheTensorSpec]:
        """The tensors of ONE layer's cache holding ``num_blocks`` blocks of ``block_size`` tokens each.

        Their total bytes must be ``num_blocks`` times those of one block (the
        memory plan divides memory by it). The engine allocates them through
        the memory plugin, zeroed, and passes them back as the ``kv_cache``
        tuple, in this order, to :meth:`store_kv` and :meth:`attend`. Raise
        ``ValueError`` (naming the setting) for a ``block_size`` the kernels
        cannot serve.
        """

    def order_batch(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> Sequence[int] | None:
        """The order in which the step's sequences should be laid out in the flat batch.

        ``query_lens[i]`` / ``context_lens[i]``: new tokens and tokens already
        cached of the scheduler's ``i``-th sequence. Return a permutation of
        ``range(len(query_lens))`` (the flat batch holds sequence
        ``order[0]`` first), or ``None`` to keep the scheduler's order. Every
        token-indexed input of the step (ids, positions, slots, queries)
        follows this order. See
        :func:`kunlun_infer.ops.attention_step.decodes_first`.
        """
        return None

    @abc.abstractmethod
    def build_metadata(self, step: AttentionStep) -> Any:
        """Whatever the kernels read for this step, built once and shared by every layer.

        ``step`` describes the flat batch in host lists; make the host and
        device tensors the kernels need from it (``step.device``). The result
        is opaque to the framework: it is only handed back to
        :meth:`store_kv` and :meth:`attend`.
        """

    @abc.abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 metadata: Any) -> None:
        """Write the step's new ``key``/``value`` (``[T, num_kv_heads, head_dim]``) into ``kv_cache`` in place."""

    @abc.abstractmethod
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: tuple[torch.Tensor, ...], metadata: Any, *, scale: float) -> torch.Tensor:
        """Causal attention of the step's queries over their sequences' context.

        ``query``: ``[T, num_heads, head_dim]``; ``key``/``value``: the same
        step's new keys and values (already stored by :meth:`store_kv`;
        a kernel may read them directly instead of from the cache). Query
        token ``j`` of sequence ``i`` sits at position ``context_lens[i] + j``
        and sees every key of its sequence up to that position. Returns
        ``[T, num_heads, head_dim]`` in ``query.dtype``, rows in flat-batch
        order.
        """


def kv_cache_bytes(tensors: Sequence[CacheTensorSpec]) -> int:
    """Total bytes of one layer's cache tensors."""
    return sum(t.nbytes for t in tensors)
