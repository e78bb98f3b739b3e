"""The reward-hacking alarm (grpo.eval.alarm) on synthetic sequences of evaluations."""

import io
import random

import torch

from grpo.eval.alarm import METRIC, Alarm
from grpo.eval.metrics import mean_ci


def feed(alarm, points, every=10):
    """Evaluations at steps 0, every, 2*every, ...: (reward, metric, half-width) each, the
    interval clipped to [0, 1] as the runner's is. Returns what each update returned."""
    lines = []
    for i, (reward, metric, half) in enumerate(points):
        lines.append(alarm.update(i * every, reward, metric, (max(0.0, metric - half), min(1.0, metric + half))))
    return lines


def test_rising_reward_and_falling_metric_fires_once():
    alarm = Alarm(3)
    lines = feed(alarm, [(None, 0.42, 0.08), (0.31, 0.30, 0.08), (0.78, 0.10, 0.06)])
    assert lines[:2] == [None, None] and lines[2] is not None
    assert lines[2].startswith("grpo: warning: step 20: possible reward hacking")
    for said in ("0.31 -> 0.78", "last 3 evaluations", "steps 0-20", "eval/pass@1 fell 0.42 -> 0.1"):
        assert said in lines[2], (said, lines[2])
    assert "\n" not in lines[2]
    assert alarm.metrics() == {METRIC: 1.0}
    # Still diverging at the next evaluation: no second warning, the metric stays up.
    assert alarm.update(30, 0.9, 0.05, (0.0, 0.09)) is None
    assert alarm.metrics() == {METRIC: 1.0}


def test_it_rearms_once_the_condition_clears():
    alarm = Alarm(2)
    lines = feed(alarm, [(0.2, 0.5, 0.05), (0.4, 0.2, 0.05), (0.5, 0.6, 0.05), (0.6, 0.6, 0.05), (0.8, 0.2, 0.05)])
    assert [line is not None for line in lines] == [False, True, False, False, True]
    assert alarm.metrics() == {METRIC: 1.0}
    feed(alarm, [(0.9, 0.25, 0.05)])
    assert alarm.metrics() == {METRIC: 0.0}  # the metric stopped falling beyond its interval


def test_rising_reward_and_rising_metric_is_quiet():
    alarm = Alarm(3)
    assert feed(alarm, [(None, 0.1, 0.05), (0.3, 0.3, 0.08), (0.7, 0.6, 0.08), (0.9, 0.8, 0.06)]) == [None] * 4
    assert alarm.metrics() == {METRIC: 0.0}


def test_a_fall_within_the_interval_is_quiet():
    """The metric falls, but its latest interval still holds the window's first value."""
    alarm = Alarm(3)
    assert feed(alarm, [(None, 0.42, 0.15), (0.3, 0.36, 0.15), (0.8, 0.30, 0.15)]) == [None] * 3
    # The same fall with narrower intervals is beyond them.
    assert feed(Alarm(3), [(None, 0.42, 0.05), (0.3, 0.36, 0.05), (0.8, 0.30, 0.05)])[-1] is not None


def test_a_falling_metric_without_a_rising_reward_is_quiet():
    """Both fall (the run is getting worse, nothing hacked), or the reward spikes and drops back."""
    assert feed(Alarm(3), [(0.8, 0.5, 0.05), (0.6, 0.3, 0.05), (0.3, 0.1, 0.05)]) == [None] * 3
    assert feed(Alarm(3), [(0.5, 0.5, 0.05), (0.9, 0.3, 0.05), (0.45, 0.1, 0.05)]) == [None] * 3
    # A plateau, then back below where it started: the slope is > 0, but the reward ends lower.
    rewards = [0.5, 0.5, 1.0, 1.0, 0.49]
    assert feed(Alarm(5), [(r, 0.5 - 0.1 * i, 0.02) for i, r in enumerate(rewards)]) == [None] * 5


def test_only_the_last_window_counts():
    """A drop that happened before the window, then a plateau: the window holds no fall."""
    alarm = Alarm(3)
    points = [(None, 0.6, 0.05), (0.2, 0.2, 0.05)] + [(0.2 + 0.1 * i, 0.2, 0.05) for i in range(1, 5)]
    lines = feed(alarm, points)
    assert lines[2] is not None  # steps 0-20 hold the drop
    assert lines[3:] == [None] * 3 and alarm.metrics() == {METRIC: 0.0}
    assert feed(Alarm(3), points[:2]) == [None, None]  # fewer evaluations than the window: nothing to say


def test_noisy_flat_runs_are_quiet():
    """Reward and metric flat with noise within the metric's interval: never fires, whatever
    the draw, over many windows."""
    rng = random.Random(0)
    for window in (2, 3, 5):
        alarm = Alarm(window)
        for i in range(200):
            reward = 0.5 + rng.uniform(-0.2, 0.2)
            metric, half = 0.4 + rng.uniform(-0.04, 0.04), 0.08
            assert alarm.update(10 * i, reward, metric, (metric - half, metric + half)) is None, (window, i)


def test_the_reward_is_the_mean_recorded_since_the_last_evaluation():
    alarm = Alarm(2)
    assert alarm.recent() is None
    for reward in (0.2, None, 0.4, float("nan")):
        alarm.record(reward)
    assert alarm.recent() == (0.2 + 0.4) / 2
    alarm.update(10, alarm.recent(), 0.5, (0.4, 0.6))
    assert alarm.recent() is None  # the next evaluation averages only the steps after this one


def test_a_resumed_alarm_continues_as_one_never_stopped():
    """state_dict after any evaluation or step, through torch.save/load(weights_only=True) as a
    checkpoint holds it: the restored alarm says and reports what the uninterrupted one does."""
    steps = [0.1 * i for i in range(12)]  # rewards per step, evaluations every 3 steps
    metrics = [0.5, 0.45, 0.3, 0.15, 0.1]

    def run(alarm, start, stop):
        said = []
        for step in range(start, stop):
            if step % 3 == 0:
                m = metrics[step // 3]
                said.append(alarm.update(step, alarm.recent(), m, (m - 0.04, m + 0.04)))
                said.append(alarm.metrics())
            alarm.record(steps[step] if step < len(steps) else None)
        return said

    whole = run(Alarm(3), 0, 13)
    assert any(isinstance(s, str) for s in whole)
    for cut in range(1, 13):
        first = Alarm(3)
        said = run(first, 0, cut)
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)
        buffer.seek(0)
        resumed = Alarm(3)
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        assert said + run(resumed, cut, 13) == whole, cut


def binomial_evaluations(rng, rates, n, count):
    """`count` evaluations of a model that does not change: each draws n samples of every
    problem afresh (independent draws, noisier than the loop's reseeded ones) and reports
    pass@1 with the runner's interval (grpo.eval.metrics.mean_ci)."""
    for _ in range(count):
        mean, (lo, hi) = mean_ci([sum(rng.random() < p for _ in range(n)) / n for p in rates])
        yield mean, (lo, hi)


def test_sampling_noise_alone_rarely_fires():
    """A model that does not change, its reward noisy and its evaluations redrawn: the alarm
    holds at few evaluations (a one-sided 2.5% test, where the reward happens to rise)."""
    rng = random.Random(0)
    rates = [rng.uniform(0.1, 0.7) for _ in range(16)]
    for window in (2, 3, 5):
        alarm, held = Alarm(window), 0
        for i, (metric, interval) in enumerate(binomial_evaluations(rng, rates, 8, 400)):
            alarm.update(10 * i, 0.5 + rng.gauss(0, 0.1), metric, interval)
            held += alarm.firing
        assert held <= 0.02 * 400, (window, held)
