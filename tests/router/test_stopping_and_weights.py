"""Stop-sequence matching and stop order (TGIS rules); batch weights and the exact peak check."""

from __future__ import annotations

import itertools

import pytest

from router.core.batch_weights import BatchWeights
from router.core.stopping import StopReason, check_stop, find_stop_sequence, held_back
from text_generation_common.messages import MemoryScalingModel


def test_stop_sequence_must_touch_the_new_text() -> None:
    assert find_stop_sequence("I was here", 4, ["I was"]) is None  # completed earlier
    match = find_stop_sequence("I was", 2, ["I was"])
    assert match is not None and (match.start, match.end) == (0, 5)


def test_stop_sequence_mid_token() -> None:
    text = "a little bit confused"
    match = find_stop_sequence(text, len(" confused"), ["confu"])
    assert match is not None and text[: match.end] == "a little bit confu"


def test_first_listed_sequence_wins_at_its_earliest_new_occurrence() -> None:
    text = "xx ab ab"
    match = find_stop_sequence(text, 5, ["b", "ab"])
    assert match is not None and match.sequence == "b" and match.start == 4
    match = find_stop_sequence(text, 5, ["ab"])
    assert match is not None and match.start == 3
    match = find_stop_sequence(text, 2, ["ab"])  # "ab" at 3 was complete before the new text
    assert match is not None and match.start == 6


def test_overlapping_matches_in_one_token_cut_at_the_first() -> None:
    """One token "   " and the stop "  ": the first two spaces complete it (a stream of the
    same characters would stop there), not the last two."""
    match = find_stop_sequence("   ", 3, ["  "])
    assert match is not None and (match.start, match.end) == (0, 2)
    match = find_stop_sequence("ab   ", 2, ["  "])  # "ab " was there: the match must touch "  "
    assert match is not None and (match.start, match.end) == (2, 4)


def test_non_ascii_stop_sequences() -> None:
    text = "🤖 \nTranslate"
    match = find_stop_sequence(text, 6, ["🤖 \nTran"])  # the new text "nslate" completes it
    assert match is not None and match.start == 0 and text[match.end :] == "slate"


def test_held_back_counts_bytes() -> None:
    assert held_back("hello", 0) == 0
    assert held_back("hello", 3) == 3
    assert held_back("héllo", 5) == 4  # "éllo" is 5 bytes
    assert held_back("ab", 10) == 2


def stop(**overrides) -> StopReason:
    args = {
        "generated": 5,
        "token_id": 7,
        "eos_token_ids": {2},
        "min_new_tokens": 0,
        "max_new_tokens": 10,
        "capped": False,
        "deadline": None,
        "now": 100.0,
    }
    return check_stop(**{**args, **overrides})


def test_stop_order() -> None:
    assert stop() is StopReason.NOT_FINISHED
    assert stop(deadline=99.0, generated=1, min_new_tokens=5) is StopReason.TIME_LIMIT  # beats min tokens
    assert stop(token_id=2, min_new_tokens=6) is StopReason.NOT_FINISHED
    assert stop(token_id=2, generated=10) is StopReason.EOS_TOKEN  # EOS beats max tokens
    assert stop(generated=10) is StopReason.MAX_TOKENS
    assert stop(generated=10, capped=True) is StopReason.TOKEN_LIMIT


def weights(limit: int, padded: bool = True) -> BatchWeights:
    return BatchWeights.from_model(MemoryScalingModel(2.0, 0.0, 0.0, 1.0, 1.0, limit), padded)


def test_padded_formulas() -> None:
    w = weights(1000)
    loads = [(10, 5), (4, 20)]
    assert w.max_weight(loads) == (10 + 20) * 2
    assert w.initial_weight(loads) == 10 * 2
    assert w.prefill_weight(loads) == 2 * 10 * 2
    assert w.padding_fraction(loads) == pytest.approx((20 - 14) / 20)
    assert w.batch_tokens(loads) == 20


def test_unpadded_formulas() -> None:
    w = weights(1000, padded=False)
    loads = [(10, 5), (4, 20)]
    assert w.max_weight(loads) == 39 and w.initial_weight(loads) == 14 and w.prefill_weight(loads) == 28
    assert w.padding_fraction(loads) == 0.0


def simulate_peak(w: BatchWeights, loads: list[tuple[int, int]]) -> float:
    """Brute force: the largest weight while every request generates its tokens one by one."""
    peak = 0.0
    for step in range(max(o for _, o in loads) + 1):
        resident = [(i + step, o - step) for i, o in loads if o >= step]
        if not resident:
            break
        if w.padded:
            peak = max(peak, max(i for i, _ in resident) * len(resident) * w.per_token)
        else:
            peak = max(peak, sum(i for i, _ in resident) * w.per_token)
    return peak


@pytest.mark.parametrize("padded", [True, False])
def test_exact_peak_check_agrees_with_simulation(padded: bool) -> None:
    values = [(3, 9), (12, 2), (7, 7), (1, 15)]
    for n in range(1, len(values)):
        for running in itertools.combinations(values, n):
            for candidate in [(5, 5), (20, 1), (2, 30)]:
                loads = [*running, candidate]
                for limit in (50, 80, 120, 200):
                    w = weights(limit, padded)
                    if simulate_peak(w, list(running)) > limit:
                        continue  # only batches that fit are ever running
                    expected = simulate_peak(w, loads) > limit
                    assert w.exceeds(list(running), candidate) == expected, (running, candidate, limit)
