"""Saying what failed in a step: the plugin, hook and layer at fault, found anywhere in the cause chain.

A plugin's exception reaches the engine as a :class:`PluginError` — directly
(an op) or as the cause of another error (a collective that failed on one rank
surfaces as a ``WorkerError``). The text a failed request carries names the
plugin error either way; a failure with no plugin in its chain is the
framework's own.
"""

from __future__ import annotations

from kunlun_infer.errors import PluginError, WorkerError


def describe_failure(exc: BaseException) -> tuple[str, str | None, str | None, str]:
    """``(text, plugin, hook, layer)`` of a step's failure; a plugin error anywhere in the chain is named."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not e for e in chain):  # the exception, then its causes
        chain.append(current)
        current = current.__cause__ or current.__context__
    text = " ".join(str(chain[0]).split())
    culprit = next((e for e in chain if isinstance(e, PluginError)), None)
    if culprit is not None:
        if culprit is not chain[0]:
            text = f"{type(chain[0]).__name__}: {text}; cause: {' '.join(str(culprit).split())}"
        return text, culprit.plugin, culprit.hook, culprit.layer
    what = "a tensor-parallel worker failed" if isinstance(chain[0], WorkerError) else "the framework failed"
    return f"{what} (layer: framework): {type(chain[0]).__name__}: {text}", None, None, "framework"
