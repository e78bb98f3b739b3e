"""Prompt datasets: every format, every user mistake's one-line message, the prompt stream."""

import csv
import json
import random
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.data import GIVEN_DATASET, PromptStream, given_rows, load_rows, with_system_prompt
from grpo.errors import UserError
from tests.dataset_folders import gsm8k_rows, offline_datasets, write_gsm8k_folder

ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "level": 1},
    {"prompt": "What is 3*3?", "answer": "9", "level": 2},
]
CHAT = [
    {
        "prompt": [
            {"role": "system", "content": "Think step by step."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "answer": "4",
    },
    {"prompt": [{"role": "user", "content": "What is 3*3?"}], "answer": "9"},
]


def user_error(call, *args, **kwargs) -> str:
    """The message of the UserError that `call` raises, checked to be one line."""
    with pytest.raises(UserError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message
    return message


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_csv(path, rows):
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def no_datasets(monkeypatch):
    """Make `import datasets` fail: the file formats must not need it."""
    monkeypatch.setitem(sys.modules, "datasets", None)


@pytest.fixture
def datasets_offline(tmp_path, monkeypatch):
    return offline_datasets(tmp_path, monkeypatch)


# --- formats ---------------------------------------------------------------------------------


def test_jsonl_keeps_every_column_and_skips_blank_lines(tmp_path, no_datasets):
    path = tmp_path / "prompts.jsonl"
    path.write_text(f"{json.dumps(ROWS[0])}\n\n   \n{json.dumps(ROWS[1])}")  # no final newline
    assert load_rows(str(path)) == ROWS


def test_json_list(tmp_path, no_datasets):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(ROWS, indent=2))
    assert load_rows(str(path)) == ROWS


def test_json_object_with_one_list_value(tmp_path, no_datasets):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps({"version": "1.0", "data": ROWS}))
    assert load_rows(str(path)) == ROWS


def test_parquet_keeps_types(tmp_path, no_datasets):
    assert load_rows(write_parquet(tmp_path / "prompts.parquet", ROWS)) == ROWS


def test_csv_values_stay_strings(tmp_path, no_datasets):
    rows = load_rows(write_csv(tmp_path / "prompts.csv", ROWS))
    assert rows == [{k: str(v) for k, v in row.items()} for row in ROWS]


def test_csv_quoted_fields(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text('prompt,answer\n"Say ""hi"", twice",x\n"two\nlines",y\n')
    assert load_rows(str(path)) == [
        {"prompt": 'Say "hi", twice', "answer": "x"},
        {"prompt": "two\nlines", "answer": "y"},
    ]


def test_file_ending_is_case_insensitive(tmp_path):
    assert load_rows(write_jsonl(tmp_path / "PROMPTS.JSONL", ROWS)) == ROWS


def test_other_prompt_column(tmp_path):
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]
    assert load_rows(write_jsonl(tmp_path / "q.jsonl", rows), prompt_column="question") == rows


def test_save_to_disk_dataset(tmp_path, datasets_offline):
    datasets_offline.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(str(tmp_path / "saved")) == ROWS


def test_save_to_disk_dataset_dict_takes_the_split(tmp_path, datasets_offline):
    other = [{"prompt": "held out", "answer": "0", "level": 3}]
    splits = {"train": ROWS, "test": other}
    dataset_dict = datasets_offline.DatasetDict(
        {name: datasets_offline.Dataset.from_list(rows) for name, rows in splits.items()}
    )
    dataset_dict.save_to_disk(str(tmp_path / "saved"))
    assert load_rows(str(tmp_path / "saved")) == ROWS
    assert load_rows(str(tmp_path / "saved"), split="test") == other
    message = user_error(load_rows, str(tmp_path / "saved"), split="validation")
    saved = tmp_path / "saved"
    assert message == f"data.split: {saved} has no split 'validation' (splits: train, test)"


def test_directory_of_data_files(tmp_path, datasets_offline):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train.jsonl", ROWS)
    assert load_rows(str(tmp_path / "data")) == ROWS


# --- configurations: a dataset folder whose card names two, as openai/gsm8k's does ------------


def test_a_dataset_folder_s_configuration_and_split_are_loaded_by_name(tmp_path, datasets_offline):
    folder = str(write_gsm8k_folder(tmp_path / "gsm8k"))
    assert load_rows(folder, prompt_column="question", config="socratic") == gsm8k_rows("socratic", "train")
    assert load_rows(folder, prompt_column="question", config="main", split="test") == gsm8k_rows("main", "test")


def test_an_unknown_configuration_is_one_line_with_the_dataset_s_list(tmp_path, datasets_offline):
    folder = str(write_gsm8k_folder(tmp_path / "gsm8k"))
    message = user_error(load_rows, folder, prompt_column="question", config="mian")
    assert message == f"data.config: {folder} has no configuration 'mian' (configurations: main, socratic)"


def test_no_configuration_named_where_there_are_several_is_one_line_with_the_list(tmp_path, datasets_offline):
    folder = str(write_gsm8k_folder(tmp_path / "gsm8k"))
    message = user_error(load_rows, folder, prompt_column="question")
    assert message == f"data.config: {folder} has several configurations, name one (configurations: main, socratic)"


def test_a_configuration_of_data_that_has_none_is_one_line(tmp_path, datasets_offline):
    file = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    datasets_offline.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert user_error(load_rows, file, config="main") == (
        f"data.config: {file} is one file, with no configurations (got 'main'): leave data.config unset"
    )
    assert user_error(load_rows, str(tmp_path / "saved"), config="main").startswith(
        f"data.config: {tmp_path / 'saved'} is a saved dataset (save_to_disk), with no configurations"
    )


# --- the system prompt -------------------------------------------------------------------------


def test_a_system_prompt_goes_before_every_prompt_and_a_row_s_own_stays(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    rows = load_rows(write_jsonl(tmp_path / "chat.jsonl", ROWS + CHAT), system_prompt="Be brief.")
    assert rows[0] == {**ROWS[0], "prompt": [system, {"role": "user", "content": "What is 2+2?"}]}
    assert rows[2] == CHAT[0]  # it opens with a system message of its own
    assert rows[3] == {**CHAT[1], "prompt": [system, *CHAT[1]["prompt"]]}
    assert with_system_prompt(ROWS, "prompt", "") is ROWS  # none: the rows as they are
    assert ROWS[0]["prompt"] == "What is 2+2?"  # copied, never changed in place


# --- rows handed over in Python (grpo.train(dataset=...)) ----------------------------------------


def test_given_rows_take_a_dataset_a_dataset_dict_s_split_and_a_list(datasets_offline):
    held_out = [{"prompt": "held out", "answer": "0", "level": 3}]
    dataset_dict = datasets_offline.DatasetDict(
        {"train": datasets_offline.Dataset.from_list(ROWS), "test": datasets_offline.Dataset.from_list(held_out)}
    )
    assert given_rows(datasets_offline.Dataset.from_list(ROWS)) == ROWS
    assert given_rows(dataset_dict, split="test") == held_out
    assert given_rows(ROWS) == ROWS and given_rows(tuple(ROWS)) == ROWS
    assert given_rows(ROWS, system_prompt="Be brief.")[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert user_error(given_rows, dataset_dict, split="validation") == (
        "data.split: the dataset has no split 'validation' (splits: train, test)"
    )


def test_given_rows_are_checked_as_a_file_s_are():
    assert user_error(given_rows, ROWS, prompt_column="question") == (
        "data.prompt_column: no column 'question' in dataset (columns: prompt, answer, level)"
    )
    assert (
        user_error(given_rows, [ROWS[0], "What is 3*3?"]) == "dataset row 2: expected a dict of columns, got a string"
    )
    assert user_error(given_rows, []) == "dataset: has no rows"
    assert user_error(given_rows, "prompts.jsonl") == (
        "dataset: expected a datasets.Dataset, a DatasetDict or a list of dicts, got str"
    )


def test_a_resume_of_rows_handed_over_says_to_hand_them_again():
    assert user_error(load_rows, GIVEN_DATASET).startswith(
        "data.path: this run's rows were handed to grpo.train(dataset=...): hand them again"
    )


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_conversational_prompts(tmp_path, fmt):
    path = tmp_path / f"chat.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, CHAT)
    elif fmt == "json":
        path.write_text(json.dumps(CHAT))
    else:
        write_parquet(path, CHAT)
    assert load_rows(str(path)) == CHAT


def generated_rows(path, *, prompt_column, task_options):
    """A generated data source (as reasoning-gym's is): rows made from the path and options."""
    return [{prompt_column: f"{path} #{i}", **(task_options or {})} for i in range(2)]


def test_a_registered_source_makes_the_rows_of_its_paths(monkeypatch, no_datasets):
    from grpo import data

    monkeypatch.setitem(data.SOURCES, "made:", "tests.test_data:generated_rows")
    rows = load_rows("made:x", prompt_column="q", task_options={"level": 3})
    assert rows == [{"q": "made:x #0", "level": 3}, {"q": "made:x #1", "level": 3}]
    with pytest.raises(UserError, match="only a .*'made:NAME' data.path takes task options"):
        load_rows("file.jsonl", task_options={"level": 3})


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["prompts.jsonl", "prompts.json", "prompts.parquet", "p.csv"])
def test_missing_file(tmp_path, name, no_datasets):
    # no_datasets: a data-file ending must never fall through to a `datasets` lookup.
    path = str(tmp_path / name)
    assert user_error(load_rows, path) == f"data.path: no such file {path!r}"


def test_missing_local_path_is_not_a_hub_name(tmp_path, no_datasets):
    path = str(tmp_path / "no-such-dir")
    assert user_error(load_rows, path) == f"data.path: no such file or directory {path!r}"


def test_empty_path(no_datasets):
    assert user_error(load_rows, " ") == "data.path: is empty"


def test_existing_file_of_unknown_format(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("What is 2+2?\n")
    assert user_error(load_rows, str(path)).startswith(f"data.path: cannot read {str(path)!r}:")


def test_jsonl_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps(ROWS[0])] * 3 + [""] + [json.dumps(ROWS[1])] * 2 + ["{'prompt': 'x'}"]
    path.write_text("\n".join(lines) + "\n")
    message = user_error(load_rows, str(path))
    expected = "invalid JSON (Expecting property name enclosed in double quotes)"
    assert message == f"{path} line 7: {expected}"
    path.write_text(json.dumps(ROWS[0]) + "\n" + "{}}\n")
    assert user_error(load_rows, str(path)) == f"{path} line 2: invalid JSON (Extra data)"
    path.write_text(json.dumps(ROWS[0]) + "\nprompt: hi\n")
    assert user_error(load_rows, str(path)) == f"{path} line 2: invalid JSON (Expecting value)"


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(ROWS[0]) + '\n["What is 2+2?", "4"]\n')
    assert user_error(load_rows, str(path)) == f"{path} line 2: expected a JSON object, got a list"


def test_not_utf8(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert user_error(load_rows, str(path)).startswith(f"{path}: not UTF-8 text")


@pytest.mark.parametrize(
    "content, expected",
    [
        ('"just a string"', "got a string"),
        ('{"train": [], "test": []}', "got an object with list values: train, test"),
        ('{"prompt": "hi"}', "got an object with list values: none"),
    ],
)
def test_json_top_level_that_is_not_rows(tmp_path, content, expected):
    path = tmp_path / "prompts.json"
    path.write_text(content)
    message = user_error(load_rows, str(path))
    assert message.startswith(f"{path}: expected a list of objects or an object with a single list")
    assert message.endswith(expected)


def test_json_item_that_is_not_an_object(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([ROWS[0], "What is 3*3?"]))
    assert user_error(load_rows, str(path)) == f"{path} row 2: expected a JSON object, got a string"


def test_json_invalid_and_json_lines_named_json(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text("[\n" + json.dumps(ROWS[0]) + ",\n]")
    assert user_error(load_rows, str(path)) == f"{path} line 3: invalid JSON (Expecting value)"
    write_jsonl(path, ROWS)
    message = user_error(load_rows, str(path))
    assert message.startswith(f"{path} line 2: invalid JSON (Extra data)")
    assert "name the file .jsonl" in message


def test_malformed_parquet(tmp_path):
    path = tmp_path / "prompts.parquet"
    path.write_bytes(b"this is not parquet")
    assert user_error(load_rows, str(path)).startswith(f"{path}: not a readable Parquet file (")


@pytest.mark.parametrize(
    "content, expected",
    [
        ("prompt,answer\nhi,4,extra\n", "line 2: 3 fields, the header has 2"),
        ("prompt,answer\nhi,4\nho\n", "line 3: 1 fields, the header has 2"),
        ('prompt,answer\n"hi,4\n', "line 2: malformed CSV (unexpected end of data)"),
        ('prompt,answer\n"hi"x,4\n', "line 2: malformed CSV (',' expected after '\"')"),
    ],
)
def test_malformed_csv(tmp_path, content, expected):
    path = tmp_path / "prompts.csv"
    path.write_text(content)
    assert user_error(load_rows, str(path)) == f"{path} {expected}"


def test_missing_prompt_column(tmp_path):
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    message = user_error(load_rows, path)
    expected = f"data.prompt_column: no column 'prompt' in {path} (columns: question, answer)"
    assert message == expected


def test_prompt_column_missing_from_one_row(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(f"{json.dumps(ROWS[0])}\n\n{json.dumps({'question': 'x'})}\n")
    message = user_error(load_rows, str(path))
    assert message == f"data.prompt_column: no column 'prompt' in {path} line 3 (columns: question)"


@pytest.mark.parametrize(
    "prompt, problem",
    [
        (7, "got a number"),
        (None, "got null"),
        ("", "got an empty string"),
        ("   \n", "got an empty string"),
        ({"role": "user", "content": "hi"}, "got an object"),
        ([], "got an empty list"),
        (["hi"], "but message 1 is a string"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant"}],
            "message 2 has no string 'content'",
        ),
        ([{"content": "hi"}], "message 1 has no string 'role'"),
        ([{"role": "user", "content": ["hi"]}], "message 1 has no string 'content'"),
    ],
)
def test_invalid_prompt_value_names_the_row(tmp_path, prompt, problem):
    path = write_jsonl(tmp_path / "prompts.jsonl", [ROWS[0], {"prompt": prompt, "answer": "4"}])
    message = user_error(load_rows, path)
    assert message.startswith(f"{path} line 2: 'prompt' must be a non-empty string or a list of")
    assert message.endswith(problem)


def test_invalid_prompt_in_csv_and_parquet_names_the_row(tmp_path):
    csv_path = tmp_path / "prompts.csv"
    csv_path.write_text("prompt,answer\nhi,4\n,5\n")
    assert user_error(load_rows, str(csv_path)).startswith(f"{csv_path} line 3: 'prompt' must be")
    no_prompt = {**ROWS[1], "prompt": None}
    parquet_path = write_parquet(tmp_path / "prompts.parquet", [ROWS[0], no_prompt])
    assert user_error(load_rows, parquet_path).startswith(f"{parquet_path} row 2: 'prompt' must be")


@pytest.mark.parametrize(
    "name, content",
    [
        ("prompts.jsonl", "\n  \n"),
        ("prompts.json", "[]"),
        ("p.json", '{"data": []}'),
        ("prompts.csv", "prompt,answer\n"),
        ("empty.csv", ""),
    ],
)
def test_empty_dataset(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    assert user_error(load_rows, str(path)) == f"data.path: {path} has no rows"


def test_empty_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    assert user_error(load_rows, str(path)) == f"data.path: {path} has no rows"


def test_unloadable_dataset_name(datasets_offline):
    message = user_error(load_rows, "foo/bar")
    assert message.startswith("data.path: cannot load dataset 'foo/bar' (")
    assert message.endswith(")")


def test_dataset_name_without_datasets_installed(no_datasets):
    message = user_error(load_rows, "foo/bar")
    assert message.startswith("data.path: loading dataset 'foo/bar' needs the datasets package")
    assert message.endswith("pip install 'grpo[data]'")


def test_directory_that_is_not_a_dataset(tmp_path, datasets_offline):
    (tmp_path / "empty").mkdir()
    message = user_error(load_rows, str(tmp_path / "empty"))
    assert message.startswith(f"data.path: cannot load dataset {str(tmp_path / 'empty')!r} (")


# --- the prompt stream -----------------------------------------------------------------------


def numbered(n):
    return [{"prompt": f"p{i}", "i": i} for i in range(n)]


def ids(rows):
    return [row["i"] for row in rows]


def test_same_seed_same_order_different_seed_different_order():
    rows = numbered(20)
    first = ids(PromptStream(rows, seed=3).take(50))
    assert first == ids(PromptStream(rows, seed=3).take(50))
    assert first != ids(PromptStream(rows, seed=4).take(50))
    assert first[:20] != list(range(20))  # it is shuffled at all


def test_every_row_once_per_epoch_and_reshuffled_between_epochs():
    stream = PromptStream(numbered(10), seed=0)
    seen = []
    for _ in range(9):  # 63 rows in uneven chunks, crossing epoch boundaries mid-take
        seen += ids(stream.take(7))
    epochs = [seen[e * 10 : (e + 1) * 10] for e in range(6)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 6
    assert stream.epoch == 6
    assert stream.state_dict() == {"epoch": 6, "position": 3}


def test_take_more_than_the_rows():
    stream = PromptStream(numbered(4), seed=1)
    batch = ids(stream.take(10))
    assert len(batch) == 10
    assert sorted(batch[:4]) == sorted(batch[4:8]) == [0, 1, 2, 3]
    assert stream.epoch == 2
    assert stream.take(0) == []
    assert stream.state_dict() == {"epoch": 2, "position": 2}


def test_epoch_counts_completed_passes():
    stream = PromptStream(numbered(5), seed=0)
    stream.take(4)
    assert stream.epoch == 0
    stream.take(1)
    assert stream.epoch == 1
    assert stream.state_dict() == {"epoch": 1, "position": 0}


def test_shuffle_false_keeps_file_order():
    stream = PromptStream(numbered(4), seed=5, shuffle=False)
    assert ids(stream.take(10)) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("consumed", [0, 3, 10, 13, 37])
def test_resume_through_json_continues_identically(consumed):
    rows = numbered(10)
    uninterrupted = PromptStream(rows, seed=7)
    expected = ids(uninterrupted.take(consumed + 25))[consumed:]
    interrupted = PromptStream(rows, seed=7)
    interrupted.take(consumed)
    saved = json.loads(json.dumps(interrupted.state_dict()))
    resumed = PromptStream(rows, seed=7)
    resumed.load_state_dict(saved)
    assert resumed.epoch == interrupted.epoch
    assert ids(resumed.take(25)) == expected


@given(
    n=st.integers(1, 12),
    seed=st.integers(0, 2**32),
    sizes=st.lists(st.integers(0, 30), max_size=6),
    cut=st.integers(0, 6),
)
def test_any_split_of_takes_with_a_resume_matches_one_take(n, seed, sizes, cut):
    rows = numbered(n)
    expected = ids(PromptStream(rows, seed=seed).take(sum(sizes)))
    stream, got = PromptStream(rows, seed=seed), []
    for index, size in enumerate(sizes):
        if index == cut:  # resume mid-run into a fresh stream
            state = stream.state_dict()
            stream = PromptStream(rows, seed=seed)
            stream.load_state_dict(state)
        got += ids(stream.take(size))
    assert got == expected


def test_take_leaves_the_global_rngs_alone():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()
    stream = PromptStream(numbered(10), seed=1)
    stream.take(25)
    stream.load_state_dict({"epoch": 4, "position": 2})
    stream.take(3)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_taken_rows_are_copies():
    stream = PromptStream(numbered(2), seed=0, shuffle=False)
    first = stream.take(2)
    first[0].pop("prompt")
    assert stream.take(1) == [{"prompt": "p0", "i": 0}]


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0},
        {"epoch": -1, "position": 0},
        {"epoch": 0, "position": 1.0},
        {"epoch": True, "position": 0},
        [0, 0],
    ],
)
def test_load_state_dict_rejects_a_malformed_state(state):
    stream = PromptStream(numbered(3), seed=0)
    assert user_error(stream.load_state_dict, state).startswith("checkpoint: the prompt stream state must be")


def test_load_state_dict_rejects_a_position_past_the_rows():
    stream = PromptStream(numbered(3), seed=0)
    message = user_error(stream.load_state_dict, {"epoch": 1, "position": 3})
    assert message.startswith("checkpoint: prompt stream position 3 is past the end of the dataset")


def test_stream_needs_rows_and_a_non_negative_seed():
    with pytest.raises(ValueError):
        PromptStream([], seed=0)
    with pytest.raises(ValueError):
        PromptStream(numbered(2), seed=-1)
    with pytest.raises(ValueError):
        PromptStream(numbered(2), seed=0).take(-1)
