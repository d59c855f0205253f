"""The batch-weight model a shard reports (ESTIMATE_MEMORY): formulas of each mode."""

from __future__ import annotations

import pytest

from text_generation_server.memory import UNLIMITED, MemoryFacts, estimate

FACTS = MemoryFacts(
    kv_bytes_per_input_token=512,
    kv_bytes_per_output_token=256,
    prefill_bytes_per_token=2048,
    free_bytes=10_000_000,
)


def test_auto_is_in_bytes_with_the_margin_held_back() -> None:
    m = estimate("auto", FACTS, max_sequence_length=200, max_batch_size=8, safety_margin=20)
    assert m.nexttoken_linear_coef0 == 512 and m.nexttoken_linear_coef1 == 256
    assert m.prefill_linear_coef0 == 2048 + 512 and m.prefill_quadratic_coef1 == 0
    assert m.weight_limit == 8_000_000


def test_manual_matches_tgis() -> None:
    """TGIS manual mode: capacity about P^2 * L * B tokens, weight limit P * 100."""
    m = estimate("manual", FACTS, max_sequence_length=200, max_batch_size=8, safety_margin=20)
    assert m.weight_limit == 80
    tokens = m.weight_limit / m.nexttoken_linear_coef0
    assert tokens == pytest.approx(0.8**2 * 200 * 8)
    assert m.prefill_quadratic_coef1 == pytest.approx(100 / (0.8 * 200**2 * 8))


def test_off_limits_nothing() -> None:
    m = estimate("off", FACTS, max_sequence_length=200, max_batch_size=8, safety_margin=20)
    assert m.weight_limit == UNLIMITED and m.nexttoken_linear_coef0 == 0


def test_bad_mode_and_margin() -> None:
    with pytest.raises(ValueError, match="unknown memory estimation mode"):
        estimate("guess", FACTS, max_sequence_length=200, max_batch_size=8, safety_margin=20)
    with pytest.raises(ValueError, match="safety margin"):
        estimate("auto", FACTS, max_sequence_length=200, max_batch_size=8, safety_margin=100)
