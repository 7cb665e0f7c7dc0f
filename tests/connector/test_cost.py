"""connector.planning.cost: load or recompute, per request: the estimates and the decision, as plain values."""

from __future__ import annotations

import math

import pytest

from connector.planning.cost import FLOOR, MIB, CostModel, CostSettings, LoadOutcome, Verdict

BLOCK_BYTES = 1 * MIB
BLOCK_TOKENS = 16


def model(**kw: float) -> CostModel:
    settings = {"bandwidth_prior_bytes_s": 100.0 * MIB, "prefill_tokens_s": 1600.0, "lookup_rtt_prior_s": 0.001}
    return CostModel(CostSettings(**(settings | kw)))  # type: ignore[arg-type]


def test_a_fast_link_loads_the_whole_hit_with_a_deadline_from_the_prediction() -> None:
    m = model(prefill_tokens_s=800.0)  # a block recomputes in 20 ms, loads in 10 ms
    d = m.plan(hit_blocks=100, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0)
    assert d.verdict is Verdict.LOAD and d.blocks == 100
    assert d.predicted_load_s == pytest.approx(0.001 + 1.0)
    assert d.predicted_recompute_s == pytest.approx(2.0)
    assert d.deadline_s == pytest.approx(2 * d.predicted_load_s)


def test_a_link_slower_than_recompute_loads_nothing_once_measured() -> None:
    m = model(prefill_tokens_s=3200.0, bandwidth_half_life_s=30.0)  # a block recomputes in 5 ms, loads in 10 ms
    # nothing measured the link yet: the prior says skip, so a probe measures it (at most the shortest deadline)
    d = m.plan(hit_blocks=100, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0)
    assert d.verdict is Verdict.PROBE and d.blocks == 100 and d.deadline_s == m.settings.min_deadline_s
    m.observe_load(nbytes=100 * MIB, seconds=1.0, now=0.0)
    d = m.plan(hit_blocks=100, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=1.0)
    assert d.verdict is Verdict.SKIP and d.blocks == 0 and "recomputes" in d.reason
    # a half-life later with no load in between, one probe again
    assert m.plan(hit_blocks=100, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=31.0).verdict is Verdict.PROBE


def test_a_hit_longer_than_the_longest_wait_loads_the_prefix_that_fits() -> None:
    m = model(prefill_tokens_s=800.0, max_deadline_s=0.5)  # 10 ms a block: 49 blocks fit 0.5 s after the rtt
    d = m.plan(hit_blocks=100, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0)
    assert d.verdict is Verdict.PARTIAL and d.blocks == 49
    assert d.predicted_load_s <= 0.5 and d.deadline_s == 0.5


def test_a_gain_below_the_round_trip_is_not_worth_a_load() -> None:
    m = model(prefill_tokens_s=800.0, lookup_rtt_prior_s=0.05)  # one block gains 10 ms, the round trip is 50 ms
    assert m.plan(hit_blocks=1, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0).verdict is Verdict.SKIP
    assert m.plan(hit_blocks=10, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0).verdict is Verdict.LOAD


def test_an_unknown_prefill_rate_loads_what_fits_the_longest_wait() -> None:
    m = model(prefill_tokens_s=0.0)
    d = m.plan(hit_blocks=10, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0)
    assert d.verdict is Verdict.LOAD and math.isinf(d.predicted_recompute_s)


def test_a_missed_deadline_pulls_the_bandwidth_down_and_it_drifts_back() -> None:
    m = model(prefill_tokens_s=800.0, bandwidth_half_life_s=10.0)
    assert m.plan(hit_blocks=10, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0).verdict is Verdict.LOAD
    m.observe_load(nbytes=1 * MIB, seconds=2.0, now=100.0)  # the first sample replaces the prior: 0.5 MiB/s
    assert m.bandwidth(now=100.0) == pytest.approx(0.5 * MIB)
    assert m.plan(hit_blocks=10, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=100.0).verdict is Verdict.SKIP
    m.observe_load(nbytes=0, seconds=1.0, now=100.0)  # a stall: nothing arrived before the deadline
    assert m.bandwidth(now=100.0) == pytest.approx(0.35 * MIB)
    # no load measures it for a while: half-way back to the prior (in log terms) per half-life, then loads again
    assert m.bandwidth(now=110.0) == pytest.approx(math.sqrt(100 * 0.35) * MIB)
    assert m.bandwidth(now=100.01) == pytest.approx(0.35 * MIB, rel=0.01)
    for _ in range(30):
        m.observe_load(nbytes=0, seconds=1.0, now=100.0)
    assert m.bandwidth(now=100.0) == pytest.approx(
        100 * MIB / FLOOR
    )  # a floor: never so low that it takes ages to come back
    assert m.plan(hit_blocks=10, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=200.0).verdict is Verdict.LOAD


def test_the_prefill_rate_is_learnt_from_prefill_sized_steps_only() -> None:
    m = model(prefill_tokens_s=0.0)
    m.observe_step(tokens=8, seconds=0.001)  # a decode step: not a prefill rate
    assert m.prefill.value == 0.0
    m.observe_step(tokens=2048, seconds=1.0)
    m.observe_step(tokens=1024, seconds=1.0)
    assert m.prefill.value == pytest.approx(2048 + 0.3 * (1024 - 2048))
    assert m.predict_recompute_s(tokens=2048) == pytest.approx(2048 / m.prefill.value)


def test_outcomes_of_the_ranks_merge_as_one_load() -> None:
    a = LoadOutcome(loaded=10, nbytes=100, seconds=1.0, expired=False)
    b = LoadOutcome(loaded=7, nbytes=70, seconds=2.0, expired=True)
    assert a.merge(b) == LoadOutcome(loaded=7, nbytes=170, seconds=2.0, expired=True)


def test_always_load_loads_every_hit_whole_with_the_longest_deadline() -> None:
    """``cost_model: false``: a link measured slower than recompute still loads the whole hit, bounded by the
    longest wait (correctness runs on a loaded machine must see every hit loaded)."""
    m = model(prefill_tokens_s=3200.0, always_load=True)
    m.observe_load(nbytes=MIB, seconds=1.0, now=0.0)  # 1 MiB/s: a block loads in 1 s, recomputes in 5 ms
    d = m.plan(hit_blocks=100, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=1.0)
    assert d.verdict is Verdict.LOAD and d.blocks == 100 and d.deadline_s == m.settings.max_deadline_s
    assert (
        model(prefill_tokens_s=3200.0)
        .plan(hit_blocks=100, block_tokens=BLOCK_TOKENS, block_bytes=BLOCK_BYTES, now=0.0)
        .verdict
        is not Verdict.LOAD
    )
