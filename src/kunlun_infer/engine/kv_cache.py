"""The paged KV cache's memory: how many blocks, and the per-layer cache tensors in the backend's layout.

The attention backend decides what one layer's cache is made of
(:meth:`~kunlun_infer.ops.attention.AttentionBackend.kv_cache_tensors`);
:class:`KVLayout` turns that into bytes per block, the one figure both the
engine and ``kunlun-infer plan`` size the cache with. ``cache.num_blocks``
fixes the count. Otherwise :func:`size_kv_cache` gives
the cache what remains of ``cache.memory_fraction`` of the device memory (free
when the engine starts) after the weights, the activation peak of a warm-up
step and the comm plugin's buffers, and never more blocks than the
configured concurrency can fill (``max_num_seqs`` sequences of
``max_model_len`` tokens): on a host whose device memory is the machine's
RAM, the default leaves the machine usable. Tensors come from the runtime's
memory plugin and are zeroed, so no kernel ever reads garbage; nothing here
looks inside them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from kunlun_infer.capabilities import MemoryAllocator
from kunlun_infer.errors import DeviceOutOfMemoryError, PluginError
from kunlun_infer.ops.attention import AttentionBackend, CacheTensorSpec, kv_cache_bytes

log = logging.getLogger("kunlun_infer.framework")

#: one tuple of cache tensors per layer, in the attention backend's layout
KVCaches = list[tuple[torch.Tensor, ...]]


@dataclasses.dataclass(frozen=True, eq=False)
class KVLayout:
    """The cache of a run: ``num_layers`` layers, each the backend's tensors for blocks of ``block_size`` tokens."""

    num_layers: int
    block_size: int
    backend: AttentionBackend

    def layer_tensors(self, num_blocks: int) -> tuple[CacheTensorSpec, ...]:
        """What one layer's cache of ``num_blocks`` blocks is made of."""
        return tuple(self.backend.kv_cache_tensors(num_blocks, self.block_size))

    @functools.cached_property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers (the cache must grow linearly with its blocks)."""
        one, several = kv_cache_bytes(self.layer_tensors(1)), kv_cache_bytes(self.layer_tensors(8))
        if one <= 0 or several != 8 * one:
            raise PluginError(f"attention backend '{self.backend.name}': a layer's cache takes {one} bytes for 1 "
                              f"block and {several} for 8; it must take the same positive number of bytes per "
                              f"block", hook="attention.kv_cache_tensors")
        return self.num_layers * one

    def nbytes(self, num_blocks: int) -> int:
        """Bytes of the whole cache with ``num_blocks`` blocks."""
        return num_blocks * self.bytes_per_block


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """The memory ledger of one device and the KV blocks it leaves room for.

    ``memory_fraction × device_memory`` is what the engine may use; weights,
    the activation peak and the comm plugin's buffers come out of it first,
    and what remains becomes whole KV blocks — never more than the configured
    concurrency can fill (``max_num_seqs`` sequences of ``max_model_len``
    tokens). ``kunlun-infer plan`` and the engine both size the cache with
    :func:`size_kv_cache`, so the plan is what the engine allocates.
    """

    device_memory: int
    memory_fraction: float
    weight_bytes: int
    activation_bytes: int
    comm_bytes: int
    bytes_per_block: int
    block_size: int
    max_num_seqs: int
    max_model_len: int

    @property
    def usable_bytes(self) -> int:
        """``memory_fraction`` of the device memory: what the engine may use."""
        return int(self.memory_fraction * self.device_memory)

    @property
    def reserve_bytes(self) -> int:
        """The device memory left alone (``1 - memory_fraction`` of it)."""
        return self.device_memory - self.usable_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes left for the KV cache after weights, activations and comm buffers (may be negative)."""
        return self.usable_bytes - self.weight_bytes - self.activation_bytes - self.comm_bytes

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one sequence of ``max_model_len`` tokens needs."""
        return -(-self.max_model_len // self.block_size)

    @property
    def blocks_by_memory(self) -> int:
        return max(0, self.kv_bytes // self.bytes_per_block)

    @property
    def blocks_by_concurrency(self) -> int:
        return self.max_num_seqs * self.blocks_per_seq

    @property
    def num_blocks(self) -> int:
        """Blocks the engine allocates: what memory allows, capped by what concurrency can use."""
        return min(self.blocks_by_memory, self.blocks_by_concurrency)

    @property
    def max_concurrency(self) -> int:
        """Sequences of ``max_model_len`` tokens the memory holds at once."""
        return self.blocks_by_memory // self.blocks_per_seq


def size_kv_cache(layout: KVLayout, *, device_memory: int, memory_fraction: float, weight_bytes: int,
                  activation_bytes: int, comm_bytes: int = 0, max_num_seqs: int, max_model_len: int,
                  strict: bool = True) -> KVBudget:
    """The :class:`KVBudget` of a device; with ``strict``, raises when not even one block fits."""
    budget = KVBudget(device_memory=int(device_memory), memory_fraction=float(memory_fraction),
                      weight_bytes=int(weight_bytes), activation_bytes=int(activation_bytes),
                      comm_bytes=int(comm_bytes), bytes_per_block=layout.bytes_per_block,
                      block_size=layout.block_size, max_num_seqs=int(max_num_seqs), max_model_len=int(max_model_len))
    if not strict:
        return budget
    if budget.num_blocks < 1:
        raise DeviceOutOfMemoryError(
            f"no room for the KV cache: cache.memory_fraction={memory_fraction} of {device_memory} bytes, "
            f"minus {weight_bytes} bytes of weights, {activation_bytes} of activations and {comm_bytes} of "
            f"comm buffers, leaves less than one block ({layout.bytes_per_block} bytes); raise "
            f"cache.memory_fraction, lower scheduler.max_num_batched_tokens, or set cache.num_blocks "
            f"(kunlun-infer plan shows the breakdown)",
            requested=layout.bytes_per_block + weight_bytes + activation_bytes + comm_bytes, free=device_memory)
    if budget.num_blocks < budget.blocks_per_seq:
        log.warning("KV cache holds %d tokens, fewer than model.max_model_len=%d; longer requests are refused",
                    budget.num_blocks * layout.block_size, max_model_len)
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB; memory allows %d, concurrency uses at most %d)",
             budget.num_blocks, layout.block_size, budget.num_blocks * layout.bytes_per_block / 2**20,
             budget.blocks_by_memory, budget.blocks_by_concurrency)
    return budget


def blocks_for_budget(layout: KVLayout, *, free_bytes: int, memory_fraction: float, activation_bytes: int,
                      max_num_seqs: int, max_model_len: int) -> int:
    """Blocks for ``memory_fraction`` of ``free_bytes`` after activations (weights already loaded)."""
    return size_kv_cache(layout, device_memory=free_bytes, memory_fraction=memory_fraction, weight_bytes=0,
                         activation_bytes=activation_bytes, max_num_seqs=max_num_seqs,
                         max_model_len=max_model_len).num_blocks


def allocate_kv_caches(memory: MemoryAllocator, layout: KVLayout, num_blocks: int) -> KVCaches:
    """Zeroed cache tensors for every layer, in the backend's shapes, from the memory plugin."""
    tensors = layout.layer_tensors(num_blocks)
    caches: KVCaches = []
    layer: list[torch.Tensor] = []
    try:
        for _ in range(layout.num_layers):
            layer = []
            for spec in tensors:
                layer.append(memory.allocate(spec.shape, spec.dtype))
            for t in layer:
                t.zero_()
            caches.append(tuple(layer))
            layer = []
    except BaseException:
        for t in layer:  # the layer being built when it failed
            memory.free(t)
        free_kv_caches(memory, caches)
        raise
    return caches


def free_kv_caches(memory: MemoryAllocator, caches: KVCaches) -> None:
    """Give every cache tensor back to the memory plugin."""
    for layer in caches:
        for t in layer:
            memory.free(t)
    caches.clear()
