"""The fault suite: a run never loses work, and every fault ends in one line.

Each case injects one fault at an exact point (a reward that signals, raises or never
scores at its Nth call; files damaged between runs) and checks the exit status, the one
line printed, what survives on disk, and that `--resume` then continues from the last
completed step with the metrics of a run never interrupted.
"""

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import yaml

from grpo.infra.checkpoint import _sha256
from grpo.infra.lock import DirectoryLock
from tests.train.test_resume import results

ROOT = Path(__file__).parents[2]
STEPS = 5


def train(path, *args, env=None, capsys=None):
    """`grpo train` in this process (as the CLI runs it); returns (exit status, stderr).
    The test rewards count their calls from 0 again for each run."""
    from grpo.cli import main
    from tests.train import rewards_for_tests

    rewards_for_tests._calls["n"] = 0
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        code = main(["train", str(path), "--quiet", *args])
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return code, capsys.readouterr().err if capsys is not None else ""


def our_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("grpo:")]


def checkpoints(output_dir):
    root = Path(output_dir) / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) if root.is_dir() else []


def config_for(tiny_model, prompts_file, output_dir, reward="tests.train.rewards_for_tests:sevens", **train):
    return {
        "algorithm": "grpo",
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(output_dir),
        "data": {"path": prompts_file},
        "rewards": [{"function": reward}],
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
        "train": {"steps": STEPS, "lr": 1e-3, "sample_every": 2, "checkpoint_minutes": 0, **train},
        "loss": {"beta": 0.04},
    }


@pytest.fixture
def runs(tiny_model, prompts_file, tmp_path):
    """Write a config named `name` (a 5-step run with the given reward) with its own output_dir."""

    def write(name, reward="tests.train.rewards_for_tests:sevens", **train):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config_for(tiny_model, prompts_file, tmp_path / name, reward, **train)))
        return path

    return write


@pytest.fixture(scope="module")
def finished(tiny_model, prompts_file, tmp_path_factory):
    """An uninterrupted 5-step run with checkpoints at steps 4 and 5: what the others are
    compared with, and a folder to copy and damage."""
    from grpo.cli import main

    tmp = tmp_path_factory.mktemp("finished")
    path = tmp / "straight.yaml"
    path.write_text(
        yaml.safe_dump(config_for(tiny_model, prompts_file, tmp / "straight", checkpoint_every=2, sample_every=1))
    )
    assert main(["train", str(path), "--quiet"]) == 0
    return tmp / "straight", results(tmp / "straight")


def copy_of(finished, tmp_path, name):
    """The finished run's folder copied to `name`, and a config that points at it."""
    import shutil

    out = tmp_path / name
    shutil.copytree(finished[0], out)
    config = yaml.safe_load((out / "config.yaml").read_text())
    config["output_dir"] = str(out)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return out, path


@pytest.mark.resume
@pytest.mark.parametrize("name,code", [("INT", 130), ("TERM", 143)])
def test_a_signal_saves_the_step_in_progress_and_resume_continues(runs, finished, capsys, name, code):
    path = runs("signalled", reward="tests.train.rewards_for_tests:sevens_then_signal")
    out = yaml.safe_load(path.read_text())["output_dir"]
    # What the handlers were (SIG_IGN, not Python's default, in a shell's background job).
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    status, err = train(path, env={"GRPO_TEST_SIGNAL_AT": "3", "GRPO_TEST_SIGNAL": name}, capsys=capsys)
    assert status == code, err
    assert "after step 3; checkpoint saved: continue with `grpo train CONFIG --resume`" in our_lines(err)[-1]
    assert checkpoints(out) == ["step-000003"] and [m["step"] for m in results(out)] == [1, 2, 3]
    status, err = train(path, "--resume", capsys=capsys)
    assert status == 0, err
    assert results(out) == finished[1]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # the handlers are put back


def test_a_reward_that_fails_mid_run_keeps_the_completed_steps(runs, finished, capsys):
    path = runs("failing", reward="tests.train.rewards_for_tests:sevens_then_raise")
    out = yaml.safe_load(path.read_text())["output_dir"]
    status, err = train(path, env={"GRPO_TEST_RAISE_AT": "4"}, capsys=capsys)
    assert status == 2
    lines = our_lines(err)
    assert len(lines) == 1 and "the judge is down" in lines[0] and "checkpoint of step 3 saved" in lines[0], err
    assert checkpoints(out) == ["step-000003"] and [m["step"] for m in results(out)] == [1, 2, 3]
    status, err = train(path, "--resume", capsys=capsys)  # the judge is back
    assert status == 0, err
    assert results(out) == finished[1]


def test_a_failure_before_the_first_step_is_not_a_dead_end(runs, capsys):
    path = runs("first", reward="tests.train.rewards_for_tests:sevens_then_raise")
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    status, err = train(path, env={"GRPO_TEST_RAISE_AT": "1"}, capsys=capsys)
    assert status == 2 and "the judge is down" in our_lines(err)[0]
    assert checkpoints(out) == []
    status, err = train(path, capsys=capsys)  # no completed step: the folder is free again, no --resume needed
    assert status == 0, err
    assert [m["step"] for m in results(out)] == [1, 2, 3, 4, 5]


def test_steps_where_no_reward_scores_warn_then_stop(runs, capsys):
    path = runs("unscored", reward="tests.train.rewards_for_tests:never_scores", max_unscored_steps=2)
    out = yaml.safe_load(path.read_text())["output_dir"]
    status, err = train(path, capsys=capsys)
    assert status == 2
    lines = our_lines(err)
    assert sum("no reward scored any completion (every reward returned None)" in line for line in lines) == 2
    assert (
        "no reward scored any completion in 2 steps in a row" in lines[-1] and "checkpoint of step 2 saved" in lines[-1]
    )
    assert checkpoints(out) == ["step-000002"]


def _damage(path, how):
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(os.urandom(4096))


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
def test_a_damaged_newest_checkpoint_falls_back_to_an_older_one(finished, tmp_path, capsys, how):
    out, path = copy_of(finished, tmp_path, "damaged")
    assert checkpoints(out) == ["step-000004", "step-000005"]
    _damage(out / "checkpoints" / "step-000005" / "state.pt", how)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')  # and a line cut short by a full disk
    status, err = train(path, "--resume", capsys=capsys)
    assert status == 0, err
    warning = [line for line in our_lines(err) if "warning" in line]
    assert len(warning) == 1 and "step-000005 is damaged (state.pt does not match its checksum)" in warning[0]
    assert results(out) == finished[1]  # step 5 redone from the checkpoint of step 4; the half line gone


class Payload:
    """What a malicious checkpoint would hold: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_payload_does_not_execute(finished, tmp_path, capsys):
    out, path = copy_of(finished, tmp_path, "planted")
    marker = tmp_path / "pwned"
    newest = out / "checkpoints" / "step-000005"
    state = torch.load(newest / "state.pt", weights_only=True)
    state["data"] = Payload(marker)
    torch.save(state, newest / "state.pt")
    # An attacker rewrites the checksum too: the loader itself must refuse to build the object.
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["state.pt"] = _sha256(newest / "state.pt")
    (newest / "manifest.json").write_text(json.dumps(manifest))
    status, err = train(path, "--resume", capsys=capsys)
    assert not marker.exists()
    assert status == 0, err
    assert any("step-000005 is damaged (cannot be read" in line for line in our_lines(err))
    assert results(out) == finished[1]  # resumed from step 4


def test_resume_drops_the_logs_written_after_the_checkpoint(finished, tmp_path, capsys):
    import shutil

    out, path = copy_of(finished, tmp_path, "logs")
    shutil.rmtree(out / "checkpoints" / "step-000005")  # as if killed after step 5 was logged, before its checkpoint
    status, err = train(path, "--resume", capsys=capsys)
    assert status == 0, err
    samples = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples == sorted(samples) and samples.count(5) == samples.count(1)  # step 5's rows once, not twice
    assert results(out) == finished[1]


def test_one_run_per_folder(runs, capsys):
    from grpo.cli import main

    path = runs("locked")
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    lock = DirectoryLock(out).acquire()  # another run holds the folder
    try:
        assert main(["train", str(path), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            err == f"grpo: error: output_dir '{out}' is in use by another run (process {os.getpid()}); "
            "wait for it to end or choose another output_dir"
        )
    finally:
        lock.release()
    assert not (out / "metrics.jsonl").exists()


def test_resume_refuses_a_config_that_changes_what_the_checkpoint_holds(finished, capsys, tmp_path):
    from grpo.cli import main

    out, path = copy_of(finished, tmp_path, "changed")
    (tmp_path / "other").mkdir()  # another model (its config is read before the folder is)
    shutil.copy(out / "final" / "config.json", tmp_path / "other")
    code = main(
        [
            "train",
            str(path),
            "--quiet",
            "--resume",
            "--set",
            f"model={tmp_path}/other",
            "--set",
            "rollout.group_size=4",
            "--set",
            "train.steps=6",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err]
    assert (
        "--resume: the config changes what the checkpoint holds (model: " in err and "rollout.group_size: 8 -> 4" in err
    )
    assert (
        main(["train", str(path), "--quiet", "--resume", "--set", "train.steps=6", "--set", "train.sample_every=3"])
        == 0
    )
    assert [m["step"] for m in results(out)] == [1, 2, 3, 4, 5, 6]  # more steps and other logging: allowed


def test_an_output_dir_that_is_a_file_is_one_line(runs, capsys, tmp_path):
    from grpo.cli import main

    path = runs("file")
    config = yaml.safe_load(path.read_text())
    Path(config["output_dir"]).write_text("not a folder")
    assert main(["train", str(path), "--quiet"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"grpo: error: output_dir '{config['output_dir']}' is a file, not a directory"
    )


def test_context_limits_are_one_line_and_long_prompts_can_be_cut(runs, tmp_path, capsys):
    """The tiny model has 256 positions: a config that cannot fit is refused before the first
    step; a prompt that does not fit is refused at sampling unless rollout.max_prompt_length
    cuts it (from the left), and the cut prompts are counted."""
    from grpo.cli import main

    path = runs("context")
    assert main(["train", str(path), "--quiet", "--set", "rollout.max_prompt_length=250"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "= 258 tokens exceed the model's 256 positions" in err
    assert (
        not (tmp_path / "context" / "metrics.jsonl").exists()
        or not (tmp_path / "context" / "metrics.jsonl").read_text()
    )

    long_prompts = tmp_path / "long.jsonl"
    long_prompts.write_text(json.dumps({"prompt": "ab" * 150}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    settings = [
        "--set",
        f"data.path={long_prompts}",
        "--set",
        "rollout.prompts_per_step=2",
        "--set",
        "data.shuffle=false",
    ]
    assert main(["train", str(path), "--quiet", *settings]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "exceed the model's 256 positions; set rollout.max_prompt_length" in err
    assert main(["train", str(path), "--quiet", "--overwrite", *settings, "--set", "rollout.max_prompt_length=32"]) == 0
    assert all(m["prompts/truncated"] == 1 for m in results(tmp_path / "context", keys=["prompts/truncated"]))


def test_a_full_disk_while_logging_loses_no_step(runs, finished, capsys, monkeypatch):
    """The 3rd metrics line fails to write (half of it lands): one line, a checkpoint of step 3
    that keeps step 3's metrics, and a resume that restores them."""
    import errno

    from grpo.infra import logging as sinks

    class FullDisk:
        def __init__(self, file):
            self.file, self.writes = file, 0

        def write(self, text):
            self.writes += 1
            if self.writes == 3:
                self.file.write(text[: len(text) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(text)

        def __getattr__(self, name):
            return getattr(self.file, name)

    real_init = sinks.JsonlSink.__init__

    def init(self, path):
        real_init(self, path)
        self.file = FullDisk(self.file)

    path = runs("full")
    out = yaml.safe_load(path.read_text())["output_dir"]
    with monkeypatch.context() as patch:
        patch.setattr(sinks.JsonlSink, "__init__", init)
        status, err = train(path, capsys=capsys)
    assert status == 2
    lines = our_lines(err)
    assert (
        len(lines) == 1
        and "metrics.jsonl: No space left on device" in lines[0]
        and "checkpoint of step 3 saved" in lines[0]
    )
    status, err = train(path, "--resume", capsys=capsys)
    assert status == 0, err
    assert results(out) == finished[1]


@pytest.mark.parametrize("code", [0, 3])
def test_a_reward_that_exits_is_an_error_not_the_end_of_the_run(runs, finished, capsys, code):
    path = runs("exits", reward="tests.train.rewards_for_tests:sevens_then_exit")
    out = yaml.safe_load(path.read_text())["output_dir"]
    status, err = train(path, env={"GRPO_TEST_EXIT_AT": "3", "GRPO_TEST_EXIT_CODE": str(code)}, capsys=capsys)
    assert status == 2, err
    lines = our_lines(err)
    assert (
        len(lines) == 1
        and "tests.train.rewards_for_tests:sevens_then_exit" in lines[0]
        and "checkpoint of step 2 saved" in lines[0]
    )
    assert checkpoints(out) == ["step-000002"]
    status, err = train(path, "--resume", capsys=capsys)
    assert status == 0, err
    assert results(out) == finished[1]


@pytest.mark.slow
def test_a_reward_that_hangs_times_out(runs, tmp_path, capsys):
    path = runs("hangs", reward="tests.train.rewards_for_tests:sevens_then_hang")
    config = yaml.safe_load(path.read_text())
    config["rewards"][0]["timeout"] = 1.0
    path.write_text(yaml.safe_dump(config))
    status, err = train(path, env={"GRPO_TEST_HANG_AT": "2"}, capsys=capsys)
    assert status == 2
    lines = our_lines(err)
    assert (
        len(lines) == 1
        and "sevens_then_hang" in lines[0]
        and "1.0 s" in lines[0]
        and "checkpoint of step 1 saved" in lines[0]
    )

    config["rewards"][0]["on_timeout"] = "none"  # or: that call scores None, and the run goes on
    path.write_text(yaml.safe_dump(config))
    status, err = train(path, "--overwrite", env={"GRPO_TEST_HANG_AT": "2"}, capsys=capsys)
    assert status == 0, err
    steps = results(config["output_dir"], keys=["step", "frac_unscored"])
    assert [m["frac_unscored"] for m in steps] == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_a_reward_that_edits_its_inputs_breaks_nothing(runs, finished, capsys):
    path = runs("vandal", reward="tests.train.rewards_for_tests:sevens_and_vandal")
    status, err = train(path, capsys=capsys)
    assert status == 0, err
    ours = results(yaml.safe_load(path.read_text())["output_dir"])
    assert [m["reward/mean"] for m in ours] == [m["reward/mean"] for m in finished[1]]


@pytest.mark.parametrize("value,shown", [("1e39", "1e+39"), ("10**400", "about 1e+400")])
def test_a_score_beyond_float32_is_one_line_naming_the_row(runs, capsys, value, shown):
    path = runs("huge", reward="tests.train.rewards_for_tests:sevens_then_huge")
    status, err = train(path, env={"GRPO_TEST_HUGE_AT": "2", "GRPO_TEST_HUGE": value}, capsys=capsys)
    assert status == 2
    lines = our_lines(err)
    assert len(lines) == 1 and f"returned {shown} for row 3, outside float32's range" in lines[0], err
    assert "checkpoint of step 1 saved" in lines[0]


def test_a_negative_seed_is_one_line(runs, capsys):
    from grpo.cli import main

    assert main(["train", str(runs("seed")), "--quiet", "--set", "seed=-1"]) == 2
    assert capsys.readouterr().err.strip() == "grpo: error: seed: must be >= 0, got -1"


def test_chat_prompts_without_a_chat_template_are_one_line_and_no_dead_end(runs, tmp_path, capsys):
    """The error comes after the models load (at the first sampling): the folder holds no
    completed step, so the fixed config runs there without --resume or --overwrite."""
    from grpo.cli import main

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n" for p in "abcd"))
    path = runs("chat")
    assert main(["train", str(path), "--quiet", "--set", f"data.path={chat}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "grpo: error: the prompts are chat messages but the model's tokenizer has no chat template"
    assert main(["train", str(path), "--quiet"]) == 0


def test_a_run_logged_to_a_file_prints_plain_lines(runs, capsys):
    """stderr not a terminal (here: captured): one line per train.log_every steps, no bar."""
    import grpo

    config = yaml.safe_load(runs("logged").read_text())
    config["train"]["log_every"] = 2
    grpo.train(config, progress=True)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("grpo: step")]
    assert [line.split()[2] for line in lines] == ["1/5", "2/5", "4/5", "5/5"]
    assert all(
        " reward " in line and " kl " in line and " length 8.0 " in line and line.endswith(" s/step") for line in lines
    )
    assert not re.search(r"grpo: *\d+%\|", err)  # no progress bar of ours (transformers' loading bars are its own)


def test_a_run_on_a_terminal_shows_the_bar_and_no_plain_lines(runs, capsys, monkeypatch):
    import sys

    import grpo

    config = yaml.safe_load(runs("on-a-terminal").read_text())
    config["train"]["log_every"] = 1
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    grpo.train(config, progress=True)
    err = capsys.readouterr().err
    assert re.search(r"grpo: *100%\|", err) and "5/5" in err and "reward=" in err and "kl=" in err
    assert "grpo: step" not in err


def test_overwrite_touches_nothing_in_a_folder_another_run_holds(finished, tmp_path, capsys):
    from grpo.cli import main

    out, path = copy_of(finished, tmp_path, "held")
    lock = DirectoryLock(out).acquire()
    try:
        assert main(["train", str(path), "--quiet", "--overwrite"]) == 2
        assert "is in use by another run" in capsys.readouterr().err
    finally:
        lock.release()
    assert results(out) == finished[1] and checkpoints(out) == ["step-000004", "step-000005"]


def _fill_disk_in_step_3(path, limit, file=None):
    """`grpo train` in a process of its own whose file-size limit falls to `limit` bytes (past
    `file`'s size) in step 3: writes beyond it fail with EFBIG (as they would with ENOSPC)."""
    from tests.train.test_resume import grpo_train

    env = {"GRPO_TEST_FULL_AT": "3", "GRPO_TEST_FULL_LIMIT": str(limit), "GRPO_TEST_FULL_FILE": str(file or "")}
    return grpo_train(path, env=env)


@pytest.mark.resume
@pytest.mark.parametrize("full", ["log", "checkpoint"])
def test_a_full_disk_is_one_line_keeps_the_last_checkpoint_and_resumes(runs, finished, capsys, full):
    """Step 2's checkpoint is written; then the disk fills. "log": step 3's metrics line is cut
    short, and the checkpoint of step 3 that would keep it cannot be written either.
    "checkpoint": step 4's checkpoint cannot be written. Either way one line says what and
    where, step 2's checkpoint is intact and alone (no partial one beside it), and --resume
    continues from it to the metrics of a run never interrupted."""
    path = runs(f"full_{full}", reward="tests.train.rewards_for_tests:sevens_then_fill_disk", checkpoint_every=2)
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    if full == "log":  # a line's worth past metrics.jsonl; far below a checkpoint
        failed = _fill_disk_in_step_3(path, 100, out / "metrics.jsonl")
        what = (
            f"cannot write {out / 'metrics.jsonl'}: File too large [could not save a checkpoint of step 3 "
            f"(cannot write {out / 'checkpoints' / 'step-000003'}: File too large); "
        )
    else:  # the logs fit; a checkpoint (1 MB) does not
        failed = _fill_disk_in_step_3(path, 500_000)
        what = f"cannot write {out / 'checkpoints' / 'step-000004'}: File too large ["
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert our_lines(failed.stderr) == [
        f"grpo: error: {what}the checkpoint of step 2 is kept: free space and continue with --resume]"
    ]
    assert os.listdir(out / "checkpoints") == ["step-000002"]
    status, err = train(path, "--resume", capsys=capsys)
    assert status == 0, err
    assert results(out) == finished[1]
