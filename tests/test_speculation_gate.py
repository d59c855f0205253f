"""SPECULATOR_BATCH_GATE=measured: the gate's rule (speculation/gate.py) on made-up costs and
tokens, and the start-up measurement (engines/tgis_native/speculation_costs.py) on the tiny
Llama: what it measures, that it leaves the engine as it found it, and that the engine's steps
follow the gate."""

from __future__ import annotations

import logging

import pytest

from tests.engines.conformance import Runner, joined, sharding
from tests.engines.test_tgis_native import config_for
from tests.test_speculation import Replay, recorded
from text_generation_common.messages import GenerationRequest
from text_generation_server.config import ServerConfig
from text_generation_server.engines.tgis_native.engine import TgisNativeEngine
from text_generation_server.speculation import gate
from text_generation_server.speculation.gate import SpeculationGate, StepCosts, measured_rows

COSTS = StepCosts((1, 2, 4, 8), (1.2, 1.4, 1.9, 2.6))


def measuring(model_dir, speculate: int, **overrides) -> ServerConfig:
    """The tests' tgis_native config with n-gram speculation and the measured gate."""
    return config_for(
        model_dir,
        speculate=speculate,
        deployment_framework="tgis_native",
        speculator_batch_gate="measured",
        **overrides,
    )


def test_the_cost_of_a_row_count_is_that_of_the_next_measured_one() -> None:
    assert [COSTS.ratio(rows) for rows in (1, 2, 3, 4, 5, 8, 9, 40)] == [
        1.2,
        1.4,
        1.9,
        1.9,
        2.6,
        2.6,
        2.6,
        2.6,
    ]
    assert measured_rows(16) == [1, 2, 4, 8, 16]
    assert measured_rows(6) == [1, 2, 4, 6]
    assert measured_rows(1) == [1]
    with pytest.raises(ValueError, match="ascending row counts"):
        StepCosts((2, 1), (1.0, 1.0))
    with pytest.raises(ValueError, match="ascending row counts"):
        StepCosts((1, 2), (1.0,))


def test_a_fixed_gate_speculates_up_to_the_batch_limit_only() -> None:
    fixed = SpeculationGate(4)
    for _ in range(3 * gate.PROBE_EVERY):
        fixed.record(4, 4)  # no tokens can close it
    assert [fixed.allows(rows) for rows in (0, 1, 4, 5)] == [False, True, True, False]


def settle(measured: SpeculationGate, rows: int, tokens: int) -> None:
    for _ in range(600):  # long enough for the decaying mean to reach tokens / rows
        measured.record(rows, tokens)


def test_the_gate_speculates_where_the_tokens_taken_pay_for_the_cost(caplog) -> None:
    caplog.set_level(logging.INFO, logger=gate.__name__)
    measured = SpeculationGate(8, COSTS)
    for _ in range(gate.MIN_STEPS - 1):  # too few steps to judge: every count up to the limit
        assert measured.allows(8)
        measured.record(8, 8)  # one token per row: speculation never pays
    assert not caplog.records
    measured.record(2, 3)
    assert measured.paying == 0 and "does not pay at any batch size now" in caplog.text
    # held back, but one step in PROBE_EVERY speculates to keep the mean current
    allowed = [measured.allows(1) for _ in range(3 * gate.PROBE_EVERY)]
    assert allowed.count(True) == 3 and allowed[gate.PROBE_EVERY - 1]
    assert not measured.allows(9)  # past SPECULATOR_MAX_BATCH_SIZE: never, not even a probe

    caplog.clear()
    settle(measured, 2, 3)  # 1.5 tokens a row: pays at 1 and 2 rows (1.2x, 1.4x), not at 3 or 4 (1.9x)
    assert measured.paying == 2 and [measured.allows(rows) for rows in (1, 2)] == [True, True]
    assert not measured.allows(3)
    assert "speculation pays while at most 1 row decode (" in caplog.text  # on its way up
    assert "speculation pays while at most 2 rows decode (" in caplog.text
    settle(measured, 8, 24)
    assert measured.paying == 8 and measured.allows(8)
    assert "speculation pays while at most 8 rows decode (2.7" in caplog.text  # once over 2.6 x 1.05

    # a mean just under a cost (2.55 against 2.6x at 8 rows) keeps P: it must fall short by the margin
    caplog.clear()
    settle(measured, 20, 51)
    assert measured.paying == 8 and not caplog.records
    settle(measured, 20, 40)  # 2.0: under 8 rows' 2.6x by more than the margin, over 4 rows' 1.9x
    assert measured.paying == 4 and measured.allows(4) and not measured.allows(5)
    assert caplog.text.count("speculation pays while") == 1  # logged once, where it settled


def test_the_engine_measures_the_cost_and_is_left_as_it_was(tiny_model, caplog) -> None:
    caplog.set_level(logging.INFO)
    model_dir = tiny_model("llama")
    engine = TgisNativeEngine(measuring(model_dir, 3, speculator_max_batch_size=4, prefix_caching=True))
    costs = engine.gate.costs
    assert costs is not None and costs.rows == (1, 2, 4)
    assert all(0.2 < r < 50 for r in costs.ratios), costs  # timed: loose bounds, a sane ratio
    # at 1 row also with 1 candidate; 2 between 1 and 3 on a line, never falling
    one, two, three = costs.lookahead
    assert 0.2 < one <= three and three == max(one, costs.ratios[0]), costs
    assert two == pytest.approx((one + three) / 2)
    assert "speculating step / plain step, measured: at 1 / 2 / 4 rows" in caplog.text
    assert "at 1 row with 1 / 2 / 3 candidates" in caplog.text
    assert engine.kv.pool.free == engine.kv.pool.num_blocks and not engine.allocations.reserved_blocks
    assert engine.prefix_caching and engine.prefix_query_tokens == engine.prefix_hit_tokens == 0
    assert engine.speculator is not None and type(engine.speculator).__name__ == "NgramSpeculator"
    assert engine.gate.steps == 0  # the measurement's own steps do not count as served ones
    # requests ask by them (a new batch looks its prompt up in the prefix cache: checked above)
    request = GenerationRequest(99, tuple(range(60, 80)), 10)
    batch, _ = engine.new_batch(99, [request])
    assert batch is not None and batch.states[99].lookahead.costs == costs.lookahead  # type: ignore[union-attr]
    engine.release([99])

    # the engine serves as one that measured nothing
    requests = [GenerationRequest(i, tuple(range(30 + i, 50 + i)), 10) for i in range(3)]
    unmeasured = TgisNativeEngine(config_for(model_dir, speculate=3, deployment_framework="tgis_native"))
    assert Runner(engine).run({0: requests}) == Runner(unmeasured).run({0: requests})


def test_a_cache_too_small_for_a_row_count_ends_the_measurement_there(tiny_model, caplog) -> None:
    caplog.set_level(logging.INFO)
    # sequences of at most 128 tokens in blocks of 4: 33 blocks each, 80 blocks hold 2 of them
    engine = TgisNativeEngine(measuring(tiny_model("llama"), 2, kv_cache_blocks=80))
    assert engine.gate.costs is not None and engine.gate.costs.rows == (1, 2)
    assert "speculation's cost measured up to 2 rows: the KV cache holds no more" in caplog.text


def test_no_more_rows_are_measured_than_a_batch_holds(tiny_model) -> None:
    engine = TgisNativeEngine(measuring(tiny_model("llama"), 2, max_batch_size=2, kv_cache_blocks=200))
    assert engine.gate.costs is not None and engine.gate.costs.rows == (1, 2)
    assert engine.gate.most_rows == 16  # SPECULATOR_MAX_BATCH_SIZE: the cost past 2 rows is 2 rows'


def test_sequences_too_short_to_measure_leave_the_limit_alone(tiny_model, caplog) -> None:
    engine = TgisNativeEngine(measuring(tiny_model("llama"), 4, max_sequence_length=40, max_new_tokens=8))
    assert engine.gate.costs is None and engine.gate.most_rows == 16
    assert "speculation's cost is not measured (MAX_NEW_TOKENS=8 and sequences of 40 tokens" in caplog.text


@pytest.mark.parametrize("cost", [0.5, 100.0])
def test_the_engine_speculates_as_the_gate_says(tiny_model, cost: float) -> None:
    model_dir = tiny_model("llama")
    requests = [GenerationRequest(i, tuple(range(20 + i, 33 + i)), 48) for i in (1, 2)]
    expected = Runner(TgisNativeEngine(config_for(model_dir, max_new_tokens=48))).run({0: requests})
    config = config_for(model_dir, speculate=3, deployment_framework="tgis_native", max_new_tokens=48)
    engine = TgisNativeEngine(config)
    engine.gate = SpeculationGate(16, StepCosts((1, 16), (cost, cost)))
    engine.speculator = Replay([[*r.input_ids, *expected[r.id]] for r in requests], wrong_every=1000)
    verified = recorded(engine)
    assert Runner(engine).run({0: requests}) == expected
    steps = engine.gate.steps
    if cost < 1:  # every step speculates (each takes up to 4 tokens of the 48)
        assert steps >= 12 and len(verified) >= 2 * steps - 2
    else:  # the first MIN_STEPS only: the 16 tokens left come within PROBE_EVERY plain steps
        assert steps == gate.MIN_STEPS and len(verified) == 2 * steps


@pytest.mark.skipif(not sharding(), reason="runs on each rank of tests/engines/test_sharded.py")
def test_the_gate_is_measured_alike_on_every_rank(tiny_model) -> None:
    """Each rank measures its own steps (collectives in lockstep) and takes the largest ratio of
    all: both speculate at the same steps (test_sharded.py compares what they log)."""
    config = measuring(tiny_model("llama"), 2, speculator_max_batch_size=4, **sharding())
    engine = TgisNativeEngine(joined(config))
    assert engine.gate.costs is not None and engine.gate.costs.rows == (1, 2, 4)
    requests = [GenerationRequest(i, (7, 8, 9, 7, 8, 9, 7, 8), 24) for i in range(3)]
    logging.getLogger(__name__).info(
        "rank outputs: %s", Runner(engine).run({0: requests[:1], 2: requests[1:]})
    )


def test_an_unknown_gate_is_refused() -> None:
    with pytest.raises(
        ValueError, match="unknown SPECULATOR_BATCH_GATE 'sometimes'; choose one of measured, fixed"
    ):
        ServerConfig(model_name="m", speculator_batch_gate="sometimes")
