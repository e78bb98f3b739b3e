import itertools
import json
import math
import random
import sys
import time
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.errors import UserError
from grpo.eval import maj_at_k, pass_at_k
from grpo.eval import runner
from grpo.eval.runner import Verifier, evaluate, measure, reward_verifier, sample_completions, task_verifier
from grpo.tasks import load_task
from grpo.tasks.arithmetic import ALPHABET, make_rows, problem_for
from tests.tasks import user_task
from grpo.tasks.tiny import save_tiny_model

# A synthetic task: a completion is its own answer ("" = no answer); a row's answer is right.
SYNTHETIC = Verifier(extract=lambda c: c or None, check=lambda c, row: c == row["answer"])


def brute_force(group, truth, k):
    """pass@k and maj@k of one prompt by enumerating every k-subset of its completions."""
    answers = [c or None for c in group]
    right = {truth}
    passed, voted, subsets = 0.0, 0.0, 0
    for pick in itertools.combinations(range(len(group)), k):
        subsets += 1
        passed += any(group[i] == truth for i in pick)
        votes = Counter(answers[i] for i in pick if answers[i] is not None)
        if votes:
            top = max(votes.values())
            winners = [a for a, v in votes.items() if v == top]
            voted += sum(w in right for w in winners) / len(winners)
    return passed / subsets, voted / subsets


@given(
    groups=st.lists(st.lists(st.sampled_from(["", "1", "2", "3"]), min_size=6, max_size=6), min_size=1, max_size=4),
    ks=st.lists(st.integers(1, 6), min_size=1, max_size=4),
)
def test_measure_equals_enumeration_over_subsets(groups, ks):
    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(len(groups))]
    report = measure(groups, rows, ks=ks, verifier=SYNTHETIC)
    assert list(report["pass@k"]) == [str(k) for k in sorted(set(ks))]
    for k in set(ks):
        want = [brute_force(group, "1", k) for group in groups]
        assert report["pass@k"][str(k)] == pytest.approx(sum(p for p, _ in want) / len(groups), abs=1e-12)
        assert report["maj@k"][str(k)] == pytest.approx(sum(m for _, m in want) / len(groups), abs=1e-12)


@given(groups=st.lists(st.lists(st.sampled_from(["", "1", "2", "3"]), min_size=5, max_size=5), min_size=1, max_size=6))
def test_intervals_contain_the_mean_and_stay_in_0_1(groups):
    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(len(groups))]
    report = measure(groups, rows, ks=[1, 2, 3, 5], verifier=SYNTHETIC)
    for metric in ("pass@k", "maj@k"):
        for k, mean in report[metric].items():
            lo, hi = report[f"{metric}_ci"][k]
            assert 0.0 <= lo <= mean + 1e-12 and mean - 1e-12 <= hi <= 1.0


def test_interval_is_the_normal_one_over_prompts():
    # Per-prompt accuracies 1/4, 3/4, 1/2, 1/2: mean 1/2, sample std sqrt(0.125 / 3).
    groups = [["1", "2", "2", "2"], ["1", "1", "1", "2"], ["1", "1", "2", "2"], ["1", "1", "", ""]]
    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(4)]
    report = measure(groups, rows, ks=[1], verifier=SYNTHETIC)
    half = 1.96 * math.sqrt(0.125 / 3) / math.sqrt(4)
    assert report["pass@k"]["1"] == pytest.approx(0.5)
    assert report["pass@k_ci"]["1"] == pytest.approx([0.5 - half, 0.5 + half])
    # Clipped: every prompt always right gives [1, 1]; one prompt has no spread at all.
    assert measure([["1", "1"]] * 3, rows[:3], ks=[2], verifier=SYNTHETIC)["maj@k_ci"]["2"] == [1.0, 1.0]
    assert measure([["1", "2"]], rows[:1], ks=[1], verifier=SYNTHETIC)["pass@k_ci"]["1"] == [0.5, 0.5]


def test_per_prompt_details_are_consistent_with_the_totals():
    groups = [["1", "1", "2", ""], ["3", "", "", ""], ["1", "1", "1", "1"]]
    rows = [{"prompt": f"q{i}", "answer": "1"} for i in range(3)]
    report = measure(groups, rows, ks=[1, 4], verifier=SYNTHETIC)
    assert [p["correct"] for p in report["per_prompt"]] == [2, 0, 4]
    assert report["per_prompt"][0] == {
        "prompt": "q0",
        "correct": 2,
        "answers": {"1": 2, "2": 1},
        "no_answer": 1,
        "pass@k": {"1": 0.5, "4": 1.0},
        "maj@k": {"1": pytest.approx(0.5), "4": 1.0},
    }
    # Each prompt's own values average to the report's totals.
    for metric in ("pass@k", "maj@k"):
        for k in ("1", "4"):
            mean = sum(p[metric][k] for p in report["per_prompt"]) / 3
            assert mean == pytest.approx(report[metric][k])
    assert report["per_prompt"][1]["answers"] == {"3": 1}
    for p in report["per_prompt"]:
        assert sum(p["answers"].values()) + p["no_answer"] == 4
    assert report["accuracy"] == pytest.approx(6 / 12) == report["pass@k"]["1"]
    assert report["no_answer"] == pytest.approx(4 / 12)
    assert report["mean_length"] == pytest.approx(8 / 12)
    assert report["n"] == 4 and report["prompts"] == 3
    json.dumps(report)  # serialisable as it is


def test_ks_beyond_n_are_dropped_with_a_warning(capsys):
    report = measure([["1", "2", "1"]], [{"answer": "1"}], ks=[8, 2, 1, 2, 3, 4], verifier=SYNTHETIC)
    assert list(report["pass@k"]) == ["1", "2", "3"] == list(report["maj@k_ci"])
    err = capsys.readouterr().err
    assert "dropping k = 4, 8" in err and err.count("\n") == 1
    with pytest.raises(UserError, match="no k <= n = 3"):
        measure([["1", "2", "1"]], [{"answer": "1"}], ks=[4], verifier=SYNTHETIC)
    with pytest.raises(UserError, match="positive integers"):
        measure([["1"]], [{"answer": "1"}], ks=[0], verifier=SYNTHETIC)


def test_a_correct_completion_without_an_answer_counts_for_pass_not_for_the_vote():
    lenient = Verifier(extract=lambda c: None, check=lambda c, row: True)
    report = measure([["x", "y"]], [{}], ks=[1, 2], verifier=lenient)
    assert report["pass@k"] == {"1": 1.0, "2": 1.0}
    assert report["maj@k"] == {"1": 0.0, "2": 0.0}


def test_maj_at_k_cache_keys_on_counts_and_correctness_not_on_labels():
    # Same profile (two answers x2, the right one differs in name): same value, and right.
    first = runner._maj_at_ks(["a", "a", "b", "b", None], [True, True, False, False, False], [1, 2, 3, 5])
    second = runner._maj_at_ks(["q", "z", "z", "q", None], [False, True, True, False, False], [1, 2, 3, 5])
    assert first == second
    for k, value in first.items():
        assert value == pytest.approx(maj_at_k(["a", "a", "b", "b", None], "a", k))
    # Which answer is right matters: 3 wrong "b" against 1 right "a".
    assert runner._maj_at_ks(["a", "b", "b", "b"], [True, False, False, False], [4]) == {4: 0.0}
    assert runner._maj_at_ks(["a", "b", "b", "b"], [False, True, True, True], [4]) == {4: 1.0}


def test_metrics_of_100_prompts_x_64_samples_take_well_under_10_s():
    rng = random.Random(0)
    ks = [1, 2, 4, 8, 16, 32, 64]
    groups, rows = [], []
    for i in range(100):
        right = rng.random()
        wrong = [str(rng.randint(0, 30)) for _ in range(rng.randint(1, 12))]
        groups.append(["ok" if rng.random() < right else rng.choice([*wrong, ""]) for _ in range(64)])
        rows.append({"prompt": str(i), "answer": "ok"})
    runner._maj_of_profile.cache_clear()
    start = time.perf_counter()
    report = measure(groups, rows, ks=ks, verifier=SYNTHETIC)
    assert time.perf_counter() - start < 10.0
    # Spot check against the library function directly.
    k = 16
    want = sum(maj_at_k([c or None for c in g], [c == "ok" for c in g], k) for g in groups) / 100
    assert report["maj@k"]["16"] == pytest.approx(want, abs=1e-12)


# ---- verifiers --------------------------------------------------------------------------


def test_arithmetic_task_verifier():
    verifier = task_verifier(load_task("arithmetic"))
    problem = problem_for(47, 85)
    row = {"prompt": problem.prompt, "answer": problem.answer}
    assert verifier.check(problem.solution, row)
    assert not verifier.check("7+5+0=12;4+8+1=13>131", row)
    assert verifier.extract("x>131") == "131" and verifier.extract("132") is None
    # Without an answer column the prompt is the reference; with neither, it cannot score.
    assert verifier.check(problem.solution, {"prompt": problem.prompt})
    assert not verifier.check("", {"prompt": "what?"})
    assert torch.isnan(verifier.score_group(["", "1"], {"prompt": "what?"})).all()


def test_a_users_task_verifier_uses_its_verifier_threshold_and_extractor():
    verifier = task_verifier(user_task.task)
    row = {"prompt": "abc", "avoid": "c"}
    assert verifier.check_all(["a", "c", "", "bc"], row) == [True, False, False, True]
    assert [verifier.extract(c) for c in ["a", "", "bc"]] == ["a", None, "b"]
    strict = task_verifier(user_task.task, threshold=1.5, extract=str.upper)  # the caller's override
    assert strict.check_all(["a"], row) == [False] and strict.extract("ab") == "AB"
    renamed = task_verifier(user_task.task, prompt_column="question")
    assert renamed.check_all(["a"], {"question": "abc", "avoid": "c"}) == [True]
    with pytest.raises(
        UserError, match=r"^task 'avoid': data column 'prompts' has the name of a reward-function argument"
    ):
        verifier.check_all(["a"], {"prompt": "abc", "avoid": "c", "prompts": "x"})


def test_reward_verifier_thresholds_scores_and_names_its_failures():
    rows = [{"prompt": "q", "answer": "12"}]
    exact = reward_verifier("exact_answer")
    assert exact.check_all(["<answer>12</answer>", "<answer>13</answer>", "12"], rows[0]) == [True, False, False]
    assert exact.extract("<answer> 12 </answer>") == "12"
    graded = reward_verifier("tests.eval.test_runner:length_score", threshold=0.3)
    assert graded.check_all(["", "ab", "abc", "abcdefghij"], rows[0]) == [False, False, True, True]
    assert graded.check("abc", rows[0]) is True
    assert reward_verifier("tests.eval.test_runner:length_score", threshold=0.0).check("", {"answer": None}) is False
    with pytest.raises(UserError, match=r"^verifier 'tests.eval.test_runner:explodes' raised ZeroDivisionError"):
        reward_verifier("tests.eval.test_runner:explodes").check("x", rows[0])
    # What a verifier returns is checked by the same function as in training (as_scores).
    with pytest.raises(UserError, match=r"^verifier 'tests.eval.test_runner:one_short' returned 1 scores for 2"):
        reward_verifier("tests.eval.test_runner:one_short").check_all(["a", "b"], rows[0])
    with pytest.raises(
        UserError,
        match=r"^verifier 'tests.eval.test_runner:not_a_number' returned 'yes' \(str\) "
        "for row 0; expected a number",
    ):
        reward_verifier(not_a_number, name="tests.eval.test_runner:not_a_number").check("x", rows[0])
    with pytest.raises(
        UserError,
        match=r"^verifier 'tests.eval.test_runner:nan' returned nan for row 0; "
        "return None for 'cannot score'",
    ):
        reward_verifier(nan).check("x", rows[0])  # named by module:qualname
    with pytest.raises(UserError, match="did you mean 'exact_answer'"):
        reward_verifier("exact_anwser")


def test_a_reward_function_and_an_answer_extractor():
    verifier = reward_verifier(user_task.verify, extract=user_task.extract)
    row = {"prompt": "abc", "avoid": "c"}
    assert verifier.check_all(["a", "c"], row) == [True, False] and verifier.extract("ba") == "b"
    assert reward_verifier(user_task.verify).extract("ba") is None  # default: grpo.rewards.rules.extract_answer
    with pytest.raises(
        UserError,
        match=r"^answer extractor 'tests.tasks.user_task:unhashable_answer' returned a "
        "list, which cannot be a vote",
    ):
        reward_verifier(user_task.verify, extract=user_task.unhashable_answer).extract("ab")
    with pytest.raises(UserError, match=r"^answer extractor 'tests.eval.test_runner:explodes' raised TypeError"):
        reward_verifier(user_task.verify, extract=explodes).extract("ab")


def length_score(prompts, completions, answer=None, **_):
    """len/10 per completion; None where the row's answer is None."""
    return [None if a is None else len(c) / 10 for c, a in zip(completions, answer)]


def explodes(prompts, completions, **_):
    return [1 / 0 for _ in completions]


def one_short(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def not_a_number(prompts, completions, **_):
    return ["yes"] * len(completions)


def nan(prompts, completions, **_):
    return [float("nan")] * len(completions)


# ---- evaluate, with sampling replaced by known completions ----------------------------------


def test_evaluate_scores_what_was_sampled(monkeypatch):
    rows = make_rows(5, seed=3)
    # Prompt i: i of its 4 completions are the worked solution, the rest answer 0.
    known = [[row["solution"]] * min(i, 4) + ["0+0+0=00>0"] * (4 - min(i, 4)) for i, row in enumerate(rows)]
    calls = []

    def fake_sample(model, tokenizer, rows_, **kwargs):
        calls.append(kwargs)
        return known

    monkeypatch.setattr(runner, "sample_completions", fake_sample)
    report = evaluate(
        None,
        None,
        rows,
        n=4,
        ks=[1, 2, 4],
        verifier=task_verifier(load_task("arithmetic")),
        seed=7,
        temperature=0.3,
        batch_size=8,
        progress=False,
    )
    assert callable(calls[0].pop("on_prompt"))  # checks each prompt as it is sampled (not called here)
    assert calls[0].pop("lengths") == {}  # the sampler counts tokens and cut samples there (this one does not)
    assert report["truncated"] is None and report["mean_tokens"] is None
    assert calls == [
        {
            "n": 4,
            "prompt_column": "prompt",
            "temperature": 0.3,
            "top_p": 1.0,
            "max_new_tokens": 64,
            "batch_size": 8,
            "seed": 7,
            "progress": False,
            "log_every": 10,
            "tools": None,  # single-turn samples
            "draw": "auto",  # as training draws
            "share": (0, 1),  # one process samples every prompt
        }
    ]
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, min(i, 4), k) for i in range(5)) / 5
        assert report["pass@k"][str(k)] == pytest.approx(want)
    # With two answers, the right one wins a 4-vote only with 3 or 4 copies, ties at 2.
    assert report["maj@k"]["4"] == pytest.approx((0 + 0 + 0.5 + 1 + 1) / 5)
    assert report["temperature"] == 0.3 and report["seed"] == 7 and report["no_answer"] == 0.0
    assert [p["correct"] for p in report["per_prompt"]] == [0, 1, 2, 3, 4]
    assert report["time_s"] >= report["time_metrics_s"] >= 0
    assert json.loads(json.dumps(report)) == report


# ---- the real thing, on a tiny untrained model ----------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from grpo.infra.hf import load_causal_lm, load_tokenizer

    directory = save_tiny_model(tmp_path_factory.mktemp("eval-model"), ALPHABET, hidden_size=32, layers=1, heads=2)
    return load_causal_lm(str(directory), "float32"), load_tokenizer(str(directory))


@pytest.fixture(autouse=True)
def one_thread():
    # A 32-wide model gains nothing from threads, and on a busy machine 2 threads wait on
    # each other far longer than the work takes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_evaluate_runs_end_to_end_and_is_reproducible(tiny, capsys):
    model, tokenizer = tiny
    rows = make_rows(3, seed=0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    kwargs = dict(
        n=4, ks=[1, 2, 4, 8], verifier=task_verifier(load_task("arithmetic")), max_new_tokens=10, batch_size=8
    )
    first = evaluate(model, tokenizer, rows, seed=1, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    assert "eval" in capsys.readouterr().err  # the progress bar, on stderr
    again = evaluate(model, tokenizer, rows, seed=1, progress=False, **kwargs)
    for report in (first, again):
        report.pop("time_s"), report.pop("time_metrics_s")
    assert first == again
    assert list(first["pass@k"]) == ["1", "2", "4"]
    assert first["n"] == 4 and first["prompts"] == 3 and len(first["per_prompt"]) == 3
    assert 0.0 <= first["accuracy"] <= 0.25  # untrained: nothing (or next to nothing) is right
    assert 0 < first["mean_length"] <= 10  # one character per token, at most 10 new tokens
    for p in first["per_prompt"]:
        assert sum(p["answers"].values()) + p["no_answer"] == 4


class EchoModel(torch.nn.Module):
    """A fake causal LM whose 'completion' is the last 3 prompt tokens, then EOS."""

    def __init__(self, eos_token_id):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the sampler reads the device off it
        self.eos_token_id = eos_token_id
        self.calls = []

    def generate(self, input_ids, attention_mask, generation_config):
        self.calls.append(input_ids.shape[0])
        eos = torch.full((input_ids.shape[0], 1), self.eos_token_id)
        return torch.cat([input_ids, input_ids[:, -3:], eos, eos], 1)


@pytest.mark.parametrize("batch_size, calls", [(2, [2, 1] * 4), (6, [6, 6]), (7, [6, 6]), (100, [12])])
def test_completions_go_to_their_own_prompt(tiny, batch_size, calls):
    _, tokenizer = tiny
    rows = [{"prompt": p} for p in ("12+34=", "5+67=", "89+1=", "2+3=")]
    model = EchoModel(tokenizer.eos_token_id)
    completions = sample_completions(model, tokenizer, rows, n=3, batch_size=batch_size, progress=False)
    assert completions == [[row["prompt"][-3:]] * 3 for row in rows]
    assert model.calls == calls


def test_sampling_is_seeded_and_batching_keeps_n_per_prompt(tiny):
    model, tokenizer = tiny
    rows = make_rows(3, seed=0)
    common = dict(max_new_tokens=10, progress=False)
    one = sample_completions(model, tokenizer, rows, n=5, batch_size=16, seed=0, **common)
    same = sample_completions(model, tokenizer, rows, n=5, batch_size=16, seed=0, **common)
    other = sample_completions(model, tokenizer, rows, n=5, batch_size=16, seed=1, **common)
    assert one == same and one != other
    # n split over calls (5 = 2 + 2 + 1) and prompts split over calls (2 + 1 prompts per call).
    for batch_size in (2, 10):
        split = sample_completions(model, tokenizer, rows, n=5, batch_size=batch_size, seed=0, **common)
        assert [len(group) for group in split] == [5, 5, 5]
        assert all(isinstance(c, str) for group in split for c in group)


def test_draw_generate_samples_generate_s_own_tokens(tiny):
    """draw: generate gives what transformers' generate draws from the same seed; the default
    (auto) other tokens from the same distribution; the report says which."""
    from grpo.rollout import Sampler

    model, tokenizer = tiny
    rows = make_rows(3, seed=0)
    common = dict(n=4, max_new_tokens=10, batch_size=12, seed=5, progress=False)
    generate = sample_completions(model, tokenizer, rows, draw="generate", **common)
    auto = sample_completions(model, tokenizer, rows, **common)
    torch.manual_seed(5)
    by_hf = Sampler(tokenizer, prompt_column="prompt", group_size=4, max_new_tokens=10, temperature=0.7, backend="hf")
    expected = by_hf.sample(model, rows).scored_completions
    assert [c for group in generate for c in group] == expected
    assert auto != generate
    report = evaluate(
        model, tokenizer, rows, ks=[1], verifier=task_verifier(load_task("arithmetic")), draw="generate", **common
    )
    assert report["draw"] == "generate"


@pytest.mark.parametrize("batch_size", [2, 100])
def test_each_prompt_is_handed_on_once_all_its_n_are_sampled(tiny, batch_size):
    _, tokenizer = tiny
    rows = [{"prompt": p} for p in ("12+34=", "5+67=", "89+1=")]
    seen = []
    completions = sample_completions(
        EchoModel(tokenizer.eos_token_id),
        tokenizer,
        rows,
        n=3,
        batch_size=batch_size,
        progress=False,
        on_prompt=lambda i, group: seen.append((i, list(group))),
    )
    assert seen == [(i, group) for i, group in enumerate(completions)] and all(len(g) == 3 for _, g in seen)


def test_known_verdicts_are_not_asked_again():
    rows = [{"answer": "1"}, {"answer": "1"}]
    report = measure([["1", "2"], ["1", "2"]], rows, ks=[1], verifier=SYNTHETIC, verdicts=[[False, False], None])
    assert [p["correct"] for p in report["per_prompt"]] == [0, 1]  # the first as given, the second checked


# Echoed completions: the last 3 characters of the prompt. Prompts 0, 1 and 3 are right.
ECHO_ROWS = [
    {"prompt": "12+34=", "answer": "34="},
    {"prompt": "5+67=", "answer": "67="},
    {"prompt": "89+1=", "answer": "no"},
    {"prompt": "2+3=", "answer": "+3="},
]


def test_evaluate_logged_to_a_file_prints_lines_with_the_running_pass_at_1(tiny, capsys):
    """stderr not a terminal (captured): a line every log_every prompts, the first and the
    last always, with completions and prompts done, pass@1 so far and completions/s."""
    _, tokenizer = tiny
    capsys.readouterr()
    report = evaluate(
        EchoModel(tokenizer.eos_token_id),
        tokenizer,
        ECHO_ROWS,
        n=3,
        ks=[1],
        verifier=SYNTHETIC,
        batch_size=3,
        log_every=2,
    )
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[:3] for line in lines] == [
        ["grpo eval: completions 3/12", "prompts 1/4", "pass@1 1.000"],
        ["grpo eval: completions 6/12", "prompts 2/4", "pass@1 1.000"],
        ["grpo eval: completions 12/12", "prompts 4/4", "pass@1 0.750"],
    ]
    assert all(line.endswith(" completions/s") and "  elapsed " in line for line in lines)
    assert report["accuracy"] == 0.75


def test_evaluate_on_a_terminal_shows_a_bar(tiny, capsys, monkeypatch):
    _, tokenizer = tiny
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    evaluate(EchoModel(tokenizer.eos_token_id), tokenizer, ECHO_ROWS, n=3, ks=[1], verifier=SYNTHETIC, batch_size=3)
    err = capsys.readouterr().err
    assert "eval" in err and "\r" in err and "12/12" in err and "pass@1=0.750" in err
    assert "grpo eval: completions" not in err


class EndlessModel(EchoModel):
    """The echo without the EOS: every sample runs into max_new_tokens."""

    def generate(self, input_ids, attention_mask, generation_config):
        self.calls.append(input_ids.shape[0])
        return torch.cat([input_ids, input_ids[:, -3:]], 1)


def test_the_report_gives_the_share_of_samples_cut_at_max_new_tokens(tiny):
    """A sample whose last token is EOS ended by itself; one without ran into the budget. The
    report counts the second kind (what a budget too short for the model's answers shows)."""
    _, tokenizer = tiny
    common = dict(n=3, ks=[1], verifier=SYNTHETIC, batch_size=3, progress=False, max_new_tokens=3)
    ended = evaluate(EchoModel(tokenizer.eos_token_id), tokenizer, ECHO_ROWS, **{**common, "max_new_tokens": 5})
    assert ended["truncated"] == 0.0 and ended["mean_tokens"] == 4.0  # 3 echoed tokens and EOS
    cut = evaluate(EndlessModel(tokenizer.eos_token_id), tokenizer, ECHO_ROWS, **common)
    assert cut["truncated"] == 1.0 and cut["mean_tokens"] == 3.0
