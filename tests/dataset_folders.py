"""Dataset folders as the Hub lays them out, written offline for the tests of data.path,
data.config and data.split (tests/test_data.py, tests/train/test_data_in.py)."""

import json
from pathlib import Path

import pytest

CONFIGURATIONS = {"main": "", "socratic": "Socratic: "}  # each configuration's question lead


def offline_datasets(tmp_path, monkeypatch):
    """`datasets` with no network attempts (fails at once, no retries) and a private cache."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return datasets


def gsm8k_row(a: int, b: int, lead: str) -> dict:
    """A GSM8K row: the question, and the worked answer ending in its '#### N' line."""
    return {"question": f"{lead}What is {a}+{b}?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}


def write_gsm8k_folder(root: Path) -> Path:
    """A dataset folder as the Hub lays out openai/gsm8k: a README.md card whose `configs`
    front matter names each configuration's data files (main and socratic, with train and
    test splits), GSM8K's question/answer rows with the '#### 42' answer line."""
    card = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
  - split: test
    path: socratic/test.jsonl
---
# A GSM8K-shaped dataset
"""
    root.mkdir(parents=True)
    (root / "README.md").write_text(card)
    for config, lead in CONFIGURATIONS.items():
        (root / config).mkdir()
        for split, start in (("train", 1), ("test", 20)):
            rows = gsm8k_rows(config, split)
            (root / config / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def gsm8k_rows(config: str, split: str) -> list[dict]:
    """The rows `write_gsm8k_folder` writes for `config` and `split`: four a configuration and split."""
    start = {"train": 1, "test": 20}[split]
    return [gsm8k_row(a, a + 1, CONFIGURATIONS[config]) for a in range(start, start + 4)]
