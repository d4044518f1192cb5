"""The plugin contract: every hook a kunlun_infer plugin can implement.

A chip vendor should be able to write a plugin from this file alone.

How plugins are found
    A plugin is a module (or object) exposing functions decorated with
    :data:`hookimpl`. Installed distributions advertise it through the
    entry-point group ``kunlun_infer`` (``[project.entry-points.kunlun_infer]
    myname = "my_pkg.plugin"``); the built-in CPU plugins are registered by the
    framework itself. The env vars ``KUNLUN_INFER_PLUGINS`` (allow-list) and
    ``KUNLUN_INFER_DISABLE_PLUGINS`` (block-list), comma-separated entry-point
    names, filter what is loaded.

How capabilities are chosen
    A plugin *registers factories by name* for any of the five capabilities
    (device, memory, ops, comm, streams). The Hydra group of the same name picks
    one by its registered name (``device=cpu memory=caching``). Two plugins
    registering the same name for the same capability is a load error, so no
    result depends on import order. Plugins can add their options to the Hydra
    groups through :func:`kunlun_infer_config_options`.

Versioning
    The contract carries :data:`HOOK_API_VERSION` (``MAJOR.MINOR``). Every
    plugin declares in :func:`kunlun_infer_plugin_info` the range of API
    versions it supports (``">=1.0,<2"``); a plugin whose range excludes this
    framework's version is refused at load, naming plugin, distribution
    version, offered and required versions. Minor versions only add hooks or
    optional arguments (pluggy passes a hook only the arguments it names), so a
    plugin written for 1.0 keeps working on 1.x.

Threading and streams, for every factory-made object
    Capability objects are created and used by one engine; the engine calls
    them from its own thread (the step loop). ``Device.open``/``close`` must be
    thread-safe. Kernels returned by an ops provider are called on the
    compute stream of the streams plugin; collectives may be called from the
    comm stream's worker. A kernel must not synchronize the device unless it
    returns host data.

Errors
    Anything a hook or a capability method raises is re-raised by the
    framework as :class:`kunlun_infer.errors.PluginError` naming the plugin,
    the hook and the layer, the original exception chained — except from the
    observability hooks, whose failures are logged and ignored (see there).

Attention backends (1.1)
    An ops provider may own the paged KV cache and the attention kernels:
    :meth:`kunlun_infer.capabilities.OpsProvider.attention_backend` returns an
    :class:`kunlun_infer.ops.attention.AttentionBackend` for the model's
    :class:`~kunlun_infer.ops.attention.AttentionSpec`. The backend says which
    tensors one layer's cache is made of (``kv_cache_tensors``), in which
    order a step's sequences go into the flat batch (``order_batch``), builds
    its per-step metadata from the engine's neutral
    :class:`~kunlun_infer.ops.attention_step.AttentionStep` (host lists:
    query and context lengths, block tables, slot mapping; prefill, chunked
    prefill and decode kinds), and stores and attends (``store_kv``,
    ``attend``). The engine allocates the cache through the memory plugin in
    the backend's shapes and never indexes it. A provider without one gets
    the reference backend: separate K and V caches ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` served by the op table's
    ``store_kv`` and ``paged_attention``, exactly as in 1.0. The conformance
    suite (:func:`kunlun_infer.testing.check_attention_backend`) checks a
    backend against the reference backend.

    Since 1.4 the spec may ask for multi-head latent attention
    (``spec.kind == "mla"``, DeepSeek-V2/V3): the cache holds one compressed
    latent and one rotary key per token, shared by every head. A provider
    serving it returns an
    :class:`~kunlun_infer.ops.attention.MLAAttentionBackend` (same cache and
    metadata calls; ``store_latent`` and ``attend_latent`` instead of
    ``store_kv`` and ``attend``); ``None``, or a backend of another class,
    leaves it to the framework's plain-torch reference
    (:mod:`kunlun_infer.ops.reference_mla`), logged. The conformance suite
    checks an MLA backend against that reference too.

Logits processors (1.2)
    A plugin may register logits processors by name
    (:func:`kunlun_infer_logits_processor_factories`); ``structured.backend``
    picks the one that serves requests with structured output
    (``SamplingParams.structured``). A processor
    (:class:`kunlun_infer.capabilities.LogitsProcessor`) compiles a request's
    constraint, keeps one :class:`~kunlun_infer.capabilities.ConstraintState`
    per sequence (advanced by every token the sequence accepts, rolled back
    when the engine takes tokens back) and masks the logits rows of the
    constrained sequences once per step, in one batched call. The built-in
    ``xgrammar`` processor fills a token bitmask on the host and applies it
    with the op table's ``apply_token_bitmask``, which an ops plugin may
    serve with its own kernel.

Changes
    1.0 — first version of the contract.
    1.1 — the ``platform`` config group: :func:`kunlun_infer_config_options`
    may contribute ``ConfigOption("platform", name, PlatformConfig(...))``;
    and attention backends: the optional ``OpsProvider.attention_backend(spec)``
    and the contract of :mod:`kunlun_infer.ops.attention` (``AttentionSpec``,
    ``CacheTensorSpec``, ``AttentionBackend``) and
    :mod:`kunlun_infer.ops.attention_step` (``AttentionStep``). A 1.0 plugin
    (op table only) loads and runs unchanged, on the reference backend.
    1.2 — hook :func:`kunlun_infer_logits_processor_factories`; interfaces
    ``LogitsProcessor``, ``ConstraintState`` and ``LogitsProcessorContext``
    in :mod:`kunlun_infer.capabilities`; op ``apply_token_bitmask`` in the
    op table (reference in :mod:`kunlun_infer.ops.reference`). Nothing else
    changed: a 1.0 plugin loads and runs unchanged.
    1.3 — the op table gains ``pack_int8_linear_weight`` and ``int8_linear``
    (int8 weights per output channel, activations quantized per token at run
    time; used when ``model.quantization=int8``). A provider without them is
    served by the references, like any op it lacks; a 1.2 plugin loads and
    runs unchanged.
    1.4 — :class:`~kunlun_infer.capabilities.Comm` gains point-to-point
    ``send(tensor, dst)`` / ``recv(tensor, src)`` and ``subgroup(ranks)`` (a
    Comm over some of the group's ranks), which pipeline parallelism
    (``parallel.pipeline_size``) passes hidden states and gives each stage
    its tensor-parallel group with. Their defaults refuse with a message
    naming the comm; the engine checks for them before it starts a pipeline,
    so a 1.3 comm plugin loads and runs unchanged without one.
    Also in 1.4, multi-head latent attention through the attention-backend
    contract:
    ``AttentionSpec.kind == "mla"`` with its sizes (``kv_lora_rank``,
    ``qk_rope_head_dim``, ``v_head_dim``; :func:`kunlun_infer.ops.attention.mla_spec`),
    :class:`~kunlun_infer.ops.attention.MLAAttentionBackend` and the base
    class both kinds share,
    :class:`~kunlun_infer.ops.attention.AttentionBackendBase`. A plugin
    written for 1.3 or earlier loads and runs unchanged: MLA models get the
    reference MLA backend, even from a provider that answers every spec with
    its MHA backend.
    Also in 1.4, mixture-of-experts ops in the op table: ``moe_route`` (router
    logits to each token's top-k experts and their weights: softmax or
    sigmoid scores, grouped top-k, a correction bias for the choice,
    renormalisation, a scaling factor), ``pack_moe_weights`` and
    ``fused_moe`` (the chosen experts' SiLU-gated MLPs over stacked expert
    weights, combined by the weights). Like every op, a provider without them
    is served by the references; a 1.3 plugin loads and runs unchanged.
    Comm gains ``all_to_all(tensor, send_splits, recv_splits)`` (rows
    exchanged with uneven splits; expert parallelism sends tokens to the
    ranks owning their experts with it): ``Comm`` provides a default built
    on ``all_gather``, so a comm plugin written before 1.4 serves
    ``parallel.expert_size`` unchanged, moving more data than a native one.
    1.5 — captured decode steps. ``OpsProvider.capture(fn)`` may run ``fn``
    (one forward of the model's layers on fixed buffers) once and return a
    :class:`~kunlun_infer.capabilities.CapturedStep` whose ``replay()``
    repeats its kernel launches on those buffers without the Python that
    made them (a device graph; the ``cpu`` option records its native
    kernels). ``AttentionBackendBase.update_metadata(static, step)`` writes a
    later step's metadata into the buffers of one built for capture, and says
    whether it could. The engine uses them for decode-only steps of one
    rank, once per batch size (``ops.step_graphs``). Both default to "no"
    (``None`` / ``False``), so a 1.4 plugin loads and runs unchanged, every
    step eager.
    1.6 — padded captured steps. With ``ops.step_graph_sizes`` set (the
    ``cuda`` option sets it; the default is unset), the engine captures
    only those batch sizes and runs a decode step of another size in the
    capture of the next larger one: the step it gives ``update_metadata``
    then ends with padding sequences (one new token, nothing cached, block
    table ``[0]``, slot ``-1``; :meth:`AttentionStep.padded_to`), whose keys
    and values a backend must not store (a negative slot stores nothing,
    as the reference ``store_kv`` always did) and whose outputs are
    dropped. Nothing changes while the option is unset, so a 1.5 plugin
    loads and runs unchanged.
    1.7 — overlapped steps. ``Streams.asynchronous`` (a property,
    default ``False``) says that kernels called on the compute stream run
    after the call returns. Where it is ``True`` the engine launches a
    step (decodes, prompt chunks) before the step in flight has come back
    to the host (the input token of a sequence that step sampled is taken
    on the device from its drawn tokens; ``scheduler.overlap_steps``), and
    reads each step's tokens back through a non-blocking copy and an event
    of the compute stream: a plugin that
    says ``True`` must order that copy and its ``record_event`` behind the
    step's kernels, as a device queue does. A 1.6 streams plugin has no such
    property, gets ``False`` and runs every step as before.
    1.8 — the op table gains ``greedy_tokens(logits)``: each row's argmax
    (int64; the first index of the largest value, a NaN counted largest),
    which the engine's sampler takes for greedy rows and speculative
    decoding's checks. The engine asks for it apart from the model's ops
    (``Runtime.optional_ops``): a provider without it is served by the
    reference, noted at info level, and is not refused under
    ``ops.strict``, so a 1.7 plugin loads and runs unchanged.
    1.9 — collectives in captured steps. ``Comm.capturable`` (a property,
    default ``False``) says that the comm's all-reduce runs inside the ops
    plugin's capture (1.5) and is replayed with it. Where the comm of a
    tensor-parallel group says ``True`` (and the streams plugin runs
    collectives inline), the engine captures and replays that group's decode
    steps on every rank, in lockstep. A 1.8 comm plugin has no such
    property, gets ``False``, and its tensor-parallel steps run eagerly as
    before.
    1.10 — the op table gains ``sample_tokens(logits, temperature, top_k,
    top_p, min_p, uniforms)``: each row's token (int64), its argmax where
    the temperature is 0, else drawn from its temperature's softmax kept to
    its top-k / top-p nucleus and ``min_p``, by inverse transform with two
    uniforms a row (a block of 1024 tokens, then a token in it; the
    reference in ``ops/reference.py`` is the definition, and its
    conformance samples put each uniform mid-way through a token's share).
    The engine's sampler draws every sampled row of a step through it where
    the ops plugin has one; penalties, logit biases and grammar masks are
    applied to the logits before. It is asked for apart from the model's
    ops, like ``greedy_tokens``: a provider without it is not refused under
    ``ops.strict``, and the sampler draws those rows itself as before, so a
    1.9 plugin loads and runs unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kunlun_infer.capabilities import (Comm, Device, LogitsProcessor, LogitsProcessorContext, MemoryAllocator,
                                           OpsProvider, Streams)

#: pluggy project name and entry-point group
PROJECT_NAME = "kunlun_infer"
#: version of this contract, ``(major, minor)``
HOOK_API_VERSION: tuple[int, int] = (1, 10)
HOOK_API_VERSION_STR = "{}.{}".format(*HOOK_API_VERSION)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: the five capabilities, in the order the runtime composes them
CAPABILITIES: tuple[str, ...] = ("device", "memory", "ops", "comm", "streams")


@dataclasses.dataclass(frozen=True)
class PluginInfo:
    """What a plugin says about itself.

    ``name``: short unique name (shown by ``kunlun-infer plugins``).
    ``version``: the plugin's own version (usually its distribution's).
    ``api``: the hook-API versions supported, as comma-separated comparisons
    (``">=1.0,<2"``). ``capabilities``: which of :data:`CAPABILITIES` it
    provides. ``stack``: versions of the software beneath it (driver,
    runtime, collective library …), for the version matrix.
    """

    name: str
    version: str
    api: str = ">=1.0,<2"
    capabilities: tuple[str, ...] = ()
    stack: Mapping[str, str] = dataclasses.field(default_factory=dict)
    description: str = ""


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One option a plugin adds to a Hydra group.

    ``group``: a config group (``device``, ``memory``, ``ops``, ``comm``,
    ``streams`` or any other of the config tree). ``name``: the option's name
    (``device=<name>``). ``node``: a dataclass *instance or class* that
    subclasses the group's schema from :mod:`kunlun_infer.config` (e.g.
    ``DeviceConfig``) so its keys are type-checked; its ``name`` field must
    equal the capability factory's registered name.

    Since 1.1 the ``platform`` group takes options too: a
    :class:`kunlun_infer.config.PlatformConfig` naming the option chosen in
    each of the five capability groups, so that ``platform=<name>`` composes
    a plugin's whole stack in one word (a capability named on the command
    line still wins). Options of other plugins may be named in it.
    """

    group: str
    name: str
    node: Any


#: ``factory(*, config) -> Device`` — ``config`` is the composed ``device`` node;
#: ``local_rank`` (int) is passed too when the factory accepts it.
DeviceFactory = Callable[..., "Device"]
#: ``factory(*, config, device) -> MemoryAllocator``
MemoryFactory = Callable[..., "MemoryAllocator"]
#: ``factory(*, config, device) -> OpsProvider``
OpsFactory = Callable[..., "OpsProvider"]
#: ``factory(*, config, device) -> Comm``
CommFactory = Callable[..., "Comm"]
#: ``factory(*, config, device) -> Streams``
StreamsFactory = Callable[..., "Streams"]
#: ``factory(*, context: LogitsProcessorContext) -> LogitsProcessor``
LogitsProcessorFactory = Callable[..., "LogitsProcessor"]


# ============================================================== identity


@hookspec
def kunlun_infer_plugin_info() -> PluginInfo:
    """Describe this plugin: name, version, supported hook-API range, capabilities, stack versions.

    Required of every plugin. Called once at load, before any other hook;
    a plugin whose ``api`` range excludes :data:`HOOK_API_VERSION` is refused
    and none of its other hooks is called.

    :return: a :class:`PluginInfo`. Each plugin's own result is kept
        (not first-result-wins).

    Added in 1.0.
    """


# ============================================================== capabilities


@hookspec
def kunlun_infer_device_factories() -> Mapping[str, DeviceFactory]:
    """Register device factories by name.

    :return: ``{name: factory}``. ``factory(config=..., local_rank=...)``
        returns a :class:`kunlun_infer.capabilities.Device`, not yet opened;
        ``config`` is the composed ``device`` config node (an OmegaConf
        DictConfig with at least ``name``), ``local_rank`` the index of the
        process on its host (pick the matching physical device). The factory
        must be cheap and must not touch hardware before ``Device.open``.

    Called once per plugin at load; names must be unique across plugins.
    Added in 1.0.
    """


@hookspec
def kunlun_infer_memory_factories() -> Mapping[str, MemoryFactory]:
    """Register memory allocator factories by name.

    :return: ``{name: factory}``. ``factory(config=..., device=...)`` returns a
        :class:`kunlun_infer.capabilities.MemoryAllocator` for the *opened*
        ``device``. Allocations honour the allocator's ``alignment`` and
        ``granularity``; exhaustion raises
        :class:`kunlun_infer.errors.DeviceOutOfMemoryError` with the numbers.
        The allocator is used from the engine's thread only.

    Added in 1.0.
    """


@hookspec
def kunlun_infer_ops_factories() -> Mapping[str, OpsFactory]:
    """Register op-table factories by name.

    :return: ``{name: factory}``. ``factory(config=..., device=...)`` returns a
        :class:`kunlun_infer.capabilities.OpsProvider` whose kernels follow the
        signatures and semantics of :mod:`kunlun_infer.ops` (each op there has
        a plain-torch reference, the definition of its meaning). A provider may
        cover any subset; ``supports(op)`` must answer truthfully, since the
        runtime resolves every op before the first step and falls back to the
        reference for gaps (or refuses under ``ops.strict``). Since 1.1 the
        provider may also serve attention with a cache layout of its own
        (``OpsProvider.attention_backend``; see "Attention backends" above).
        ``kunlun-infer plugins`` builds providers with ``device=None`` to list
        coverage without hardware: a factory must then answer for the device
        type it targets, without touching hardware. A provider that
        implements ``pack_linear_weight`` must also implement ``linear``; its
        ``linear`` receives only weights its own ``pack_linear_weight`` made.
        Kernels run on the compute stream.

    Added in 1.0.
    """


@hookspec
def kunlun_infer_comm_factories() -> Mapping[str, CommFactory]:
    """Register collective-communication factories by name.

    :return: ``{name: factory}``. ``factory(config=..., device=...)`` returns a
        :class:`kunlun_infer.capabilities.Comm`; the engine then calls
        ``init(rank=, world_size=, init_method=, timeout_s=)`` matching the
        process layout. ``all_reduce`` honours ``accumulate_dtype``
        (``comm.accumulate_dtype``, float32 by default for bf16/fp16).
        Collectives may be issued from the comm stream's worker.

    Added in 1.0.
    """


@hookspec
def kunlun_infer_streams_factories() -> Mapping[str, StreamsFactory]:
    """Register stream-provider factories by name.

    :return: ``{name: factory}``. ``factory(config=..., device=...)`` returns a
        :class:`kunlun_infer.capabilities.Streams`. Work submitted to one
        stream runs in order; events order work across streams;
        ``synchronize`` waits for completion and re-raises the first error of
        queued work. ``close`` stops any threads it started.

    Added in 1.0.
    """


# ============================================================== logits processors


@hookspec
def kunlun_infer_logits_processor_factories() -> Mapping[str, LogitsProcessorFactory]:
    """Register logits-processor factories by name (structured-output backends).

    :return: ``{name: factory}``. ``factory(context=...)`` gets a
        :class:`kunlun_infer.capabilities.LogitsProcessorContext` (tokenizer,
        vocabulary size, EOS ids, device, op table, the ``structured``
        config node) and returns a
        :class:`kunlun_infer.capabilities.LogitsProcessor`. The engine builds
        the processor named by ``structured.backend`` when the first request
        with structured output arrives, so a factory may import heavy
        libraries; if one is missing it should raise
        :class:`kunlun_infer.errors.RequestError` saying what to install.

    Called once per plugin at load; names must be unique across plugins.
    Added in 1.2.
    """


# ============================================================== configuration


@hookspec
def kunlun_infer_config_options() -> Iterable[ConfigOption]:
    """Add options to the Hydra config groups, so ``device=<yours>`` composes after ``pip install``.

    :return: an iterable of :class:`ConfigOption`. They are stored in Hydra's
        config store before composition; each node subclasses the group's
        schema, so unknown keys and wrongly typed values are refused at
        composition, naming the key.

    Called once per plugin at load. Added in 1.0.
    """


# ============================================================== observability
#
# pluggy calls the observers in its usual order (``tryfirst``/``trylast``;
# ``wrapper=True`` and ``hookwrapper=True`` implementations surround the
# others). Each observer is isolated: whatever it raises is logged on
# ``kunlun_infer.runtime`` naming the plugin and the hook, and ignored; the
# other observers still hear the event and the engine's step goes on.


@hookspec
def kunlun_infer_engine_start(info: Mapping[str, Any]) -> None:
    """The engine finished start-up and is ready to serve.

    :param info: facts about the run: ``model`` (path), ``dtype``,
        ``kv_blocks_total``, ``block_size``, ``plugins`` (capability → plugin
        name), ``tensor_size``.

    Called in the engine's thread; must return quickly. Result ignored.
    Added in 1.0.
    """


@hookspec
def kunlun_infer_engine_step(stats: Mapping[str, Any]) -> None:
    """One engine step finished.

    :param stats: ``step`` (counter), ``num_prefill_tokens``,
        ``num_decode_tokens``, ``num_running``, ``num_waiting``,
        ``kv_blocks_free``, ``duration_s``.

    Called after every step in the engine's thread; keep it cheap (it sits on
    the hot path). Result ignored. Added in 1.0.
    """


@hookspec
def kunlun_infer_request_finished(output: Any) -> None:
    """A request finished (stop, length or abort).

    :param output: the final :class:`kunlun_infer.RequestOutput`.

    Result ignored. Added in 1.0.
    """


@hookspec
def kunlun_infer_engine_stop(stats: Mapping[str, Any]) -> None:
    """The engine is shutting down; ``stats`` is its final ``stats()`` dict.

    Result ignored. Added in 1.0.
    """
