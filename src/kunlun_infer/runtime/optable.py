"""The op table of a run: every op the model needs, resolved to one kernel before the first step.

Each op comes from the chosen ops plugin when it supports it, otherwise from
the plain-torch reference in :mod:`kunlun_infer.ops` (a *fallback*, logged
once and counted) — or, with ``ops.strict=true``, the run is refused with the
list of missing ops. ``pack_linear_weight`` and ``linear`` always come from
the same source, since a provider's ``linear`` only understands weights its
own ``pack_linear_weight`` prepared (likewise ``pack_int8_linear_weight`` and
``int8_linear``, and ``pack_moe_weights`` and ``fused_moe``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from kunlun_infer.errors import OpsCoverageError, PluginError
from kunlun_infer.ops import OP_SPECS
from kunlun_infer.runtime.guard import DeferredFailures, guarded_call, plugin_failure

REFERENCE = "reference"
#: ops that must be served by one source together
COUPLED_OPS: tuple[frozenset[str], ...] = (frozenset({"pack_linear_weight", "linear"}),
                                           frozenset({"pack_int8_linear_weight", "int8_linear"}),
                                           frozenset({"pack_moe_weights", "fused_moe"}))


class OpTable:
    """Resolved kernels by op name: ``table.rms_norm(x, w, eps)``."""

    def __init__(self, kernels: dict[str, Callable[..., Any]], sources: dict[str, str]) -> None:
        self._kernels = kernels
        self._sources = sources
        #: calls made through reference fallbacks, by op
        self.fallback_calls: collections.Counter[str] = collections.Counter()

    def defer_failures(self, failures: DeferredFailures) -> None:
        """From now on a plugin kernel that raises is answered by its op's reference, the error kept in ``failures``.

        For a tensor-parallel rank (see :class:`~kunlun_infer.runtime.guard.DeferredFailures`):
        the forward completes, its results are discarded, the error is
        reported at the end of the step. Where the reference cannot run on
        the plugin's inputs either (a weight packed in the plugin's own
        layout), the plugin's error is raised after all.
        """
        for op, source in self._sources.items():
            if source != REFERENCE:
                self._kernels[op] = self._deferring(op, self._kernels[op], failures)

    @staticmethod
    def _deferring(op: str, kernel: Callable[..., Any], failures: DeferredFailures) -> Callable[..., Any]:
        reference = OP_SPECS[op].reference

        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return kernel(*args, **kwargs)
            except PluginError as exc:
                failures.record(exc)
                try:
                    return reference(*args, **kwargs)
                except Exception:  # noqa: BLE001 - the plugin's error is the one to report
                    raise exc from None

        run.__name__ = run.__qualname__ = op
        run.__doc__ = kernel.__doc__
        return run

    def __getattr__(self, op: str) -> Callable[..., Any]:
        kernels = self.__dict__.get("_kernels", {})
        if op in kernels:
            return kernels[op]
        raise AttributeError(f"op '{op}' was not resolved for this run; resolved ops: {', '.join(sorted(kernels))}")

    def __getitem__(self, op: str) -> Callable[..., Any]:
        return getattr(self, op)

    def __contains__(self, op: str) -> bool:
        return op in self._kernels

    @property
    def ops(self) -> list[str]:
        """Every resolved op name."""
        return sorted(self._kernels)

    def source(self, op: str) -> str:
        """The plugin serving ``op``, or ``"reference"`` for a fallback."""
        return self._sources[op]

    @property
    def fallbacks(self) -> list[str]:
        """Ops served by the plain-torch reference because the plugin lacks them."""
        return sorted(op for op, src in self._sources.items() if src == REFERENCE)


def _with_coupled(ops: Iterable[str]) -> list[str]:
    wanted = list(dict.fromkeys(ops))
    for group in COUPLED_OPS:
        if group & set(wanted):
            wanted += sorted(group - set(wanted))
    return wanted


def _supports(provider: Any, plugin: str, op: str) -> bool:
    return bool(guarded_call(plugin, "ops.supports", provider.supports, op))


def resolve(ops: Iterable[str], *, provider: Any, plugin: str, strict: bool) -> OpTable:
    """Build the :class:`OpTable` for ``ops`` from ``provider`` (the plugin's own object)."""
    wanted = _with_coupled(ops)
    supported = {op: _supports(provider, plugin, op) for op in wanted}
    for group in COUPLED_OPS:
        if group <= set(wanted) and len({supported[op] for op in group}) > 1:
            for op in group:  # half a pair cannot be mixed with the other half's reference
                supported[op] = False
    missing = [op for op in wanted if not supported[op]]
    unknown = [op for op in missing if op not in OP_SPECS]
    if strict and missing:
        raise OpsCoverageError(
            f"ops plugin '{plugin}' lacks {len(missing)} op(s) the model needs: {', '.join(missing)}; "
            f"ops.strict=true refuses reference fallbacks: choose another ops plugin or set ops.strict=false",
            missing=missing, plugin=plugin)
    if unknown:
        raise OpsCoverageError(
            f"ops plugin '{plugin}' lacks op(s) {', '.join(unknown)}, which have no reference "
            f"implementation to fall back to; choose an ops plugin that provides them",
            missing=unknown, plugin=plugin)
    table = OpTable({}, {})
    for op in wanted:
        if supported[op]:
            table._kernels[op] = _plugin_kernel(provider, plugin, op)
            table._sources[op] = plugin
        else:
            table._kernels[op] = _fallback_kernel(op, table.fallback_calls)
            table._sources[op] = REFERENCE
    return table


def _plugin_kernel(provider: Any, plugin: str, op: str) -> Callable[..., Any]:
    kernel = guarded_call(plugin, "ops.get", provider.get, op)
    hook = f"ops.{op}"

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return kernel(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - attributed to the plugin and re-raised
            error = plugin_failure(exc, plugin=plugin, hook=hook)
            if error is exc:
                raise
            raise error from exc

    run.__name__ = run.__qualname__ = op
    run.__doc__ = getattr(kernel, "__doc__", None)
    return run


def _fallback_kernel(op: str, counter: collections.Counter[str]) -> Callable[..., Any]:
    reference = OP_SPECS[op].reference

    def run(*args: Any, **kwargs: Any) -> Any:
        counter[op] += 1
        return reference(*args, **kwargs)

    run.__name__ = run.__qualname__ = op
    run.__doc__ = reference.__doc__
    return run
