"""Hugging Face compatible models: config parsing, the model classes, the safetensors loader, the tokenizer.

The surface the engine uses: :data:`SUPPORTED_ARCHITECTURES`,
:func:`load_model_config`, :func:`load_tokenizer`, :func:`load_model` and the
:class:`CausalLM` interface every model implements.
"""

from kunlun_infer.models.base import CausalLM
from kunlun_infer.models.config import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelArchConfig,
    load_model_config,
    resolve_dtype,
)
from kunlun_infer.models.loader import MODEL_CLASSES, load_model, model_class
from kunlun_infer.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "MODEL_CLASSES",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_ROPE_TYPES",
    "CausalLM",
    "ModelArchConfig",
    "Tokenizer",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "model_class",
    "resolve_dtype",
]
