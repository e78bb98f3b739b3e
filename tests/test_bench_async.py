"""benchmarks/bench_async.py's arithmetic on made-up runs (the runs themselves take minutes)."""

import pytest

from benchmarks import bench_async


def made_up(times, rewards, asynchronous):
    steps = []
    for i, (t, r) in enumerate(zip(times, rewards)):
        m = {"time/step": t, "tokens/completion": 100, "reward/mean": r, "time/generate": 0.5, "time/update": 0.4}
        if asynchronous:
            m.update({"async/staleness": min(i, 1), "async/staleness_max": 2 if i == 2 else min(i, 1)})
            m.update({"async/dropped": int(i == 2), "async/queue_wait_s": 0.1, "async/generator_wait_s": 0.2})
            m["async/push_s"] = 0.01
        steps.append(m)
    return {"steps": steps, "process_wall_s": sum(times)}


def test_summaries_skip_the_first_step_and_compare_the_rewards_per_step():
    sync = bench_async.summarize(made_up([9.0, 2.0, 2.0, 4.0], [0.1, 0.2, 0.3, 0.4], False))
    asyn = bench_async.summarize(made_up([9.0, 1.0, 1.0, 1.0], [0.1, 0.2, 0.3, 0.5], True))
    assert sync["step_s_median"] == 2.0 and sync["tokens_per_s_median"] == 50.0  # step 1 left out
    assert (sync["reward_first_quarter"], sync["reward_last_quarter"]) == (0.1, 0.4)
    assert "async" not in sync
    a = asyn["async"]
    assert a["staleness_mean"] == 0.75 and a["staleness_max"] == 2 and a["dropped"] == 1
    printed = bench_async.table({"sync": sync, "async": asyn})
    assert "async / sync step time: 0.50" in printed and "dropped 1" in printed
    assert "  async: 0.100 0.200 0.300 0.500" in printed
    assert asyn["reward_per_step"] == pytest.approx([0.1, 0.2, 0.3, 0.5])
