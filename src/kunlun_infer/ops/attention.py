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

Kinds of attention (``AttentionSpec.kind``): :data:`MHA` (per-head keys and
values, grouped queries) is served by an :class:`AttentionBackend`.
:data:`MLA` (hook API 1.4; DeepSeek's multi-head latent attention) caches one
compressed latent and one shared rotary key per token instead of per-head
keys and values, and is served by an :class:`MLAAttentionBackend`, whose
store and attend calls take the latent (see there). Both share the cache
and metadata half of the contract (:class:`AttentionBackendBase`). A
provider returns ``None`` for a kind it does not serve and the framework
uses its reference for that kind (:mod:`kunlun_infer.ops.reference_mla` for
MLA); a backend of the wrong class for the spec's kind is not used either.
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
#: multi-head latent attention (DeepSeek-V2/V3): a cached latent and rotary key shared by every head (1.4)
MLA = "mla"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What a model's attention layers need, on one tensor-parallel rank.

    ``num_heads``: query heads of this rank. ``num_kv_heads``: key/value heads
    of this rank (``num_heads`` is a multiple of it: grouped-query
    attention). ``head_dim``: size of one head. ``dtype``: the dtype of the
    keys and values the layers produce, and of the cache unless the backend
    chooses another. ``kind``: :data:`MHA` or :data:`MLA`.

    For :data:`MLA` (added in 1.4; build it with :func:`mla_spec`):
    ``num_kv_heads`` is 1 (the latent is shared by every head), ``head_dim``
    is the query/key head size ``qk_nope_head_dim + qk_rope_head_dim``,
    ``kv_lora_rank`` the size of the cached latent, ``qk_rope_head_dim`` the
    size of the cached rotary key, ``v_head_dim`` the size of one head of
    the output. The three are 0 for :data:`MHA`.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kind: str = MHA
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the part of a query/key head without rotary position (decompressed from the latent)."""
        return self.head_dim - self.qk_rope_head_dim


def mla_spec(*, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, kv_lora_rank: int,
             v_head_dim: int, dtype: torch.dtype) -> AttentionSpec:
    """The :class:`AttentionSpec` of multi-head latent attention with ``num_heads`` heads on this rank."""
    return AttentionSpec(num_heads=num_heads, num_kv_heads=1, head_dim=qk_nope_head_dim + qk_rope_head_dim,
                         dtype=dtype, kind=MLA, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                         v_head_dim=v_head_dim)


@dataclasses.dataclass(frozen=True)
class CacheTensorSpec:
    """One tensor of a layer's KV cache: its shape and dtype (``name`` is for messages only)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str = "kv"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class AttentionBackendBase(abc.ABC):
    """What every attention backend has, whatever its kind: cache layout, batch order, per-step metadata.

    Built by an ops provider for one :class:`AttentionSpec`; used from the
    engine's thread. Creating it must not touch hardware (``kunlun-infer
    plan`` builds backends without a device to size caches). The store and
    attend calls depend on the kind: :class:`AttentionBackend` (:data:`MHA`),
    :class:`MLAAttentionBackend` (:data:`MLA`).
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
        is opaque to the framework: it is only handed back to the
        backend's store and attend calls.
        """

    def update_metadata(self, static: Any, step: AttentionStep) -> bool:
        """Write the metadata of decode-only ``step`` into ``static``'s buffers, in place, for a captured replay.

        ``static`` was built by :meth:`build_metadata` for a decode-only step
        of as many sequences, whose block tables were padded to the widest a
        sequence can have; the captured store and attend calls read its
        buffers again on every replay. Return ``True`` when ``static`` now
        describes ``step`` exactly as far as those calls can tell: nothing
        they decided from host values at capture may differ. ``False`` (the
        default) means this backend's steps are not captured. Added in 1.5.
        """
        return False


class AttentionBackend(AttentionBackendBase):
    """A paged-attention implementation of :data:`MHA` attention: cache layout, per-step metadata, store and attend.

    Built by an ops provider for one :class:`AttentionSpec`; used from the
    engine's thread. Creating it must not touch hardware (``kunlun-infer
    plan`` builds backends without a device to size caches).
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


class MLAAttentionBackend(AttentionBackendBase):
    """A paged implementation of multi-head latent attention (:data:`MLA`, hook API 1.4).

    Per token the cache holds the normalised latent ``c`` (``kv_lora_rank``
    numbers) and the rotated shared key ``k_rope`` (``qk_rope_head_dim``);
    how, in which dtype and in how many tensors is the backend's choice
    (:meth:`kv_cache_tensors`). Keys and values of head ``h`` are the latent
    decompressed by this rank's up-projection ``kv_up`` (``[num_heads,
    qk_nope_head_dim + v_head_dim, kv_lora_rank]``, the checkpoint's
    ``kv_b_proj`` weight per head)::

        k_h = concat(kv_up[h, :qk_nope_head_dim] @ c, k_rope)
        v_h = kv_up[h, qk_nope_head_dim:] @ c

    A backend may compute exactly that (decompress, then attend), or fold
    the up-projection into the query and the output and attend over the
    latent itself (``q_nope @ kv_up[:, :qk_nope_head_dim]`` against ``c``,
    as DeepSeek does for decode); the result is the same.
    """

    @abc.abstractmethod
    def store_latent(self, latent: torch.Tensor, k_rope: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                     metadata: Any) -> None:
        """Write the step's ``latent`` (``[T, kv_lora_rank]``) and ``k_rope`` (``[T, qk_rope_head_dim]``) in place."""

    @abc.abstractmethod
    def attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, ...], metadata: Any, *, kv_up: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """Causal attention of the step's queries over their sequences' latent context.

        ``q_nope``: ``[T, num_heads, qk_nope_head_dim]``; ``q_rope``: ``[T,
        num_heads, qk_rope_head_dim]`` (already rotated); ``latent`` /
        ``k_rope``: the step's own (already stored by :meth:`store_latent`;
        a kernel may read them directly). ``kv_up``: see the class. Query
        token ``j`` of sequence ``i`` sits at position ``context_lens[i] + j``
        and sees every token of its sequence up to that position; scores are
        ``scale × (q · k_h)``, softmax in float32. Returns ``[T, num_heads,
        v_head_dim]`` in ``q_nope.dtype``, rows in flat-batch order.
        """


def kv_cache_bytes(tensors: Sequence[CacheTensorSpec]) -> int:
    """Total bytes of one layer's cache tensors."""
    return sum(t.nbytes for t in tensors)
