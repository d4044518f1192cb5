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
