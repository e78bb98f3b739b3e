"""Nothing a user started is lost to a run that cannot start, and no folder is a dead end.

A config with a mistake (a misspelt reward, a missing model or data file) is refused for
that mistake, with or without --overwrite, before output_dir is touched: the finished run in
it stays byte for byte. A mistake found only once the folder is claimed (a model that does
not load) puts back what --overwrite set aside, and a refused run leaves no folder behind.
A folder whose run logged steps but saved no checkpoint (a disk that filled first) is
continued with --resume, which starts afresh and keeps the old logs in previous/.
"""

import copy
import errno
import json
import shutil
from pathlib import Path

import pytest
import yaml

from grpo.cli import main
from grpo.config import config_from_dict
from grpo.infra import checkpoint
from grpo.infra.checkpoint import list_checkpoints
from grpo.train import checkpointing
from grpo.train.checkpointing import Checkpointer
from grpo.train.output_dir import ASIDE
from tests.infra.test_space import Filling
from tests.train.test_faults import config_for as faulty_config
from tests.train.test_resume import results

STEPS = 2


def config_for(tiny_model, prompts_file, output_dir, **train):
    """test_faults' config: 2 steps, a checkpoint after each, samples of each."""
    return faulty_config(
        tiny_model, prompts_file, output_dir, **{"steps": STEPS, "checkpoint_every": 1, "sample_every": 1, **train}
    )


def write(path, config):
    path.write_text(yaml.safe_dump(config))
    return str(path)


def train(capsys, config_path, *flags):
    """`grpo train` in this process: (exit status, stderr's lines)."""
    code = main(["train", config_path, "--quiet", *flags])
    return code, capsys.readouterr().err.strip().splitlines()


def files(folder):
    """Every file under `folder` with its bytes, but the lock (a run writes its pid there)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished(tiny_model, prompts_file, tmp_path_factory):
    """A finished 2-step run: checkpoints, final/, metrics, samples, summary."""
    tmp = tmp_path_factory.mktemp("finished")
    config = config_for(tiny_model, prompts_file, tmp / "run")
    assert main(["train", write(tmp / "run.yaml", config), "--quiet"]) == 0
    return tmp / "run", config


@pytest.fixture
def held(finished, tmp_path):
    """A copy of the finished run's folder, and its config pointed there."""
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    return out, {**copy.deepcopy(finished[1]), "output_dir": str(out)}


def _broken_model(tmp_path, tiny_model):
    """A model directory with a config.json and nothing else: it passes the cheap check
    (its config reads), and fails to load only once the run has claimed its folder."""
    folder = tmp_path / "no_weights"
    folder.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", folder)
    return str(folder)


MISTAKES = {
    "reward": (
        lambda config, tmp: config.update(rewards=[{"function": "tests.train.rewards_for_tests:sevnes"}]),
        "reward 'tests.train.rewards_for_tests:sevnes': module 'tests.train.rewards_for_tests' has no attribute 'sevnes'",
    ),
    "model": (lambda config, tmp: config.update(model=str(tmp / "no_model")), "model: no such directory"),
    "data": (
        lambda config, tmp: config["data"].update(path=str(tmp / "no_prompts.jsonl")),
        "data.path: no such file",
    ),
}


@pytest.mark.parametrize("flags", [[], ["--overwrite"]], ids=["plain", "overwrite"])
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_config_mistake_is_named_and_the_run_in_the_folder_is_intact(held, tmp_path, capsys, mistake, flags):
    out, config = held
    before = files(out)
    edit, message = MISTAKES[mistake]
    edit(config, tmp_path)
    code, lines = train(capsys, write(tmp_path / "broken.yaml", config), *flags)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert files(out) == before  # final/, checkpoints, metrics: byte for byte
    assert not (out / ASIDE).exists()


def test_overwrite_puts_the_run_back_when_the_new_one_fails_to_start(held, tmp_path, tiny_model, capsys):
    """The model's config reads, so the folder is claimed and --overwrite sets the run aside;
    the model then fails to load: the run is put back as it was."""
    out, config = held
    before = files(out)
    config["model"] = _broken_model(tmp_path, tiny_model)
    code, lines = train(capsys, write(tmp_path / "broken.yaml", config), "--overwrite")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("grpo: error: model: cannot load"), lines
    assert files(out) == before and not (out / ASIDE).exists()
    code, lines = train(capsys, write(tmp_path / "same.yaml", held[1]))  # the folder still holds its run
    assert code == 2 and "already holds a run; pass --resume to continue it, --overwrite to start afresh" in lines[0]


def test_overwrite_removes_the_run_once_the_new_one_starts(held, tmp_path, capsys):
    out, config = held
    (out / "notes.txt").write_text("mine")
    code, lines = train(
        capsys, write(tmp_path / "again.yaml", {**config, "train": {**config["train"], "steps": 1}}), "--overwrite"
    )
    assert code == 0, lines
    assert [m["step"] for m in results(out)] == [1] and sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000001"
    ]
    assert (out / "notes.txt").read_text() == "mine" and not (out / ASIDE).exists()


def test_a_run_killed_as_it_started_is_put_back(held, tmp_path, capsys):
    """What a run killed between --overwrite's setting aside and its start leaves: the earlier
    run in .overwritten/ and the new run's first files. The next run puts the earlier one back."""
    out, config = held
    before = files(out)
    (out / ASIDE).mkdir()
    for path in list(out.iterdir()):
        if path.name not in (ASIDE, ".lock"):
            path.rename(out / ASIDE / path.name)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events").write_text("the killed run's")
    code, lines = train(capsys, write(tmp_path / "same.yaml", config))
    assert code == 2 and "already holds a run; pass --resume" in lines[0], lines
    assert files(out) == before and not (out / ASIDE).exists()


@pytest.mark.parametrize("mistake", ["reward", "model that does not load"])
def test_a_refused_run_leaves_no_folder_behind(make_config, tmp_path, tiny_model, capsys, mistake):
    """Refused before the folder is claimed, or after (the lock made it): either way nothing
    is left, not even the folders above output_dir that the run made."""
    config = make_config(output_dir=str(tmp_path / "new" / "deeper" / "run"))
    if mistake == "reward":
        MISTAKES["reward"][0](config, tmp_path)
    else:
        config["model"] = _broken_model(tmp_path, tiny_model)
    code, lines = train(capsys, write(tmp_path / "config.yaml", config))
    assert code == 2 and len(lines) == 1, lines
    assert not (tmp_path / "new").exists()


def _no_checkpoint(held):
    """The held run as a disk that filled before its first checkpoint leaves it: logged steps,
    no checkpoint, no final model."""
    out, config = held
    for name in ("checkpoints", "final"):
        shutil.rmtree(out / name)
    (out / "summary.json").unlink()
    return out, config


def test_logged_steps_without_a_checkpoint_name_the_way_out(held, tmp_path, capsys):
    out, config = _no_checkpoint(held)
    code, lines = train(capsys, write(tmp_path / "same.yaml", config))
    assert code == 2 and lines == [
        f"grpo: error: output_dir '{out}' holds {STEPS} logged step(s) but no checkpoint; pass --resume to start "
        "afresh keeping them in previous/, --overwrite to start afresh without them, or choose another output_dir"
    ]


def test_resume_without_a_checkpoint_starts_afresh_and_keeps_the_logs(held, finished, tmp_path, capsys):
    out, config = _no_checkpoint(held)
    logged = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "samples.jsonl", "config.yaml")}
    path = write(tmp_path / "same.yaml", config)
    code, lines = train(capsys, path, "--resume")
    assert code == 0, lines
    assert lines == [
        f"grpo: warning: --resume: output_dir '{out}' has {STEPS} logged step(s) but no checkpoint to continue "
        f"from; starting afresh, their logs kept in {out / 'previous'}"
    ]
    assert {name: (out / "previous" / name).read_bytes() for name in logged} == logged
    assert results(out) == results(finished[0])  # the run, redone from its start
    assert (out / "final" / "config.json").exists()
    _no_checkpoint(held)  # and once more: the earlier logs stay, the new ones go beside them
    code, lines = train(capsys, path, "--resume")
    assert code == 0 and "their logs kept in " + str(out / "previous-2") in lines[0], lines
    assert (out / "previous" / "metrics.jsonl").read_bytes() == logged["metrics.jsonl"]


def test_a_disk_full_before_the_first_checkpoint_is_no_dead_end(
    tiny_model, prompts_file, tmp_path, capsys, monkeypatch
):
    """The disk is full for checkpoints (the logs fit): the run's one checkpoint, at its end,
    cannot be written. One line names --resume, and --resume then runs the whole run."""
    out = tmp_path / "full"
    path = write(tmp_path / "full.yaml", config_for(tiny_model, prompts_file, out, checkpoint_every=0))

    def full(file, mode):  # a checkpoint's file takes 500 bytes, then the disk is full
        return Filling(open(file, mode), errno.ENOSPC, 500) if "w" in mode else open(file, mode)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "open", full, raising=False)
        code, lines = train(capsys, path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].endswith(
        "no checkpoint was saved yet: free space and start again with --resume (the logged steps are kept aside)]"
    )
    assert [m["step"] for m in results(out)] == [1, 2] and list_checkpoints(out) == []
    code, lines = train(capsys, path, "--resume")
    assert code == 0 and "starting afresh" in lines[0], lines
    assert [m["step"] for m in results(out)] == [1, 2] and (out / "final" / "config.json").exists()
    kept = (out / "previous" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [1, 2]


def test_the_first_time_based_checkpoint_comes_within_a_minute(make_config, monkeypatch):
    """With train.checkpoint_minutes 10 (the default) the first checkpoint is due a minute into
    the run, the next ten minutes after it; with 0 (by steps only) none is due by time."""
    clock = {"now": 0.0}
    monkeypatch.setattr(checkpointing.time, "monotonic", lambda: clock["now"])
    config = config_from_dict(make_config(train={"steps": 1000}))
    due = Checkpointer(None, config, None, None)
    assert config.train.checkpoint_minutes == 10 and checkpointing.FIRST_CHECKPOINT_MINUTES == 1
    clock["now"] = 59.0
    assert not due.due(1)
    clock["now"] = 60.0
    assert due.due(2)
    due.saved_at = 60.0  # as a save sets it
    clock["now"] = 60.0 + 599
    assert not due.due(3)
    clock["now"] = 60.0 + 600
    assert due.due(4) and due.due(1000)
    by_steps = Checkpointer(
        None, config_from_dict(make_config(train={"steps": 1000, "checkpoint_minutes": 0})), None, None
    )
    clock["now"] = 1e6
    assert not by_steps.due(1) and by_steps.due(1000)
