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

__version__ = "0.1.0"

from kunlun_infer.runtime.compose import compose_config  # noqa: E402 - needs __version__ above
from kunlun_infer.engine.engine import LLMEngine  # noqa: E402
from kunlun_infer.engine.outputs import RequestOutput  # noqa: E402
from kunlun_infer.engine.params import SamplingParams  # noqa: E402
from kunlun_infer.llm import LLM  # noqa: E402

__all__ = [
    "ConfigError",
    "DeviceOutOfMemoryError",
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
    "WorkerError",
    "__version__",
    "compose_config",
]
