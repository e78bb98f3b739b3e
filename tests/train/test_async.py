"""Asynchronous rollouts (rollout.async: grpo.train.rollouts over a grpo.rollout.worker): K = 0 is today's step; the
generator process samples what the in-process sampler samples; a batch staler than K is
dropped; the ratio's old log-probs are the sampling policy's; a K = 1 run learns; a generator
that fails, dies at any moment or hangs is one line and leaves no process; a stop and resume
restart the generator from the checkpoint."""

import copy
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import grpo
from grpo.config import config_from_dict, config_to_dict
from grpo.data import PromptStream, load_rows
from grpo.errors import Stopped, UserError
from grpo.infra.distributed import SingleProcess
from grpo.rewards import load_rewards
from grpo.rollout.generator import GeneratorSpec
from grpo.rollout.worker import NAME, build_generator
from grpo.train.loop import build_engine, build_run_generator
from grpo.train.rollouts import Rollouts
from grpo.train.layouts import policy_logprobs
from grpo.train.step import _passes, train_step
from tests.helpers import assert_close_scaled, run_generator, sample, sampled_step
from tests.train import rewards_for_tests
from tests.train.test_learning import gain

# What a step computes; times are measurements, not results.
COMPUTED = ("reward/mean", "loss", "kl", "entropy", "grad_norm", "tokens/completion", "completion_length/mean")


def engine_for(config):
    c = config_from_dict(config)
    torch.manual_seed(c.seed)
    e = build_engine(c, load_rewards([(r.function, r.weight) for r in c.rewards]))
    rows = load_rows(c.data.path, prompt_column=c.data.prompt_column)
    return c, e, rows, PromptStream(rows, seed=c.seed, shuffle=c.data.shuffle)


def changed(c, *overrides):
    """`c` with `overrides` (a validated config is read-only: another one is built)."""
    return config_from_dict(config_to_dict(c), list(overrides))


def with_async(make_config, k=1, async_push_every=1, **rollout):
    config = make_config(train={"steps": 6, "lr": 1e-2, "sample_every": 0})
    config["rollout"].update(rollout, **{"async": {"max_staleness": k, "push_every": async_push_every}})
    return config


def test_k0_is_the_synchronous_step(make_config, tmp_path):
    """max_staleness: 0 set explicitly runs exactly the step without the option (the pinned
    trajectory of test_pinned.py covers the default), and logs no async metric."""
    plain = make_config(train={"steps": 3, "sample_every": 0})
    explicit = copy.deepcopy(plain)
    explicit["rollout"]["async"] = {"max_staleness": 0}
    explicit["output_dir"] = str(tmp_path / "explicit")
    a = grpo.train(plain, progress=False).metrics
    b = grpo.train(explicit, progress=False).metrics
    assert [[m[k] for k in COMPUTED] for m in a] == [[m[k] for k in COMPUTED] for m in b]
    assert not any(k.startswith("async/") for m in b for k in m)


@pytest.mark.slow
@pytest.mark.parametrize("draw", ["generate", "fast"])
def test_the_generator_samples_what_the_in_process_sampler_samples(make_config, draw, tmp_path):
    """The same weights (moved away from the model on disk, which the generator loads first)
    and the same step draw the same tokens and log-probs in the generator process, with
    either rollout.draw."""
    c, e, rows, stream = engine_for(with_async(make_config, min_new_tokens=0, max_new_tokens=12, draw=draw))
    with torch.no_grad():
        for p in e.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch_rows = stream.take(c.rollout.prompts_per_step)
    spec = GeneratorSpec.of(c, autocast=None)
    local, worker = build_generator(spec, e.tokenizer), build_generator(spec, e.tokenizer, worker=True)
    try:
        for generator in (local, worker):
            generator.publish(e.policy, 7)
            generator.request(5, batch_rows)
        here, there = local.take(5), worker.take(5)
        seconds = worker.seconds
    finally:
        worker.close()
    assert (here.policy_version, there.policy_version) == (7, 7)
    assert there.completions == here.completions and len(set(here.completions)) > 1
    assert torch.equal(there.input_ids, here.input_ids)
    assert_close_scaled(there.sampled_logprobs, here.sampled_logprobs)
    assert seconds["generate"] > 0


def schedule(c, e, rows, ahead=None):
    """The loop's schedule over the run's generator (a worker process with rollout.async)."""
    generator = build_run_generator(c, e)
    try:
        return Rollouts(c, e, generator, rows, ahead=ahead).start(e, 0)
    except BaseException:
        generator.close()
        raise


def run_steps(e, rollouts, steps):
    """What the loop does with `rollouts` for `steps` steps: take, train, publish."""
    metrics = []
    try:
        for step in range(steps):
            sampled, taken = rollouts.take(e, step)
            result = train_step(e, sampled, step, taken["time/generate"])
            metrics.append({**result.metrics, **taken, **rollouts.after_update(e)})
    finally:
        rollouts.close()
    return metrics


class Recorded:
    """A generator that samples nothing: the requests the schedule made, in order."""

    def __init__(self):
        self.published, self.requests, self.seconds = None, [], {"generate": 0.0, "idle": 0.0}

    def publish(self, policy, version):
        self.published = version

    def request(self, step, rows, seeds=None):
        self.requests.append((step, rows))

    def take(self, step):
        return SimpleNamespace(policy_version=self.published)


def test_the_checkpointed_position_is_the_first_step_not_trained(make_config):
    """Requests two steps ahead run the one prompt stream ahead; the position a checkpoint
    keeps is that of the first step not yet trained, and a schedule started from it
    requests the same rows again for the same steps."""
    c = config_from_dict(make_config(train={"steps": 6}))
    rows, k = load_rows(c.data.path, prompt_column=c.data.prompt_column), c.rollout.prompts_per_step
    e = SimpleNamespace(world=SingleProcess(), policy=None, version=0)
    straight = Rollouts(c, e, Recorded(), rows, ahead=2).start(e, 0)
    positions = [straight.state_dict()]
    for step in range(3):
        straight.take(e, step)
        straight.after_update(e)
        positions.append(straight.state_dict())
    stream = PromptStream(rows, seed=c.seed, shuffle=c.data.shuffle)
    for position in positions:  # one step's rows apart, however far the requests ran
        assert position == stream.state_dict()
        stream.take(k)
    resumed = Rollouts(c, e, Recorded(), rows, ahead=2)
    resumed.load_state_dict(positions[1])
    resumed.start(e, 1)
    assert resumed.generator.requests == [(s, r) for s, r in straight.generator.requests if s in (1, 2, 3)]


@pytest.mark.slow
def test_a_batch_older_than_k_is_dropped_counted_and_sampled_again(make_config):
    """A schedule two steps ahead with K = 1 makes batches two optimizer steps stale: each is
    dropped, counted and sampled again, and no step trains on one staler than K."""
    c, e, rows, _ = engine_for(with_async(make_config, k=1))
    metrics = run_steps(e, schedule(c, e, rows, ahead=2), steps=5)
    assert all(m["async/staleness"] <= 1 for m in metrics), [m["async/staleness"] for m in metrics]
    assert sum(m["async/dropped"] for m in metrics) >= 2
    assert max(m["async/staleness_max"] for m in metrics) == 2  # what was dropped, shown
    assert [m["async/dropped"] > 0 for m in metrics] == [m["async/staleness_max"] > 1 for m in metrics]


@pytest.mark.slow
def test_push_every_sends_the_weights_every_nth_update_within_the_bound(make_config):
    c, e, rows, _ = engine_for(with_async(make_config, k=2, async_push_every=2))
    metrics = run_steps(e, schedule(c, e, rows), steps=5)
    assert [m["async/push_s"] > 0 for m in metrics] == [False, True, False, True, False]
    assert [m["async/staleness"] for m in metrics] == [0, 1, 2, 1, 2]  # one step ahead, weights up to 1 behind
    assert all(m["async/dropped"] == 0 for m in metrics)


@pytest.mark.slow
def test_the_old_logprobs_of_a_stale_batch_are_the_sampling_policys(make_config):
    """After an update, the ratio's anchor for a batch the previous weights drew is those
    weights' log-probs (the sampler's, no pass over the current weights)."""
    c, e, rows, stream = engine_for(with_async(make_config, min_new_tokens=0))
    sampling_policy = copy.deepcopy(e.policy)
    generator = run_generator(c, e)  # a worker process: closed before the assertions
    try:
        stale = sample(e, generator, stream.take(4))
        sampled_step(e, generator, stream.take(4), step=1)  # the policy moves on
    finally:
        generator.close()
    assert e.version == stale.policy_version + 1
    old = _passes(e, stale).old_logprobs
    with torch.no_grad():
        sampling = policy_logprobs(sampling_policy, stale, c.rollout.temperature)
        current = policy_logprobs(e.policy, stale, c.rollout.temperature)
    mask = stale.loss_mask.bool()
    assert_close_scaled(old[mask], sampling[mask])
    assert (old[mask] - current[mask]).abs().max() > 1e-2  # the update moved them: the test can tell


@pytest.mark.learning
def test_async_k1_learns_the_sevens_reward(make_config):
    config = make_config(train={"steps": 40, "lr": 1e-3, "sample_every": 10})
    config["rollout"]["async"] = {"max_staleness": 1}
    result = grpo.train(config, progress=False)
    m = result.metrics
    assert gain(m) >= 0.25, [round(x["reward/mean"], 3) for x in m]
    assert [x["async/staleness"] for x in m] == [0] + [1] * 39  # the first batch has nothing to lag
    assert result.summary["async"]["dropped"] == 0 and result.summary["async"]["staleness_max"] == 1
    assert any(x["clip_fraction"] > 0 for x in m)  # off-policy: the ratio leaves 1, unlike mu = 1 in sync


@pytest.mark.slow
def test_a_generator_that_fails_dies_or_hangs_is_one_line(make_config, tmp_path):
    c, e, rows, _ = engine_for(with_async(make_config))
    broken = changed(c, f"model={tmp_path / 'no-such-model'}")  # the generator cannot load it
    with pytest.raises(UserError, match=r"^rollout.async: the generator failed: model: ") as failed:
        run_steps(e, schedule(broken, e, rows), steps=1)
    assert "\n" not in str(failed.value)

    patient = changed(c, "rollout.async.timeout=60")  # the death is told at once, not at the timeout
    rollouts = schedule(patient, e, rows)
    os.kill(rollouts.generator.process.pid, signal.SIGKILL)
    with pytest.raises(UserError, match=r"the generator process died \(exit code -9\)"):
        run_steps(e, rollouts, steps=1)

    silent = changed(c, "rollout.async.timeout=0.5")  # less than it takes to start
    start = time.monotonic()
    with pytest.raises(UserError, match=r"the generator sent no batch in 0.5 s \(rollout.async.timeout\)"):
        run_steps(e, schedule(silent, e, rows), steps=1)
    assert time.monotonic() - start < 30


def generators() -> list:
    return [p for p in multiprocessing.active_children() if p.name == NAME]


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["a batch waits in the queue", "it reads new weights", "it hangs"])
def test_a_generator_killed_at_any_moment_or_hung_is_one_line_and_leaves_nothing(make_config, capfd, moment):
    """SIGKILL with a sampled batch in the queue, or while it reads a push of many tensors, or
    SIGSTOP with a batch in the queue: one line (no traceback from any thread, no wait past
    the timeout), no process and no file of the run's folder left."""
    c, e, rows, _ = engine_for(with_async(make_config))
    c = changed(c, "rollout.async.timeout=120")
    rollouts = schedule(c, e, rows)
    generator = rollouts.generator
    stopped, stuck = [], False

    def receive():  # on a thread: a trainer stuck on the generator fails the test, not hangs it
        try:
            while True:
                generator._receive(time.monotonic() + (2 if moment == "it hangs" else 60))
        except BaseException as err:
            stopped.append(err)

    try:
        generator._receive(time.monotonic() + 120)  # up, and sampling step 1
        while generator.results.empty():
            time.sleep(0.05)
        if moment == "it reads new weights":
            many = {f"w{i}": torch.full((64,), float(i)) for i in range(3000)}
            policy = SimpleNamespace(named_parameters=many.items, named_modules=dict().items, config=SimpleNamespace())
            generator.publish(policy, 1)
            time.sleep(0.3)
        os.kill(generator.process.pid, signal.SIGSTOP if moment == "it hangs" else signal.SIGKILL)
        waiting = threading.Thread(target=receive, daemon=True)
        waiting.start()
        waiting.join(90)
        stuck = waiting.is_alive()
    finally:
        if stuck:
            generator.process.kill()  # what the trainer waits on
            waiting.join(30)
        rollouts.close()
    assert not stuck, "the trainer waited on the generator past its deadline"
    (error,) = stopped
    assert isinstance(error, UserError) and str(error).startswith("rollout.async: the generator"), repr(error)
    assert "\n" not in str(error)
    if moment == "it hangs":
        assert "sent no batch in" in str(error)  # at the deadline, not stuck reading the queued batch
    assert not generator.process.is_alive() and not generators()
    assert not Path(generator.folder).exists()
    assert "Traceback" not in capfd.readouterr().err


def sevens_then_kill_the_generator(prompts, completions, **columns):
    """`sevens`, but at the Nth call ($GRPO_TEST_KILL_AT) the generator process is killed
    (SIGKILL), in the trainer's step N while it samples the steps ahead."""
    rewards_for_tests._calls["n"] += 1
    if rewards_for_tests._calls["n"] == int(os.environ.get("GRPO_TEST_KILL_AT", "0")):
        for process in generators():
            os.kill(process.pid, signal.SIGKILL)
    return rewards_for_tests.sevens(prompts, completions)


def in_group(group: int) -> list[int]:
    """The processes still in process group `group` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[2]) == group:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.resume
def test_a_run_whose_generator_is_killed_keeps_its_steps_in_one_line_and_resumes(make_config, tmp_path, capfd):
    """`grpo train` in a process of its own (what it prints up to its exit, the resource
    tracker's warnings included), its generator killed in step 3: one line, step 3 saved, no
    process left in its group; then --resume trains steps 4 to 6."""
    import subprocess
    import sys

    from tests.train.test_faults import checkpoints, our_lines, train

    config = with_async(make_config)
    config["train"]["checkpoint_minutes"] = 0
    config["rewards"] = [{"function": "tests.train.test_async:sevens_then_kill_the_generator"}]
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(config))
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "GRPO_TEST_KILL_AT": "3"}
    run = subprocess.Popen(
        [sys.executable, "-m", "grpo", "train", str(path), "--quiet"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    err = run.communicate(timeout=600)[1]
    assert run.returncode == 2, err
    (line,) = our_lines(err)
    assert "the generator process died (exit code -9)" in line and "checkpoint of step 3 saved" in line
    assert "Traceback" not in err and "leaked" not in err, err
    assert checkpoints(config["output_dir"]) == ["step-000003"]
    deadline = time.monotonic() + 10
    while in_group(run.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not in_group(run.pid)
    status, _ = train(path, "--resume")
    assert status == 0, capfd.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6] and not generators()


@pytest.mark.resume
def test_a_stop_saves_the_step_and_resume_restarts_the_generator_from_it(make_config, monkeypatch):
    """Ctrl-C in step 3 saves step 3; the resumed run's generator starts from its weights:
    step 4's batch is theirs (staleness 0, nothing dropped), the queue of the stopped run gone.
    With per-prompt seeds: the steps ahead get the seeds the loop gives them."""
    config = make_config(
        train={"steps": 6, "lr": 1e-3, "sample_every": 0},
        rewards=[{"function": "tests.train.rewards_for_tests:sevens_then_signal"}],
    )
    config["rollout"].update({"async": {"max_staleness": 1}, "seed_per_prompt": True})
    monkeypatch.setenv("GRPO_TEST_SIGNAL_AT", "3")
    monkeypatch.setitem(rewards_for_tests._calls, "n", 0)
    with pytest.raises(Stopped, match="after step 3; checkpoint saved"):
        grpo.train(config, progress=False)
    monkeypatch.delenv("GRPO_TEST_SIGNAL_AT")
    result = grpo.train(config, progress=False, resume=True)
    m = result.metrics
    assert [x["step"] for x in m] == [1, 2, 3, 4, 5, 6]
    assert [x["async/staleness"] for x in m] == [0, 1, 1, 0, 1, 1]
    assert all(x["async/dropped"] == 0 for x in m)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"train": {"epochs": 2}}, r"max_staleness: 1 leaves the generator no step ahead: .* at least 2$"),
        ({"rollout": {"async": {"max_staleness": 1, "push_every": 2}}}, r"push_every adds 1; set it to at least 2"),
        ({"rollout": {"sampler": "hf"}}, r"rollout.sampler: hf \(transformers' generate\) returns no log-probs"),
        ({"train": {"old_logprobs": "recompute"}}, r"only loss.engine_correction .* then corrects"),
    ],
)
def test_what_the_generator_cannot_do_is_refused_in_one_line(make_config, sections, message):
    config = make_config(**{k: v for k, v in sections.items() if k != "rollout"})
    config["rollout"]["async"] = {"max_staleness": 1}
    config["rollout"].update(sections.get("rollout", {}))
    with pytest.raises(UserError, match=message) as refused:
        config_from_dict(config)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_recompute_with_an_engine_correction_is_decoupled_ppo_and_allowed(make_config):
    config = make_config(train={"old_logprobs": "recompute"}, loss={"engine_correction": "token_tis"})
    config["rollout"]["async"] = {"max_staleness": 1}
    assert config_from_dict(config).rollout.async_.max_staleness == 1


@pytest.mark.slow
def test_an_unguarded_script_is_told_to_guard_its_call(make_config, tmp_path):
    """The generator process imports the main script again: a top-level grpo.train call ends
    it there, and the trainer says why in one line (no traceback from either), no hang."""
    import subprocess
    import sys
    from pathlib import Path

    config = with_async(make_config)
    script = tmp_path / "unguarded.py"
    script.write_text(f"import grpo\ngrpo.train({config!r}, progress=False)\n")
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("grpo:")]
    assert ours == [
        "grpo: error: rollout.async: the generator process imports the main script again: put its call of "
        'grpo.train under if __name__ == "__main__":'
    ], done.stderr
    assert "Traceback" not in done.stderr
