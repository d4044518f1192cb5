"""Fuzzing the request API: whatever a caller sends, the engine refuses it cleanly or serves it to the end.

One engine (tiny model, a KV cache small enough to preempt) takes hundreds of
random scripts of ``add_request`` / ``abort`` / ``step`` calls: prompts as
text or token lists (empty, out of vocabulary, of the wrong type), sampling
parameters with NaN, infinities, huge, negative and tiny values, empty stop
strings, odd seeds, duplicate request ids, aborts of live, finished and
unknown requests. The properties:

- a refusal is a ``RequestError`` (a ``ValueError``) whose ``field`` names the
  parameter, and it leaves nothing behind;
- an accepted request runs to exactly one final output per sample, within its
  ``max_tokens``, with ``finish_reason`` "length" at exactly ``max_tokens``;
- after every step each KV block is either free or held by live sequences
  with matching reference counts, and when the engine drains all are free.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kunlun_infer import LLM, SamplingParams
from kunlun_infer.errors import KunlunInferError, RequestError
from kunlun_infer.runtime import compose_config
from tests.engine.tiny_models import EOS_ID, VOCAB_SIZE
from tests.hardening.conftest import tiny_overrides
from tests.hardening.kv_audit import assert_drained, assert_kv_conserved

MAX_STEPS_TO_DRAIN = 2000
FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop", "stop_token_ids",
          "logprobs", "n", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "min_tokens")

# ---------------------------------------------------------------------------- strategies

ODD_NUMBERS = st.sampled_from([0, 1, -1, 2, 2**63 - 1, 5e-324, -5e-324, 1e-300, 1e300, -1e300, math.inf, -math.inf, math.nan,
                               2**63, 2**64, -(2**63), 10**30, True, False, 0.5, 1.0000001, 7])
JUNK = st.sampled_from([None, "x", "", b"ab", [], [1], {}, {"a": 1}, (1,), object(), 1j, [None], ["a", ""]])
ANY_VALUE = st.one_of(ODD_NUMBERS, JUNK, st.floats(), st.integers(-(2**70), 2**70),
                      st.lists(st.one_of(st.integers(-5, 400), st.text(max_size=3)), max_size=3))

short_text = st.text(max_size=4)
valid_params = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 16),
    "temperature": st.one_of(st.just(0.0), st.floats(0, 3), st.sampled_from([5e-324, 1e-30, 1e6, 1e300])),
    "top_k": st.integers(0, 300),
    "top_p": st.one_of(st.floats(1e-9, 1), st.sampled_from([5e-324, 1.0])),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "ignore_eos": st.booleans(),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3),
                                                                            max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=4)),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "n": st.integers(1, 3),
    "repetition_penalty": st.one_of(st.floats(0.01, 10), st.sampled_from([5e-324, 1e-300, 1e300])),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "min_p": st.floats(0, 1),
    "min_tokens": st.integers(0, 3),
})
fuzzed_params = st.dictionaries(st.sampled_from(FIELDS), ANY_VALUE, max_size=4)
valid_prompts = st.one_of(st.text(min_size=1, max_size=12),
                          st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=30),
                          st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=12, max_size=30))
prompts = st.one_of(
    valid_prompts, valid_prompts, valid_prompts,
    st.text(max_size=12),
    st.lists(st.integers(-3, VOCAB_SIZE + 3), max_size=12),
    st.tuples(st.integers(0, VOCAB_SIZE - 1), st.integers(0, VOCAB_SIZE - 1)),
    JUNK, ODD_NUMBERS,
)
# "req-N" is what the engine names requests itself: a caller's own "req-1" must not collide with it
request_ids = st.one_of(st.none(), st.none(), st.none(), st.sampled_from(["", "dup", 7, "req-0", "req-1", "req-2"]),
                        st.text(max_size=3))
add = st.tuples(st.just("add"), prompts, st.one_of(valid_params, valid_params, valid_params, fuzzed_params),
                request_ids)
abort = st.tuples(st.just("abort"), st.integers(0, 20), st.booleans())
step = st.tuples(st.just("step"), st.integers(1, 4))
scripts = st.lists(st.one_of(add, add, add, abort, step), min_size=1, max_size=14)

# ---------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine(tiny_folder):
    cfg = compose_config(tiny_overrides(tiny_folder, cache__block_size=4, cache__num_blocks=12,
                                        model__max_model_len=64, scheduler__max_num_seqs=6,
                                        scheduler__max_num_batched_tokens=24))
    llm = LLM.from_config(cfg)
    yield llm.engine
    llm.close()


class Ledger:
    """What the test expects of every accepted request, checked against every output."""

    def __init__(self, engine):
        self.engine = engine
        self.params: dict[str, SamplingParams] = {}
        self.finals: dict[tuple[str, int], object] = {}
        self.aborted: set[str] = set()
        self.seen: dict[tuple[str, int], int] = {}
        self.reused = 0

    def add(self, prompt, kwargs, request_id) -> None:
        engine = self.engine
        before = (set(engine._requests), engine.stats()["kv_blocks_free"], len(engine.scheduler.waiting))
        try:
            params = SamplingParams(**kwargs)
            rid = engine.add_request(prompt, params, request_id=request_id)
        except RequestError as error:
            assert isinstance(error, ValueError) and isinstance(error, KunlunInferError)
            assert error.field in FIELDS + ("prompt", "params", "request_id"), error.field
            assert error.field in str(error), f"message does not name the field {error.field!r}: {error}"
            after = (set(engine._requests), engine.stats()["kv_blocks_free"], len(engine.scheduler.waiting))
            assert after == before, "a refused request left something behind"
            event(f"refused: {error.field}")
            return
        event("accepted")
        if rid in self.params:  # an id may be used again once its request is over and reported
            old = self.params.pop(rid)
            assert all((rid, i) in self.finals for i in range(old.n)), f"{rid!r} reused while unfinished"
            for i in range(old.n):
                del self.finals[(rid, i)]
                self.seen.pop((rid, i), None)
            self.aborted.discard(rid)
            self.reused += 1
        self.params[rid] = params

    def abort(self, pick: int, known: bool) -> None:
        live = sorted(self.engine._requests)
        if known and live:
            rid = live[pick % len(live)]
            assert self.engine.abort(rid) is True
            self.aborted.add(rid)
        else:
            finished = sorted(self.params.keys() - self.engine._requests.keys())
            rid = finished[pick % len(finished)] if finished and pick % 2 else f"unknown-{pick}"
            assert self.engine.abort(rid) is False

    def step(self) -> None:
        for out in self.engine.step():
            key = (out.request_id, out.index)
            assert key not in self.finals, f"output after the final one: {out}"
            params = self.params[out.request_id]
            assert 0 <= out.index < params.n
            assert len(out.token_ids) <= params.max_tokens
            assert len(out.token_ids) >= self.seen.get(key, 0), "token_ids shrank"
            self.seen[key] = len(out.token_ids)
            assert all(0 <= t < VOCAB_SIZE for t in out.token_ids)
            if out.finished:
                self.finals[key] = out
                self.check_final(out, params)
        assert_kv_conserved(self.engine)

    def check_final(self, out, params: SamplingParams) -> None:
        if out.request_id in self.aborted:
            assert out.finish_reason == "abort"
            return
        assert out.error is None and out.finish_reason in ("stop", "length"), out
        if out.finish_reason == "length":
            assert len(out.token_ids) == params.max_tokens
        else:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS_ID})
            assert (out.token_ids and out.token_ids[-1] in stops) or params.stop, out

    def drain(self) -> None:
        for _ in range(MAX_STEPS_TO_DRAIN):
            if not self.engine.has_unfinished():
                break
            self.step()
        assert_drained(self.engine)
        expected = {(rid, i) for rid, p in self.params.items() for i in range(p.n)}
        assert self.finals.keys() == expected, f"requests without a final output: {expected - self.finals.keys()}"


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(script=scripts)
def test_any_request_script_is_refused_cleanly_or_served_to_the_end(engine, script):
    for rid in list(engine._requests):  # a failed example must not poison the next one
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    ledger = Ledger(engine)
    preemptions = engine.stats()["num_preemptions"]
    for action, *args in script:
        if action == "add":
            ledger.add(*args)
        elif action == "abort":
            ledger.abort(*args)
        else:
            for _ in range(args[0]):
                ledger.step()
    ledger.drain()
    if engine.stats()["num_preemptions"] > preemptions:
        event("preempted")
    if ledger.aborted:
        event("aborted")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.one_of(st.lists(prompts, max_size=4), prompts), params=st.one_of(valid_params, fuzzed_params))
def test_generate_refuses_a_bad_batch_before_queueing_any_of_it(engine, batch, params):
    llm = LLM.__new__(LLM)
    llm.engine = engine
    try:
        outputs = llm.generate(batch, SamplingParams(**params), use_tqdm=False)
    except RequestError as error:
        assert error.field in str(error)
        assert not engine.has_unfinished()  # nothing of the batch was queued
    else:
        assert all(o.finished and o.finish_reason in ("stop", "length") for o in outputs)
    assert_drained(engine)
