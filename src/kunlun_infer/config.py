"""Structured-config schemas: the type-checked shape of every Hydra group, with its defaults and ranges.

Each group of the config tree (``conf/``) is validated against one dataclass
here. These dataclasses are the one place a key's default lives: the YAML
files of ``conf/`` set only what an option changes (``name``, a preset's
limits). A value range the type alone does not express sits on the field
(:func:`ranged`) and is checked at composition and again when the engine or
the server starts from a config (:func:`check_ranges`). Options contributed
by plugins subclass the capability schemas (``DeviceConfig`` …) to add keys of
their own (``device.capacity``). Configs never carry ``_target_``:
implementations are found by registered name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, List, Optional

from omegaconf import MISSING

from kunlun_infer.dtypes import DTYPES
from kunlun_infer.errors import ConfigError

#: seconds a collective may stay silent before the comm gives up: the one default of ``comm.timeout_s``,
#: also of every ``Comm.init(timeout_s=)``
COMM_TIMEOUT_S: float = 120.0
#: what the engine does after a failed step (``scheduler.on_step_error``)
ON_STEP_ERROR: tuple[str, ...] = ("recover", "shutdown")
#: ``scheduler.overlap_steps`` values
OVERLAP_STEPS: tuple[str, ...] = ("auto", "on", "off")
#: how drafts are proposed (``speculative.method``)
SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft")


def overlap_choice(value: object) -> str:
    """``scheduler.overlap_steps`` as one of :data:`OVERLAP_STEPS` (YAML reads an unquoted on/off as a boolean)."""
    text = str(value).lower()
    return {"true": "on", "false": "off"}.get(text, text)


def ranged(default: Any, allowed: str, ok: Callable[[Any], bool]) -> Any:
    """A schema field whose values must pass ``ok``; ``allowed`` says which do, for the error message."""
    return dataclasses.field(default=default, metadata={"allowed": allowed, "ok": ok})


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: v >= low


@dataclasses.dataclass
class DeviceConfig:
    """``device`` group: which device plugin, and which physical device."""

    name: str = MISSING
    #: physical device index; ``None`` = the process's local rank
    index: Optional[int] = None


@dataclasses.dataclass
class MemoryConfig:
    """``memory`` group: the allocator."""

    name: str = MISSING


@dataclasses.dataclass
class OpsConfig:
    """``ops`` group: the op table; ``strict`` refuses to fall back to references."""

    name: str = MISSING
    strict: bool = False
    #: decode steps of up to this many sequences run once per batch size under the ops plugin's capture and are
    #: replayed after that (hook API 1.5; the ``cpu`` option captures, ``torch`` does not); 0 = every step eager
    step_graphs: int = ranged(64, ">= 0", _at_least(0))
    #: the batch sizes captured (each ``<= step_graphs``); a decode step of another size runs padded to the next
    #: one, its padding sequences storing nothing (slot -1). ``None``: every size up to ``step_graphs``, as met
    step_graph_sizes: Optional[List[int]] = ranged(None, "null or a list of sizes >= 1",
                                                   lambda v: v is None or all(int(n) >= 1 for n in v))


@dataclasses.dataclass
class CommConfig:
    """``comm`` group: collectives. ``accumulate_dtype`` is used for bf16/fp16 all-reduce."""

    name: str = MISSING
    accumulate_dtype: str = "float32"
    #: seconds a collective or a worker may take before the engine gives up
    timeout_s: float = COMM_TIMEOUT_S


@dataclasses.dataclass
class StreamsConfig:
    """``streams`` group: compute/comm stream provider."""

    name: str = MISSING


#: ``model.quantization`` values (``none`` = full-precision weights)
QUANTIZATION_METHODS = ("none", "int8")


@dataclasses.dataclass
class ModelConfig:
    """``model`` group. ``path=None`` means the embedded default model."""

    path: Optional[str] = None
    dtype: str = ranged("auto", "auto, " + ", ".join(DTYPES), lambda v: v == "auto" or v in DTYPES)
    #: ``None`` = the model's ``max_position_embeddings``
    max_model_len: Optional[int] = None
    #: tokenizer folder; ``None`` = ``path``
    tokenizer: Optional[str] = None
    seed: int = 0
    #: weight quantization at load: ``none`` (or null) | ``int8`` (see ``kunlun_infer.layers.quantization``)
    quantization: Optional[str] = ranged(None, ", ".join(QUANTIZATION_METHODS) + " or null",
                                         lambda v: v is None or str(v).lower() in QUANTIZATION_METHODS)
    #: with ``quantization``: the LM head too / the token-embedding table too
    quantize_head: bool = True
    quantize_embedding: bool = True


@dataclasses.dataclass
class CacheConfig:
    """``cache`` group: the paged KV cache."""

    block_size: int = ranged(16, ">= 1", _at_least(1))
    #: explicit number of KV blocks; ``None`` = sized from memory
    num_blocks: Optional[int] = ranged(None, ">= 1 or null", lambda v: v is None or v >= 1)
    #: share of device memory the engine may use (weights + activations + KV)
    memory_fraction: float = ranged(0.9, "in (0, 1]", lambda v: 0 < v <= 1)
    prefix_caching: bool = True


@dataclasses.dataclass
class SchedulerConfig:
    """``scheduler`` group: continuous batching limits."""

    max_num_seqs: int = ranged(16, ">= 1", _at_least(1))
    max_num_batched_tokens: int = ranged(2048, ">= 1", _at_least(1))
    #: chunk long prompts into pieces under ``max_num_batched_tokens``
    chunked_prefill: bool = True
    #: after a failed step (its requests end with an error): ``recover`` serves on, ``shutdown`` closes the engine
    on_step_error: str = ranged("recover", " or ".join(ON_STEP_ERROR), lambda v: v in ON_STEP_ERROR)
    #: launch a step while the one before still runs on the device (``engine/overlap.py``): ``auto`` where
    #: the streams plugin runs kernels asynchronously (``Streams.asynchronous``), ``on``, or ``off``
    overlap_steps: str = ranged("auto", " or ".join(OVERLAP_STEPS), lambda v: overlap_choice(v) in OVERLAP_STEPS)


@dataclasses.dataclass
class ParallelConfig:
    """``parallel`` group: tensor and pipeline parallelism (``pipeline_size`` × ``tensor_size`` ranks), and how
    mixture-of-experts models spread their experts."""

    tensor_size: int = ranged(1, "at least 1", _at_least(1))
    #: pipeline stages, each a contiguous run of layers on its own ``tensor_size`` ranks
    pipeline_size: int = ranged(1, "at least 1", _at_least(1))
    #: layers per stage, first stage first (e.g. ``[10,14]``); ``None`` = as even as possible
    pipeline_layers: Optional[List[int]] = None
    #: batches in flight through the pipeline at once (at least 2 lets the stages overlap)
    pipeline_batches: int = ranged(2, "at least 1", _at_least(1))
    #: ranks the experts are divided among: 1 splits every expert like a dense MLP (tensor parallelism);
    #: ``tensor_size`` gives each rank whole experts and sends tokens to them (expert parallelism)
    expert_size: int = ranged(1, "at least 1", _at_least(1))
    #: ``tcp://host:port`` for rendezvous of engine-spawned workers; ``None`` = pick a free port
    init_method: Optional[str] = None
    #: seconds to wait for a worker before declaring it dead
    worker_timeout_s: float = 60.0


@dataclasses.dataclass
class ServerConfig:
    """``server`` group: the OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    port: int = ranged(8000, "in [0, 65535] (0 = any free port)", lambda v: 0 <= v <= 65535)
    max_queue: int = ranged(256, ">= 0", _at_least(0))
    model_name: Optional[str] = None
    #: how the model writes tool calls (``hermes`` | ``llama3_json``); ``None`` = read it off the chat template
    tool_call_parser: Optional[str] = None


@dataclasses.dataclass
class PlatformConfig:
    """A ``platform`` option: one word for a whole stack, the option it picks in each capability group.

    ``platform=simchip`` composes ``device``, ``memory``, ``ops``, ``comm`` and
    ``streams`` as the option says; a capability named after it on the command
    line still wins (``platform=kunlun ops=torch``). Plugins contribute their
    own through ``kunlun_infer_config_options`` with an instance of this class.
    """

    name: str = MISSING
    device: str = MISSING
    memory: str = MISSING
    ops: str = MISSING
    comm: str = MISSING
    streams: str = MISSING


@dataclasses.dataclass
class PlatformChoice:
    """What the composed config keeps of the platform: its name (the capability groups say what runs)."""

    name: Optional[str] = None


@dataclasses.dataclass
class StructuredConfig:
    """``structured`` node: structured output (``SamplingParams.structured``, ``response_format``)."""

    #: the logits processor that serves it, by registered name (built in: ``xgrammar``)
    backend: str = "xgrammar"


@dataclasses.dataclass
class SpeculativeConfig:
    """``speculative`` node: speculative decoding, off unless ``method`` is set."""

    #: ``ngram`` (prompt lookup, no extra model) or ``draft`` (a small model sharing the tokenizer); null = off
    method: Optional[str] = ranged(None, "ngram, draft or null (off)", lambda v: v is None or v in SPECULATIVE_METHODS)
    #: draft tokens proposed, and checked in one forward pass, per sequence and step
    num_tokens: int = ranged(4, ">= 1", _at_least(1))
    #: prompt lookup matches the sequence's last ngram_max down to ngram_min tokens
    ngram_min: int = ranged(1, ">= 1", _at_least(1))
    ngram_max: int = ranged(3, ">= 1", _at_least(1))
    #: the draft model's folder (method=draft); it must share the model's tokenizer
    draft_model: Optional[str] = None


@dataclasses.dataclass
class ReplicaConfig:
    """One replica of a fleet (``fleet.replicas.<name>``): how its engine differs, and what Ray reserves for it."""

    #: Hydra overrides of this replica's engine, applied after the command line's (``[platform=simchip]``);
    #: composed where the replica runs, so its node needs the plugins it names
    overrides: list[str] = dataclasses.field(default_factory=list)
    #: Ray resources its actor reserves: ``{GPU: 1}``, ``{CPU: 4}``, or custom ones its nodes declare
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    #: identical copies of it (``name``, ``name-1``, ``name-2`` …)
    count: int = 1


@dataclasses.dataclass
class FleetConfig:
    """``fleet`` group: engine replicas as Ray actors behind one endpoint (``kunlun-infer serve fleet=<name>``).

    Empty ``replicas`` (no ``fleet=`` chosen) means one engine in this process.
    """

    name: Optional[str] = None
    replicas: dict[str, ReplicaConfig] = dataclasses.field(default_factory=dict)
    #: the Ray cluster to join (``host:port`` that ``ray start --head`` printed); ``None`` = start one on this
    #: machine, on 127.0.0.1 only, stopped with the fleet
    address: Optional[str] = None
    #: a cluster the fleet starts: the logical CPUs and GPUs and the custom resources it offers
    #: (``None`` = what Ray detects)
    num_cpus: Optional[int] = None
    num_gpus: Optional[int] = None
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Ray restarts a replica's actor this often after it dies (-1 = always)
    max_restarts: int = ranged(3, ">= -1", _at_least(-1))
    #: seconds a replica may leave a poll unanswered before it is taken out of rotation and restarted
    health_timeout_s: float = ranged(30.0, "> 0", lambda v: v > 0)
    #: seconds one engine step may run before its replica counts as hung (it leaves rotation and is restarted)
    step_timeout_s: float = ranged(300.0, "> 0", lambda v: v > 0)
    #: seconds a replica may take to load its engine (at start and after a restart)
    start_timeout_s: float = ranged(600.0, "> 0", lambda v: v > 0)
    #: prefix affinity: a request follows the replica caching its prompt's longest prefix when that prefix is at
    #: least this many tokens and this share of the prompt …
    affinity_min_tokens: int = ranged(32, ">= 1", _at_least(1))
    affinity_min_share: float = ranged(0.5, "in [0, 1]", lambda v: 0 <= v <= 1)
    #: … unless that replica's outstanding tokens (scaled by its measured speed) exceed the least loaded
    #: replica's by both this many tokens and this factor
    overload_tokens: int = ranged(2048, ">= 0", _at_least(0))
    overload_factor: float = ranged(1.5, ">= 1", _at_least(1))


@dataclasses.dataclass
class KunlunConfig:
    """The whole composed config (root schema)."""

    device: DeviceConfig = dataclasses.field(default_factory=DeviceConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    ops: OpsConfig = dataclasses.field(default_factory=OpsConfig)
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    streams: StreamsConfig = dataclasses.field(default_factory=StreamsConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    platform: PlatformChoice = dataclasses.field(default_factory=PlatformChoice)
    structured: StructuredConfig = dataclasses.field(default_factory=StructuredConfig)
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    fleet: FleetConfig = dataclasses.field(default_factory=FleetConfig)


#: the schema of each group, for plugin options to subclass (a platform option lists its five choices)
GROUP_SCHEMAS: dict[str, type] = {**{f.name: f.default_factory for f in dataclasses.fields(KunlunConfig)},  # type: ignore[misc]
                                  "platform": PlatformConfig}


def group_schema(group: str) -> Any:
    """The schema dataclass of ``group`` (``KeyError`` for an unknown group)."""
    return GROUP_SCHEMAS[group]


def _field(key: str) -> dataclasses.Field:
    group, name = key.split(".")
    return next(f for f in dataclasses.fields(GROUP_SCHEMAS[group]) if f.name == name)


def schema_default(key: str) -> Any:
    """The default of ``key`` (``"scheduler.on_step_error"``), as the schema defines it."""
    return _field(key).default


def setting(cfg: Any, key: str) -> Any:
    """``key`` of ``cfg``, or its schema default where a config built by hand leaves it out."""
    group, name = key.split(".")
    node = cfg.get(group) if hasattr(cfg, "get") else getattr(cfg, group, None)
    if node is not None and name in node:
        return node[name]
    return schema_default(key)


def check_ranges(cfg: Any) -> None:
    """Refuse a value outside its field's range (:func:`ranged`), naming the key and what is allowed.

    Keys a config built by hand leaves out are left to their defaults.
    """
    for group, schema in GROUP_SCHEMAS.items():
        node = cfg.get(group) if hasattr(cfg, "get") else None
        if node is None:
            continue
        for f in dataclasses.fields(schema):
            if "ok" not in f.metadata or f.name not in node:
                continue
            value = node[f.name]
            try:
                ok = f.metadata["ok"](value)
            except (TypeError, ValueError):  # a config built by hand may hold a string where a number belongs
                ok = False
            if not ok:
                raise ConfigError(f"{group}.{f.name}={value} must be {f.metadata['allowed']}")
