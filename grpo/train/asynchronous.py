"""Asynchronous rollouts (rollout.async.max_staleness = K >= 1): a generator process samples
the next batches while the trainer trains this one.

The process boundary. The generator is a worker process of our own (torch.multiprocessing,
spawned: a fresh interpreter, nothing inherited but its arguments), on rollout.async.threads
torch threads. It loads the policy from the run's model directory, builds the sampler the
trainer would build (the same config, the same seed: each step draws from its own stream,
`grpo.rollout.sampler`), and then serves two kinds of message from one queue, in order:
`weights` (a version number and the file holding a copy of the policy's state dict,
`write_weights`) and `sample` (a step, its rows, its per-prompt seeds). Each rollout goes back on CPU tensors with the version of the
weights that drew it. Messages are handled in the order sent, so what the generator samples
is decided by the trainer alone: the same weights and seeds give the same tokens and
log-probs as the in-process sampler (a test compares them). With rollout.sampler: vllm
(colocated) the vLLM engine is the generator's: built there, synced to each version's
weights there, and none is built in the trainer.

With a vLLM server (rollout.vllm.server) the generator is the server's client (and the
trainer none): the server is a process apart already, but pushing a version means writing
its weights into the server's file and checking them (rollout.vllm.check_sync: a forward
pass of the policy on our side), work that the generator does on its copy of the weights
while the trainer trains, where a thread in the trainer would need a copy too and take the
trainer's cores. Before it samples with a new version the generator pushes it and has it
checked, and every generate request carries that push's token (grpo.vllm.client), which the
server refuses if it holds other weights since: a batch is stamped with the version the
server confirmed. A server that dies or refuses is the generator's one-line error; one that
hangs is one line after rollout.vllm.timeout (the generator's request) or
rollout.async.timeout (the trainer's wait), whichever is shorter.

Bounded staleness. The trainer keeps the generator `lookahead` steps ahead (`lookahead` in
grpo.config: as many as K allows): after each update it sends the weights (every
push_every optimizer steps) and the request for the step `lookahead` ahead. A batch whose
weights lag the trainer's by more than K optimizer steps (which that schedule never makes,
but a late generator or a changed schedule could) is dropped, counted in async/dropped, and
sampled again with the current weights.

The old log-probs of the ratio are the sampler's (`Rollout.sampled_logprobs`): the weights
that drew a stale batch are gone from the trainer, and recomputing them would mean keeping K
old copies of the policy and a forward pass over each batch; the fast sampler's log-probs
are the sampling policy's own (exact on float32 weights, up to bf16 rounding under
autocast). `Engine.old_logprobs_from_sampler` takes them for every stale batch; the KL is to
the reference, as in a synchronous step. With vLLM they are the engine's: the ratio then
carries the engine's mismatch as well as the staleness, and the clip bounds both (the server's
engine as the colocated one).

Faults. The trainer never waits silently: it polls the generator, and a generator that
raised (its one-line error), died (its exit code; at any moment, a batch it sent included,
whose tensors died with it) or gave no batch within rollout.async.timeout seconds stops the
run with one line (the loop saves the last completed step), and `close` leaves no process.
Neither side's read depends on the other being alive: the weights and each batch travel as
files of a private folder of the run (in /dev/shm where it is: memory), written whole before
their name is sent, and removed by their reader (the folder by `close`, or by the generator
when the trainer is gone). Shared tensors would pass descriptors over the resource sharer's
socket instead: a read from a killed generator fails mid-unpickle, one from a stopped one
waits forever, and the trainer's sharer thread prints a traceback when its reader dies. The generator ignores Ctrl-C (the trainer decides when to
stop) and exits when the trainer goes away. A stop discards the queue: a resume starts a
new generator from the checkpoint's weights and resamples the steps ahead.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from grpo.config import Config, RolloutConfig, lookahead
from grpo.data import PromptStream
from grpo.errors import UserError, first_line
from grpo.infra.seed import prompt_seed
from grpo.rollout import Rollout
from grpo.train.step import Engine, StepResult, train_step
from grpo.vllm.client import weights_folder

__all__ = ["AsyncRollouts", "GeneratorSpec", "InProcess", "refuse_in_generator", "rollouts_for", "summary"]

POLL_S = 0.5  # how often a waiting side checks that the other is still there
NAME = "grpo-generator"  # the generator process's name
UNGUARDED = 87  # the generator's exit code when the main script it imports calls grpo.train
REFUSED = 'rollout.async: the generator process imports the main script again: put its call of grpo.train under if __name__ == "__main__":'


def refuse_in_generator() -> None:
    """End the generator process, quietly, where training starts inside it: a spawned
    process imports the parent's main script again before it runs (as torch's DataLoader
    workers do), and a script that calls grpo.train at its top level, not under
    `if __name__ == "__main__":`, would train again there. The trainer says why, in one line
    (`AsyncRollouts._gone`): a traceback here, in the middle of the import, would be a second
    one."""
    if multiprocessing.current_process().name == NAME:
        os._exit(UNGUARDED)


def _plain_if_uncaught(error: UserError) -> None:
    """Print `error`, or the UserError that carries it (the loop adds what it saved), as one
    line rather than a traceback should it end the script: the refusal of an unguarded
    script reaches a script's top level, where nothing else would print it."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        cause = value
        while cause is not None and cause is not error:
            cause = cause.__cause__
        if cause is None:
            return previous(kind, value, traceback)
        print(f"grpo: error: {value}", file=sys.stderr)

    sys.excepthook = hook


# Tensors laid out in one weights file start at multiples of this (any dtype's alignment).
_ALIGN = 64


def write_weights(path: str, weights: dict[str, torch.Tensor]) -> list[tuple]:
    """`weights` copied once, straight into a new file at `path` (mapped, in memory when the
    folder is /dev/shm), and their layout, what `read_weights` takes: (name, dtype, shape,
    byte offset) per tensor."""
    layout, size = [], 0
    for name, tensor in weights.items():
        size = -(-size // _ALIGN) * _ALIGN
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), size))
        size += tensor.numel() * tensor.element_size()
    mapped = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)
    for (_, _, shape, offset), tensor in zip(layout, weights.values()):
        nbytes = tensor.numel() * tensor.element_size()
        mapped[offset : offset + nbytes].view(tensor.dtype).view(shape).copy_(tensor.detach())
    return layout


def read_weights(path: str, layout: list[tuple]) -> dict[str, torch.Tensor]:
    """The tensors `write_weights` wrote at `path`, on a private mapping of it; the file is
    unlinked at once (the mapping stays readable, and its memory goes back when it is dropped)."""
    size = max(
        (offset + math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape, offset in layout), default=1
    )
    mapped = torch.from_file(path, shared=False, size=max(size, 1), dtype=torch.uint8)
    os.unlink(path)
    weights = {}
    for name, dtype, shape, offset in layout:
        kind = getattr(torch, dtype)
        weights[name] = mapped[offset : offset + math.prod(shape) * kind.itemsize].view(kind).view(shape)
    return weights


def _put_rollout(folder: str, step: int, rollout: Rollout) -> str:
    """`rollout` pickled into a new file of `folder` (written whole, then renamed into place);
    its path. Our own process's batch, read once by the trainer (`_take_rollout`): the queue
    carries only its name, so that no reader ever waits on a writer that died mid-message."""
    path = os.path.join(folder, f"rollout-{step}-{time.monotonic_ns()}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(rollout, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(path + ".part", path)
    return path


def _take_rollout(path: str) -> Rollout:
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    return pickle.loads(data)  # the generator's own batch, in the run's private folder (not a user's file)


class InProcess:
    """The synchronous step (K = 0): sample, then train, in this process; nothing to start or
    stop. The null object of `AsyncRollouts`."""

    def train_step(self, e: Engine, rows: list[dict], seeds: list[int] | None, step: int) -> StepResult:
        return train_step(e, rows, seeds, step=step)

    def close(self) -> None:
        pass


@dataclass
class GeneratorSpec:
    """What the generator process needs to build its model and sampler (plain, picklable)."""

    model: str  # the run's model directory or hub id (the weights are replaced by the trainer's)
    dtype: str  # train.dtype
    device: str  # the trainer's device
    autocast: torch.dtype | None  # train.autocast, resolved
    rollout: RolloutConfig
    prompt_column: str
    seed: int
    threads: int
    folder: str = ""  # where the weights and the batches are passed as files (`AsyncRollouts.folder`)


def _generator(spec: GeneratorSpec, requests, results) -> None:
    """The generator process: serve `weights` and `sample` messages until `stop` (or until
    the trainer is gone); an error goes back as one line, and ends the process."""
    from tqdm import tqdm

    from grpo.infra.hf import load_tokenizer
    from grpo.rollout import Sampler
    from grpo.train.models import load_causal_lm

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the trainer stops us
    # tqdm's default lock is a named semaphore the trainer's resource tracker would report as
    # leaked (a warning on the trainer's stderr) were this process killed: a thread's lock does.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(spec.threads)
    parent = multiprocessing.parent_process()
    try:
        tokenizer = load_tokenizer(spec.model)
        policy = load_causal_lm(spec.model, spec.dtype, device=spec.device)
        sampler = Sampler.from_config(
            tokenizer, spec.rollout, prompt_column=spec.prompt_column, autocast=spec.autocast, seed=spec.seed
        )
        sampler.hold_prepared = True  # a version's fused weights serve every batch it samples
        sampler.start(policy)  # rollout.sampler: vllm: the engine, in this process (none in the trainer's)
        version, idle, since = None, 0.0, time.perf_counter()
        while True:
            try:
                message = requests.get(timeout=POLL_S)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    shutil.rmtree(spec.folder, ignore_errors=True)  # what it left
                    return  # the trainer is gone (killed): nobody to sample for
                continue
            if message[0] == "stop":
                return
            if message[0] == "weights":
                _, version, path, layout, aliases = message
                weights = read_weights(path, layout)
                policy.load_state_dict({**weights, **{name: weights[tied] for name, tied in aliases.items()}})
                del weights
                continue
            _, step, rows, seeds = message
            idle += time.perf_counter() - since  # waiting for a request and its weights
            start = time.perf_counter()
            rollout = sampler.sample(policy, rows, seeds, step=step, version=version)
            if rollout.sampled_logprobs is None:
                raise UserError(
                    "rollout.async: the sampler chose transformers' generate (the model is not one the fast sampler "
                    "supports), which returns no log-probs; the ratio of a stale batch needs the sampling policy's"
                )
            rollout.policy_version = version
            seconds = {"generate": time.perf_counter() - start, "idle": idle}
            results.put(("rollout", step, _put_rollout(spec.folder, step, rollout.to("cpu")), seconds))
            idle, since = 0.0, time.perf_counter()
    except BaseException as err:  # anything: the trainer must hear of it, not wait for a batch
        message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {first_line(err)}"
        results.put(("error", message))


class AsyncRollouts:
    """The trainer's side of asynchronous rollouts: starts the generator with the policy's
    current weights, keeps it `ahead` steps ahead (requests and weights after each update),
    takes each step's batch from it, drops a batch staler than K and has it sampled again.
    Every step's metrics gain async/staleness (the trained batch's), async/staleness_max (the
    stalest batch received in the step, dropped ones included), async/dropped, the trainer's
    async/queue_wait_s and async/push_s (copying and sending the weights), and the
    generator's async/generator_wait_s (idle before it sampled the batch); time/generate is
    the generator's sampling time and time/step the step's wall time."""

    def __init__(self, c: Config, e: Engine, stream: PromptStream, rows: list[dict], start: int, *, ahead: int = 0):
        assert e.world.world_size == 1, "refused at launch (grpo.infra.distributed.check_launch)"
        a = c.rollout.async_
        self.max_staleness, self.push_every, self.timeout = a.max_staleness, a.push_every, a.timeout
        self.ahead = ahead or lookahead(c)  # `ahead`: a test's schedule, beyond what K allows
        self.prompts_per_step, self.steps = c.rollout.prompts_per_step, c.train.steps
        self.seed, self.seed_per_prompt = c.seed, c.rollout.seed_per_prompt
        # The steps ahead take their rows from a stream of their own, at the trainer's position:
        # the trainer's stream (and so its checkpoint) stays at the steps it trained.
        self.rows_ahead = PromptStream(rows, seed=c.seed, shuffle=c.data.shuffle)
        self.rows_ahead.load_state_dict(stream.state_dict())
        self.requested: dict[int, tuple[list[dict], list[int] | None]] = {}  # step -> its rows and seeds
        self.ready: dict[int, tuple[Rollout, dict]] = {}  # batches received before their step
        self.next_request, self.pushed = start, None  # the next step to request; the version the generator holds
        # The files the weights and batches travel in (module doc), in memory where /dev/shm is.
        self.folder = weights_folder()
        self.pushes = 0
        spec = GeneratorSpec(
            model=c.model,
            dtype=c.train.dtype,
            device=str(e.device),
            autocast=e.compute_dtype,
            rollout=c.rollout,
            prompt_column=c.data.prompt_column,
            seed=c.seed,
            threads=a.threads,
            folder=self.folder,
        )
        context = torch.multiprocessing.get_context("spawn")
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(
            target=_generator, args=(spec, self.requests, self.results), name=NAME, daemon=True
        )
        self.process.start()
        self._push(e)
        for _ in range(self.ahead + 1):  # this step and the `ahead` after it
            self._request_next()

    def _push(self, e: Engine) -> float:
        """Send the policy's weights; the seconds it took. Each tensor is copied once, straight
        into one file of the run's folder (the trainer goes on changing its own; the queue
        then passes its name, not the bytes), and tied tensors (an embedding and its LM head)
        once for all their names."""
        start = time.perf_counter()
        weights, aliases, first = {}, {}, {}
        for name, tensor in e.policy.state_dict().items():
            where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
            if where in first:
                aliases[name] = first[where]
                continue
            first[where] = name
            weights[name] = tensor
        self.pushes += 1
        path = os.path.join(self.folder, f"weights-{self.pushes}.bin")
        layout = write_weights(path, weights)
        self.requests.put(("weights", e.version, path, layout, aliases))
        self.pushed = e.version
        return time.perf_counter() - start

    def _request(self, step: int) -> None:
        rows, seeds = self.requested[step]
        self.requests.put(("sample", step, rows, seeds))

    def _request_next(self) -> None:
        """Request the next step's batch (its rows from the stream ahead), unless the run ends first."""
        step = self.next_request
        if step >= self.steps:
            return
        rows = self.rows_ahead.take(self.prompts_per_step)
        seeds = [prompt_seed(self.seed, step, i) for i in range(len(rows))] if self.seed_per_prompt else None
        self.requested[step] = (rows, seeds)
        self._request(step)
        self.next_request += 1

    def _receive(self, deadline: float) -> tuple[int, Rollout, dict]:
        """The generator's next batch; a one-line UserError when it failed, died, or sent
        nothing before `deadline`."""
        while True:
            try:
                message = self.results.get(timeout=max(min(POLL_S, deadline - time.monotonic()), 0.01))
            except queue.Empty:
                if not self.process.is_alive():
                    raise self._gone() from None
                if time.monotonic() >= deadline:
                    raise UserError(
                        f"rollout.async: the generator sent no batch in {self.timeout:g} s (rollout.async.timeout): "
                        "it hangs, or samples slower than that"
                    ) from None
                continue
            if message[0] == "error":
                raise UserError(f"rollout.async: the generator failed: {message[1]}")
            got, path, seconds = message[1:]
            return got, _take_rollout(path), seconds

    def _gone(self) -> UserError:
        """Why the generator process is no longer there, in one line."""
        code = self.process.exitcode
        if code == UNGUARDED:
            error = UserError(REFUSED)
            _plain_if_uncaught(error)
            return error
        return UserError(
            f"rollout.async: the generator process died (exit code {code}) without a word: killed, out of memory, "
            "or stopped as it started (its error is above)"
        )

    def _take(self, e: Engine, step: int) -> tuple[Rollout, dict]:
        """Step `step`'s batch, within K optimizer steps of the current weights, and what it
        cost to get: stale batches are dropped and sampled again with the current weights."""
        waited, dropped, stalest = 0.0, 0, 0
        while True:
            if step not in self.ready:
                start = time.perf_counter()
                deadline = time.monotonic() + self.timeout
                while step not in self.ready:
                    got, rollout, seconds = self._receive(deadline)
                    self.ready[got] = (rollout, seconds)
                waited += time.perf_counter() - start
            rollout, seconds = self.ready.pop(step)
            staleness = e.version - rollout.policy_version  # optimizer steps the sampling weights lag
            stalest = max(stalest, staleness)
            if staleness <= self.max_staleness:
                break
            dropped += 1
            if self.pushed != e.version:
                self._push(e)
            self._request(step)  # the same rows and seeds, with the current weights
        metrics = {
            "async/staleness": staleness,
            "async/staleness_max": stalest,
            "async/dropped": dropped,
            "async/queue_wait_s": waited,
            "async/generator_wait_s": seconds["idle"],
        }
        return rollout, {**metrics, "time/generate": seconds["generate"]}

    def train_step(self, e: Engine, rows: list[dict], seeds: list[int] | None, step: int) -> StepResult:
        """One step on a batch the generator sampled: take it (waiting, dropping), score and
        learn from it, then send the new weights (when due) and the next request."""
        start = time.perf_counter()
        assert self.requested[step] == (rows, seeds), "the batch requested ahead is not the step's"  # one stream
        rollout, taken = self._take(e, step)
        del self.requested[step]
        result = train_step(e, rows, seeds, step, sampled=rollout)
        push = self._push(e) if e.version - self.pushed >= self.push_every else 0.0
        self._request_next()
        result.metrics.update(taken)
        result.metrics.update({"async/push_s": push, "time/step": time.perf_counter() - start})
        return result

    def close(self) -> None:
        """Stop the generator; what it sampled ahead is discarded (a resume samples it again)."""
        if self.process.is_alive():
            try:
                self.requests.put(("stop",))
            except (OSError, ValueError):
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        for q in (self.requests, self.results):
            q.cancel_join_thread()  # nothing left to flush to a process that is gone
            q.close()
        shutil.rmtree(self.folder, ignore_errors=True)  # weights it never read, batches never taken


def rollouts_for(c: Config, e: Engine, stream: PromptStream, rows: list[dict], start: int) -> InProcess | AsyncRollouts:
    """Where a run's batches come from: this process (K = 0), or a generator process."""
    if c.rollout.async_.max_staleness == 0:
        return InProcess()
    return AsyncRollouts(c, e, stream, rows, start)


def summary(metrics: list[dict]) -> dict:
    """A run's staleness and drops, for summary.json (empty for a synchronous run)."""
    if not metrics or "async/staleness" not in metrics[0]:
        return {}
    staleness = [m["async/staleness"] for m in metrics]
    return {
        "async": {
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(m["async/staleness_max"] for m in metrics),
            "dropped": sum(m["async/dropped"] for m in metrics),
            "queue_wait_s": math.fsum(m["async/queue_wait_s"] for m in metrics),
        }
    }
