"""Guards around plugin objects: any exception they raise becomes a :class:`PluginError`.

A guard subclasses the capability interface (so ``isinstance`` still holds),
forwards every interface member to the plugin's object and re-raises foreign
exceptions as ``PluginError`` naming the plugin, the method and the layer,
the original chained. Errors of the project's own hierarchy (for instance
``DeviceOutOfMemoryError``) are part of the contract and pass unchanged.
Members a plugin adds beyond the interface are reachable too, unguarded.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from kunlun_infer.capabilities import Comm, Device, Event, MemoryAllocator, OpsProvider, Stream, Streams
from kunlun_infer.errors import KunlunInferError, PluginError
from kunlun_infer.runtime.log import call_traced


def plugin_failure(exc: BaseException, *, plugin: str, hook: str, layer: str = "plugin") -> KunlunInferError:
    """The error to raise for ``exc`` escaping ``hook`` of ``plugin`` (caller chains ``exc``)."""
    if isinstance(exc, PluginError):
        if exc.plugin is None:
            exc.plugin, exc.hook = plugin, hook
        return exc
    if isinstance(exc, KunlunInferError):
        return exc
    return PluginError(
        f"plugin '{plugin}' failed in {hook} (layer: {layer}): {type(exc).__name__}: {' '.join(str(exc).split())}",
        plugin=plugin, hook=hook, layer=layer)


class DeferredFailures:
    """Plugin failures a tensor-parallel rank holds back until the end of its step (the first one is kept).

    Ranks run the same collectives in the same order; a rank whose kernel
    raises mid-forward must still take part in the rest of them, or every other
    rank waits for it until the comm timeout. Deferring callers (the op table,
    the attention backend) record the error here and answer with a stand-in;
    the step's results are discarded, and the rank reports :meth:`take` to
    the others once the forward is done.
    """

    def __init__(self) -> None:
        self._first: PluginError | None = None

    def record(self, exc: PluginError) -> None:
        if self._first is None:
            self._first = exc

    def take(self) -> PluginError | None:
        """The first failure since the last call (``None`` if none), forgotten here."""
        first, self._first = self._first, None
        return first


def guarded_call(plugin: str, hook: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` traced, translating foreign exceptions with :func:`plugin_failure`."""
    try:
        return call_traced(plugin, hook, fn, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every plugin failure is re-raised, attributed
        error = plugin_failure(exc, plugin=plugin, hook=hook)
        if error is exc:
            raise
        raise error from exc


class Guard:
    """Base of every guard: holds the plugin's object and the names used in errors."""

    #: for a comm guard: True between a successful ``init`` and ``destroy``
    joined: bool = False

    def __init__(self, inner: Any, *, plugin: str, capability: str) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "plugin", plugin)
        object.__setattr__(self, "capability", capability)
        object.__setattr__(self, "_children", {})

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        args = tuple(unwrap(a) for a in args)
        kwargs = {k: unwrap(v) for k, v in kwargs.items()}
        fn = getattr(self.inner, method)
        result = guarded_call(self.plugin, f"{self.capability}.{method}", fn, *args, **kwargs)
        if method in ("init", "destroy") and isinstance(self, Comm):
            object.__setattr__(self, "joined", method == "init")
        return self._wrap_result(result)

    def _get(self, attr: str) -> Any:
        return self._wrap_result(guarded_call(self.plugin, f"{self.capability}.{attr}", getattr, self.inner, attr))

    def _wrap_result(self, value: Any) -> Any:
        if isinstance(value, Stream):
            # keep one guard per stream so `compute_stream() is comm_stream()` stays meaningful
            children = self._children
            key = id(value)
            if key not in children:
                children[key] = (value, guard(value, plugin=self.plugin, capability="stream"))
            return children[key][1]
        if isinstance(value, Event):
            return guard(value, plugin=self.plugin, capability="event")
        if isinstance(value, Comm) and value is not self.inner:  # a subgroup answers for its plugin too
            return guard(value, plugin=self.plugin, capability=self.capability)
        return value

    def __getattr__(self, attr: str) -> Any:  # members beyond the interface
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} plugin={self.plugin!r} of {self.inner!r}>"


def unwrap(obj: Any) -> Any:
    """The plugin's own object behind a guard (``obj`` itself if it is not guarded)."""
    return obj.inner if isinstance(obj, Guard) else obj


def _forwarding_member(interface: type, attr: str) -> Any:
    member = inspect.getattr_static(interface, attr)
    if isinstance(member, property):
        return property(lambda self: self._get(attr))
    if inspect.isfunction(member):
        @functools.wraps(member)
        def method(self: Guard, *args: Any, **kwargs: Any) -> Any:
            return self._call(attr, *args, **kwargs)
        method.__isabstractmethod__ = False  # type: ignore[attr-defined]  # wraps() copied True
        return method
    if isinstance(member, (staticmethod, classmethod)):
        return None
    # plain class attributes (name, alignment, rank …) read through to the plugin's value
    return property(lambda self: getattr(self.inner, attr))


@functools.cache
def guard_class(interface: type) -> type:
    """A :class:`Guard` subclass of ``interface`` that forwards every public member."""
    namespace: dict[str, Any] = {}
    names = {n for n in dir(interface) if not n.startswith("_")} | {"__enter__", "__exit__"}
    for attr in sorted(names):
        if attr in ("__enter__", "__exit__") and not hasattr(interface, attr):
            continue
        member = _forwarding_member(interface, attr)
        if member is not None:
            namespace[attr] = member
    if interface is Device:
        namespace["__enter__"] = lambda self: (self.open(), self)[1]
        namespace["__exit__"] = lambda self, *exc: self.close()
    return type(f"Guarded{interface.__name__}", (Guard, interface), namespace)


_INTERFACES: tuple[type, ...] = (Device, MemoryAllocator, OpsProvider, Comm, Streams, Stream, Event)


def guard(obj: Any, *, plugin: str, capability: str, interface: type | None = None) -> Any:
    """Wrap ``obj`` in the guard of ``interface`` (default: the first interface it implements)."""
    if isinstance(obj, Guard):
        return obj
    candidates = (interface,) if interface is not None else _INTERFACES
    for candidate in candidates:
        if isinstance(obj, candidate):
            return guard_class(candidate)(obj, plugin=plugin, capability=capability)
    wanted = interface.__name__ if interface is not None else "a kunlun_infer.capabilities interface"
    raise PluginError(
        f"plugin '{plugin}' returned a {type(obj).__name__} for capability '{capability}', which is not a "
        f"subclass of {wanted}", plugin=plugin, hook=capability, layer="plugin")
