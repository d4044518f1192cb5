"""Pick the next token of every sequence from its logits, all rows at once.

First the logits are reshaped for the rows that ask: penalties over the tokens
each sequence has seen (repetition: prompt and output; presence and frequency:
output; ``engine/penalties.py``, each sequence's tokens tallied a step at a
time), each row's ``logit_bias`` added, and EOS/stop tokens masked while a row
is short of ``min_tokens``.
Greedy rows take the argmax. Sampled rows are divided by their temperature and
filtered by top-k and top-p, only when a row asks for them: on a device the
host waits for at no cost (``Streams.asynchronous`` false: the CPU), each such
row's nucleus is looked for among its likeliest tokens (``CANDIDATE_WIDTHS``,
then thresholds over the whole vocabulary); on an asynchronous device, where
reading back mid-draw would stall the queue, one sort of the vocabulary serves
both filters. ``min_p`` drops tokens below ``min_p`` times a row's top
probability. Then each row is drawn by inverse transform sampling with two
uniforms (:func:`draw_from`): one picks a block of ``DRAW_BLOCK`` tokens by
their sums, one a token within it, so float32 running sums stay exact to a
block's share and no token of zero probability is ever drawn; it costs a few
passes over the row, where one exponential variate per token (the exponential
race) cost ~15 ns each on a CPU core: 20 ms a step for eight rows of a 150k
vocabulary. The uniforms of a row with a ``seed`` come from that request's own
generator, so its tokens do not depend on what else is in the batch; other
rows share the engine's generator. Rows whose sequence carries a
structured-output constraint are masked after the penalties (every such row in
one call of the engine's logits processor), so only tokens their grammar
allows can be drawn. Logprobs are those of the model's raw distribution
(``log_softmax`` of the logits, before penalties, biases, masks, temperature
and filters), or with ``logprobs_mode="processed"`` of the penalized, biased and
masked logits (tokens a mask forbids are left out of the top alternatives).

Where the ops plugin has ``sample_tokens`` (hook API 1.10; the ``cpu`` ops'
native pass, ``native/sample_tokens.c``) a step with a sampled row hands all
its rows, penalized, biased and masked, with their uniforms to it in one call:
the same distribution and the same draw, defined by its reference, in a few
passes over each row on one thread (128 rows of a 151936-token vocabulary:
8.7 ms with temperature alone and 14-17 ms with top-k or top-p, against 43-78
ms for the passes above, on the Xeon with AMX, 2 threads). Without it (an
ops plugin written before 1.10, or ``ops=torch``) the passes above serve.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kunlun_infer.engine.params import SamplingParams
from kunlun_infer.engine.penalties import Tally, TokenHistory, apply_penalties
from kunlun_infer.ops import reference
from kunlun_infer.ops.reference import (  # noqa: F401 (DRAW_BLOCK, EXP_FLOOR: the draw's constants, named here too)
    DRAW_BLOCK,
    EXP_FLOOR,
    apply_min_p,
    draw_from,
    keep_top_k_top_p,
    row_sums,
    sampling_weights,
)
from kunlun_infer.ops.upload import upload


#: the op table's ops the sampler calls (hook API 1.8, 1.10), asked for apart from the model's
#: (``Runtime.optional_ops``)
SAMPLER_OPS = ("greedy_tokens", "sample_tokens")


@dataclasses.dataclass
class SamplerOutput:
    """Host-side results: one token per row and, for rows that asked, ``{token_id: logprob}``."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def mask_stop_tokens(logits: torch.Tensor, rows: list[int], stop_ids: list[frozenset[int]]) -> torch.Tensor:
    """``logits`` with ``stop_ids[i]`` set to ``-inf`` in row ``rows[i]`` (in place)."""
    row_index = [r for r, ids in zip(rows, stop_ids) for _ in ids]
    col_index = [t for ids in stop_ids for t in ids]
    if row_index:
        logits[upload(row_index, logits.device), upload(col_index, logits.device)] = float("-inf")
    return logits


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` (in place) with each row's ``logit_bias`` added to its tokens' logits, in one scatter."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    device = logits.device
    logits.index_put_((upload(rows, device), upload(cols, device)),
                      upload(values, device, logits.dtype), accumulate=True)
    return logits


#: widths among which a filtered row's top-k/top-p nucleus is looked for, likeliest tokens first, before its
#: thresholds are selected over the whole vocabulary (where the host waits for the device at no cost; see
#: :func:`keep_nucleus`). For 8 rows of a 150k vocabulary on a Zen 5, 2 threads: ``topk`` of 256 takes
#: ~0.8 ms, of 1024 ~2 ms, of 8192 5-6 ms, a radix selection 2-4 ms: a wider candidate width does not pay
CANDIDATE_WIDTHS = (256, 1024)


def keep_nucleus(weights: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Zero, in place, each row's ``weights`` (``[n, vocab]``, non-negative, ordered as its logits) outside its
    top-k / top-p nucleus: what :func:`~kunlun_infer.ops.reference.keep_top_k_top_p` keeps, found without
    sorting the vocabulary.

    ``top_k[i]`` (0 = off) and ``top_p[i]`` (1 = off) per row. Each row's
    nucleus is looked for among its ``CANDIDATE_WIDTHS`` heaviest tokens
    (``topk``): a row is done with a width once its nucleus closes inside it
    (top-k: its ``k`` tokens and the ties of the ``k``-th; top-p: the
    candidates hold ``top_p`` of the mass, so a token past them has at least
    that much before it), which the host reads; so this is for devices it
    waits for at no cost. A row wider than every width keeps the tokens from
    its thresholds up, each a radix selection (:func:`mass_threshold`): a
    top-k row's ``k``-th heaviest weight (counting tokens; exact, ties kept
    as a sort keeps them), then top-p by :func:`keep_top_p` (of the tokens
    tied at its threshold, as many as a sort keeps; where float sums round
    differently from a sort's, its boundary may be a token or two away). A
    row's widths depend on its own weights only: its result is the same in
    any batch.
    """
    rows, vocab = weights.shape
    device = weights.device
    widths = [w for w in CANDIDATE_WIDTHS if w < vocab]

    def first_width(holding: float) -> int:
        """The first width of at least ``holding`` tokens (the whole vocabulary past the last)."""
        return next((w for w in widths if w >= holding), vocab)

    # the width each row looks at next: a top-k row's first that holds its k tokens
    next_width = {i: first_width(top_k[i] if top_k[i] > 0 else 1) for i in range(rows)}
    whole = row_sums(weights)  # the mass top-p measures against, where no top-k comes first
    for width in (*widths, vocab):
        pending = [i for i in range(rows) if next_width.get(i) == width]
        if width == vocab:  # a row wider than every width: its thresholds by the bits of its weights
            for start in range(0, len(pending), RADIX_ROWS):
                rows_here = pending[start:start + RADIX_ROWS]
                first, count = rows_here[0], len(rows_here)
                if rows_here[-1] - first + 1 == count:  # consecutive rows: a view, changed in place
                    chunk, part, total = None, weights[first:first + count], whole[first:first + count]
                else:
                    chunk = upload(rows_here, device, torch.int64)
                    part, total = weights.index_select(0, chunk), whole.index_select(0, chunk)
                if any(top_k[i] > 0 for i in rows_here):  # the k-th heaviest weight, ties kept (no top-k: all)
                    k = upload([float(top_k[i] if top_k[i] > 0 else vocab) for i in rows_here], device,
                               weights.dtype)
                    part.mul_((part >= mass_threshold(part, k, by_count=True).unsqueeze(1)).to(part.dtype))
                    with_k = upload([top_k[i] > 0 for i in rows_here], device)
                    total = torch.where(with_k, row_sums(part), total)  # top-p measures against the top-k
                if any(top_p[i] < 1 for i in rows_here):  # (a row without top-p needs more than any mass)
                    p = upload([float(top_p[i]) if top_p[i] < 1 else float("inf") for i in rows_here], device,
                               weights.dtype)
                    keep_top_p(part, torch.where(p < float("inf"), p * total, p))  # (not inf * 0)
                if chunk is not None:
                    weights.index_copy_(0, chunk, part)
            continue
        if not pending:
            continue
        index = upload(pending, device, torch.int64)
        values, ids = (weights if len(pending) == rows else weights.index_select(0, index)).topk(width, dim=-1)
        kth = upload([top_k[i] if 0 < top_k[i] <= width else width for i in pending], device, torch.int64)
        kth_value = values.gather(1, kth.sub_(1).unsqueeze(1))
        values = values * (values >= kth_value)  # top-k, ties kept
        mass = values.cumsum(dim=-1)
        with_k = upload([0 < top_k[i] for i in pending], device).unsqueeze(1)
        p = upload([float(top_p[i]) for i in pending], device, weights.dtype).unsqueeze(1)
        total = torch.where(with_k, mass[:, -1:], whole.index_select(0, index).unsqueeze(1))
        # a top-k row is done once its k-th token's ties end inside the width (or nothing past it weighs: its
        # weights fall with its logits), a top-p-only row once the candidates hold top_p of the mass
        closed = torch.where(with_k, (values[:, -1:] < kth_value) | (kth_value == 0), mass[:, -1:] >= p * total)
        facts = torch.cat([closed.to(weights.dtype), p * total - mass[:, -1:], values[:, -1:]], dim=1).tolist()
        # the mass before a token is short of top_p: it is in the nucleus (top_p = 1: every token is)
        keep = ((mass - values) < p * total) | (p >= 1)
        keep[:, 0] = True
        done = [j for j, (ok, _, _) in enumerate(facts) if ok or width == vocab]
        if done:
            at = upload(done, device, torch.int64)
            target = index.index_select(0, at)
            weights.index_fill_(0, target, 0.0)
            weights[target.unsqueeze(1), ids.index_select(0, at)] = (values * keep).index_select(0, at)
        for i, (ok, short, lightest) in zip(pending, facts):
            if ok or width == vocab:
                del next_width[i]
            elif top_k[i] > 0:  # the k-th token's ties reach past the width
                next_width[i] = first_width(width + 1)
            else:  # every token past the candidates weighs at most the lightest: skip widths that cannot close
                next_width[i] = first_width(width + short / lightest if lightest > 0 else vocab)


#: the digits of a non-negative float32's bits :func:`mass_threshold` selects by, most significant first:
#: (shift, width); and how many rows it takes at once (its int64 digits of a 150k row are 1.2 MB each)
RADIX_DIGITS = ((20, 11), (10, 10), (0, 10))
RADIX_ROWS = 8


def mass_threshold(weights: torch.Tensor, need: torch.Tensor, by_count: bool = False) -> torch.Tensor:
    """For each row of non-negative ``weights`` (``[n, vocab]``), the weight ``t`` of the token at which the
    running mass, heaviest first, reaches ``need[i]``: the tokens weighing at least ``t`` are the row's top-p
    nucleus (with every token tied at ``t``; :func:`keep_top_p` keeps as many of those as a sort would). With
    ``by_count`` every token counts 1 instead of its weight: ``t`` is the ``need[i]``-th heaviest weight (top-k,
    its ties kept; counts to 2**24 are exact in float32).

    A radix selection on the weights' float bits (monotone for non-negative floats): per digit, one histogram of
    the mass of the tokens still in question picks the digit where the mass crosses. The first digit takes the
    whole row; the tokens in its chosen digit (values within 12.5% of each other) are then gathered, and the
    later digits take only them. Each histogram adds its tokens in column order, so a row's threshold is the
    same bits in any batch. Where a sort of 150k tokens is ~5 ms a row, 8 rows take ~2 ms. Nothing waits for the
    device."""
    return _radix_select(weights, need, by_count)[0]


def _radix_select(weights: torch.Tensor, need: torch.Tensor,
                  by_count: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mass_threshold`'s ``t`` (``[n]``), the mass (or count) of the tokens heavier than ``t`` (``[n]``,
    summed by the histograms), and the (row, column) of every token weighing exactly ``t``, row-major."""
    n, device, dtype = weights.shape[0], weights.device, weights.dtype
    bits = weights.view(torch.int32)
    tiny = torch.finfo(dtype).tiny
    above = torch.zeros(n, dtype=dtype, device=device)  # the mass of the tokens past the digits chosen so far

    def choose(hist: torch.Tensor) -> torch.Tensor:
        """Each row's digit (``[n, buckets]`` histogram) where the mass, heaviest digit first, reaches what is
        still needed (at least a token's worth: rounding may leave nothing, and an empty digit must not be
        chosen); ``above`` grows by the mass of the digits before it."""
        nonlocal above
        buckets = hist.shape[1]
        hist = hist.flip(-1)  # heaviest digit first
        running = hist.cumsum(dim=-1)
        still = (need - above).clamp_(min=tiny).unsqueeze(1)
        j = (running < still).sum(dim=-1, keepdim=True).clamp_(max=buckets - 1)  # running never falls
        above = above + running.gather(1, j).squeeze(1) - hist.gather(1, j).squeeze(1)
        return (buckets - 1 - j).squeeze(1).to(torch.int32)

    (shift, width), *rest = RADIX_DIGITS
    digit = ((bits >> shift) & ((1 << width) - 1)).long()  # (a NaN from the model may carry the sign bit)
    unit = torch.ones_like(weights) if by_count else weights
    chosen = choose(torch.zeros(n, 1 << width, dtype=dtype, device=device).scatter_add_(1, digit, unit))
    prefix = chosen << shift
    row, col = (digit == chosen.unsqueeze(1).long()).nonzero(as_tuple=True)  # row-major: columns in order
    bits, unit = bits[row, col], unit[row, col]
    for shift, width in rest:
        buckets = 1 << width
        digit = (bits >> shift) & (buckets - 1)
        flat = torch.zeros(n * buckets, dtype=dtype, device=device)  # one row after another; added in order
        chosen = choose(flat.scatter_add_(0, digit.long() + row * buckets, unit).view(n, buckets))
        prefix = prefix | (chosen << shift)
        keep = torch.nonzero(digit == chosen.index_select(0, row)).squeeze(1)  # once, for the four of them
        bits, unit, row, col = (x.index_select(0, keep) for x in (bits, unit, row, col))
    return prefix.view(dtype), above, row, col


def keep_top_p(weights: torch.Tensor, need: torch.Tensor) -> None:
    """Zero, in place, each row's ``weights`` (``[n, vocab]``, non-negative) outside its top-p nucleus: the
    heaviest tokens while the mass before them is short of ``need[i]``, as a sort keeps them. The tokens heavier
    than :func:`mass_threshold`'s ``t`` all stay; of those tied at ``t``, as many as a sort would keep
    (``ceil((need - mass above) / t)``, at least one), the first in column order. Keeping every tie would keep
    the whole of a flat row at any ``top_p``."""
    t, above, row, col = _radix_select(weights, need, by_count=False)
    at = t.unsqueeze(1)
    weights.mul_((weights > at).to(weights.dtype))
    # how many of the ties a sort keeps; a threshold of 0 (asked for more than all the mass): every one
    wanted = torch.where(t > 0, ((need - above) / t).ceil_().clamp_(min=1), torch.full_like(t, float("inf")))
    per_row = torch.bincount(row, minlength=weights.shape[0])
    first = per_row.cumsum(0) - per_row  # where each row's ties start (row-major)
    rank = torch.arange(row.numel(), device=weights.device) - first.index_select(0, row)
    kept = torch.nonzero(rank < wanted.index_select(0, row)).squeeze(1)
    row, col = row.index_select(0, kept), col.index_select(0, kept)
    weights[row, col] = t.index_select(0, row)


def draw_row(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index of ``probs`` (``[vocab]``) drawn as :func:`draw_from` draws, with ``generator``'s uniforms
    (the host waits for it)."""
    return int(draw_from(probs.unsqueeze(0), torch.rand(1, 2, generator=generator, device=probs.device))[0])


def _raw_logprobs(params: Sequence[SamplingParams]) -> bool:
    """Whether a row's logprobs are to be of the raw logits (which then may not be reshaped in place)."""
    return any(p.logprobs is not None and p.logprobs_mode == "raw" for p in params)


class Sampler:
    """Turns a ``[N, vocab]`` float32 logits tensor into tokens for N requests."""

    def __init__(self, generator: torch.Generator, structured: Any = None, *, waits_are_free: bool = False,
                 greedy: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 sample: Callable[..., torch.Tensor] | None = None) -> None:
        #: the uniforms of rows without a seed of their own
        self.generator = generator
        #: each row's argmax (the op table's ``greedy_tokens``: the ops plugin's, where it has one)
        self.greedy = greedy if greedy is not None else reference.greedy_tokens
        #: the ops plugin's ``sample_tokens`` (hook API 1.10), which draws every row of a step in one call; ``None``
        #: where it has none: rows are then drawn here (:meth:`weights`, :func:`draw_from`), which picks the way
        #: that suits the device (``waits_are_free``) where the op's reference must suit every device
        self.sample = sample
        #: the engine's :class:`~kunlun_infer.engine.structured.StructuredOutputs` (masks constrained rows)
        self.structured = structured
        #: the host may read the device's results mid-draw at no cost (``Streams.asynchronous`` false): top-k and
        #: top-p then look for each row's nucleus among its likeliest tokens (:func:`keep_nucleus`) instead of
        #: sorting the vocabulary, which keeps an asynchronous device's queue free of waits
        self.waits_are_free = waits_are_free
        #: each penalized sequence's :class:`~kunlun_infer.engine.penalties.Tally`, dropped with the sequence
        self.tallies: weakref.WeakKeyDictionary[Any, Tally] = weakref.WeakKeyDictionary()

    @classmethod
    def for_runtime(cls, runtime: Any, generator: torch.Generator, structured: Any = None) -> Sampler:
        """A sampler over ``runtime``'s ops and streams: greedy rows through the op table's ``greedy_tokens`` (the
        reference where the ops plugin has none), sampled rows through its ``sample_tokens`` where it has one,
        waits free where its streams are not asynchronous."""
        table = runtime.optional_ops(SAMPLER_OPS)
        return cls(generator, structured, waits_are_free=not runtime.streams.asynchronous,
                   greedy=table.greedy_tokens,
                   sample=table.sample_tokens if table.source("sample_tokens") != "reference" else None)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: Sequence[TokenHistory] | None = None) -> SamplerOutput:
        """``histories[i]`` (the sequence of row ``i``) is needed for penalties, ``min_tokens`` and constraints."""
        tokens, processed = self.draw(logits, params, generators, histories)
        return SamplerOutput(tokens.tolist(), self.logprobs(logits, processed, tokens, params))

    def draw(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
             histories: Sequence[TokenHistory] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drawn tokens, left on the logits' device (nothing waits for them), and the processed logits
        they were drawn from: ``logits`` itself when nothing reshaped them, and where no row's logprobs are of the
        raw logits, reshaped in place (penalties, biases, masks)."""
        device = logits.device
        processed = self._process(logits, params, histories)
        if histories is not None and any(p.structured is not None for p in params):
            if processed is logits and _raw_logprobs(params):
                processed = logits.clone()  # the raw logits are still needed for logprobs
            if self.structured is None:
                raise ValueError("the sampler needs the engine's structured outputs to mask constrained rows")
            self.structured.apply(processed, histories)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return self.greedy(processed), processed
        uniforms = self.uniforms(params, generators, device)
        if self.sample is not None:
            return self.sample(*self.sample_arguments(processed, params), uniforms), processed
        sampled = draw_from(self.weights(processed, params), uniforms)
        if any(greedy):
            sampled = torch.where(upload(greedy, device), self.greedy(processed), sampled)
        return sampled, processed

    def _process(self, logits: torch.Tensor, params: list[SamplingParams],
                 histories: Sequence[TokenHistory] | None) -> torch.Tensor:
        """Penalties, logit biases and the ``min_tokens`` mask: in ``logits`` itself unless a row's logprobs are of
        the raw logits (then in a copy); ``logits`` untouched when no row asks for them."""
        penalized = any(p.has_penalties for p in params)
        biased = any(p.logit_bias for p in params)
        needs_history = penalized or any(p.min_tokens for p in params)
        if not needs_history and not biased:
            return logits
        if histories is None and needs_history:
            raise ValueError("the sampler needs each row's token history for penalties and min_tokens")
        short = [i for i, (p, h) in enumerate(zip(params, histories or ()))
                 if len(h.token_ids) - h.num_prompt_tokens < p.min_tokens]
        # the raw logits stay as they were where a row's logprobs are to be of them; else nothing reads them again
        # (the step's prompt logprobs and draft checks read theirs first) and they are reshaped in place
        keep_raw = _raw_logprobs(params)
        if penalized:
            logits = apply_penalties(logits, histories, params, self.tallies, in_place=not keep_raw)
        elif (biased or short) and keep_raw:
            logits = logits.clone()
        if biased:
            add_logit_bias(logits, params)
        if short:
            logits = mask_stop_tokens(logits, short, [histories[i].stop_token_ids for i in short])
        return logits

    def weights(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """``[N, vocab]`` non-negative weights proportional to the probabilities a sampled row draws from:
        temperature (:func:`~kunlun_infer.ops.reference.sampling_weights`; greedy rows get temperature 1, they are
        drawn by argmax), then top-k/top-p, then ``min_p``. A new tensor."""
        device = logits.device
        weights = sampling_weights(logits, upload([p.temperature if not p.greedy else 1.0 for p in params], device,
                                                  logits.dtype))
        filtered = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1]
        vocab = logits.shape[-1]  # a larger top_k keeps everything (and may not fit an int64)
        if filtered and not self.waits_are_free:  # one sort of the vocabulary serves both filters
            weights = keep_top_k_top_p(weights, upload([min(p.top_k, vocab) for p in params], device, torch.int64),
                                       upload([p.top_p for p in params], device, logits.dtype))
        elif filtered:
            rows = upload(filtered, device, torch.int64)
            part = weights if len(filtered) == len(params) else weights.index_select(0, rows)
            keep_nucleus(part, [min(params[i].top_k, vocab) for i in filtered], [params[i].top_p for i in filtered])
            if part is not weights:
                weights.index_copy_(0, rows, part)
        if any(p.min_p > 0 for p in params):
            weights = apply_min_p(weights, upload([p.min_p for p in params], device, weights.dtype))
        return weights

    @staticmethod
    def sample_arguments(logits: torch.Tensor,
                         params: Sequence[SamplingParams]) -> tuple[torch.Tensor, ...]:
        """``sample_tokens``' arguments before the uniforms: the logits, and each row's temperature (0 for a
        greedy row), top-k (at most the vocabulary), top-p and min-p, on the logits' device."""
        device, vocab = logits.device, logits.shape[-1]
        finite = torch.finfo(torch.float32).max  # (a temperature of 1e300 is a valid request)
        return (logits,
                upload([0.0 if p.greedy else min(p.temperature, finite) for p in params], device, torch.float32),
                upload([min(p.top_k, vocab) for p in params], device, torch.int64),
                upload([p.top_p for p in params], device, torch.float32),
                upload([p.min_p for p in params], device, torch.float32))

    def distribution(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The probabilities a sampled row draws from (:meth:`weights`, each row summing to 1)."""
        weights = self.weights(logits, params)
        return weights.div_(row_sums(weights).unsqueeze(1))

    def uniforms(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 device: torch.device) -> torch.Tensor:
        """``[N, 2]`` uniforms for :func:`draw_from`: a seeded sampled row's from its own generator, the
        others' from the engine's."""
        uniforms = torch.rand(len(params), 2, generator=self.generator, device=device)
        for row, generator in enumerate(generators):
            if generator is not None and not params[row].greedy:
                uniforms[row] = torch.rand(2, generator=generator, device=device)
        return uniforms

    @staticmethod
    def logprobs(logits: torch.Tensor, processed: torch.Tensor, tokens: torch.Tensor,
                 params: list[SamplingParams]) -> list[dict[int, float] | None]:
        """For each row that asks: ``{token: logprob}`` of the chosen token and the ``logprobs`` likeliest.

        From ``logits`` (``logprobs_mode="raw"``) or ``processed`` (penalized and masked) per row.
        """
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(params)
        if not rows:
            return result
        index = torch.tensor(rows, device=logits.device)
        source = logits.index_select(0, index)
        if processed is not logits:
            use_processed = [params[i].logprobs_mode == "processed" for i in rows]
            if any(use_processed):
                chosen_rows = torch.tensor(use_processed, device=logits.device).unsqueeze(1)
                source = torch.where(chosen_rows, processed.index_select(0, index), source)
        logprobs = torch.log_softmax(source, dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
        width = max(params[i].logprobs for i in rows)  # type: ignore[type-var]
        top_values, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0])
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        chosen_ids = tokens.index_select(0, index).tolist()
        for j, row in enumerate(rows):
            n = params[row].logprobs
            entry = {t: v for t, v in zip(top_ids[j][:n], top_values[j][:n]) if v != float("-inf")}
            entry[chosen_ids[j]] = chosen[j]
            result[row] = entry
        return result
