"""verify.metrics: hand-computed values, bootstrap CI, input validation."""

from __future__ import annotations

import json

import pytest

from verify import accept_histogram, bootstrap_ci, position_acceptance, summarize, tau_macro, tau_micro

# Two prompts, K = 3. Row 0: steps kept 3, 0, 1 drafts (+ one token each) -> 4 + 1 + 2 = 7 tokens.
# Row 1: steps kept 2 and 3 drafts, the last step cut by the cap after its 3 drafts -> 3 + 3 = 6.
ACCEPTED = [[3, 0, 1], [2, 3]]
NEW_TOKENS = [7, 6]
STEPS = [3, 2]
K = 3


def test_hand_computed_values():
    assert tau_micro(NEW_TOKENS, STEPS) == pytest.approx(13 / 5)
    assert tau_macro(NEW_TOKENS, STEPS) == pytest.approx((7 / 3 + 6 / 2) / 2)
    assert accept_histogram(ACCEPTED, K) == [1, 1, 1, 2]
    # counts >= k over 5 steps: k=0: 5, k=1: 4, k=2: 3, k=3: 2
    assert position_acceptance(ACCEPTED, K) == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert position_acceptance([[0, 0]], 2) == [0.0, None]  # slot 2 never reached
    # Token lists work as well as counts.
    assert tau_micro([[5, 6, 7], [1]], [1, 1]) == pytest.approx(2.0)


def test_summarize_is_json_serialisable_and_consistent():
    summary = summarize(ACCEPTED, NEW_TOKENS, STEPS, K)
    assert json.loads(json.dumps(summary)) == summary
    assert summary["tau"] == pytest.approx(13 / 5)
    assert summary["tau_macro"] == pytest.approx(8 / 3)
    assert summary["accept_hist"] == [1, 1, 1, 2]
    assert summary["mean_accepted"] == pytest.approx(9 / 5)
    assert summary["new_tokens"] == 13 and summary["target_forwards"] == 5 and summary["num_prompts"] == 2
    assert summary["tau_ci_low"] <= summary["tau"] <= summary["tau_ci_high"]


def test_bootstrap_ci_contains_point_estimate():
    new = [3, 10, 7, 4, 12, 6, 9, 5, 8, 11, 2, 6]
    steps = [2, 4, 3, 3, 4, 2, 3, 3, 3, 4, 2, 2]
    low, high = bootstrap_ci(new, steps, n_boot=2000, seed=1)
    point = tau_micro(new, steps)
    assert low < point < high
    assert 1.0 <= low and high <= 4.0
    assert bootstrap_ci(new, steps, seed=1) == bootstrap_ci(new, steps, seed=1)  # seeded
    narrow = bootstrap_ci(new, steps, alpha=0.5, seed=1)
    assert low <= narrow[0] <= narrow[1] <= high
    assert bootstrap_ci([6], [2]) == (3.0, 3.0)  # one prompt: no spread


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: tau_micro([], []), "no rows"),
        (lambda: tau_micro([3, 4], [1]), "must match"),
        (lambda: tau_micro([3, 0], [1, 0]), "at least one verification step"),
        (lambda: tau_macro([1, 4], [2, 1]), "at least one token"),
        (lambda: tau_micro([-1], [1]), "non-negative"),
        (lambda: accept_histogram([[0, 4]], 3), "0..K=3"),
        (lambda: accept_histogram([[0]], 0), "K"),
        (lambda: position_acceptance([[]], 2), "no verification steps"),
        (lambda: bootstrap_ci([3], [1], n_boot=0), "n_boot"),
        (lambda: bootstrap_ci([3], [1], alpha=1.0), "alpha"),
        (lambda: summarize([[1]], [2, 2], [1, 1], 2), "accepted_counts has 1 rows"),
        (lambda: summarize([[1, 1]], [4], [1], 2), "row 0: 2 accepted counts"),
        (lambda: summarize([[1]], [4], [1], 2), "more than K"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_accepted_by_source_counts_each_label():
    """Row-steps, share, mean kept drafts and share keeping none, per label; labels must cover every step."""
    from verify.metrics import accepted_by_source

    by = accepted_by_source([[0, 3, 1], [2, 0]], [["drafter", "hint", "hint"], ["hint", "drafter"]])
    assert by == {"drafter": {"row_steps": 2, "share": 0.4, "mean_accepted": 0.0, "zero_accepted": 1.0},
                  "hint": {"row_steps": 3, "share": 0.6, "mean_accepted": 2.0, "zero_accepted": 0.0}}
    assert accepted_by_source([[1, 2]], [[]]) == {}  # an unlabelled drafter
    with pytest.raises(ValueError, match="row 0: 1 draft sources for 2 steps"):
        accepted_by_source([[1, 2]], [["hint"]])
