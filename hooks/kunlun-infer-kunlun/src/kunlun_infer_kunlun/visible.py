"""``XPU_VISIBLE_DEVICES``: which physical cards this process sees, and which one a rank takes.

Like ``CUDA_VISIBLE_DEVICES``, the variable is read once, when the device
runtime starts; the xpytorch build imports itself together with torch, so
whether ``torch_xmlir`` is imported says nothing — what matters is whether
the runtime has started (``torch.cuda.is_initialized()``, which the stack
answers). ``device.visible_devices`` is exported before that, and refused
after it when it would change the value (it would silently have no effect).
Where ``CUDA_VISIBLE_DEVICES`` is set too, it gets the same list, so the two
never disagree. Logical index ``i`` (``device.index``, or the local rank) is
the ``i``-th visible card.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping

from kunlun_infer.errors import PluginError

log = logging.getLogger("kunlun_infer.plugin.kunlun")

VISIBLE_ENV = "XPU_VISIBLE_DEVICES"
CUDA_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


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


def normalise_visible(value: str | None) -> str | None:
    """``" 0, 1"`` → ``"0,1"``; None/empty → None; anything else unparsable is kept as given."""
    if value is None or not str(value).strip():
        return None
    return ",".join(part.strip() for part in str(value).split(","))


def apply_visible_devices(wanted: str | None, environ: MutableMapping[str, str],
                          runtime_started: Callable[[], bool] = lambda: False) -> list[int] | None:
    """Export ``wanted`` as XPU_VISIBLE_DEVICES (if given) and return the visible ids (None = all).

    ``runtime_started`` says whether the device runtime has read the
    variable already; changing it then is refused.
    """
    if wanted is None:
        return parse_visible(environ.get(VISIBLE_ENV))
    ids = parse_visible(wanted, source="device.visible_devices")
    current = environ.get(VISIBLE_ENV)
    normalised = ",".join(str(i) for i in ids or [])
    if current != normalised:
        if runtime_started():
            raise PluginError(
                f"device.visible_devices={wanted!r} cannot take effect: the device runtime has started already "
                f"with {VISIBLE_ENV}={current!r}; set {VISIBLE_ENV} before the process starts instead",
                plugin="kunlun", hook="Device.open", layer="plugin")
        environ[VISIBLE_ENV] = normalised
    cuda = environ.get(CUDA_VISIBLE_ENV)
    if cuda is not None and normalise_visible(cuda) != normalised and not runtime_started():
        log.info("device.visible_devices=%s: %s=%s becomes %s too", wanted, CUDA_VISIBLE_ENV, cuda, normalised)
        environ[CUDA_VISIBLE_ENV] = normalised
    return ids


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
