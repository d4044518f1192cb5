"""The paged KV cache's memory: how many blocks, and the per-layer K/V tensors.

``cache.num_blocks`` fixes the count. Otherwise the cache gets
``cache.memory_fraction`` of the device memory free after the weights were
loaded, minus the activation peak of a warm-up step, and never more blocks
than the configured concurrency can fill (``max_num_seqs`` sequences of
``max_model_len`` tokens): on a host whose device memory is the machine's
RAM, the default leaves the machine usable. Tensors come from the runtime's
memory plugin and are zeroed, so no kernel ever reads garbage.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kunlun_infer.capabilities import MemoryAllocator
from kunlun_infer.errors import DeviceOutOfMemoryError

log = logging.getLogger("kunlun_infer.framework")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Shape of the cache: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` K and V per layer."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


def blocks_for_budget(layout: KVLayout, *, free_bytes: int, memory_fraction: float, activation_bytes: int,
                      max_num_seqs: int, max_model_len: int) -> int:
    """Number of blocks for ``memory_fraction`` of ``free_bytes`` after activations, capped by concurrency."""
    budget = int(memory_fraction * free_bytes) - activation_bytes
    by_memory = budget // layout.bytes_per_block
    blocks_per_seq = -(-max_model_len // layout.block_size)
    by_concurrency = max_num_seqs * blocks_per_seq
    num_blocks = min(by_memory, by_concurrency)
    if num_blocks < 1:
        raise DeviceOutOfMemoryError(
            f"no room for the KV cache: cache.memory_fraction={memory_fraction} of {free_bytes} free bytes, "
            f"minus {activation_bytes} bytes of activations, leaves less than one block "
            f"({layout.bytes_per_block} bytes); raise cache.memory_fraction, lower "
            f"scheduler.max_num_batched_tokens, or set cache.num_blocks",
            requested=layout.bytes_per_block + activation_bytes, free=free_bytes)
    if num_blocks < blocks_per_seq:
        log.warning("KV cache holds %d tokens, fewer than model.max_model_len=%d; longer requests are refused",
                    num_blocks * layout.block_size, max_model_len)
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB; memory allows %d, concurrency uses at most %d)",
             num_blocks, layout.block_size, num_blocks * layout.bytes_per_block / 2**20, by_memory, by_concurrency)
    return num_blocks


def allocate_kv_caches(memory: MemoryAllocator, layout: KVLayout, num_blocks: int) -> KVCaches:
    """Zeroed K and V tensors for every layer, from the memory plugin."""
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    caches: KVCaches = []
    try:
        for _ in range(layout.num_layers):
            k = memory.allocate(shape, layout.dtype)
            caches.append((k, k))  # placeholder until V exists, so a failure frees K once
            v = memory.allocate(shape, layout.dtype)
            caches[-1] = (k.zero_(), v.zero_())
    except BaseException:
        free_kv_caches(memory, caches)
        raise
    return caches


def free_kv_caches(memory: MemoryAllocator, caches: KVCaches) -> None:
    """Give every cache tensor back to the memory plugin."""
    for k, v in caches:
        memory.free(k)
        if v is not k:
            memory.free(v)
    caches.clear()
