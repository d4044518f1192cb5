"""A test plugin with an attention backend of its own layout, and a memory option that seals what it hands out.

``ops=padded``: the torch kernels, plus a backend whose cache is ONE tensor
per layer, ``[num_blocks, 2, block_size, num_kv_heads, head_dim + 8]`` (keys
and values side by side, each head padded by 8 lanes — so its bytes differ
from the reference layout's), whose batches run longest query first, and
which attends through the reference ``paged_attention`` on views of it.
``ops=padded-broken``: the same, except ``store_kv`` writes every value
into the key half as well, so attention over cached tokens goes wrong.

``memory=sealed``: the caching allocator, handing out tensors that refuse
every operation but metadata reads and ``zero_`` unless the padded backend
is running — proof that nothing else reads, writes or indexes the KV cache.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from kunlun_infer.capabilities import DictOpsProvider
from kunlun_infer.hookspecs import PluginInfo, hookimpl
from kunlun_infer.ops import reference
from kunlun_infer.ops.attention import AttentionBackend, CacheTensorSpec
from kunlun_infer.ops.reference_attention import reference_metadata
from kunlun_infer.plugins.cpu_memory import CachingAllocator
from kunlun_infer.plugins.torch_ops import kernels

PAD = 8
_backend_running = threading.local()
#: what anyone may do with a sealed tensor: look at its metadata, zero it, free it
METADATA_CALLS = {"__get__", "zero_", "data_ptr", "numel", "element_size", "dim", "size", "stride", "nbytes",
                  "is_contiguous", "storage_offset", "__repr__", "__format__"}


@contextlib.contextmanager
def backend_running():
    _backend_running.depth = getattr(_backend_running, "depth", 0) + 1
    try:
        yield
    finally:
        _backend_running.depth -= 1


class SealedTensor(torch.Tensor):
    """A cache tensor only the padded backend may operate on."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        if not getattr(_backend_running, "depth", 0) and name not in METADATA_CALLS:
            raise AssertionError(f"a KV cache tensor was used outside the attention backend: {name}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class SealedAllocator(CachingAllocator):
    name = "sealed"

    def allocate(self, shape, dtype):
        return super().allocate(shape, dtype).as_subclass(SealedTensor)


class PaddedBackend(AttentionBackend):
    """K and V of a block side by side in one tensor per layer, heads padded; longest queries first."""

    name = "padded"

    def __init__(self, spec, *, broken: bool = False) -> None:
        self.spec, self.broken = spec, broken

    def kv_cache_tensors(self, num_blocks, block_size):
        shape = (num_blocks, 2, block_size, self.spec.num_kv_heads, self.spec.head_dim + PAD)
        return (CacheTensorSpec(shape, self.spec.dtype, "kv"),)

    def order_batch(self, query_lens, context_lens):
        return sorted(range(len(query_lens)), key=lambda i: -query_lens[i])

    def build_metadata(self, step):
        return reference_metadata(step)

    def _kv(self, cache):
        d = self.spec.head_dim
        return cache[:, 0, :, :, :d], cache[:, 1, :, :, :d]

    def store_kv(self, key, value, kv_cache, metadata):
        with backend_running():
            (cache,) = kv_cache
            slots = metadata.slot_mapping
            blocks, offsets = slots // cache.shape[2], slots % cache.shape[2]
            k_cache, v_cache = self._kv(cache)
            k_cache[blocks, offsets] = (value if self.broken else key).to(cache.dtype)
            v_cache[blocks, offsets] = value.to(cache.dtype)

    def attend(self, query, key, value, kv_cache, metadata, *, scale):
        with backend_running():
            k_cache, v_cache = self._kv(kv_cache[0])
            return reference.paged_attention(query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                             metadata.query_start_loc, scale)


class PaddedOps(DictOpsProvider):
    def __init__(self, name: str, broken: bool = False) -> None:
        table = {op: k for op, k in kernels().items() if op not in ("store_kv", "paged_attention")}
        super().__init__(table, name=name)
        self.broken = broken

    def attention_backend(self, spec):
        return PaddedBackend(spec, broken=self.broken)


@hookimpl
def kunlun_infer_plugin_info():
    return PluginInfo(name="padded-attention", version="0.0.1", api=">=1.1,<2", capabilities=("ops", "memory"))


@hookimpl
def kunlun_infer_ops_factories():
    return {"padded": lambda *, config, device: PaddedOps("padded"),
            "padded-broken": lambda *, config, device: PaddedOps("padded-broken", broken=True)}


@hookimpl
def kunlun_infer_memory_factories():
    return {"sealed": lambda *, config, device: SealedAllocator(device=device)}
