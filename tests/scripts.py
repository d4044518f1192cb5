"""``load_script``: a script of the repository (a benchmark, a training script) imported as a module by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The script at ``relative`` (to the repository's root), imported once per process and registered in
    ``sys.modules`` before it runs (dataclasses look their module up there)."""
    name = "_kunlun_infer_script_" + relative.replace("/", "_").removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
