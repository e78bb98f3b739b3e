"""A reward function's call is contained: time limits, worker processes, BaseExceptions,
copies of the batch, scores beyond float32, and a bounded search for the failing row."""

import asyncio
import math
import os
import signal
import time

import pytest
import torch

from grpo.errors import UserError
from grpo.rewards import WeightedReward, load_rewards, score
from grpo.infra.contain import stop_workers
from tests.rewards import rewards_for_containment as rfc

MODULE = "tests.rewards.rewards_for_containment"


@pytest.fixture(autouse=True)
def _no_workers_left():
    yield
    stop_workers()


def _load(fn, **options):
    return load_rewards([(f"{MODULE}:{fn}", 1.0)], [options])[0]


def _score(fn, completions, columns=None, **options):
    return score([_load(fn, **options)], ["Q"] * len(completions), completions, columns or {})


def _message(fn, completions, columns=None, **options):
    """The UserError's message, checked to be a single line."""
    with pytest.raises(UserError) as excinfo:
        _score(fn, completions, columns, **options)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# Where a function runs: in the training process, on a thread (a timeout), or in a worker.
PLACES = [{}, {"timeout": 5.0}, {"isolate": True}]
PLACE_IDS = ["here", "thread", "worker"]


# ---- load_rewards' options ----------------------------------------------------------------


def test_options_set_the_fields_and_default_to_an_uncontained_call():
    plain, limited = load_rewards(
        [("r1_format", 1.0), (f"{MODULE}:length", 0.5)],
        [{}, {"timeout": 2.0, "on_timeout": "none", "isolate": True}],
    )
    assert (plain.timeout, plain.on_timeout, plain.isolate) == (None, "fail", False)
    assert plain.spec == "grpo.rewards.rules:r1_format"  # a built-in name stands for its spec
    assert (limited.timeout, limited.on_timeout, limited.isolate) == (2.0, "none", True)
    assert limited.spec == f"{MODULE}:length" and limited.fn is rfc.length
    assert [r.name for r in load_rewards([("r1_format", 1), ("r1_format", 1)])] == ["r1_format", "r1_format#2"]


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"timeout": 0}, "reward 'r1_format': timeout must be a number of seconds > 0, or None; got 0"),
        ({"timeout": math.inf}, "reward 'r1_format': timeout must be a number of seconds > 0, or None; got inf"),
        ({"on_timeout": "skip"}, "reward 'r1_format': on_timeout must be 'fail' or 'none', got 'skip'"),
    ],
)
def test_bad_options_are_one_line_user_errors(options, expected):
    with pytest.raises(UserError) as excinfo:
        load_rewards([("r1_format", 1.0)], [options])
    assert str(excinfo.value) == expected


def test_options_must_match_the_specs():
    with pytest.raises(ValueError, match="unknown options"):
        load_rewards([("r1_format", 1.0)], [{"timeout_s": 1}])
    with pytest.raises(ValueError, match="2 options for 1 rewards"):
        load_rewards([("r1_format", 1.0)], [{}, {}])


def test_isolate_needs_a_spec():
    with pytest.raises(UserError, match="isolate needs the function's spec"):
        WeightedReward("f", rfc.length, 1.0, isolate=True)


# ---- the same scores, wherever the function runs ----------------------------------------


@pytest.mark.parametrize("options", PLACES, ids=PLACE_IDS)
@pytest.mark.parametrize("fn", ["with_columns", "async_length"])
def test_every_place_gives_the_in_process_scores(fn, options):
    completions, columns = ["a", "bb", "ccc"], {"target": ["a", "x", "ccc"], "level": [1, 2, 3]}
    expected = _score(fn, completions, columns)
    result = _score(fn, completions, columns, **options)
    torch.testing.assert_close(result.total, expected.total)
    by_hand = [1 + 1 + 1, 1 + 0 + 2, 1 + 1 + 3] if fn == "with_columns" else [1, 2, 3]
    torch.testing.assert_close(expected.total, torch.tensor(by_hand, dtype=torch.float32))


def test_an_async_function_runs_under_a_running_event_loop():
    async def in_a_notebook():
        return _score("async_length", ["a", "bb"])

    torch.testing.assert_close(asyncio.run(in_a_notebook()).total, torch.tensor([1.0, 2.0]))


def test_a_worker_serves_many_calls_and_passes_a_user_error_through():
    reward = load_rewards([("exact_answer", 1.0)], [{"isolate": True}])[0]
    for answer in ["1", "2"]:
        result = score([reward], ["Q"], ["<answer>1</answer>"], {"answer": [answer]})
        assert result.total.item() == float(answer == "1")
    with pytest.raises(UserError) as excinfo:
        score([reward], ["Q"], ["<answer>1</answer>"], {"solution": ["1"]})
    assert str(excinfo.value) == "reward 'exact_answer' needs an 'answer' column in the data"


# ---- timeouts --------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["sleeps", "async_sleeps"])
def test_a_call_past_its_timeout_fails_the_step(fn):
    started = time.monotonic()
    message = _message(fn, ["a", "b"], {"seconds": [10, 10]}, timeout=0.3)
    assert time.monotonic() - started < 3
    assert message == (
        f"reward '{MODULE}:{fn}' took longer than 0.3 s (rewards[].timeout) on a batch of 2 completions "
        "(the call was abandoned and may still be running); raise the timeout, or set "
        "rewards[].on_timeout: none to score such a batch None"
    )


def test_an_async_call_past_its_timeout_is_cancelled_not_abandoned():
    _message("async_sleeps", ["a"], {"seconds": [10], "tag": ["this test"]}, timeout=0.2)
    deadline = time.monotonic() + 2
    while "this test" not in rfc.CANCELLED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rfc.CANCELLED.count("this test") == 1


def test_on_timeout_none_scores_the_batch_none_and_warns(capsys):
    slow, fast = load_rewards(
        [(f"{MODULE}:sleeps", 1.0), (f"{MODULE}:length", 2.0)], [{"timeout": 0.3, "on_timeout": "none"}, {}]
    )
    result = score([slow, fast], ["Q", "Q"], ["a", "bb"], {"seconds": [10, 10]})
    assert torch.isnan(result.per_function[slow.name]).all()
    torch.testing.assert_close(result.total, torch.tensor([2.0, 4.0]))  # the other function's alone
    err = capsys.readouterr().err.strip()
    assert err == (
        f"grpo: warning: reward '{MODULE}:sleeps' took longer than 0.3 s (rewards[].timeout): it scores "
        "None on this batch of 2 completions (the call was abandoned and may still be running)"
    )


def test_an_isolated_call_past_its_timeout_kills_its_worker_quickly(tmp_path):
    pid_file = str(tmp_path / "pid")
    options = {"timeout": 0.5, "isolate": True}
    reward = _load("sleeps", **options)
    score([reward], ["Q"], ["a"], {"seconds": [0], "pid_file": [pid_file]})  # the worker is up
    first = int(open(pid_file).read())
    started = time.monotonic()
    with pytest.raises(UserError, match=r"took longer than 0.5 s .* \(its worker process was killed\)"):
        score([reward], ["Q"], ["a"], {"seconds": [60], "pid_file": [pid_file]})
    assert time.monotonic() - started < 2.5
    assert _gone(first)
    # The next call gets a fresh worker.
    assert score([reward], ["Q"], ["a"], {"seconds": [0], "pid_file": [pid_file]}).total.item() == 1.0
    assert int(open(pid_file).read()) != first


# ---- BaseExceptions --------------------------------------------------------------------


@pytest.mark.parametrize("options", PLACES, ids=PLACE_IDS)
@pytest.mark.parametrize(
    "fn, code, said",
    [
        ("exits", 0, "called sys.exit(0)"),
        ("exits", 3, "called sys.exit(3)"),
        ("exits", None, "called sys.exit()"),
        ("exits", "bye", "called sys.exit('bye')"),
        ("interrupts", None, "raised KeyboardInterrupt"),
        ("generator_exit", None, "raised GeneratorExit"),
        ("stops", None, "raised Stop: unwound"),
    ],
)
def test_base_exceptions_from_the_function_are_one_line(fn, code, said, options):
    message = _message(fn, ["a", "b"], {"code": [code, code]}, **options)
    assert message == f"reward '{MODULE}:{fn}' {said} on row 0 (completion 'a')"


def test_a_dead_worker_is_named_and_replaced():
    expected = f"reward '{MODULE}:dies' ended its worker process (exit code 7) on row 0 (completion 'a')"
    assert _message("dies", ["a"], isolate=True) == expected
    assert _message("dies", ["a"], isolate=True) == expected  # again: a fresh worker, not a dead one


@pytest.mark.slow
def test_os_exit_in_the_training_process_is_one_line_not_the_end_of_it():
    """Not isolated, os._exit is the call's failure (it used to end the run: no line, no
    checkpoint); in a process of its own, which a failing guard would end instead of pytest."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from tests.rewards.test_containment import _message\n"
        "for options in ({}, {'timeout': 5.0}):\n"
        "    print(_message('dies', ['a'], **options))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = f"reward '{MODULE}:dies' called os._exit(7) on row 0 (completion 'a')"
    assert done.stdout.splitlines()[-2:] == [expected, expected]


def test_a_value_that_cannot_leave_the_worker_is_named():
    message = _message("unpicklable", ["a"], isolate=True)
    assert message.startswith(f"reward '{MODULE}:unpicklable' returned a value its worker process cannot send back (")


def test_a_batch_that_cannot_reach_the_worker_is_named():
    message = _message("length", ["a"], {"fn": [lambda: 1]}, isolate=True)
    assert message.startswith(
        f"reward '{MODULE}:length' got a batch that cannot be sent to its worker process (AttributeError: Can't pickle local object "
    )
    assert message.endswith("on row 0 (completion 'a')")


def test_a_worker_killed_between_calls_is_replaced(tmp_path):
    pid_file = str(tmp_path / "pid")
    reward = _load("sleeps", isolate=True)
    score([reward], ["Q"], ["a"], {"seconds": [0], "pid_file": [pid_file]})
    os.kill(int(open(pid_file).read()), signal.SIGKILL)  # as the OOM killer would
    time.sleep(0.1)
    assert score([reward], ["Q"], ["a"], {"seconds": [0]}).total.item() == 1.0


def test_a_real_ctrl_c_is_not_the_function_s():
    # Python's default handler: KeyboardInterrupt, which must stop the run as a Ctrl-C does.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _score("ctrl_c", ["a"])
        # The training loop's handler notes the signal and returns: the call goes on.
        received = []
        signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
        assert _score("ctrl_c", ["a"]).total.item() == 1.0
        assert received == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGINT) is previous  # the chained handler is gone


# ---- copies ----------------------------------------------------------------------------


def test_a_function_that_mutates_its_arguments_breaks_nothing():
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]]
    completions = ["a", "bb"]
    shared = {"tags": ["x"]}  # one data row's value, shared by its completions
    columns = {"answer": ["1", "2"], "meta": [shared, shared]}
    seen = {}

    def after(prompts, completions, answer, meta, **_):
        seen.update(prompts=prompts, completions=completions, answer=answer, meta=meta)
        return [float(len(c[0]["content"])) for c in completions]  # conversational: TRL's message lists

    rewards = [_load("mutates"), WeightedReward("after", after, 1.0)]
    result = score(rewards, prompts, completions, columns)
    torch.testing.assert_close(result.total, torch.tensor([2.0, 3.0]))
    assert prompts == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]]
    assert completions == ["a", "bb"] and columns["answer"] == ["1", "2"]
    assert shared == {"tags": ["x"]}
    messages = [[{"role": "assistant", "content": c}] for c in completions]
    assert seen == {"prompts": prompts, "completions": messages, "answer": ["1", "2"], "meta": [shared, shared]}


# ---- scores beyond float32 -------------------------------------------------------------


@pytest.mark.parametrize(
    "value, shown",
    [(1e39, "1e+39"), (-1e39, "-1e+39"), (10**39, "1e+39"), (10**400, "about 1e+400"), (-(10**400), "about -1e+400")],
)
def test_a_score_beyond_float32_is_named_with_its_row(value, shown):
    message = _message("echo", ["a"] * 4, {"value": [0.0, 1.0, 2.0, value]})
    assert message == f"reward '{MODULE}:echo' returned {shown} for row 3, outside float32's range"


def test_float32s_own_extremes_are_scores():
    big = torch.finfo(torch.float32).max
    result = _score("echo", ["a", "b"], {"value": [big, -big]})
    assert result.per_function[f"{MODULE}:echo"].tolist() == [big, -big]


# ---- the failing row, found in a bounded number of calls ----------------------------------


@pytest.mark.parametrize("bad", [0, 20, 31])
def test_the_failing_row_is_found_in_log_n_calls(bad):
    completions = ["ok"] * 32
    completions[bad] = "bad"
    rfc.CALLS["n"] = 0
    message = _message("fails_on_bad", completions)
    assert (
        message == f"reward '{MODULE}:fails_on_bad' raised ValueError: a bad completion on row {bad} (completion 'bad')"
    )
    assert rfc.CALLS["n"] <= 1 + math.ceil(math.log2(32)) + 1  # the batch, the halvings, the last row


def test_the_first_failing_row_is_named():
    completions = ["ok", "ok", "bad", "ok", "bad", "bad", "ok"]
    message = _message("fails_on_bad", completions)
    assert message.endswith("on row 2 (completion 'bad')")


def test_a_failure_no_row_has_alone_is_reported_for_the_batch_in_log_n_calls():
    calls = []

    def batch_only(prompts, completions, **_):
        calls.append(len(completions))
        if len(completions) > 3:
            raise RuntimeError("batch too large")
        return [1.0] * len(completions)

    with pytest.raises(UserError) as excinfo:
        score([WeightedReward("t:fn", batch_only, 1.0)], ["Q"] * 32, ["a"] * 32, {})
    assert len(calls) <= 1 + math.ceil(math.log2(32)) + 1
    assert str(excinfo.value) == (
        f"reward 't:fn' raised RuntimeError: batch too large on the batch of 32 completions "
        f"(no row failed alone in {len(calls) - 1} re-runs of parts of it)"
    )


def test_a_timed_out_call_is_not_rerun(tmp_path):
    calls = []

    def slow(prompts, completions, **_):
        calls.append(len(completions))
        time.sleep(10)

    with pytest.raises(UserError, match="took longer than 0.2 s"):
        score([WeightedReward("t:fn", slow, 1.0, timeout=0.2)], ["Q"] * 8, ["a"] * 8, {})
    assert calls == [8]


# ---- async functions run together -----------------------------------------------------------


def _both(*fns, options=None):
    rewards = load_rewards([(f"{MODULE}:{fn}", 1.0) for fn in fns], [options or {} for _ in fns])
    return score(rewards, ["Q", "Q"], ["x", "yy"], {})


def test_a_steps_async_functions_run_concurrently_on_one_loop():
    rfc.ORDER.clear()
    result = _both("interleaves_a", "interleaves_b")
    # One after the other would be a starts, a ends, b starts, b ends.
    assert rfc.ORDER == ["a starts", "b starts", "a ends", "b ends"]
    torch.testing.assert_close(result.total, torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(result.per_function[f"{MODULE}:interleaves_b"], torch.tensor([2.0, 2.0]))


def test_concurrent_async_functions_run_under_a_running_event_loop():
    async def in_a_notebook():
        return _both("interleaves_a", "interleaves_b")

    torch.testing.assert_close(asyncio.run(in_a_notebook()).total, torch.tensor([3.0, 3.0]))


def test_one_concurrent_function_failing_is_its_own_one_line_error():
    with pytest.raises(UserError) as excinfo:
        _both("interleaves_a", "async_exits")
    message = str(excinfo.value)
    assert "async_exits" in message and "sys.exit(3)" in message and "\n" not in message


def test_each_concurrent_function_keeps_its_own_timeout():
    rfc.CANCELLED.clear()
    rewards = load_rewards(
        [(f"{MODULE}:async_sleeps", 1.0), (f"{MODULE}:async_length", 1.0)],
        [{"timeout": 0.2, "on_timeout": "none"}, {"timeout": 5.0}],
    )
    result = score(rewards, ["Q"], ["abc"], {"seconds": [10], "tag": ["together"]})
    assert rfc.CANCELLED == ["together"]  # cancelled at its limit, not abandoned
    assert math.isnan(result.per_function[f"{MODULE}:async_sleeps"][0])
    torch.testing.assert_close(result.total, torch.tensor([3.0]))  # the other one's score
