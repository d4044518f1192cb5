"""Build a model on the runtime's device and load its weights from safetensors, never from pickles.

Order of work, so that a bad folder fails fast and says where: parse the
config; find the weight files (``model.safetensors``, a sharded set with
``model.safetensors.index.json``, or other ``*.safetensors``) and read every
header, checking it against the file size; build the model; check every
tensor name, shape and dtype the model needs against the headers; only then
read each rank's shard with ``safe_open(...).get_slice`` and copy it in.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from kunlun_infer.capabilities import Comm, Streams
from kunlun_infer.dtypes import DTYPES
from kunlun_infer.errors import ModelLoadError
from kunlun_infer.layers import LayerContext
from kunlun_infer.layers.quantization import Quantization
from kunlun_infer.models.base import CausalLM, LayerSpan
from kunlun_infer.models.config import ModelArchConfig, load_model_config, read_json
from kunlun_infer.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from kunlun_infer.models.llama import LlamaForCausalLM
from kunlun_infer.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from kunlun_infer.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from kunlun_infer.runtime.attention import GuardedAttentionBackend, resolve_attention
from kunlun_infer.runtime.guard import DeferredFailures
from kunlun_infer.runtime.optable import OpTable
from kunlun_infer.runtime.protocol import ModelRuntime

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_ITEM_SIZES = {**_FLOAT_DTYPES, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class StoredTensor(NamedTuple):
    """A tensor as a safetensors header describes it."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


def model_class(config: ModelArchConfig) -> type[CausalLM]:
    """The model class for ``config.architecture``."""
    return MODEL_CLASSES[config.architecture]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir``; refuses pickle-only folders."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no 'weight_map' of tensor names to files")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index} lists {f.name}, which is missing from {model_dir}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles)}); only safetensors are supported "
            "because pickles can run code when loaded. Convert once with transformers: "
            "model.save_pretrained(dir, safe_serialization=True)")
    raise ModelLoadError(f"no weights in {model_dir}: expected model.safetensors or sharded *.safetensors "
                         "with model.safetensors.index.json")


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Tensor names, dtypes and shapes of one safetensors file, checked against its size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes does not fit a file of {size} bytes")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not a readable safetensors file (corrupt or truncated?): {e}") from e
    data_len = size - 8 - header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: header entry for tensor {name!r} is malformed") from None
        if end > data_len:
            raise ModelLoadError(f"{path} is truncated: tensor {name!r} ends at byte {end} of the data, "
                                 f"but the file holds only {data_len} data bytes; download or save it again")
        if dtype in _ITEM_SIZES and end - start != math.prod(shape) * _ITEM_SIZES[dtype]:
            raise ModelLoadError(f"{path}: tensor {name!r} has {end - start} bytes, not what "
                                 f"{dtype}{list(shape)} needs")
        tensors[name] = StoredTensor(path, dtype, shape)
    return tensors


def checkpoint_index(model_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint, by name."""
    index: dict[str, StoredTensor] = {}
    for path in weight_files(model_dir):
        for name, stored in read_header(path).items():
            if name in index:
                raise ModelLoadError(f"tensor {name!r} appears in both {index[name].file.name} and {path.name}")
            index[name] = stored
    return index


def validate_checkpoint(model: CausalLM, index: dict[str, StoredTensor], model_dir: Path) -> None:
    """Every tensor the model needs is present with the right shape and a float dtype; nothing else is."""
    needed = model.checkpoint_tensors()
    files = ", ".join(sorted({s.file.name for s in index.values()})) or "(no tensors)"
    missing = [name for name in needed if name not in index]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {missing[0]!r} (shape {list(needed[missing[0]][1].shape)}){more} is missing "
                             f"from {files} in {model_dir}; the weights do not match config.json")
    for name, (_, spec) in needed.items():
        stored = index[name]
        if stored.shape != spec.shape:
            raise ModelLoadError(f"{stored.file}: tensor {name!r} has shape {list(stored.shape)}, but "
                                 f"config.json implies {list(spec.shape)}")
        if stored.dtype not in _FLOAT_DTYPES:
            raise ModelLoadError(f"{stored.file}: tensor {name!r} has dtype {stored.dtype}; only "
                                 f"{', '.join(_FLOAT_DTYPES)} weights are supported")
    for name, stored in index.items():
        if name not in needed and not model.is_ignored_tensor(name):
            raise ModelLoadError(f"{stored.file}: unexpected tensor {name!r} for a {model.config.architecture} "
                                 "with this config.json; the weights do not match the config")


def load_weights(model: CausalLM, model_dir: Path, index: dict[str, StoredTensor] | None = None) -> None:
    """Validate, then copy this rank's part of every needed tensor into ``model`` and pack the weights."""
    index = checkpoint_index(model_dir) if index is None else index
    validate_checkpoint(model, index, model_dir)
    by_file: dict[Path, list[str]] = defaultdict(list)
    needed = model.checkpoint_tensors()
    for name in needed:
        by_file[index[name].file].append(name)
    for path, names in by_file.items():
        name = None
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    module, spec = needed[name]
                    module.load_weight(spec.param, spec.shard, f.get_slice(name))
        except Exception as e:
            where = f"tensor {name!r}" if name else "header"
            raise ModelLoadError(f"{path}: cannot read {where}: {e}") from e
    model.pack_weights()


def _overlap_streams(runtime: ModelRuntime, tp_size: int) -> Streams | None:
    """The runtime's streams when collectives can overlap compute on them (a distinct comm stream)."""
    streams = getattr(runtime, "streams", None)
    return streams if tp_size > 1 and streams is not None and streams.overlaps else None


def load_model(model_dir: str | Path, *, runtime: ModelRuntime, dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
               max_model_len: int | None = None, quantization: Quantization | None = None,
               span: LayerSpan | None = None, tp_comm: Comm | None = None, defer_failures: bool = False,
               expert_size: int = 1) -> CausalLM:
    """Load the model in ``model_dir`` for rank ``tp_rank`` of ``tp_size`` on the runtime's device.

    ``span``: the layers of this rank's pipeline stage (default: all);
    ``tp_comm``: the comm of this rank's tensor-parallel group (default: the
    runtime's); ``defer_failures``: hold plugin failures back to the end of a
    step (see :class:`DeferredFailures`), which any rank of a group of more
    than one needs (it is implied by ``tp_size > 1``).

    ``max_model_len`` sizes the rotary table (default: the model's
    ``max_context_len``). Ops are resolved through ``runtime.resolve_ops``;
    attention is served by the ops plugin's backend when it has one
    (``runtime.attention_backend``), else by the reference backend.
    ``quantization`` (``model.quantization``) quantizes the weights at load.
    ``expert_size`` (``parallel.expert_size``, 1 or ``tp_size``): how a
    mixture-of-experts model spreads its experts over the ranks.
    """
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    if dtype not in DTYPES.values():
        raise ModelLoadError(f"dtype {dtype} is not supported; supported: {', '.join(DTYPES)}")
    max_model_len = max_model_len or config.max_context_len
    config.check_max_model_len(max_model_len)
    if quantization is not None and config.moe is not None:
        raise ModelLoadError(f"model.quantization={quantization.method} does not cover the expert weights of "
                             f"{config.architecture} yet; load it with model.quantization=none")
    index = checkpoint_index(model_dir)
    cls = model_class(config)
    try:
        spec = cls.attention_spec(config, dtype=dtype, tp_size=tp_size)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: cannot split this model over {tp_size} ranks: {e}") from e
    required = cls.required_ops + (quantization.required_ops if quantization is not None else ())
    ops, attention = resolve_attention(runtime, required, spec)
    ctx = LayerContext(ops=ops, device=runtime.device.torch_device, attention=attention,
                       dtype=dtype, tp_rank=tp_rank, tp_size=tp_size,
                       comm=(tp_comm or runtime.comm) if tp_size > 1 else None,
                       streams=_overlap_streams(runtime, tp_size), quantization=quantization,
                       ep_size=expert_size if config.moe is not None else 1)
    try:
        model = cls(config, ctx, max_model_len, span)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: cannot split this model over {tp_size} ranks: {e}") from e
    load_weights(model, model_dir, index)
    memory = getattr(runtime, "memory", None)
    if memory is not None:  # what loading held and freed (checkpoint copies, weights before packing) goes back
        memory.empty_cache()
    if tp_size > 1 or defer_failures:  # a failing kernel must not leave the other ranks waiting in a collective
        model.deferred_failures = DeferredFailures()
        if isinstance(ops, OpTable):
            ops.defer_failures(model.deferred_failures)
        if isinstance(attention, GuardedAttentionBackend):
            attention.defer_failures(model.deferred_failures)
    return model.eval()
