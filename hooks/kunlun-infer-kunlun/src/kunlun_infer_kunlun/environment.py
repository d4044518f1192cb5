"""Environment variables of the vendor stack that quietly break this plugin, checked before the device opens.

Each finding is one warning naming the variable, what it does to a run and
what to do; none refuses, since a deployment may have reasons we cannot see.

- ``XPU_DUMMY_EVENT`` set: the vendor's own guides ``unset`` it before
  serving so that XPU events are real; with dummy events, ``streams=kunlun``'s
  record/wait would order nothing.
- ``XMLIR_DISABLE_CUDA_ALLOCATOR=1``: routes ``torch.cuda``'s memory API to
  the stack's own allocator instead of torch's caching allocator, which
  ``memory=kunlun`` (stats, ``empty_cache``) is built on.
- ``CUDA_VISIBLE_DEVICES`` set and different from ``XPU_VISIBLE_DEVICES``: the
  stack answers torch's CUDA API, so two variables claim to say which cards
  this process sees; the vendor's multi-card guides set both to the same list.
"""

from __future__ import annotations

from collections.abc import Mapping

from kunlun_infer_kunlun.visible import CUDA_VISIBLE_ENV, VISIBLE_ENV, normalise_visible

_TRUE = ("1", "true", "yes", "on")


def environment_warnings(environ: Mapping[str, str]) -> list[str]:
    """One message per setting of ``environ`` that works against this plugin."""
    found = []
    if "XPU_DUMMY_EVENT" in environ:
        found.append(f"XPU_DUMMY_EVENT={environ['XPU_DUMMY_EVENT']!r} is set: XPU events become placeholders, so "
                     f"streams=kunlun's record/wait would not order work; unset XPU_DUMMY_EVENT (the vendor's "
                     f"serving guides do)")
    if str(environ.get("XMLIR_DISABLE_CUDA_ALLOCATOR", "")).strip().lower() in _TRUE:
        found.append(f"XMLIR_DISABLE_CUDA_ALLOCATOR={environ['XMLIR_DISABLE_CUDA_ALLOCATOR']!r} takes torch's "
                     f"caching allocator away from the XPU; memory=kunlun's statistics and cache rely on it: "
                     f"leave XMLIR_DISABLE_CUDA_ALLOCATOR unset")
    cuda = environ.get(CUDA_VISIBLE_ENV)
    if cuda is not None and normalise_visible(cuda) != normalise_visible(environ.get(VISIBLE_ENV)):
        found.append(f"{CUDA_VISIBLE_ENV}={cuda!r} differs from {VISIBLE_ENV}="
                     f"{environ.get(VISIBLE_ENV)!r}: the stack serves torch's CUDA API, so both claim to choose "
                     f"the cards; set them to the same list (or use device.visible_devices, which sets both)")
    return found
