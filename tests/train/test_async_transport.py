"""What rollout.async sends through its private folder (grpo.rollout.weights, grpo.rollout.worker):
a batch is tensors and plain data and comes back as it went, a file planted in the folder runs
nothing and is refused in one line; the folder goes to /dev/shm where it has room, else to the
temporary folder (said once), else the run ends in one line, never a SIGBUS; a run's start
removes the folders of runs that are gone."""

import datetime
import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import grpo
from grpo.errors import UserError
from grpo.infra.space import no_space
from grpo.rollout import weights
from grpo.rollout.batch import Rollout
from grpo.rollout.weights import OWNER, sweep, weights_folder
from grpo.rollout.worker import _put_rollout, _take_rollout
from tests.rollout.tool_models import IncrementEnv
from tests.train.test_async import generators

ROOT = Path(__file__).parents[2]


def a_batch() -> tuple[Rollout, list[dict]]:
    """A rollout of 2 prompts x G = 2 with everything a batch may carry, and the rows asked:
    values no plain format holds (a date, a set), a prompt an environment's reset rewrote,
    environments, messages, tool counts."""
    asked = [
        {"prompt": [{"role": "user", "content": "hi"}], "when": datetime.date(2024, 1, 2), "tags": {"a"}},
        {"prompt": "plain", "when": None, "tags": set()},
    ]
    rows = [asked[0], {**asked[0], "prompt": [{"role": "user", "content": "hi, count to 3"}]}, asked[1], asked[1]]
    environments = [IncrementEnv() for _ in range(4)]
    for i, env in enumerate(environments):
        env.counter, env.target = i, 3
    ids = torch.arange(24).view(4, 6)
    rollout = Rollout(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]),
        prompts=["a", "b", "c", "d"],
        completions=["x", "y", "z", "w"],
        rows=rows,
        group_size=2,
        sampled_logprobs=-torch.rand(4, 3),
        policy_version=7,
        logprobs_exact=True,
        messages=[[{"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": {"a": 1}}}]}]] * 4,
        environments=environments,
        tool_calls=torch.tensor([1.0, 0, 2, 1]),
        tool_failures=torch.tensor([0.0, 0, 1, 0]),
    )
    return rollout, asked


def test_a_batch_comes_back_as_it_went(tmp_path):
    """Through the folder and back: the tensors, the text, the rows asked (the same objects:
    a value of any type), a rewritten prompt, the environments' state."""
    rollout, asked = a_batch()
    path = _put_rollout(str(tmp_path), 3, rollout, asked)
    back = _take_rollout(path, asked)
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
    for name in ("input_ids", "attention_mask", "completion_mask", "loss_mask", "prompt_truncated"):
        assert torch.equal(getattr(back, name), getattr(rollout, name)), name
    for name in ("sampled_logprobs", "tool_calls", "tool_failures"):
        assert torch.equal(getattr(back, name), getattr(rollout, name)), name
    for name in ("prompts", "completions", "group_size", "policy_version", "logprobs_exact", "messages", "rows"):
        assert getattr(back, name) == getattr(rollout, name), name
    assert back.rows[0] is asked[0] and back.rows[3] is asked[1]
    assert back.rows[1]["when"] is asked[0]["when"] and back.rows[1]["prompt"][0]["content"] == "hi, count to 3"
    assert [(e.counter, e.target) for e in back.environments] == [(0, 3), (1, 3), (2, 3), (3, 3)]


class Planted:
    """What a planted pickle runs as it loads: it opens (creates) the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(kind: str, folder: Path, marker: Path) -> str:
    """A file in the run's folder that runs code when it is unpickled: a bare pickle, a torch
    file holding one, or a batch whose sealed environments were swapped for one."""
    path = folder / f"rollout-1-{kind}.pt"
    if kind == "pickle":
        path.write_bytes(pickle.dumps(Planted(marker)))
    elif kind == "torch":
        torch.save({"input_ids": Planted(marker)}, path)
    else:
        rollout, asked = a_batch()
        fields = torch.load(_put_rollout(str(folder), 1, rollout, asked), weights_only=True)
        fields["environments"]["data"] = pickle.dumps([Planted(marker)])  # the seal of other bytes
        torch.save(fields, path)
    return str(path)


@pytest.mark.parametrize("kind", ["pickle", "torch", "environments"])
def test_a_file_planted_in_the_folder_runs_nothing_and_is_refused_in_one_line(tmp_path, kind):
    marker = tmp_path / "ran"
    path = plant(kind, tmp_path, marker)
    with pytest.raises(UserError, match=rf"^rollout.async: refused {path}: ") as refused:
        _take_rollout(path, a_batch()[1])
    assert "\n" not in str(refused.value)
    assert not marker.exists()


# ---- where the folder goes ----------------------------------------------------------------------


def small_places(monkeypatch, tmp_path, free: dict[str, int]) -> list[str]:
    """Two places (a /dev/shm and a temporary folder) whose free space is `free` (by name)."""
    made = {name: tmp_path / name for name in free}
    for path in made.values():
        path.mkdir()
    monkeypatch.setattr(weights, "places", lambda: [str(p) for p in made.values()])
    monkeypatch.setattr(weights, "free_bytes", lambda place: free[Path(place).name])
    return [str(p) for p in made.values()]


def async_config(make_config, steps=2):
    config = make_config(train={"steps": steps, "lr": 1e-3, "sample_every": 0})
    config["rollout"]["async"] = {"max_staleness": 1}
    return config


@pytest.mark.slow
def test_a_dev_shm_too_small_falls_back_to_the_temporary_folder_and_trains(make_config, tmp_path, monkeypatch, capfd):
    """Simulated (any host): a /dev/shm with less room than two versions of the weights. The
    run says so once, in one line, and trains through the temporary folder."""
    shm, tmp = small_places(monkeypatch, tmp_path, {"shm": 100_000, "tmp": 10**12})
    result = grpo.train(async_config(make_config), progress=False)
    assert [m["step"] for m in result.metrics] == [1, 2]
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("grpo:")]
    assert len(lines) == 1 and f"{shm} has 0.1 MB free: they go through {tmp} instead" in lines[0], lines
    assert not os.listdir(shm) and not os.listdir(tmp) and not generators()


def test_where_no_place_has_room_the_run_ends_in_one_line(make_config, tmp_path, monkeypatch):
    shm, tmp = small_places(monkeypatch, tmp_path, {"shm": 100_000, "tmp": 200_000})
    with pytest.raises(UserError) as refused:
        grpo.train(async_config(make_config), progress=False)
    message = str(refused.value)
    assert message.startswith("rollout.async: the weights in transit need ") and "\n" not in message
    assert f"neither {shm} (0.1 MB free) nor {tmp} (0.2 MB free) has room" in message
    assert message.endswith("give /dev/shm more (docker run --shm-size), or point TMPDIR at a folder with room")
    assert not os.listdir(shm) and not os.listdir(tmp) and not generators()


def _namespaces_allowed() -> bool:
    """Whether this host lets us mount a tmpfs in a mount namespace of our own (root, Linux)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/dev/shm"):
        return False
    try:
        probe = ["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _namespaces_allowed(), reason="no mount namespace here (not root, or not Linux)")
@pytest.mark.parametrize("room", ["in the temporary folder", "nowhere"])
def test_grpo_train_with_a_small_dev_shm_falls_back_or_ends_in_one_line(make_config, tmp_path, room):
    """`grpo train` in a mount namespace whose /dev/shm is a 256 KB tmpfs (what a container's
    --shm-size sets), less than two versions of the tiny model's weights: it falls back and
    trains; with TMPDIR on a tmpfs as small, it ends in one line (exit 2), no SIGBUS."""
    config = async_config(make_config)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    small = tmp_path / "small-tmp"
    small.mkdir()
    mounts = "mount -t tmpfs -o size=256k tmpfs /dev/shm"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if room == "nowhere":
        mounts += f" && mount -t tmpfs -o size=256k tmpfs {small}"
        env["TMPDIR"] = str(small)
    script = f'{mounts} && exec "$0" -m grpo train "$1" --quiet'
    command = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, str(path)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    ours = [line for line in done.stderr.splitlines() if line.startswith("grpo:")]
    assert "Traceback" not in done.stderr and len(ours) == 1, done.stderr[-3000:]
    if room == "nowhere":
        assert done.returncode == 2, done.stderr[-3000:]
        assert ours[0].startswith("grpo: error: rollout.async: the weights in transit need "), ours
        assert f"neither /dev/shm (0.2 MB free) nor {small} (0.2 MB free) has room" in ours[0], ours
    else:
        assert done.returncode == 0, done.stderr[-3000:]
        assert "/dev/shm has 0.2 MB free: they go through" in ours[0], ours
        metrics = (Path(config["output_dir"]) / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1, 2]


# ---- the sweep ----------------------------------------------------------------------------------


def test_a_run_s_start_removes_the_folders_of_runs_that_are_gone(tmp_path, monkeypatch):
    """A folder whose owner ended (made by a process that has exited), and one naming a live
    pid with another start time (the pid reused) go as a run makes its own; one without an
    owner file (being made) and one from another machine or container stay."""
    monkeypatch.setattr(weights, "places", lambda: [str(tmp_path)])
    made = "import sys, grpo.rollout.weights as w; w.places = lambda: [sys.argv[1]]; print(w.weights_folder())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ended = subprocess.run([sys.executable, "-c", made, str(tmp_path)], capture_output=True, text=True, env=env)
    dead = Path(ended.stdout.strip())
    assert dead.is_dir() and json.loads((dead / OWNER).read_text())["pid"] != os.getpid()
    alive = {"pid": os.getpid(), "started": weights._started(os.getpid()), "host": weights._host()}
    kept = {"unowned": None, "elsewhere": {**alive, "host": "another-machine pid:[1]"}}
    if alive["started"] is not None:  # Linux: a pid's start time tells a reused pid
        kept["live"] = alive
        reused = tmp_path / "grpo-weights-reused"
        reused.mkdir()
        (reused / OWNER).write_text(json.dumps({**alive, "started": str(int(alive["started"]) + 1)}))
    for name, owner in kept.items():
        (tmp_path / f"grpo-weights-{name}").mkdir()
        if owner is not None:
            (tmp_path / f"grpo-weights-{name}" / OWNER).write_text(json.dumps(owner))
    ours = Path(weights_folder())  # a run's start
    assert ours.is_dir() and not dead.exists()
    assert all((tmp_path / f"grpo-weights-{name}").is_dir() for name in kept)
    assert alive["started"] is None or not (tmp_path / "grpo-weights-reused").exists()
    assert sweep() == []


def test_a_full_folder_is_an_error_or_a_wait_never_a_fault(tmp_path, monkeypatch):
    """Where a version's bytes cannot be reserved (ENOSPC), nothing is mapped: without a
    `wait` the OSError rises and no file is left; with one, it is asked and the write tried
    again, and the reader gets the tensors."""
    reserve, refusals = weights._reserve, []

    def full_twice(path, size):
        if len(refusals) < 2:
            open(path, "wb").close()
            raise OSError(errno.ENOSPC, "No space left on device")
        reserve(path, size)

    monkeypatch.setattr(weights, "_reserve", full_twice)
    sent = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    path = str(tmp_path / "weights-1.bin")
    with pytest.raises(OSError, match="No space left"):
        weights.write_weights(path, sent.items())
    assert os.listdir(tmp_path) == []
    layout, aliases = weights.write_weights(path, sent.items(), wait=refusals.append)
    assert len(refusals) == 2 and all(no_space(err) is not None for err in refusals)
    got = weights.read_weights(path, layout, aliases)
    assert all(torch.equal(got[name], tensor) for name, tensor in sent.items())
