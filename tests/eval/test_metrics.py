import itertools
import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.eval import maj_at_k, pass_at_k

# ---- hand-computed numbers -------------------------------------------------------------


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples: some pick is right


def test_pass_at_k_is_not_the_biased_with_replacement_formula():
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    assert 1 - (1 - 2 / 4) ** 2 == pytest.approx(0.75)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 2, 5), (4, 2, 0), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_maj_at_k_by_hand():
    answers = ["7", "7", "9"]
    assert maj_at_k(answers, "7", 1) == pytest.approx(2 / 3)
    # Pairs: {7,7} wins; {7,9} twice is a tie worth 1/2 each: (1 + 0.5 + 0.5) / 3.
    assert maj_at_k(answers, "7", 2) == pytest.approx(2 / 3)
    assert maj_at_k(answers, "7", 3) == 1.0
    assert maj_at_k(answers, [True, True, False], 2) == pytest.approx(2 / 3)
    assert maj_at_k(answers, "8", 2) == 0.0


def test_unanswered_samples_never_win_a_vote():
    assert maj_at_k([None, "3"], "3", 1) == pytest.approx(0.5)
    assert maj_at_k([None, "3"], "3", 2) == 1.0
    # {None, None} scores 0, {None, 3} twice scores 1.
    assert maj_at_k([None, None, "3"], "3", 2) == pytest.approx(2 / 3)
    # Two unanswered samples outnumber one wrong answer, and still do not win.
    assert maj_at_k([None, None, "4"], [False, False, False], 3) == 0.0


def test_majority_beats_a_lone_correct_sample_that_pass_at_k_credits():
    answers = ["1", "1", "1", "2"]
    assert maj_at_k(answers, "2", 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0


def test_maj_at_k_handles_a_thousand_samples():
    # 600 right, 400 wrong: a 500-sample vote is right almost surely.
    got = maj_at_k(["a"] * 600 + ["b"] * 400, "a", 500)
    assert 0.999 < got <= 1.0 + 1e-12


# ---- fast == naive ----------------------------------------------------------------------


def enumerated_pass_at_k(flags, k):
    subsets = list(itertools.combinations(flags, k))
    return sum(any(s) for s in subsets) / len(subsets)


def brute_force_maj_at_k(answers, flags, k):
    right = {a for a, ok in zip(answers, flags) if ok and a is not None}
    total, subsets = 0.0, 0
    for pick in itertools.combinations(range(len(answers)), k):
        subsets += 1
        votes = Counter(answers[i] for i in pick if answers[i] is not None)
        if votes:
            top = max(votes.values())
            winners = [a for a, v in votes.items() if v == top]
            total += sum(w in right for w in winners) / len(winners)
    return total / subsets


@given(flags=st.lists(st.booleans(), min_size=1, max_size=12), data=st.data())
def test_pass_at_k_equals_enumeration_over_subsets(flags, data):
    k = data.draw(st.integers(1, len(flags)))
    assert pass_at_k(len(flags), sum(flags), k) == pytest.approx(enumerated_pass_at_k(flags, k), abs=1e-12)


@given(
    answers=st.lists(st.sampled_from([None, "1", "2", "3", "4", "5"]), min_size=1, max_size=10),
    truth=st.sampled_from(["1", "2", "3"]),
    data=st.data(),
)
def test_maj_at_k_equals_brute_force(answers, truth, data):
    k = data.draw(st.integers(1, len(answers)))
    flags = [a == truth for a in answers]
    want = brute_force_maj_at_k(answers, flags, k)
    assert maj_at_k(answers, flags, k) == pytest.approx(want, abs=1e-12)
    assert maj_at_k(answers, truth, k) == pytest.approx(want, abs=1e-12)
    assert maj_at_k(answers, np.array(flags), k) == pytest.approx(want, abs=1e-12)


@given(answers=st.lists(st.sampled_from([None, 1, 2, 3]), min_size=2, max_size=9), data=st.data())
def test_several_correct_answers_split_ties_the_same_way(answers, data):
    # With a lenient verifier two different answers can both be correct.
    k = data.draw(st.integers(1, len(answers)))
    flags = [a in (1, 2) for a in answers]
    assert maj_at_k(answers, flags, k) == pytest.approx(brute_force_maj_at_k(answers, flags, k), abs=1e-12)


@given(answers=st.lists(st.sampled_from([None, "a", "b"]), min_size=1, max_size=10))
def test_one_sample_vote_is_the_accuracy(answers):
    flags = [a == "a" for a in answers]
    assert maj_at_k(answers, flags, 1) == pytest.approx(sum(flags) / len(flags))
    assert pass_at_k(len(flags), sum(flags), 1) == pytest.approx(sum(flags) / len(flags))
    assert maj_at_k(answers, flags, 1) <= pass_at_k(len(flags), sum(flags), len(flags)) + 1e-12
    assert math.isfinite(maj_at_k(answers, flags, len(answers)))
