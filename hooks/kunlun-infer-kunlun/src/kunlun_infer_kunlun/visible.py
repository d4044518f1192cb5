"""``XPU_VISIBLE_DEVICES``: which physical cards this process sees, and which one a rank takes.

Like ``CUDA_VISIBLE_DEVICES``, the variable is read once when the vendor
runtime starts, so ``device.visible_devices`` is exported before
``torch_xmlir`` is imported, and refused when the stack is already up with a
different value (it would silently have no effect). Logical index ``i``
(``device.index``, or the local rank) is the ``i``-th visible card.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping

from kunlun_infer.errors import PluginError

VISIBLE_ENV = "XPU_VISIBLE_DEVICES"
STACK_MODULE = "torch_xmlir"


def parse_visible(value: str | None, *, source: str = VISIBLE_ENV) -> list[int] | None:
    """``"0,2,3"`` → ``[0, 2, 3]``; None/empty → None (every card visible)."""
    if value is None or not str(value).strip():
        return None
    ids = []
    for part in str(value).split(","):
        part = part.strip()
        if not part.isdigit():
            raise PluginError(f"{source}={value!r} is not a comma-separated list of XPU ids (e.g. 0,1,2,3)",
                              plugin="kunlun", hook="Device.open", layer="plugin")
        ids.append(int(part))
    if len(set(ids)) != len(ids):
        raise PluginError(f"{source}={value!r} lists an XPU twice", plugin="kunlun", hook="Device.open")
    return ids


def apply_visible_devices(wanted: str | None, environ: MutableMapping[str, str],
                          modules: dict | None = None) -> list[int] | None:
    """Export ``wanted`` as XPU_VISIBLE_DEVICES (if given) and return the visible ids (None = all)."""
    modules = sys.modules if modules is None else modules
    if wanted is not None:
        ids = parse_visible(wanted, source="device.visible_devices")
        current = environ.get(VISIBLE_ENV)
        normalised = ",".join(str(i) for i in ids or [])
        if current != normalised:
            if STACK_MODULE in modules:
                raise PluginError(
                    f"device.visible_devices={wanted!r} cannot take effect: {STACK_MODULE} is already imported with "
                    f"{VISIBLE_ENV}={current!r}; set {VISIBLE_ENV} before the process starts instead",
                    plugin="kunlun", hook="Device.open", layer="plugin")
            environ[VISIBLE_ENV] = normalised
        return ids
    return parse_visible(environ.get(VISIBLE_ENV))


def physical_id(index: int, visible: list[int] | None) -> int:
    """The physical card of logical ``index``; PluginError when fewer cards are visible."""
    if visible is None:
        return index
    if not 0 <= index < len(visible):
        raise PluginError(
            f"device.index={index} but {VISIBLE_ENV} makes only {len(visible)} XPU(s) visible "
            f"({','.join(map(str, visible))}); widen {VISIBLE_ENV} or run fewer ranks per host",
            plugin="kunlun", hook="Device.open", layer="hardware")
    return visible[index]
