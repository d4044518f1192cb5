"""The attention backend of a run: the ops plugin's own, guarded, or the reference one on the op table.

:func:`plugin_attention_backend` asks the ops provider
(``OpsProvider.attention_backend``, hook API 1.1) and wraps what it returns
so that anything the backend raises surfaces as a
:class:`~kunlun_infer.errors.PluginError` naming the plugin and the call
(``attention.attend`` …). :func:`resolve_attention` resolves the model's ops
and returns the backend the model will use: the plugin's, or — for a
provider without one — the reference backend over the op table, whose
``store_kv`` and ``paged_attention`` are then resolved too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kunlun_infer.errors import PluginError
from kunlun_infer.ops.attention import AttentionBackend, AttentionSpec, CacheTensorSpec
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.ops.reference_attention import REFERENCE_ATTENTION_OPS, ReferenceAttentionBackend
from kunlun_infer.runtime.guard import DeferredFailures, guarded_call, plugin_failure
from kunlun_infer.runtime.log import runtime_log
from kunlun_infer.runtime.optable import OpTable
from kunlun_infer.runtime.protocol import ModelRuntime


class GuardedAttentionBackend(AttentionBackend):
    """Forwards to a plugin's backend; its failures become ``PluginError`` naming plugin and call."""

    def __init__(self, inner: AttentionBackend, plugin: str) -> None:
        self.inner = inner
        self.plugin = plugin
        self.name = str(getattr(inner, "name", type(inner).__name__))
        #: where ``store_kv``/``attend`` failures go instead of being raised (tensor-parallel ranks)
        self._deferred: DeferredFailures | None = None

    def defer_failures(self, failures: DeferredFailures) -> None:
        """From now on a failing ``store_kv`` stores nothing and a failing ``attend`` answers zeros; errors kept.

        The step's results are discarded once the rank reports the error (see
        :class:`~kunlun_infer.runtime.guard.DeferredFailures`).
        """
        self._deferred = failures

    def _fail(self, exc: Exception, call: str) -> Exception:
        return plugin_failure(exc, plugin=self.plugin, hook=f"attention.{call}")

    def kv_cache_tensors(self, num_blocks: int, block_size: int) -> Sequence[CacheTensorSpec]:
        tensors = tuple(guarded_call(self.plugin, "attention.kv_cache_tensors", self.inner.kv_cache_tensors,
                                     num_blocks, block_size))
        if not tensors or not all(isinstance(t, CacheTensorSpec) for t in tensors):
            raise PluginError(f"plugin '{self.plugin}' attention backend '{self.name}': kv_cache_tensors must return "
                              f"CacheTensorSpec objects, got {tensors!r}", plugin=self.plugin,
                              hook="attention.kv_cache_tensors")
        return tensors

    def order_batch(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> Sequence[int] | None:
        order = guarded_call(self.plugin, "attention.order_batch", self.inner.order_batch, query_lens, context_lens)
        if order is not None and sorted(order) != list(range(len(query_lens))):
            raise PluginError(f"plugin '{self.plugin}' attention backend '{self.name}': order_batch returned "
                              f"{list(order)}, not a permutation of the step's {len(query_lens)} sequences",
                              plugin=self.plugin, hook="attention.order_batch")
        return order

    def build_metadata(self, step: AttentionStep) -> Any:
        try:
            return self.inner.build_metadata(step)
        except Exception as exc:  # noqa: BLE001 - attributed to the plugin
            raise self._fail(exc, "build_metadata") from exc

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 metadata: Any) -> None:
        try:
            self.inner.store_kv(key, value, kv_cache, metadata)
        except Exception as exc:  # noqa: BLE001 - attributed to the plugin
            error = self._fail(exc, "store_kv")
            if self._deferred is None or not isinstance(error, PluginError):
                raise error from exc
            self._deferred.record(error)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: tuple[torch.Tensor, ...], metadata: Any, *, scale: float) -> torch.Tensor:
        try:
            return self.inner.attend(query, key, value, kv_cache, metadata, scale=scale)
        except Exception as exc:  # noqa: BLE001 - attributed to the plugin
            error = self._fail(exc, "attend")
            if self._deferred is None or not isinstance(error, PluginError):
                raise error from exc
            self._deferred.record(error)
            return torch.zeros_like(query)

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r} of plugin {self.plugin!r}>"


def plugin_attention_backend(provider: Any, plugin: str, spec: AttentionSpec) -> AttentionBackend | None:
    """The ops provider's backend for ``spec`` (guarded), or ``None`` when it has none (1.0 providers)."""
    method = getattr(provider, "attention_backend", None)
    if method is None:
        return None
    backend = guarded_call(plugin, "ops.attention_backend", method, spec)
    if backend is None:
        return None
    if not isinstance(backend, AttentionBackend):
        raise PluginError(f"plugin '{plugin}': ops.attention_backend returned a {type(backend).__name__}, not a "
                          f"kunlun_infer.ops.attention.AttentionBackend", plugin=plugin, hook="ops.attention_backend")
    return GuardedAttentionBackend(backend, plugin)


def resolve_attention(runtime: ModelRuntime, required_ops: Iterable[str],
                      spec: AttentionSpec) -> tuple[OpTable, AttentionBackend]:
    """``(op table, attention backend)`` for a model needing ``required_ops`` and attention ``spec``.

    ``runtime`` needs ``resolve_ops``; its ``attention_backend(spec)``, when it
    has one, may offer the ops plugin's backend. Otherwise the reference
    backend serves, and the op table includes its ``store_kv`` and
    ``paged_attention``.
    """
    offer = getattr(runtime, "attention_backend", None)
    backend = offer(spec) if offer is not None else None
    ops = list(required_ops) + ([] if backend is not None else list(REFERENCE_ATTENTION_OPS))
    table = runtime.resolve_ops(ops)
    if backend is None:
        backend = ReferenceAttentionBackend(spec, table)
    runtime_log.debug("attention backend: %s", backend.name)
    return table, backend
