"""train.report_to: wandb (offline) and trackio (its local store) get every step's metrics
at that step, read back from what they wrote, with no network; --resume continues the same
run; names, missing packages and services that fail are one line or one warning."""

import json
import struct
import sys
import types
from pathlib import Path

import pytest

import grpo
from grpo.config import config_from_dict, reporters
from grpo.errors import UserError
from grpo.infra.logging import WandbSink


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """wandb offline and trackio local, everything they write under tmp_path, no token or
    remote target that could make either connect."""
    for name in (
        "WANDB_API_KEY",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "WANDB_NAME",
        "WANDB_DIR",
        "WANDB_BASE_URL",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "TRACKIO_SPACE_ID",
        "TRACKIO_SERVER_URL",
        "TRACKIO_BUCKET_ID",
        "TRACKIO_DATASET_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    store = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    # trackio reads TRACKIO_DIR once, when imported: if this process imported it already,
    # point its modules' copies at this test's store.
    for module in [m for n, m in sys.modules.items() if n == "trackio" or n.startswith("trackio.")]:
        if hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", store)
    return store


def wandb_records(path):
    """The records of a .wandb file (LevelDB's log format: 32 KiB blocks of chunks, each with
    a 7-byte header: CRC, length, type full/first/middle/last), as wandb's own protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(output_dir, run_id):
    """(run record, {step: {key: value}}) of the offline run `run_id` under output_dir/wandb
    (several when the run was resumed: the newest, by when it was written; a directory's name
    carries its start time to the second, and wandb adds '-1' to the second one of a second)."""
    path = max(output_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"), key=lambda p: p.stat().st_mtime_ns)
    run, history = None, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = items
    return run, history


def trackio_steps(project, run):
    """The steps' metrics in trackio's store (each table, the samples', is a line of its own)."""
    from trackio.sqlite_storage import SQLiteStorage

    return [log for log in SQLiteStorage.get_logs(project, run) if "reward/mean" in log]


@pytest.mark.resume
def test_wandb_offline_run_has_every_steps_metrics_and_resume_continues_it(make_config, no_network):
    config = make_config(train={"steps": 2, "report_to": "wandb", "run_name": "first", "checkpoint_minutes": 0})
    result = grpo.train(config, progress=False)
    run_id = (result.output_dir / "wandb_run_id").read_text().strip()
    run, history = wandb_run(result.output_dir, run_id)
    assert (run.run_id, run.display_name, run.project) == (run_id, "first", "grpo")
    config_items = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config_items["train"]["steps"] == 2 and config_items["model"] == config["model"]
    assert sorted(history) == [1, 2]
    for logged in result.metrics:  # the same numbers as metrics.jsonl, each at its step
        step = history[logged["step"]]
        assert step["reward/mean"] == pytest.approx(logged["reward/mean"]) and step["kl"] == pytest.approx(logged["kl"])
        assert "models" in step and "time/step" in step

    resumed = grpo.train(
        make_config(train={"steps": 3, "report_to": ["wandb"], "run_name": "first"}), resume=True, progress=False
    )
    _, history = wandb_run(resumed.output_dir, run_id)  # the same run id, continued
    assert sorted(history) == [3] and history[3]["reward/mean"] == pytest.approx(resumed.metrics[-1]["reward/mean"])


def test_trackio_local_store_has_every_steps_metrics_and_resume_continues_it(make_config, no_network):
    from trackio.sqlite_storage import SQLiteStorage

    result = grpo.train(make_config(train={"steps": 2, "report_to": ["trackio"], "project": "tests"}), progress=False)
    assert (no_network / "tests.db").is_file()
    assert SQLiteStorage.get_runs("tests") == ["run"]  # the run's name: output_dir's folder name
    logs = trackio_steps("tests", "run")
    assert [log["step"] for log in logs] == [1, 2]
    for log, logged in zip(logs, result.metrics):
        assert log["reward/mean"] == pytest.approx(logged["reward/mean"]) and log["kl"] == pytest.approx(logged["kl"])
    assert SQLiteStorage.get_run_config("tests", "run")["train"]["steps"] == 2

    resumed = grpo.train(
        make_config(train={"steps": 3, "report_to": "trackio", "project": "tests"}), resume=True, progress=False
    )
    assert SQLiteStorage.get_runs("tests") == ["run"]
    logs = trackio_steps("tests", "run")
    assert [log["step"] for log in logs] == [1, 2, 3]
    assert logs[-1]["reward/mean"] == pytest.approx(resumed.metrics[-1]["reward/mean"])


class FakeWandb(types.ModuleType):
    """A stand-in for the wandb module that records what it is given, and fails on request."""

    def __init__(self, fail_init=None, fail_log_at=None):
        super().__init__("wandb")
        self.fail_init, self.fail_log_at = fail_init, fail_log_at
        self.logged, self.inits, self.finished = [], [], 0

    def init(self, **kwargs):
        if self.fail_init:
            raise self.fail_init
        self.inits.append(kwargs)
        return self

    def log(self, data, step=None):
        if step == self.fail_log_at:
            raise RuntimeError("connection lost\nmore detail")
        self.logged.append((step, data))

    def finish(self):
        self.finished += 1


def test_dashboards_get_the_finite_numbers_at_their_step(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = WandbSink(tmp_path, project="", run_name="r", config={"seed": 0}, resume=False)
    sink.log(
        7,
        {
            "step": 7,
            "reward/mean": 0.5,
            "kl": float("nan"),
            "loss": float("inf"),
            "models": 2,
            "done": True,
            "name": "x",
            "list": [1],
        },
    )
    sink.close()
    assert fake.logged == [(7, {"reward/mean": 0.5, "models": 2})]  # the step is the x-axis
    assert fake.finished == 1
    assert (
        fake.inits[0]["project"] == "grpo" and fake.inits[0]["name"] == "r" and fake.inits[0]["config"] == {"seed": 0}
    )


def test_a_dashboard_that_fails_mid_run_is_one_warning_and_the_run_completes(make_config, monkeypatch, capsys):
    fake = FakeWandb(fail_log_at=2)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    result = grpo.train(make_config(train={"steps": 3, "report_to": "wandb"}), progress=False)
    assert [m["step"] for m in result.metrics] == [1, 2, 3]  # metrics.jsonl has every step
    assert [step for step, _ in fake.logged] == [1]  # nothing more is sent once it failed
    assert fake.finished == 1
    warnings = [line for line in capsys.readouterr().err.splitlines() if "wandb" in line]
    assert warnings == [
        "grpo: warning: wandb stopped logging at step 2 (connection lost); the run goes on and "
        "metrics.jsonl has every step"
    ]


def test_a_service_that_refuses_stops_the_run_in_one_line_before_any_step(make_config, monkeypatch):
    monkeypatch.setitem(
        sys.modules, "wandb", FakeWandb(fail_init=RuntimeError("api_key not configured (no-tty)\ntraceback"))
    )
    config = make_config(train={"steps": 2, "report_to": ["tensorboard", "wandb"]})
    with pytest.raises(UserError) as err:
        grpo.train(config, progress=False)
    assert str(err.value) == (
        "train.report_to: wandb could not start a run (api_key not configured (no-tty)); "
        "fix its settings, or take wandb out of train.report_to"
    )
    out = Path(config["output_dir"])
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_a_missing_package_is_one_line_naming_the_extra(make_config, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # import fails as if it were not installed
    with pytest.raises(UserError) as err:
        grpo.train(make_config(train={"steps": 1, "report_to": name}), progress=False)
    assert str(err.value) == f"train.report_to: {name} needs the {name} package: pip install 'grpo[{name}]'"


def test_report_to_takes_a_list_a_name_or_none_and_tensorboard_true_adds_it(make_config):
    def names(**train):
        return reporters(config_from_dict(make_config(train=train)).train)

    assert names() == []
    assert names(report_to="none") == names(report_to=[]) == names(report_to=None) == names(report_to=["none"]) == []
    assert names(report_to="wandb") == ["wandb"]
    assert names(report_to="wandb, trackio") == ["wandb", "trackio"]  # as --set train.report_to=wandb,trackio gives it
    assert names(report_to=["trackio", "wandb", "trackio"]) == ["trackio", "wandb"]
    assert names(tensorboard=True) == ["tensorboard"]
    assert names(report_to=["wandb", "tensorboard"], tensorboard=True) == ["wandb", "tensorboard"]


@pytest.mark.parametrize(
    "given,message",
    [
        (
            "wandbb",
            "train.report_to: unknown logger 'wandbb' (did you mean 'wandb'?); choose among tensorboard, wandb, trackio, or none",
        ),
        (
            ["tensorboard", "mlflow"],
            "train.report_to: unknown logger 'mlflow'; choose among tensorboard, wandb, trackio, or none",
        ),
    ],
)
def test_an_unknown_name_is_one_line_with_a_hint(make_config, given, message):
    with pytest.raises(UserError) as err:
        config_from_dict(make_config(train={"report_to": given}))
    assert str(err.value) == message
