"""kunlun_infer: an embeddable LLM inference engine whose hardware lives entirely in plugins."""

from kunlun_infer.errors import (
    ConfigError,
    DeviceOutOfMemoryError,
    KunlunInferError,
    ModelLoadError,
    OpsCoverageError,
    PluginError,
    PluginVersionError,
    RequestError,
    WorkerError,
)
from kunlun_infer.engine.engine import LLMEngine
from kunlun_infer.engine.outputs import RequestOutput
from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.structured_output import StructuredOutput
from kunlun_infer.llm import LLM
from kunlun_infer.runtime.compose import compose_config
from kunlun_infer.version import __version__

__all__ = [
    "ConfigError",
    "DeviceOutOfMemoryError",
    "Fleet",
    "KunlunInferError",
    "LLM",
    "LLMEngine",
    "ModelLoadError",
    "OpsCoverageError",
    "PluginError",
    "PluginVersionError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "WorkerError",
    "__version__",
    "compose_config",
]


def __getattr__(name: str) -> object:
    """``kunlun_infer.Fleet`` on first use: it needs the ``cluster`` extra, which plain use of the engine does not."""
    if name == "Fleet":
        try:
            from kunlun_infer.fleet import Fleet
        except ImportError as exc:
            raise ImportError(f"kunlun_infer.Fleet needs {exc.name}: pip install 'kunlun-infer[cluster]'") from exc
        return Fleet
    raise AttributeError(f"module 'kunlun_infer' has no attribute {name!r}")
