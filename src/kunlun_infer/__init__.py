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
    "compose_config",
]
