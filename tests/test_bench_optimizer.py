"""benchmarks/bench_optimizer.py on the tiny shape: its table has every optimizer, and the
state sizes it prints are what the optimizers hold (AdamW 8 bytes a parameter, 8-bit less
than a third of that)."""

from benchmarks import bench_optimizer


def test_the_table_lists_every_optimizer_with_its_state_size(capsys):
    bench_optimizer.run("tiny", steps=2)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert {"adamw", "adamw_8bit"} <= set(rows)
    assert float(rows["adamw"][1]) == 8.0 and float(rows["adamw"][4]) == 0.0
    assert float(rows["adamw_8bit"][1]) < 8.0 / 3 and 0 < float(rows["adamw_8bit"][4]) < 0.05
