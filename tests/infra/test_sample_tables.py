"""The samples on the dashboards: every train.sample_every steps the rows of samples.jsonl
(the prompt, the completion, the reward and each reward function's score, the advantage,
whether it was cut, log_extra's columns) go to each dashboard of train.report_to as a
table, read back here from what each wrote, offline: wandb's offline run folder, trackio's
local store, TensorBoard's event file."""

import json
import math
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import grpo
from grpo.algo import group_advantages
from grpo.errors import UserError
from grpo.infra.logging import JsonlSink, Sinks, WandbSink, markdown_table
from grpo.rewards.logged import RewardLog
from tests.infra.test_report_to import FakeWandb, no_network, wandb_run  # noqa: F401 (a fixture)

# TensorBoard renders markdown with a vendored sanitizer that warns of its own deprecation.
pytestmark = pytest.mark.filterwarnings("ignore:html5lib's sanitizer is deprecated:DeprecationWarning")

LOGGED = "tests.rewards.trl_style_rewards:sevens_logged"  # its log_extra columns: sevens, chars
SEVENS = "tests.train.rewards_for_tests:sevens"


def samples(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "samples.jsonl").read_text().splitlines()]


def cell(value):
    """A samples.jsonl value as a dashboard's cell holds it."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)


class _Cells(HTMLParser):
    """The cells of an HTML table, row by row (a <br> as a line break)."""

    def __init__(self):
        super().__init__()
        self.rows, self.text = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.text = ""
        elif tag == "br" and self.text is not None:
            self.text += "\n"

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append(self.text)
            self.text = None

    def handle_data(self, data):
        if self.text is not None:
            self.text += data


def shown_by_tensorboard(markdown: str) -> list[list[str]]:
    """What TensorBoard's Text tab shows of a markdown table: the text of its cells, the
    header first (rendered by TensorBoard's own markdown)."""
    from tensorboard.plugin_util import markdown_to_safe_html

    parser = _Cells()
    parser.feed(markdown_to_safe_html(markdown))
    return parser.rows


@pytest.mark.usefixtures("no_network")  # wandb offline, trackio local, under tmp_path
def test_each_dashboard_gets_the_samples_as_a_table_at_their_steps(make_config):
    config = make_config(
        rewards=[{"function": LOGGED}, {"function": SEVENS, "weight": 0.5}],
        train={"steps": 3, "sample_every": 2, "report_to": ["wandb", "trackio", "tensorboard"], "project": "tests"},
    )
    result = grpo.train(config, progress=False)
    rows = samples(result.output_dir)
    assert {row["step"] for row in rows} == {2} and len(rows) == 8  # the first prompt's G completions
    columns = list(rows[0])
    expected = ["step", "prompt", "completion", "reward", f"reward/{LOGGED}", f"reward/{SEVENS}", "advantage"]
    assert columns == [*expected, "truncated", "sevens", "chars"]
    assert set(columns) >= {f"reward/{LOGGED}", f"reward/{SEVENS}"} <= set(result.metrics[0])  # as metrics name them
    cells = [[cell(row[c]) for c in columns] for row in rows]

    # wandb: a table file in the offline run's media, named in the history at step 2 alone
    run_id = (result.output_dir / "wandb_run_id").read_text().strip()
    _, history = wandb_run(result.output_dir, run_id)
    assert [step for step, items in sorted(history.items()) if "samples.path" in items] == [2]
    assert history[2]["samples._type"] == "table-file"
    folder = next(result.output_dir.glob(f"wandb/offline-run-*-{run_id}"))
    table = json.loads((folder / "files" / history[2]["samples.path"]).read_text())
    assert table["columns"] == columns
    assert table["data"] == cells

    # trackio: a table at step 2 in the project's SQLite store
    from trackio.sqlite_storage import SQLiteStorage

    tables = [(log["step"], log["samples"]) for log in SQLiteStorage.get_logs("tests", "run") if "samples" in log]
    assert [step for step, _ in tables] == [2]
    assert tables[0][1]["_type"] == "trackio.table"
    assert tables[0][1]["_value"] == [dict(zip(columns, row)) for row in cells]

    # TensorBoard: a markdown table in the Text tab at step 2, showing each cell as written
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(result.output_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [2]
    shown = shown_by_tensorboard(texts[0].tensor_proto.string_val[0].decode())
    assert shown[0] == columns
    assert [[s.strip() for s in row] for row in shown[1:]] == [
        ["" if c is None else str(c).strip() for c in row] for row in cells
    ]


def test_the_rows_hold_each_functions_score_the_advantage_and_the_cut(make_config):
    """samples.jsonl (the dashboards' rows): the total is the weighted sum of the functions'
    scores, the advantage is GRPO's of the group's rewards, and a completion made to run to
    max_new_tokens is cut."""
    config = make_config(
        rewards=[{"function": LOGGED}, {"function": SEVENS, "weight": 0.5}],
        train={"steps": 2, "sample_every": 1},
    )
    result = grpo.train(config, progress=False)
    rows = samples(result.output_dir)
    assert [row["step"] for row in rows] == [1] * 8 + [2] * 8
    for step in (1, 2):
        group = [row for row in rows if row["step"] == step]
        rewards = torch.tensor([row["reward"] for row in group])
        expected = group_advantages(rewards, len(group), scale="group", eps=1e-4)
        assert [row["advantage"] for row in group] == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-6)
        for row in group:
            assert row[f"reward/{LOGGED}"] == row["sevens"] == row["completion"].count("7")
            assert row["reward"] == pytest.approx(row[f"reward/{LOGGED}"] + 0.5 * row[f"reward/{SEVENS}"])
            assert row["truncated"] is True  # min_new_tokens = max_new_tokens: no EOS before the budget ends


def sevens_past_one_letter(prompts, completions, **columns):
    """The '7's of a completion, for a prompt of more than one letter; 0 for the others."""
    return [float(c.count("7")) if len(p) > 1 else 0.0 for p, c in zip(prompts, completions)]


def test_a_row_left_out_of_the_update_has_no_advantage(make_config):
    """loss.drop_zero_std_groups: step 1's first prompts (one letter each, every reward 0)
    are left out, their rows' advantage None; the rows kept have their own group's."""
    config = make_config(
        data={"shuffle": False},  # a, b, c, ab, ba, cab, abc, cc
        rewards=[{"function": "tests.infra.test_sample_tables:sevens_past_one_letter"}],
        loss={"drop_zero_std_groups": True},
        train={"steps": 2, "sample_every": 1},
    )
    rows = samples(grpo.train(config, progress=False).output_dir)
    first, second = rows[:8], rows[8:]
    assert {row["prompt"] for row in first} == {"a"} and len(second[0]["prompt"]) > 1
    assert [row["advantage"] for row in first] == [None] * 8
    rewards = torch.tensor([row["reward"] for row in second])
    assert len(set(rewards.tolist())) > 1  # a group with a spread: kept
    expected = group_advantages(rewards, 8, scale="group", eps=1e-4)
    assert [row["advantage"] for row in second] == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-6)


def test_a_ppo_rows_advantage_is_its_mean_over_its_tokens(make_config):
    result = grpo.train(make_config("ppo", train={"steps": 1, "sample_every": 1}), progress=False)
    rows = samples(result.output_dir)
    assert len(rows) == 1 and math.isfinite(rows[0]["advantage"])  # (N, T) advantages, one number a row


def test_metrics_jsonl_takes_no_table_and_a_dashboard_that_fails_a_table_is_one_warning(tmp_path, monkeypatch, capsys):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    wandb_sink = WandbSink(tmp_path, project="", run_name="r", config={}, resume=False)

    def table_fails(**kwargs):
        raise RuntimeError("table refused\nmore detail")

    fake.Table = table_fails
    sinks = Sinks([JsonlSink(tmp_path / "metrics.jsonl"), wandb_sink])
    sinks.log(1, {"step": 1, "reward/mean": 0.5})
    sinks.log_table(1, "samples", [{"step": 1, "completion": "x"}])
    sinks.log(2, {"step": 2, "reward/mean": 0.25})
    sinks.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert fake.logged == [(1, {"reward/mean": 0.5})]  # nothing more once it failed
    assert capsys.readouterr().err.splitlines() == [
        "grpo: warning: wandb stopped logging at step 1 (table refused); the run goes on and "
        "metrics.jsonl has every step"
    ]


def test_tensorboard_shows_a_cells_text_as_written():
    text = "a | b <think> & *not bold* snake_case `code` [x](y) \\ # !\nsecond line"
    rows = [{"completion": text, "prompt": [{"role": "user", "content": "hi"}], "reward": None, "cut": True}]
    shown = shown_by_tensorboard(markdown_table(rows))
    assert shown == [
        ["completion", "prompt", "reward", "cut"],
        [text, '[{"role": "user", "content": "hi"}]', "", "True"],
    ]


@pytest.mark.parametrize("column", ["advantage", "truncated", f"reward/{SEVENS}"])
def test_a_reward_may_not_log_a_column_the_rows_have(column):
    log_extra = RewardLog(2).arguments("mine")["log_extra"]
    with pytest.raises(
        UserError, match=rf"^reward 'mine' called log_extra\('{column}', \.\.\.\): samples.jsonl writes"
    ):
        log_extra(column, [1, 2])
