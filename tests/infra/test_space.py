"""A write that fails for lack of space (ENOSPC, EDQUOT, EFBIG alike), however the library
reports it, is one NoSpace naming the file; the write leaves no partial file and the one
before it intact."""

import errno
import os

import pytest
import torch

from grpo.infra import checkpoint
from grpo.infra.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint
from grpo.infra.logging import JsonlSink, write_atomic
from grpo.infra.space import NoSpace, no_space, writing
from grpo.errors import UserError

NO_SPACE = [errno.ENOSPC, errno.EDQUOT, errno.EFBIG]


class Filling:
    """A file that takes `room` bytes, then fails as a full disk does (`code`)."""

    def __init__(self, file, code, room):
        self.file, self.code, self.room = file, code, room

    def write(self, data):
        if len(data) > self.room:
            self.file.write(data[: self.room])
            self.room = 0
            raise OSError(self.code, os.strerror(self.code))
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def torch_save_error(code):
    """What torch.save raises when its file's write fails: a RuntimeError, the OSError beneath."""
    with pytest.raises(RuntimeError) as raised:
        with open(os.devnull, "wb") as sink:
            torch.save({"w": torch.zeros(1000)}, Filling(sink, code, 100))
    return raised.value


def checkpoint_exception(code):
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("save failed", {1: (OSError(code, os.strerror(code)), None)})


@pytest.mark.parametrize("code", NO_SPACE)
@pytest.mark.parametrize(
    "raised",
    [
        lambda code: OSError(code, os.strerror(code)),
        torch_save_error,
        lambda code: Exception(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})"),
        checkpoint_exception,
    ],
    ids=["OSError", "torch.save", "safetensors", "torch.distributed.checkpoint"],
)
def test_every_way_a_library_says_no_space_is_one_line_naming_the_file(code, raised):
    error = raised(code)
    assert no_space(error).errno == code
    with pytest.raises(NoSpace) as caught:
        with writing("/run/metrics.jsonl"):
            raise error
    assert str(caught.value) == f"cannot write /run/metrics.jsonl: {os.strerror(code)}"
    assert caught.value.__cause__ is error


@pytest.mark.parametrize(
    "error", [OSError(errno.EACCES, "Permission denied"), RuntimeError("boom"), KeyboardInterrupt()]
)
def test_other_errors_pass_as_they_are(error):
    assert no_space(error) is None
    with pytest.raises(type(error)) as caught:
        with writing("/run/metrics.jsonl"):
            raise error
    assert caught.value is error


@pytest.mark.parametrize("code", NO_SPACE)
def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one_alone(tmp_path, monkeypatch, code):
    save_checkpoint(tmp_path, 1, {"step": 1, "w": torch.ones(1000)}, keep=1)
    monkeypatch.setattr(checkpoint, "open", lambda path, mode: Filling(open(path, mode), code, 500), raising=False)
    with pytest.raises(NoSpace, match=f"cannot write {tmp_path / 'checkpoints' / 'step-000002'}: "):
        save_checkpoint(tmp_path, 2, {"step": 2, "w": torch.zeros(1000)}, keep=1)
    assert os.listdir(tmp_path / "checkpoints") == ["step-000001"]  # no partial one beside it; keep=1 pruned nothing
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000001"]
    assert load_latest_checkpoint(tmp_path)["step"] == 1


@pytest.mark.parametrize("code", NO_SPACE)
def test_an_atomic_write_that_fails_keeps_the_old_file_and_removes_its_partial_one(tmp_path, monkeypatch, code):
    path = tmp_path / "summary.json"
    path.write_text("old\n")

    def full(self, text, **kwargs):  # half of it lands, then the disk is full
        with open(self, "w") as f:
            f.write(text[:2])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(type(path), "write_text", full)
    with pytest.raises(NoSpace, match=f"cannot write {path}: "):
        write_atomic(path, "new\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["summary.json"]


def test_the_metrics_log_says_no_space_apart_from_other_failures(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.file = Filling(sink.file, errno.EDQUOT, 10)
    with pytest.raises(NoSpace, match="metrics.jsonl: Disk quota exceeded"):
        sink.log(1, {"step": 1, "loss": 0.5})
    sink.close()
    sink = JsonlSink(tmp_path / "other.jsonl")
    sink.file = Filling(sink.file, errno.EIO, 10)
    with pytest.raises(UserError, match="other.jsonl: Input/output error"):
        sink.log(1, {"step": 1})
