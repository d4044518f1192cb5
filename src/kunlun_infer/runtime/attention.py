"""The attention backend of a run: the ops plugin's own, guarded, or the reference one on the op table.

:func:`plugin_attention_backend` asks the ops provider
(``OpsProvider.attention_backend``, hook API 1.1) and wraps what it returns
so that anything the backend raises surfaces as a
:class:`~kunlun_infer.errors.PluginError` naming the plugin and the call
(``attention.attend`` …). :func:`resolve_attention` resolves the model's ops
and returns the backend the model will use: the plugin's, or — for a
provider without one — the reference backend over the op table, whose
``store_kv`` and ``paged_attention`` are then resolved too. For multi-head
latent attention (``AttentionSpec.kind == "mla"``, hook API 1.4) only an
:class:`~kunlun_infer.ops.attention.MLAAttentionBackend` is taken from a
plugin; anything else (a provider without one, or one written before 1.4
that answers every spec with its MHA backend) is logged and the reference
MLA backend (:mod:`kunlun_infer.ops.reference_mla`) serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kunlun_infer.errors import PluginError
from kunlun_infer.ops.attention import (MLA, AttentionBackend, AttentionBackendBase, AttentionSpec, CacheTensorSpec,
                                        MLAAttentionBackend)
from kunlun_infer.ops.attention_step import AttentionStep
from kunlun_infer.ops.reference_attention import REFERENCE_ATTENTION_OPS, ReferenceAttentionBackend
from kunlun_infer.ops.reference_mla import ReferenceMLABackend
from kunlun_infer.runtime.guard import DeferredFailures, guarded_call, plugin_failure
from kunlun_infer.runtime.log import runtime_log
from kunlun_infer.runtime.optable import OpTable
from kunlun_infer.runtime.protocol import ModelRuntime


class _Guard:
    """What the guarded backends of every kind share: the cache and metadata calls, and failure handling."""

    inner: AttentionBackendBase

    def __init__(self, inner: AttentionBackendBase, plugin: str) -> None:
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

    def update_metadata(self, static: Any, step: AttentionStep) -> bool:
        try:  # a backend written before 1.5 inherits the base class's answer: False
            return bool(self.inner.update_metadata(static, step))
        except Exception as exc:  # noqa: BLE001 - attributed to the plugin
            raise self._fail(exc, "update_metadata") from exc

    def _store(self, call: str, store: Any, *args: Any) -> None:
        try:
            store(*args)
        except Exception as exc:  # noqa: BLE001 - attributed to the plugin
            error = self._fail(exc, call)
            if self._deferred is None or not isinstance(error, PluginError):
                raise error from exc
            self._deferred.record(error)

    def _attend(self, call: str, attend: Any, zeros: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        try:
            return attend(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - attributed to the plugin
            error = self._fail(exc, call)
            if self._deferred is None or not isinstance(error, PluginError):
                raise error from exc
            self._deferred.record(error)
            return zeros()

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r} of plugin {self.plugin!r}>"


class GuardedAttentionBackend(_Guard, AttentionBackend):
    """Forwards to a plugin's backend; its failures become ``PluginError`` naming plugin and call."""

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                 metadata: Any) -> None:
        self._store("store_kv", self.inner.store_kv, key, value, kv_cache, metadata)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: tuple[torch.Tensor, ...], metadata: Any, *, scale: float) -> torch.Tensor:
        return self._attend("attend", self.inner.attend, lambda: torch.zeros_like(query), query, key, value,
                            kv_cache, metadata, scale=scale)


class GuardedMLAAttentionBackend(_Guard, MLAAttentionBackend):
    """Forwards to a plugin's MLA backend; its failures become ``PluginError`` naming plugin and call."""

    def store_latent(self, latent: torch.Tensor, k_rope: torch.Tensor, kv_cache: tuple[torch.Tensor, ...],
                     metadata: Any) -> None:
        self._store("store_latent", self.inner.store_latent, latent, k_rope, kv_cache, metadata)

    def attend_latent(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, ...], metadata: Any, *, kv_up: torch.Tensor,
                      scale: float) -> torch.Tensor:
        def zeros() -> torch.Tensor:
            return q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], kv_up.shape[1] - q_nope.shape[2])
        return self._attend("attend_latent", self.inner.attend_latent, zeros, q_nope, q_rope, latent, k_rope,
                            kv_cache, metadata, kv_up=kv_up, scale=scale)


#: the backend class a plugin must return for each kind of attention
_BACKEND_CLASSES: dict[str, type[AttentionBackendBase]] = {MLA: MLAAttentionBackend}


def plugin_attention_backend(provider: Any, plugin: str, spec: AttentionSpec) -> AttentionBackendBase | None:
    """The ops provider's backend for ``spec`` (guarded), or ``None`` when it has none for this kind.

    A backend of the wrong class for ``spec.kind`` — e.g. the MHA backend of
    a plugin written before MLA existed, which never looked at the kind — is
    logged and not used: ``None``, so the framework's reference serves.
    """
    method = getattr(provider, "attention_backend", None)
    if method is None:
        return None
    backend = guarded_call(plugin, "ops.attention_backend", method, spec)
    if backend is None:
        return None
    wanted = _BACKEND_CLASSES.get(spec.kind, AttentionBackend)
    if spec.kind in _BACKEND_CLASSES and isinstance(backend, AttentionBackendBase) and not isinstance(backend,
                                                                                                       wanted):
        runtime_log.warning("plugin '%s' answered %s attention with a %s, not a %s: using the framework's reference "
                            "for it", plugin, spec.kind.upper(), type(backend).__name__, wanted.__name__)
        return None
    if not isinstance(backend, wanted):
        raise PluginError(f"plugin '{plugin}': ops.attention_backend returned a {type(backend).__name__}, not a "
                          f"kunlun_infer.ops.attention.{wanted.__name__}", plugin=plugin, hook="ops.attention_backend")
    if isinstance(backend, MLAAttentionBackend):
        return GuardedMLAAttentionBackend(backend, plugin)
    return GuardedAttentionBackend(backend, plugin)


def reference_backend(spec: AttentionSpec, ops: Any = None) -> AttentionBackendBase:
    """The framework's own backend for ``spec``: over the op table ``ops`` for MHA, plain torch for MLA."""
    if spec.kind == MLA:
        return ReferenceMLABackend(spec)
    return ReferenceAttentionBackend(spec, ops)


def resolve_attention(runtime: ModelRuntime, required_ops: Iterable[str],
                      spec: AttentionSpec) -> tuple[OpTable, AttentionBackendBase]:
    """``(op table, attention backend)`` for a model needing ``required_ops`` and attention ``spec``.

    ``runtime`` needs ``resolve_ops``; its ``attention_backend(spec)``, when it
    has one, may offer the ops plugin's backend. Otherwise the reference
    backend serves: for MHA the op table then includes its ``store_kv`` and
    ``paged_attention``; for MLA the plain-torch reference MLA backend needs
    no op.
    """
    offer = getattr(runtime, "attention_backend", None)
    backend = offer(spec) if offer is not None else None
    needs_table_attention = backend is None and spec.kind != MLA
    ops = list(required_ops) + (list(REFERENCE_ATTENTION_OPS) if needs_table_attention else [])
    table = runtime.resolve_ops(ops)
    if backend is None:
        backend = reference_backend(spec, table)
        if spec.kind == MLA:
            runtime_log.warning("MLA attention: the ops plugin has no MLA backend; using the framework's reference "
                             "backend '%s' (plain torch)", backend.name)
    runtime_log.debug("attention backend: %s", backend.name)
    return table, backend
