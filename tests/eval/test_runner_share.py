"""The evaluation shared out among processes (`sample_completions`' share, `evaluate`'s world):
each process samples whole prompts, each generate call draws from its own seed, and the shares
put together are the samples one process draws alone, whatever the split."""

import pytest

from grpo.errors import UserError
from grpo.eval.runner import Verifier, _calls, _owners, evaluate, sample_completions, task_verifier
from grpo.tasks import load_task
from grpo.tasks.arithmetic import ALPHABET, make_rows
from grpo.tasks.tiny import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from grpo.infra.hf import load_causal_lm, load_tokenizer

    directory = save_tiny_model(tmp_path_factory.mktemp("share-model"), ALPHABET, hidden_size=32, layers=1, heads=2)
    return load_causal_lm(str(directory), "float32"), load_tokenizer(str(directory))


@pytest.mark.parametrize("n, batch_size", [(4, 8), (4, 3), (3, 7)])
def test_the_shares_put_together_are_one_process_s_samples(tiny, n, batch_size):
    model, tokenizer = tiny
    rows = make_rows(5, seed=0)
    common = dict(n=n, max_new_tokens=6, batch_size=batch_size, seed=4, progress=False)
    alone = sample_completions(model, tokenizer, rows, **common)
    for world_size in (2, 3):
        shares = [
            sample_completions(model, tokenizer, rows, share=(r, world_size), **common) for r in range(world_size)
        ]
        # Each prompt is sampled whole by exactly one process.
        owners = [[r for r in range(world_size) if shares[r][i]] for i in range(len(rows))]
        assert all(len(o) == 1 for o in owners), owners
        assert [shares[o[0]][i] for i, o in enumerate(owners)] == alone
    assert len({c for group in alone for c in group}) > 1  # sampled, not one string over and over


def test_a_prompt_whose_n_spans_calls_stays_with_one_process():
    calls = _calls(3, 5, 2)  # each prompt's 5 in calls of 2, 2, 1
    owners = _owners(calls, 2)
    assert owners == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert _owners(_calls(5, 2, 4), 2) == [0, 1, 0]  # 2 prompts a call, in turn


class Gathered(Exception):
    """Raised by a process whose share is gathered before the other's exists."""


class FakeWorld:
    """One of two processes: `gather_objects` keeps what it is given in `shares` and hands
    back both processes' (raising Gathered while the other's is not there yet)."""

    def __init__(self, rank, shares):
        self.rank, self.world_size, self.shares = rank, 2, shares

    def gather_objects(self, obj):
        self.shares[self.rank] = obj
        if len(self.shares) < 2:
            raise Gathered
        return [self.shares[r] for r in range(2)]


def test_evaluate_over_two_processes_reports_the_one_process_numbers(tiny):
    model, tokenizer = tiny
    rows = make_rows(5, seed=1)
    common = dict(n=4, ks=[1, 2, 4], verifier=task_verifier(load_task("arithmetic")), max_new_tokens=8, batch_size=4)
    common.update(seed=2, progress=False)
    alone = evaluate(model, tokenizer, rows, **common)
    shares: dict = {}
    with pytest.raises(Gathered):
        evaluate(model, tokenizer, rows, world=FakeWorld(1, shares), **common)  # process 1 samples its share
    together = evaluate(model, tokenizer, rows, world=FakeWorld(0, shares), **common)
    assert shares[1][1]["samples"] == 8  # process 1 sampled 2 of the 5 prompts (calls 1 and 3, one prompt each)
    for report in (alone, together):
        report.pop("time_s"), report.pop("time_metrics_s")
    assert together == alone


def test_a_verifier_failing_in_one_process_stops_every_process(tiny):
    model, tokenizer = tiny
    rows = make_rows(4, seed=1)
    common = dict(n=2, ks=[1], max_new_tokens=4, batch_size=2, progress=False)

    def fails(completions, row):
        raise UserError("the judge is down")

    shares: dict = {}
    broken = Verifier(extract=lambda c: None, check=lambda c, row: False, check_group=fails)
    with pytest.raises(Gathered):  # process 1: its error goes to the gathering, not out of it
        evaluate(model, tokenizer, rows, verifier=broken, world=FakeWorld(1, shares), **common)
    fine = task_verifier(load_task("arithmetic"))
    with pytest.raises(UserError, match="^the judge is down$"):  # process 0 raises process 1's
        evaluate(model, tokenizer, rows, verifier=fine, world=FakeWorld(0, shares), **common)
