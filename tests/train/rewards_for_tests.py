"""Reward functions the training tests name by import path, as a user's config would."""

import os
import signal

_calls = {"n": 0}


def sevens(prompts, completions, **columns):
    """Learnable from scratch: the fraction of '7' among the first 8 characters."""
    return [c[:8].count("7") / 8 for c in completions]


def process_logged(prompts, completions, log_metric=None, **columns):
    """No reward (0 for every completion); logs the process's rank with TRL's log_metric, so
    that a run of several processes shows their mean."""
    log_metric("process", float(os.environ.get("RANK", "0")))
    return [0.0 for _ in completions]


def sevens_then_die(prompts, completions, **columns):
    """`sevens`, but the process kills itself (SIGKILL, no clean-up) at the Nth call, where
    N is $GRPO_TEST_DIE_AT: a crash in the middle of a step, after its sampling."""
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_DIE_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    return sevens(prompts, completions)


def explodes(prompts, completions, **columns):
    raise ZeroDivisionError("the reward divided by zero")


def constant(prompts, completions, **columns):
    return [0.5 for _ in completions]


def sevens_or_none(prompts, completions, **columns):
    """`sevens`, but completions that start with '0' cannot be scored."""
    return [None if c.startswith("0") else c[:8].count("7") / 8 for c in completions]


def sevens_steps(prompts, completions, **columns):
    """Process supervision: each of the first 8 characters is a step, rewarded if it is '7'."""
    return [[(i + 1, float(ch == "7")) for i, ch in enumerate(c[:8])] or None for c in completions]


def sevens_then_signal(prompts, completions, **columns):
    """`sevens`, but at the Nth call ($GRPO_TEST_SIGNAL_AT) the process sends itself
    $GRPO_TEST_SIGNAL (INT or TERM): a Ctrl-C or a scheduler's SIGTERM in the middle of a step."""
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_SIGNAL_AT", "0")):
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("GRPO_TEST_SIGNAL", "INT")))
    return sevens(prompts, completions)


def sevens_then_raise(prompts, completions, **columns):
    """`sevens`, but the Nth call ($GRPO_TEST_RAISE_AT) raises: a reward that breaks mid-run."""
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_RAISE_AT", "0")):
        raise RuntimeError("the judge is down")
    return sevens(prompts, completions)


def never_scores(prompts, completions, **columns):
    return [None for _ in completions]


def sevens_then_exit(prompts, completions, **columns):
    """`sevens`, but the Nth call ($GRPO_TEST_EXIT_AT) calls sys.exit($GRPO_TEST_EXIT_CODE)."""
    import sys

    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_EXIT_AT", "0")):
        sys.exit(int(os.environ.get("GRPO_TEST_EXIT_CODE", "0")))
    return sevens(prompts, completions)


def sevens_then_hang(prompts, completions, **columns):
    """`sevens`, but the Nth call ($GRPO_TEST_HANG_AT) sleeps for a minute: a judge that hangs."""
    import time

    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_HANG_AT", "0")):
        time.sleep(60)
    return sevens(prompts, completions)


def sevens_and_vandal(prompts, completions, **columns):
    """`sevens`, then empties the lists it was given (a function that edits its inputs)."""
    scores = sevens(prompts, completions)
    completions.clear()
    prompts.clear()
    for values in columns.values():
        if isinstance(values, list):  # a column (trainer_state is one object for the batch)
            values.clear()
    return scores


def sevens_then_huge(prompts, completions, **columns):
    """`sevens`, but from the Nth call ($GRPO_TEST_HUGE_AT) one score is $GRPO_TEST_HUGE
    (1e39 overflows float32; 10**400 overflows float)."""
    _calls["n"] += 1
    scores = sevens(prompts, completions)
    if _calls["n"] >= int(os.environ.get("GRPO_TEST_HUGE_AT", "0")) > 0:
        scores[3] = eval(os.environ["GRPO_TEST_HUGE"])  # a literal from the test: 1e39 or 10**400
    return scores


def sevens_then_die_or_raise_in_rank_1(prompts, completions, **columns):
    """`sevens_then_die` in every process, and `sevens_then_raise` in torchrun's process 1
    only (one process's judge breaks): a run killed, then failing, in one config."""
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_DIE_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("RANK") == "1" and _calls["n"] == int(os.environ.get("GRPO_TEST_RAISE_AT", "0")):
        raise RuntimeError("the judge is down")
    return sevens(prompts, completions)


def sevens_then_fill_disk(prompts, completions, **columns):
    """`sevens`, but at the Nth call ($GRPO_TEST_FULL_AT) the process's file-size limit falls
    to $GRPO_TEST_FULL_LIMIT bytes (beyond the size of $GRPO_TEST_FULL_FILE, when given), with
    SIGXFSZ ignored: every write past it fails with EFBIG, as on a full disk. Run it in a
    process of its own."""
    import resource

    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_FULL_AT", "0")):
        limit = int(os.environ["GRPO_TEST_FULL_LIMIT"])
        if os.environ.get("GRPO_TEST_FULL_FILE"):
            limit += os.path.getsize(os.environ["GRPO_TEST_FULL_FILE"])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return sevens(prompts, completions)
