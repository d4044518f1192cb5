"""Hook-API version ranges: parse a plugin's ``api`` string and check it against ours."""

from __future__ import annotations

import operator
import re

from kunlun_infer.errors import PluginVersionError
from kunlun_infer.hookspecs import HOOK_API_VERSION, HOOK_API_VERSION_STR
from kunlun_infer.version import __version__

_COMPARISONS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
                ">": operator.gt, "<": operator.lt}
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*(\d+)(?:\.(\d+))?\s*$")


def parse_api_range(spec: str) -> list[tuple[str, tuple[int, int]]]:
    """``">=1.0,<2"`` → ``[(">=", (1, 0)), ("<", (2, 0))]``; ``ValueError`` when malformed."""
    clauses = []
    for part in spec.split(","):
        match = _CLAUSE.match(part)
        if match is None:
            raise ValueError(f"malformed hook-API range {spec!r}: expected comparisons such as '>=1.0,<2'")
        op, major, minor = match.groups()
        clauses.append((op, (int(major), int(minor or 0))))
    return clauses


def api_range_admits(spec: str, version: tuple[int, int] = HOOK_API_VERSION) -> bool:
    """True when every clause of ``spec`` holds for ``version``."""
    return all(_COMPARISONS[op](version, bound) for op, bound in parse_api_range(spec))


def check_api_range(spec: str, *, plugin: str, distribution: str | None, distribution_version: str | None) -> None:
    """Raise :class:`PluginVersionError` unless ``spec`` admits this framework's hook API."""
    where = f"distribution {distribution} {distribution_version}" if distribution else "not from a distribution"
    try:
        admitted = api_range_admits(spec)
    except ValueError as exc:
        raise PluginVersionError(f"plugin '{plugin}' ({where}) declares {exc}", plugin=plugin,
                                 hook="kunlun_infer_plugin_info", layer="plugin") from None
    if not admitted:
        raise PluginVersionError(
            f"plugin '{plugin}' ({where}) supports hook API '{spec}', but kunlun-infer {__version__} "
            f"requires hook API {HOOK_API_VERSION_STR}; install a release of the plugin that supports "
            f"{HOOK_API_VERSION_STR}", plugin=plugin, hook="kunlun_infer_plugin_info", layer="plugin")
