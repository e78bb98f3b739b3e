"""Which reasoning-gym tasks work as `data.path: reasoning_gym:NAME?size=64&seed=1`.

For every task name reasoning-gym registers, this generates the rows through
`grpo.data.load_rows` (as `grpo train`, `grpo eval --data` and `grpo sft --data` do) and
scores them with the built-in reward `reasoning_gym`:
- each row's own answer must score 1.0 (bare, and inside <answer>...</answer>);
- a wrong answer ("wrong") must score < 1.0;
- rows saved as JSON and read back (no `reasoning_gym_entry` column, JSON-safe metadata)
  must still score their answer 1.0, the fallback the reward takes for such rows.
It prints one line per task and a summary of the ones that fail, and why. Not part of the
test suite (it takes minutes): run it by hand after upgrading reasoning-gym.

    .venv/bin/python benchmarks/gym_tasks.py                 # every task
    .venv/bin/python benchmarks/gym_tasks.py chain_sum maze  # some
    .venv/bin/python benchmarks/gym_tasks.py --timeout 120   # seconds per task (default 60)
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.data import load_rows  # noqa: E402
from grpo.infra.imports import describe  # noqa: E402
from grpo.tasks.reasoning_gym import ENTRY_COLUMN, reward, task_names  # noqa: E402


class _Late(Exception):
    pass


def _alarm(signum, frame):
    raise _Late()


def _scores(rows: list[dict], completions: list[str]) -> list[float | None]:
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
    return reward(prompts=[row["prompt"] for row in rows], completions=completions, **columns)


# Tasks that need options to load at all: composite mixes other tasks, named here.
OPTIONS = {
    "composite": {
        "datasets": [
            {"name": "chain_sum", "weight": 1, "config": {}},
            {"name": "spell_backward", "weight": 1, "config": {}},
        ]
    }
}


def check(name: str, size: int, seed: int) -> str | None:
    """None when the task passes every check, else what went wrong (one line); a task whose
    rows carry no reference answer is checked on a wrong answer only and says so."""
    rows = load_rows(f"reasoning_gym:{name}?size={size}&seed={seed}", task_options=OPTIONS.get(name))
    missing = sum(row["answer"] is None for row in rows)
    if missing:
        wrong = _scores(rows, ["wrong"] * size)
        if any(s == 1.0 for s in wrong):
            return f"no reference answer, and a wrong answer scores 1.0 on {sum(s == 1.0 for s in wrong)} rows"
        return (
            f"loads, a wrong answer scores < 1; but {missing} of {size} rows have no reference answer "
            "(answer None: the scorer checks a solution), so no completion for grpo sft"
        )
    answers = [row["answer"] for row in rows]
    for label, completions in (("bare", answers), ("tagged", [f"<answer>{a}</answer>" for a in answers])):
        scores = _scores(rows, completions)
        bad = [i for i, s in enumerate(scores) if s != 1.0]
        if bad:
            return f"own answer ({label}) scores {scores[bad[0]]} on {len(bad)} of {size} rows, e.g. row {bad[0]}: {answers[bad[0]][:60]!r}"
    wrong = _scores(rows, ["wrong"] * size)
    if any(s == 1.0 for s in wrong):
        return f"a wrong answer ('wrong') scores 1.0 on {sum(s == 1.0 for s in wrong)} of {size} rows"
    saved = [json.loads(json.dumps({k: v for k, v in row.items() if k != ENTRY_COLUMN})) for row in rows]
    scores = _scores(saved, answers)
    bad = [i for i, s in enumerate(scores) if s != 1.0]
    if bad:
        return f"rows saved as JSON (no entry column): own answer scores {scores[bad[0]]} on {len(bad)} of {size} rows"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="task names (default: all)")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=60, help="seconds per task")
    args = parser.parse_args()
    names = args.names or task_names()
    signal.signal(signal.SIGALRM, _alarm)
    failures = {}
    for name in names:
        signal.alarm(args.timeout)
        try:
            problem = check(name, args.size, args.seed)
        except _Late:
            problem = f"took longer than {args.timeout} s"
        except Exception as exc:  # noqa: BLE001 (a survey reports every failure and goes on)
            problem = describe(exc)
        finally:
            signal.alarm(0)
        print(f"{name:28s} {'ok' if problem is None else 'FAIL: ' + problem}", flush=True)
        if problem is not None:
            failures[name] = problem
    print(f"\n{len(names) - len(failures)} of {len(names)} tasks pass; failing:")
    for name, problem in failures.items():
        print(f"- {name}: {problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
