"""Parse a Hugging Face ``config.json`` (+ ``generation_config.json``) into a :class:`ModelArchConfig`.

Both layouts of rotary settings are read: the older top-level ``rope_theta``
with ``rope_scaling``, and ``rope_parameters`` written by newer
``transformers``. Defaults for absent fields are those of the matching
``transformers`` config class, so a folder means the same thing here as there.
Anything this engine cannot run faithfully is refused with a
:class:`~kunlun_infer.errors.ModelLoadError` naming the file and field and
listing what is supported.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from kunlun_infer.dtypes import DTYPES
from kunlun_infer.errors import ConfigError, ModelLoadError

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "MixtralForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "llama3")

_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "mixtral": "MixtralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM"}
#: architectures with multi-head latent attention (a compressed latent cached instead of per-head K/V)
_MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# defaults of the transformers config classes, for fields a config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None,
                         "bos_token_id": 1, "eos_token_id": 2},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "head_dim": None,
                           "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "head_dim": None,
                            "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                            "norm_topk_prob": False, "decoder_sparse_step": 1},
    "MixtralForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "head_dim": None,
                           "bos_token_id": 1, "eos_token_id": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
                           "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "DeepseekV2ForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None, "bos_token_id": 1,
                              "eos_token_id": 2, "intermediate_size": 11008, "q_lora_rank": 1536,
                              "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                              "v_head_dim": 128, "rope_interleave": True, "n_routed_experts": 64,
                              "moe_intermediate_size": 1407, "num_experts_per_tok": None},
    "DeepseekV3ForCausalLM": {"max_position_embeddings": 4096, "num_key_value_heads": 128, "bos_token_id": 0,
                              "eos_token_id": 1, "intermediate_size": 18432, "q_lora_rank": 1536,
                              "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                              "v_head_dim": 128, "rope_interleave": True, "n_routed_experts": 256,
                              "moe_intermediate_size": 2048, "num_experts_per_tok": 8},
}
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): the sizes of its projections and cached latent."""

    #: rank of the query's low-rank compression; ``None``: one full query projection (V2-Lite)
    q_lora_rank: int | None
    #: size of the cached latent from which every head's key (without position) and value are decompressed
    kv_lora_rank: int
    #: per head: the query/key part without position, the rotated part (shared by all heads in the key), the value
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    #: the checkpoint's rotary dimensions come in interleaved pairs (x0, x1), (x2, x3)… (DeepSeek's own layout)
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoeArchConfig:
    """The mixture-of-experts part of an architecture: its experts, how tokens are routed, which layers have them.

    The routing fields are ``moe_route``'s options (:meth:`route_options`). ``sparse_layers[i]`` says whether
    decoder layer ``i`` has experts (the others have a dense MLP of ``ModelArchConfig.intermediate_size``).
    ``shared_intermediate_size``: the dense MLP every token also goes through (shared experts), 0 for none.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[bool, ...]
    renormalize: bool = False
    scoring: str = "softmax"
    num_expert_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    #: the router carries a per-expert bias added to the scores for the choice only (DeepSeek-V3)
    correction_bias: bool = False
    shared_intermediate_size: int = 0

    def route_options(self) -> dict[str, Any]:
        """Keyword arguments of ``ops.moe_route`` besides the logits and the correction bias."""
        return dict(top_k=self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                    num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                    group_score=self.group_score, routed_scaling_factor=self.routed_scaling_factor)


@dataclasses.dataclass(frozen=True)
class ModelArchConfig:
    """What the model code needs to know about a checkpoint's architecture."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    #: ``None`` for plain RoPE, else the scaling settings with ``rope_type`` set
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    #: q/k/v projections carry a bias (Qwen2)
    attention_bias: bool
    #: the attention output projection carries a bias
    attention_out_bias: bool
    mlp_bias: bool
    #: RMSNorm of each query and key head before rotary (Qwen3)
    qk_norm: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    #: attention window of the checkpoint; the usable context is capped to it
    sliding_window: int | None
    #: multi-head latent attention (DeepSeek); ``None`` for per-head K/V attention
    mla: MLAConfig | None = None
    #: the experts of a mixture-of-experts model; ``None`` for a dense one
    moe: MoeArchConfig | None = None

    @property
    def max_context_len(self) -> int:
        """Longest context this model serves: positions it was trained or scaled for, within the window."""
        n = self.max_position_embeddings
        s = self.rope_scaling or {}
        if s.get("rope_type") in ("linear", "dynamic"):
            n = int(n * s["factor"])
        elif s.get("rope_type") == "yarn" and s.get("factor"):
            n = max(n, int(s["original_max_position_embeddings"] * s["factor"]))
        return min(n, self.sliding_window) if self.sliding_window else n

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context longer than the attention window (sliding-window attention is not run)."""
        if self.sliding_window and max_model_len > self.sliding_window:
            raise ModelLoadError(
                f"max_model_len={max_model_len} exceeds this {self.architecture}'s sliding_window="
                f"{self.sliding_window}; sliding-window attention is not supported, so set "
                f"model.max_model_len <= {self.sliding_window}")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or a ModelLoadError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found; a model folder needs config.json, safetensors weights "
                             "and tokenizer.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _architecture(raw: dict[str, Any], path: Path) -> str:
    names = raw.get("architectures") or []
    if not names and raw.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[raw["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(names) or f"model_type={raw.get('model_type')!r}"
    raise ModelLoadError(f"{path}: architecture {shown} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope(raw: dict[str, Any], path: Path, max_position_embeddings: int,
          default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"{path}: rope_scaling/rope_parameters must be one flat object; per-layer "
                             "rotary settings are not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"{path}: partial_rotary_factor={partial} is not supported (only full rotary)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{path}: rope scaling type {rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in params]
    if missing:
        raise ModelLoadError(f"{path}: rope scaling {rope_type!r} needs field(s) {', '.join(missing)}")
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    if rope_type in ("yarn", "llama3"):
        original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original or max_position_embeddings)
    return theta, scaling


def _dtype(raw: dict[str, Any], path: Path) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ModelLoadError(f"{path}: dtype {name!r} is not supported; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_model_config(raw: dict[str, Any], path: Path, generation: dict[str, Any] | None = None) -> ModelArchConfig:
    """Build a :class:`ModelArchConfig` from the parsed ``config.json`` at ``path``."""
    arch = _architecture(raw, path)
    if raw.get("quantization_config"):
        raise ModelLoadError(f"{path}: quantized checkpoints (quantization_config) are not supported")
    defaults = _DEFAULTS[arch]

    def field(name: str, kind: type = int, default: Any = ...) -> Any:
        value = raw.get(name, defaults.get(name, default))
        if value is ...:
            raise ModelLoadError(f"{path}: required field {name!r} is missing")
        if value is None:
            return None
        try:
            if kind is int and (isinstance(value, bool) or int(value) != value or value <= 0):
                raise ValueError
            return kind(value)
        except (TypeError, ValueError):
            raise ModelLoadError(f"{path}: field {name!r} has bad value {value!r} "
                                 f"(expected a positive {kind.__name__})") from None

    hidden, heads = field("hidden_size"), field("num_attention_heads")
    kv_heads = field("num_key_value_heads") or heads
    mla = _mla(raw, path, field, arch) if arch in _MLA_ARCHITECTURES else None
    # DeepSeek's config.json says head_dim = qk_rope_head_dim (the rotary size); a head is nope + rope
    head_dim = mla.qk_head_dim if mla is not None else field("head_dim") or hidden // heads
    if heads % kv_heads and mla is None:  # MLA has no per-head K/V: its num_key_value_heads means nothing
        raise ModelLoadError(f"{path}: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
    if head_dim % 2:
        raise ModelLoadError(f"{path}: head_dim={head_dim} must be even for rotary embeddings")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{path}: hidden_act={act!r} is not supported; supported: silu")
    max_pos = field("max_position_embeddings")
    theta, scaling = _rope(raw, path, max_pos, defaults.get("rope_theta", 10000.0))

    bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window", defaults.get("sliding_window"))
    if arch == "Qwen3MoeForCausalLM":
        window = window if raw.get("use_sliding_window", False) else None
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        layer_types = raw.get("layer_types")
        sliding_layers = ("sliding_attention" in layer_types if layer_types else
                          field("num_hidden_layers") > raw.get("max_window_layers", 28))
        window = window if raw.get("use_sliding_window", False) and sliding_layers else None
    elif arch == "LlamaForCausalLM":
        window = None
    generation = generation or {}
    eos: list[int] = []
    for i in _ids(generation.get("eos_token_id")) + _ids(raw.get("eos_token_id", defaults.get("eos_token_id"))):
        if i not in eos:
            eos.append(i)
    bos = generation.get("bos_token_id", raw.get("bos_token_id", defaults.get("bos_token_id")))
    return ModelArchConfig(
        architecture=arch,
        moe=_moe(arch, raw, path, field),
        vocab_size=field("vocab_size"),
        hidden_size=hidden,
        intermediate_size=field("intermediate_size"),
        num_hidden_layers=field("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=field("rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "Qwen2ForCausalLM" else bias,
        attention_out_bias=bias if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                             *_MLA_ARCHITECTURES) else False,
        mlp_bias=bool(raw.get("mlp_bias", False)) if arch in ("LlamaForCausalLM", "DeepseekV2ForCausalLM") else False,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        torch_dtype=_dtype(raw, path),
        eos_token_ids=tuple(eos),
        bos_token_id=None if bos is None else int(bos),
        pad_token_id=raw.get("pad_token_id"),
        sliding_window=int(window) if window else None,
        mla=mla,
    )


def _mla(raw: dict[str, Any], path: Path, field: Any, arch: str) -> MLAConfig:
    """The MLA sizes of a DeepSeek ``config.json`` (defaults of its transformers config class).

    DeepSeek-V2 always rotates interleaved pairs; V3 says so in ``rope_interleave`` (default true).
    """
    interleave = arch == "DeepseekV2ForCausalLM" or bool(raw.get("rope_interleave", True))
    mla = MLAConfig(q_lora_rank=field("q_lora_rank"), kv_lora_rank=field("kv_lora_rank"),
                    qk_nope_head_dim=field("qk_nope_head_dim"), qk_rope_head_dim=field("qk_rope_head_dim"),
                    v_head_dim=field("v_head_dim"), rope_interleave=interleave)
    if mla.qk_rope_head_dim % 2:
        raise ModelLoadError(f"{path}: qk_rope_head_dim={mla.qk_rope_head_dim} must be even for rotary embeddings")
    return mla


def _first_dense_layers(raw: dict[str, Any], path: Path, arch: str) -> int:
    """DeepSeek's ``first_k_dense_replace``: its first layers with a dense MLP instead of experts."""
    default = 3 if arch == "DeepseekV3ForCausalLM" else 0
    value = raw.get("first_k_dense_replace", default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelLoadError(f"{path}: field 'first_k_dense_replace' has bad value {value!r} (expected an integer "
                             ">= 0)")
    return value


def _moe(arch: str, raw: dict[str, Any], path: Path, field: Any) -> MoeArchConfig | None:
    """The experts of a Qwen3-MoE, Mixtral or DeepSeek ``config.json``; ``None`` for a dense architecture."""
    layers = field("num_hidden_layers")
    if arch == "Qwen3MoeForCausalLM":
        step = field("decoder_sparse_step")
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
            raise ModelLoadError(f"{path}: field 'mlp_only_layers' has bad value {dense!r} (expected a list of "
                                 f"layer indices below num_hidden_layers={layers})")
        # transformers 5 writes num_local_experts for what Qwen3-MoE's own configs call num_experts
        experts = field("num_local_experts" if "num_local_experts" in raw else "num_experts")
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        moe = MoeArchConfig(num_experts=experts, top_k=field("num_experts_per_tok"),
                            intermediate_size=field("moe_intermediate_size"), sparse_layers=sparse,
                            renormalize=bool(raw.get("norm_topk_prob", False)))
    elif arch == "MixtralForCausalLM":
        moe = MoeArchConfig(num_experts=field("num_local_experts"), top_k=field("num_experts_per_tok"),
                            intermediate_size=field("intermediate_size"), sparse_layers=(True,) * layers,
                            renormalize=True)
    elif arch in _MLA_ARCHITECTURES:
        moe = _deepseek_moe(arch, raw, path, field, layers)
    else:
        return None
    if moe.top_k > moe.num_experts:
        raise ModelLoadError(f"{path}: num_experts_per_tok={moe.top_k} exceeds the {moe.num_experts} experts")
    return moe


def _deepseek_moe(arch: str, raw: dict[str, Any], path: Path, field: Any, layers: int) -> MoeArchConfig:
    """DeepSeek's experts: shared experts, and routed ones after the first ``first_k_dense_replace`` layers.

    V2 scores with a softmax and, with ``topk_method=group_limited_greedy``, chooses only among the
    ``topk_group`` groups whose best expert scores highest; V3 scores with a sigmoid, chooses by the scores
    plus ``e_score_correction_bias`` among the groups whose two best experts sum highest, and weighs the
    chosen by their unbiased scores, renormalised (``norm_topk_prob``). Both multiply the weights by
    ``routed_scaling_factor`` — except V2 with ``norm_topk_prob``, which DeepSeek's own V2 code renormalises
    instead of scaling (transformers' V2 ignores ``norm_topk_prob``; every released V2 config has it false).
    """
    v3 = arch == "DeepseekV3ForCausalLM"
    scoring = raw.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ModelLoadError(f"{path}: scoring_func={scoring!r} is not what {arch} routes with "
                             f"({'sigmoid' if v3 else 'softmax'})")
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in methods:
        raise ModelLoadError(f"{path}: topk_method={method!r} is not supported for {arch}; supported: "
                             f"{', '.join(methods)}")
    grouped = method != "greedy"
    groups = int(raw.get("n_group", 8 if v3 else None) or 1) if grouped else 1
    topk_group = int(raw.get("topk_group", 4 if v3 else None) or 1) if grouped else 1
    experts = field("n_routed_experts")
    if experts % groups or topk_group > groups:
        raise ModelLoadError(f"{path}: n_routed_experts={experts}, n_group={groups}, topk_group={topk_group}: the "
                             "experts must form n_group equal groups, of which topk_group are chosen")
    renormalize = bool(raw.get("norm_topk_prob", v3))
    scaling = float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0))
    if renormalize and not v3:
        scaling = 1.0
    shared = raw.get("n_shared_experts", 1 if v3 else 2) or 0
    first_dense = _first_dense_layers(raw, path, arch)
    top_k = field("num_experts_per_tok")
    if top_k is None:
        raise ModelLoadError(f"{path}: required field 'num_experts_per_tok' is missing")
    return MoeArchConfig(num_experts=experts, top_k=top_k,
                         intermediate_size=field("moe_intermediate_size"),
                         sparse_layers=tuple(i >= first_dense for i in range(layers)), renormalize=renormalize,
                         scoring=scoring, num_expert_group=groups, topk_group=topk_group,
                         group_score="top2_sum" if v3 else "max", routed_scaling_factor=scaling,
                         correction_bias=v3, shared_intermediate_size=field("moe_intermediate_size") * int(shared))


def load_model_config(model_dir: str | Path) -> ModelArchConfig:
    """Read ``config.json`` and, when present, ``generation_config.json`` (for EOS) of ``model_dir``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder {model_dir} does not exist or is not a folder")
    generation_path = model_dir / "generation_config.json"
    generation = read_json(generation_path) if generation_path.is_file() else None
    return parse_model_config(read_json(model_dir / "config.json"), model_dir / "config.json", generation)


def resolve_dtype(requested: str | torch.dtype, config: ModelArchConfig) -> torch.dtype:
    """The compute dtype for ``model.dtype`` (``auto`` = the checkpoint's own)."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested == "auto":
        return config.torch_dtype
    if requested not in DTYPES:
        raise ConfigError(f"model.dtype={requested!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[requested]
