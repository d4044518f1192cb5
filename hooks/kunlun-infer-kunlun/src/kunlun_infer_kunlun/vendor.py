"""Finding the vendor's kernel library, ``kunlun_ops`` (formerly ``xtorch_ops``), and what it offers.

``ops=kunlun`` calls a kernel of the library where the library is importable
and has the function, and the torch path elsewhere, op by op. This module
only answers "which functions are there, and if none, why": it imports the
library once per provider (never at plugin load), tolerates its absence, and
never guesses a function that is not an attribute of the module.

vLLM-Kunlun imports ``cocopod`` (another vendor package) before
``kunlun_ops``; so does this module, when ``cocopod`` is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: the library's module name (its older name ``xtorch_ops`` is not used: its calls were never checked here)
MODULE_NAME = "kunlun_ops"
#: imported first when installed, as the vendor's integrations do
COMPANION_MODULES = ("cocopod",)


@dataclasses.dataclass(frozen=True)
class VendorKernels:
    """The imported library (or ``None``) and the reason it is missing."""

    module: ModuleType | None
    reason: str | None = None
    #: True when the library is installed but its import failed (worth a warning on a Kunlun host)
    broken: bool = False

    def has(self, *functions: str) -> bool:
        """True when every one of ``functions`` is a callable of the library."""
        return self.module is not None and all(callable(getattr(self.module, f, None)) for f in functions)

    def missing(self, *functions: str) -> list[str]:
        """The ``functions`` the library lacks (all of them without a library)."""
        return [f for f in functions if not self.has(f)]

    def get(self, function: str) -> Callable[..., Any]:
        return getattr(self.module, function)

    @property
    def version(self) -> str | None:
        """The library's distribution version, when it is installed as one."""
        if self.module is None:
            return None
        for dist in (MODULE_NAME, MODULE_NAME.replace("_", "-")):
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return getattr(self.module, "__version__", None)


def load_vendor_kernels(import_module: Callable[[str], ModuleType] = importlib.import_module) -> VendorKernels:
    """Import the library (after its companions); never raises."""
    for companion in COMPANION_MODULES:
        try:
            import_module(companion)
        except Exception:  # noqa: BLE001 - optional; the library's own import below says what is wrong
            pass
    try:
        return VendorKernels(import_module(MODULE_NAME))
    except ModuleNotFoundError as exc:
        if exc.name == MODULE_NAME:
            return VendorKernels(None, reason=f"{MODULE_NAME} is not installed")
        return VendorKernels(None, reason=f"importing {MODULE_NAME} failed: {exc}", broken=True)
    except Exception as exc:  # noqa: BLE001 - a broken vendor install must not break the plugin
        return VendorKernels(None, reason=f"importing {MODULE_NAME} failed: {type(exc).__name__}: {exc}",
                             broken=True)
