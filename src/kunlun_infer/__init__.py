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

__all__ = [
    "ConfigError",
    "DeviceOutOfMemoryError",
    "KunlunInferError",
    "ModelLoadError",
    "OpsCoverageError",
    "PluginError",
    "PluginVersionError",
    "RequestError",
    "WorkerError",
    "__version__",
]
