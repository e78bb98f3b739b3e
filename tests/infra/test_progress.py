"""grpo.infra.progress: a bar on a terminal, plain lines elsewhere, nothing when disabled."""

import io
import re

import pytest

from grpo.infra.progress import Progress, format_elapsed


class Terminal(io.StringIO):
    def isatty(self):
        return True


def lines_of(stream):
    return stream.getvalue().splitlines()


def test_a_line_every_n_units_and_the_first_and_last_always():
    out = io.StringIO()
    with Progress(7, desc="x", every=3, stream=out) as progress:
        for step in range(7):
            progress.update(1, loss=0.5 + step)
    lines = lines_of(out)
    assert [line.split("  ")[0] for line in lines] == [
        "grpo: step 1/7",
        "grpo: step 3/7",
        "grpo: step 6/7",
        "grpo: step 7/7",
    ]
    assert [line.split("  ")[1] for line in lines] == ["loss 0.5000", "loss 2.5000", "loss 5.5000", "loss 6.5000"]
    assert all(re.fullmatch(r"grpo: step \d/7  loss [\d.]+  elapsed 0:00  \d+\.\d\d s/step", line) for line in lines)


def test_many_units_per_update_log_when_a_multiple_is_passed():
    """Counted in completions, 4 per update; every=6: lines where the count passes 6, 12, ..."""
    out = io.StringIO()
    progress = Progress(20, desc="eval", prefix="grpo eval", unit="completions", every=6, per_second=True, stream=out)
    for _ in range(5):
        progress.update(4, prompts="x")
    assert [line.split("  ")[0] for line in lines_of(out)] == [
        "grpo eval: completions 4/20",
        "grpo eval: completions 8/20",
        "grpo eval: completions 12/20",
        "grpo eval: completions 20/20",
    ]  # 4 (first), 8 (passed 6), 12 (passed 12), 20 (passed 18, last)
    assert all(line.endswith(" completions/s") for line in lines_of(out))


def test_a_resumed_count_logs_at_the_same_multiples():
    out = io.StringIO()
    progress = Progress(10, desc="grpo", every=4, initial=5, stream=out)
    for _ in range(5):
        progress.update(1)
    assert [line.split("  ")[0] for line in lines_of(out)] == ["grpo: step 6/10", "grpo: step 8/10", "grpo: step 10/10"]


def test_fields_are_formatted_and_missing_numbers_are_dashes():
    out = io.StringIO()
    Progress(1, desc="x", stream=out).update(1, reward=float("nan"), kl=None, length="8.0", epoch=2, lr=0.25)
    assert lines_of(out)[0].split("  ")[1:6] == ["reward -", "kl -", "length 8.0", "epoch 2", "lr 0.2500"]


def test_a_terminal_gets_the_bar_and_disabled_gets_nothing():
    terminal = Terminal()
    with Progress(3, desc="sft", stream=terminal) as progress:
        for _ in range(3):
            progress.update(1, loss=0.25)
    text = terminal.getvalue()
    assert "sft" in text and "3/3" in text and "loss=0.2500" in text and "\r" in text
    assert "grpo: step" not in text
    for stream in (io.StringIO(), Terminal()):
        with Progress(3, desc="sft", stream=stream, enabled=False) as progress:
            progress.update(3, loss=0.25)
        assert stream.getvalue() == ""


def test_the_rate_is_that_of_the_units_since_the_previous_line(monkeypatch):
    clock = iter([0.0, 2.0, 10.0, 11.0])  # made; step 1 at 2 s; steps 2-5 at 10 s, 11 s
    monkeypatch.setattr("grpo.infra.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    progress = Progress(5, desc="x", every=4, stream=out)
    progress.update(1)
    progress.update(3)  # 4 passes the multiple 4: a line
    progress.update(1)
    assert [line.split("  ")[1:] for line in lines_of(out)] == [
        ["elapsed 0:02", "2.00 s/step"],
        ["elapsed 0:10", "2.67 s/step"],
        ["elapsed 0:11", "1.00 s/step"],
    ]


@pytest.mark.parametrize(
    "seconds, text", [(0, "0:00"), (59.9, "0:59"), (61, "1:01"), (3600, "1:00:00"), (3 * 3600 + 62, "3:01:02")]
)
def test_elapsed_time(seconds, text):
    assert format_elapsed(seconds) == text
