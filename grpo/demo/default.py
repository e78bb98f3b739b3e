"""`grpo demo`: DeepSeekMath's findings, reproduced on a CPU with no download.

A tiny model warmed up on addition (SFT) until it solves some problems sometimes is measured
(pass@k, maj@k for k up to 64), trained, and measured again: (1) RL raises Maj@K, not Pass@K;
(2) GRPO against PPO from the same base, at equal prompts (and with `full` or
`equal_tokens`, equal generated tokens): memory held against tokens generated; (3) GRPO on a
neural reward model trained on the base's own samples, its true accuracy beside the reward
it optimised; (4) with `full`, outcome against process supervision (Fig. 5) and iterative
RL (Fig. 6). Every RL arm runs over `seeds` seeds, each run in its own process; the report
says from the numbers whether each finding was reproduced (`grpo.demo.findings`).

Deliberate deviation: GRPO on the neural reward model has its own learning rate and a KL
coefficient ten times the paper's (`rm_policy_lr`, `rm_policy_beta`), since with the rule
arm's this toy reward model is hacked within a few dozen steps (benchmarks/README.md).
What it shows and writes: docs/demo.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from grpo.config.fields import opt
from grpo.errors import UserError
from grpo.infra.child import run_starter, train_in_child
from grpo.infra.contain import run_workers
from grpo.infra.host import describe_host
from grpo.demo.summary import arm_entry, by_digits, model_entry
from grpo.demo.findings import ARM_LABELS, ARM_NAMES, OUTCOME, PROCESS, findings, rm_arm, rm_arms, rm_label
from grpo.tasks import arithmetic, load_task

if TYPE_CHECKING:
    from grpo.eval.runner import Verifier

# The demo's task, named as any task is: its verifier judges every evaluation and the reward
# model's comparisons. The RL runs reward it with the built-in reward `arithmetic_correct`,
# the same function as the task's verifier; the process arm with `arithmetic_steps`.
TASK = "arithmetic"


@dataclass
class DemoConfig:
    """The demo's budget. The defaults are sized for minutes on a laptop CPU (benchmarks/README.md has the times);
    `full` adds the neural reward model, the supervision and the iterative-RL comparisons
    (their own budget below).
    The RL settings were chosen on problems outside the evaluation set, GRPO's and PPO's
    alike: benchmarks/README.md ("grpo demo") records what was tried and what it measured."""

    seed: int = opt(0, "The seed of every stage: the base's, and the first RL run's of each arm.")
    seeds: int = opt(5, "RL runs per arm, with seeds seed, seed + 1 and so on; 1 for a quick look.")
    digits: list[int] = opt([2, 3], "Operand lengths, mixed evenly (the base's training and every problem set).")
    sft_steps: int = opt(460, "SFT updates of the base: fewer, a weaker model; more, less left for RL to find.")
    eval_prompts: int = opt(100, "Held-out problems for pass@k and maj@k (split evenly over the digits).")
    n: int = opt(64, "Samples per problem: k goes up to n.")
    ks: list[int] = opt([1, 2, 4, 8, 16, 32, 64], "The k of pass@k and maj@k.")
    eval_temperature: float = opt(0.7, "The evaluation's sampling temperature (DeepSeekMath Fig. 7 samples at 0.7).")
    train_prompts: int = opt(8000, "The RL prompt pool (drawn with a seed apart from the evaluation set's).")
    steps: int = opt(150, "RL steps per run.")
    prompts_per_step: int = opt(32, "Prompts per step of GRPO and of PPO at equal prompts.")
    group_size: int = opt(8, "GRPO's G; PPO samples one completion per prompt.")
    temperature: float = opt(0.7, "The RL runs' sampling temperature: the evaluation's.")
    minibatches: int = opt(4, "GRPO's optimizer steps per RL step (each on a part of the step's samples).")
    max_new_tokens: int = opt(36, "Longest completion: a 3-digit solution is 32 tokens with its EOS.")
    lr: float = opt(1e-4, "GRPO's learning rate (higher ones wreck the warmed-up model).")
    warmup_steps: int = opt(10, "Learning-rate warm-up of every RL run, in optimizer steps.")
    schedule: str = opt(
        "cosine",
        "Learning-rate schedule of every RL run after its warm-up (constant, linear or cosine): a decay to 0 "
        "ends each run on a settled policy rather than on one step of a constant-rate walk.",
    )
    beta: float = opt(0.04, "KL coefficient of every RL run.")
    # PPO's own settings, tuned on problems outside the evaluation set: the policy's and the
    # critic's learning rates, GAE's lambda and the epochs over each batch. The critic starts
    # from the base (its backbone; the scalar head is new), as is usual.
    ppo_lr: float = opt(3e-5, "PPO's policy learning rate.")
    ppo_value_lr: float = opt(1e-3, "PPO's critic learning rate.")
    ppo_lam: float = opt(0.95, "PPO's GAE lambda.")
    ppo_epochs: int = opt(1, "PPO's epochs over each step's batch.")
    ppo_minibatches: int = opt(2, "PPO's optimizer steps per epoch.")
    micro_batch_size: int = opt(
        256, "Completions per pass, the same for every run, in every forward pass and in generation."
    )
    parallel: int = opt(2, "Runs trained at once, each on one thread (1: one at a time, on torch's threads).")
    equal_tokens: bool = opt(
        False,
        "Also PPO at equal generated tokens (G times GRPO's prompts, the costliest arm: its critic over G times "
        "the answers), over `seeds` seeds; on with `full`, over `full_seeds`.",
    )
    neural_rm: bool = opt(
        False, "Also a GRPO run driven by a reward model trained on the base's own answers (on with `full`)."
    )
    rm_prompts: int = opt(5000, "Problems the base model answers to make the reward model's comparisons.")
    rm_samples: int = opt(8, "The base's samples per such problem.")
    rm_epochs: int = opt(4, "The reward model's epochs over its comparisons (at lr 1e-3).")
    # GRPO on the reward model: its own learning rate and KL coefficient, chosen by measurement
    # (benchmarks/README.md, "grpo demo"): with the rule arm's, the policy hacks the reward
    # model within a few dozen steps, and iterative RL's update then finds no right answer.
    rm_policy_lr: float = opt(3e-5, "GRPO's learning rate on the neural reward model.")
    rm_policy_beta: float = opt(0.4, "GRPO's KL coefficient on the neural reward model.")
    full: bool = opt(
        False,
        "Also outcome vs process supervision and iterative RL on the neural reward model, over `full_seeds` (longer).",
    )
    # --full's arms. The outcome arm is the GRPO arm's own runs of the same seeds (not
    # retrained); every arm has the GRPO arm's steps, prompts and samples.
    full_seeds: int = opt(3, "Seeds of --full's arms: seed, seed + 1, ...; at most `seeds` (the outcome arm's).")
    rm_iterations: list[int] = opt(
        [1, 2],
        "--full's iterative-RL arms: GRPO on the neural reward model with this many iterations each "
        "(1: the reward model fixed), the same steps split evenly between them; [1, 2, 3] adds a third "
        "arm, and its runs' time.",
    )
    # Iterative RL's reward-model update between iterations (reward_model_update.*), chosen by
    # measurement: benchmarks/README.md ("grpo demo") records the sizes tried.
    rm_update_prompts: int = opt(256, "Problems the policy answers for the reward model's new comparisons, per update.")
    rm_update_samples: int = opt(8, "The policy's samples per such problem.")
    rm_update_pairs: int = opt(4, "Most right-over-wrong comparisons from one problem's samples.")
    rm_update_epochs: int = opt(6, "The reward model's epochs over each update's comparisons (new and replayed).")
    rm_update_lr: float = opt(1e-3, "The reward model's learning rate in each update (its first training's).")


# `grpo demo --quick`: a tiny budget that runs every stage, as a smoke run (docs/demo.md has its time).
QUICK = dict(
    sft_steps=300,
    eval_prompts=12,
    n=8,
    ks=[1, 2, 4, 8],
    train_prompts=64,
    steps=4,
    prompts_per_step=4,
    group_size=4,
    rm_prompts=64,
    rm_update_prompts=8,
)


def quick(config: DemoConfig) -> DemoConfig:
    """`config` on the QUICK budget, with at most 2 seeds."""
    return dataclasses.replace(config, **copy.deepcopy(QUICK), seeds=min(config.seeds, 2))


# The arms over seeds: name -> label (the report's names for them).
ARMS = ARM_NAMES


def _seeds(first: int, count: int) -> list[int]:
    return [first + i for i in range(count)]


def _arm_seeds(c: DemoConfig) -> dict[str, list[int]]:
    """The main arms and the seeds of each: GRPO and PPO at equal prompts over `seeds`; PPO at
    equal generated tokens (as long as GRPO's run, and a critic besides) only when asked, over
    `seeds` with `equal_tokens`, over `full_seeds` with `full`: the default demo stays short."""
    arms = {"grpo": _seeds(c.seed, c.seeds), "ppo": _seeds(c.seed, c.seeds)}
    if c.equal_tokens or c.full:
        arms["ppo_equal_tokens"] = _seeds(c.seed, c.seeds if c.equal_tokens else min(c.full_seeds, c.seeds))
    return arms


def _prompts_per_step(c: DemoConfig, arm: str) -> int:
    """PPO with equal generated tokens takes G times the prompts; the other arms take c's."""
    return c.prompts_per_step * (c.group_size if arm == "ppo_equal_tokens" else 1)


def _train_config(
    c: DemoConfig, output_dir: Path, base: str, data: str, arm: str, rewards: list[dict], seed: int
) -> dict:
    """The run's config: GRPO and the PPO arms differ only where the algorithms differ, in
    PPO's own settings and in the budget (PPO with equal tokens takes G times the prompts)."""
    ppo = arm.startswith("ppo")
    config = {
        "algorithm": "ppo" if ppo else "grpo",
        "model": base,
        "seed": seed,
        "output_dir": str(output_dir),
        "data": {"path": data},
        "rewards": rewards,
        "rollout": {
            "group_size": 1 if ppo else c.group_size,
            "prompts_per_step": _prompts_per_step(c, arm),
            "max_new_tokens": c.max_new_tokens,
            "temperature": c.temperature,
            "generation_batch_size": c.micro_batch_size,
        },
        "train": {
            "steps": c.steps,
            "lr": c.ppo_lr if ppo else c.lr,
            "warmup_steps": c.warmup_steps,
            "schedule": c.schedule,
            "minibatches": c.minibatches,
            "micro_batch_size": c.micro_batch_size,
            "sample_every": 50,
            "log_every": 25,
            "gradient_checkpointing": False,
        },  # a ~100k-parameter model: memory is not what binds
        "loss": {"beta": c.beta},
    }
    if ppo:
        config["train"]["epochs"] = c.ppo_epochs
        config["train"]["minibatches"] = c.ppo_minibatches
        config["loss"]["lam"] = c.ppo_lam
        config["value"] = {"lr": c.ppo_value_lr}
    return config


def _evaluate(model_dir: str, rows: list[dict], verifier: Verifier, c: DemoConfig, progress: bool) -> dict:
    from grpo.eval.runner import evaluate_saved

    return evaluate_saved(
        model_dir,
        rows,
        n=c.n,
        ks=c.ks,
        verifier=verifier,
        temperature=c.eval_temperature,
        max_new_tokens=c.max_new_tokens,
        seed=c.seed,
        progress=progress,
    )


def _comparisons_from_base(base: str, rows: list[dict], verifier: Verifier, c: DemoConfig) -> list[dict]:
    """The base model's own samples, correct (by the task's verifier) preferred over incorrect, per problem."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo.config import RolloutConfig
    from grpo.infra.hf import load_tokenizer
    from grpo.rollout import Sampler

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    rollout = RolloutConfig(group_size=c.rm_samples, max_new_tokens=c.max_new_tokens, temperature=1.0)
    sampler = Sampler.from_config(load_tokenizer(base), rollout, prompt_column="prompt")
    rng = random.Random(c.seed)
    pairs = []
    with torch.random.fork_rng():
        torch.manual_seed(c.seed)
        for start in range(0, len(rows), 32):
            batch = sampler.sample(model, rows[start : start + 32])
            for g in range(0, len(batch), c.rm_samples):
                group = batch.completions[g : g + c.rm_samples]
                verdicts = verifier.check_all(group, batch.rows[g])
                right = [completion for completion, ok in zip(group, verdicts) if ok]
                wrong = [completion for completion, ok in zip(group, verdicts) if not ok]
                for chosen, rejected in list(zip(right, wrong))[:2]:
                    pairs.append({"prompt": batch.rows[g]["prompt"], "chosen": chosen, "rejected": rejected})
    rng.shuffle(pairs)
    return pairs


def _train_reward_model(c: DemoConfig, out: Path, base: str, verifier: Verifier, progress: bool) -> dict | str:
    """A reward model (the base with a scalar head) on the base's own right and wrong answers;
    its held-out numbers, or the reason it could not be trained."""
    from grpo.rewards.model import RewardModel, split_pairs

    pairs = _comparisons_from_base(
        base, arithmetic.make_rows(c.rm_prompts, seed=c.seed + 3000, digits=c.digits), verifier, c
    )
    if len(pairs) < 10:
        return f"the base model's samples gave only {len(pairs)} right/wrong pairs to learn from"
    train_pairs, held_out = split_pairs(pairs, 0.2, seed=c.seed)
    rm = RewardModel.from_base(base, seed=c.seed)
    rm.fit(train_pairs, lr=RM_LR, epochs=c.rm_epochs, batch_size=16, seed=c.seed, progress=progress)
    rm.save(out / "reward_model")
    # Iterative RL replays 10% of the reward model's history at each update: its own
    # training comparisons are the first of it.
    (out / RM_PAIRS).write_text("".join(json.dumps(pair) + "\n" for pair in train_pairs))
    return {"pairs": len(train_pairs), **{f"held_out_{k}": v for k, v in rm.evaluate(held_out).items()}}


# The demo's reward model's learning rate, and where its training comparisons are saved
# (for iterative RL's replay).
RM_LR, RM_PAIRS = 1e-3, "data/rm_pairs.jsonl"


def _rm_config(c: DemoConfig, output_dir: Path, base: str, data: str, out: Path, seed: int, iterations: int) -> dict:
    """GRPO on the neural reward model's score alone (the rule watched beside it, weight 0);
    with several iterations the reward model keeps learning between them (DeepSeekMath
    §4.1.4): from the policy's fresh samples labelled by the task's verifier, with 10% of its
    history replayed, its original comparisons included; the reference is reset to the policy."""
    rewards = [
        {"model": str(out / "reward_model"), "weight": 1.0},
        {"function": "arithmetic_correct", "weight": 0.0},
    ]  # weight 0: watched, not trained on
    config = _train_config(c, output_dir, base, data, "grpo", rewards, seed)
    config["train"]["lr"], config["loss"]["beta"] = c.rm_policy_lr, c.rm_policy_beta
    if iterations > 1:
        config["train"]["iterations"] = iterations
        config["reward_model_update"] = {
            "verifier": "arithmetic_correct",
            "data": str(out / RM_PAIRS),
            "replay": 0.1,
            "prompts": c.rm_update_prompts,
            "samples_per_prompt": c.rm_update_samples,
            "max_pairs_per_prompt": c.rm_update_pairs,
            "epochs": c.rm_update_epochs,
            "lr": c.rm_update_lr,
        }
    return config


def _process_config(c: DemoConfig, output_dir: Path, base: str, data: str, seed: int) -> dict:
    """GRPO with process supervision: the task's per-step verifier as the reward (§4.1.3)."""
    rewards = [{"function": "arithmetic_steps", "weight": 1.0}, {"function": "arithmetic_correct", "weight": 0.0}]
    config = _train_config(c, output_dir, base, data, "grpo", rewards, seed)
    config["loss"]["supervision"] = "process"
    return config


@dataclass
class Job:
    name: str  # its directory under the output: "grpo/seed-0", "grpo-rm", ...
    label: str  # for the progress line
    config: dict


def train_all(jobs: list[Job], out: Path, parallel: int, say) -> tuple[dict[str, dict], dict[str, str]]:
    """Train every job in its own process, `parallel` at a time (each on one thread when more
    than one); ({name: the run's summary with its metrics}, {name: why it failed}). A line per
    finished run. A failed run does not stop the others: what they measured is kept. The runs
    fork from one helper that has imported torch and transformers once (`run_starter`)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    threads = 1 if parallel > 1 else None
    models = list(dict.fromkeys(str(job.config["model"]) for job in jobs))

    def train(job: Job) -> dict:
        path = out / f"{job.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        return train_in_child(job.config, path, progress=False, threads=threads, starter=starter)

    done: dict[str, dict] = {}
    failed: dict[str, str] = {}
    with run_starter(threads, models) as starter, ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {pool.submit(train, job): job for job in jobs}
        try:
            for future in as_completed(futures):
                job = futures[future]
                try:
                    run = done[job.name] = future.result()
                except UserError as err:
                    failed[job.name] = str(err)
                    say(f"      {job.label}: FAILED ({err})")
                    continue
                rewards = [m["reward/mean"] for m in run["metrics"]]
                head, tail = rewards[: max(1, len(rewards) // 10)], rewards[-max(1, len(rewards) // 10) :]
                say(
                    f"      {job.label}: {run['time_s']:.0f} s, mean reward {sum(head) / len(head):.3f} -> "
                    f"{sum(tail) / len(tail):.3f} ({len(done) + len(failed)}/{len(jobs)})"
                )
        except BaseException:  # Ctrl-C: no queued run starts; the running ones got it too and save their last step
            for future in futures:
                future.cancel()
            raise
    return done, failed


def fresh_output(output: str | Path, overwrite: bool, command: str) -> Path:
    """The demo's output directory, created empty: an earlier demo's output there (a directory
    holding data/ and base/) is replaced only with `overwrite`, anything else never."""
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        earlier_demo = (out / "data").is_dir() and (out / "base").is_dir()
        if not (overwrite and earlier_demo):
            hint = (
                "pass --overwrite to replace it"
                if earlier_demo
                else "it is not an earlier demo's output; choose another --output"
            )
            raise UserError(f"{command}: '{out}' is not empty; {hint}")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _check(c: DemoConfig) -> None:
    """The demo's own settings that cannot run, in one line each, before anything is written."""
    if c.seeds < 1 or c.full_seeds < 1:
        raise UserError(f"demo: seeds and full_seeds must be at least 1, got {c.seeds} and {c.full_seeds}")
    if c.full and (
        not c.rm_iterations
        or len(set(c.rm_iterations)) < len(c.rm_iterations)
        or not all(1 <= i <= c.steps for i in c.rm_iterations)
    ):
        raise UserError(
            f"demo: rm_iterations must be distinct counts between 1 and steps ({c.steps}), got {c.rm_iterations}"
        )


@dataclass
class _DemoRun:
    """One demo as its stages see it: the settings and the output folder, and what each stage
    leaves for the next (the problems, the base, the runs to train, what they measured)."""

    c: DemoConfig
    out: Path
    say: Callable[..., None]
    progress: bool
    stages: int  # the progress lines' count: [i/stages]
    started: float = dataclasses.field(default_factory=time.perf_counter)
    verifier: Verifier | None = None
    eval_rows: list[dict] = dataclasses.field(default_factory=list)
    train_data: str = ""
    base: str = ""
    base_info: dict = dataclasses.field(default_factory=dict)
    base_results: dict = dataclasses.field(default_factory=dict)
    main_arms: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    jobs: list[Job] = dataclasses.field(default_factory=list)
    skipped_rm: str | None = None
    rm_info: dict | str | None = None
    # The arms beside the main ones, each over its own seeds: name -> (label, config of a seed's run).
    extra: dict[str, tuple[str, Callable[[Path, int], dict]]] = dataclasses.field(default_factory=dict)
    iterations: dict[str, int] = dataclasses.field(default_factory=dict)  # a reward-model arm -> its iterations
    extra_seeds: list[int] = dataclasses.field(default_factory=list)
    runs: dict[str, dict] = dataclasses.field(default_factory=dict)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    evaluated: dict[str, dict] = dataclasses.field(default_factory=dict)
    summary: dict = dataclasses.field(default_factory=dict)


def _write_data(d: _DemoRun) -> None:
    """The task's verifier, and the problems under data/: the evaluation's and the RL prompt pool."""
    from grpo.eval.runner import task_verifier

    c = d.c
    task = load_task(TASK)
    d.verifier = task_verifier(task)
    d.eval_rows = arithmetic.make_rows(c.eval_prompts, seed=c.seed + 1000, digits=c.digits)
    train_rows = arithmetic.make_rows(c.train_prompts, seed=c.seed + 2000, digits=c.digits)
    data = d.out / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows))
    (data / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in d.eval_rows))
    d.train_data = str(data / "train.jsonl")


def _warm_up(d: _DemoRun) -> None:
    """The base model: a tiny Llama warmed up on addition by SFT."""
    from grpo.train.sft import SFTConfig, sft

    c = d.c
    lengths = " and ".join(f"{digits}-digit" for digits in c.digits)
    d.say(f"[1/{d.stages}] SFT warm-up of a tiny Llama on {lengths} addition (the base model)")
    d.base_info = sft(
        d.out / "base", SFTConfig(seed=c.seed, steps=c.sft_steps, digits=list(c.digits)), progress=d.progress
    )
    d.base = str(d.out / "base")


def _evaluate_base(d: _DemoRun) -> None:
    """pass@k and maj@k of the base, the point every arm starts from."""
    d.say(f"[2/{d.stages}] Evaluating the base model: {d.c.n} samples x {d.c.eval_prompts} problems")
    d.base_results = _evaluate(d.base, d.eval_rows, d.verifier, d.c, d.progress)


def _plan_main_arms(d: _DemoRun) -> None:
    """A run per seed of each main arm: GRPO and PPO on the rule's reward."""
    c, rule = d.c, [{"function": "arithmetic_correct", "weight": 1.0}]
    d.main_arms = _arm_seeds(c)
    for arm, seeds in d.main_arms.items():
        label = ARMS[arm]
        for seed in seeds:
            config = _train_config(c, d.out / arm / f"seed-{seed}", d.base, d.train_data, arm, rule, seed)
            d.jobs.append(Job(f"{arm}/seed-{seed}", f"{label}, seed {seed}", config))


def _reward_model(d: _DemoRun) -> None:
    """With --neural-rm or --full, a reward model from the base's own samples (or why none)."""
    c = d.c
    d.skipped_rm = None if c.neural_rm or c.full else "not asked (--neural-rm or --full)"
    if d.skipped_rm is None:  # full needs it: iterative RL's arms run on it
        d.say(f"[3/{d.stages}] A neural reward model from the base's own samples (for GRPO driven by it alone)")
        d.rm_info = _train_reward_model(c, d.out, d.base, d.verifier, d.progress)
        if isinstance(d.rm_info, str):
            d.skipped_rm = d.rm_info
            d.say(f"      skipped: {d.rm_info}")


def _plan_extra_arms(d: _DemoRun) -> None:
    """A run per seed of the arms beside the main ones: process supervision (--full) and GRPO
    on the reward model (one arm per iteration count with --full), when it was trained."""
    c, out, base, train_data = d.c, d.out, d.base, d.train_data
    if c.full:
        d.extra[PROCESS] = (
            ARM_LABELS[PROCESS],
            lambda folder, seed: _process_config(c, folder, base, train_data, seed),
        )
    if isinstance(d.rm_info, dict):
        d.iterations = {rm_arm(i): i for i in (c.rm_iterations if c.full else [1])}
    for name, i in d.iterations.items():
        d.extra[name] = (
            rm_label(i),
            lambda folder, seed, i=i: _rm_config(c, folder, base, train_data, out, seed, i),
        )
    d.extra_seeds = _seeds(c.seed, min(c.full_seeds, c.seeds) if c.full else 1)
    for name, (label, make) in d.extra.items():
        for seed in d.extra_seeds:
            d.jobs.append(Job(f"{name}/seed-{seed}", f"{label}, seed {seed}", make(out / name / f"seed-{seed}", seed)))


def _train_runs(d: _DemoRun) -> None:
    """Every run, in processes of their own; a failed run of a main arm stops the demo, one of
    an extra arm leaves that arm out (the report says why)."""
    c = d.c
    # Longest first, so that runs side by side finish together: PPO with equal tokens (its
    # critic and its G times the prompts), the reward model's arms (its scoring, and the
    # updates of iterative RL), GRPO, process supervision, PPO with equal prompts.
    order = ("ppo_equal_tokens/", "grpo-rm", "grpo/", "grpo-", "ppo/")
    d.jobs.sort(key=lambda job: next(i for i, prefix in enumerate(order) if job.name.startswith(prefix)))
    at_once = f"{c.parallel} at a time, one thread each" if c.parallel > 1 else "one at a time"
    d.say(
        f"[{d.stages - 2}/{d.stages}] Training {len(d.jobs)} runs ({at_once}), {c.steps} steps each: "
        + "; ".join(
            f"{ARMS[arm]} {len(seeds)} seed(s) x {_prompts_per_step(c, arm)} prompts"
            for arm, seeds in d.main_arms.items()
        )
        + "".join(f"; {label} {len(d.extra_seeds)} seed(s)" for label, _ in d.extra.values())
    )
    d.runs, d.failed = train_all(d.jobs, d.out, c.parallel, d.say)
    lost = [name for name in d.failed if name.split("/")[0] in ARMS]  # the main comparison cannot be made without it
    if lost:
        raise UserError(
            f"demo: {len(lost)} run(s) failed, first {lost[0]}: {d.failed[lost[0]]} (the other runs are in {d.out})"
        )
    # An extra arm with a failed seed is left out whole (the report says why): its seeds are the others'.
    d.extra = {name: entry for name, entry in d.extra.items() if not any(f.startswith(f"{name}/") for f in d.failed)}


def _evaluate_runs(d: _DemoRun) -> None:
    """Every trained model on the evaluation's problems; the reward model's updates of each run."""
    d.say(f"[{d.stages - 1}/{d.stages}] Evaluating the {len(d.runs)} trained models")
    d.evaluated = {
        name: _evaluate(str(d.out / name / "final"), d.eval_rows, d.verifier, d.c, d.progress) for name in d.runs
    }
    for name, run in d.runs.items():
        updates = d.out / name / "reward_model_updates.jsonl"
        if updates.exists():
            run["rm_updates"] = [json.loads(line) for line in updates.read_text().splitlines()]


def _report(d: _DemoRun) -> None:
    """summary.json (each arm over its seeds, the findings), the plots and report.md."""
    from grpo.demo.report import write_report
    from grpo.eval.plots import plot_curves, plot_rewards

    c, out, runs, evaluated = d.c, d.out, d.runs, d.evaluated

    def over(arm: str, seeds: list[int]) -> dict:
        return arm_entry(
            [(seed, runs[f"{arm}/seed-{seed}"], evaluated[f"{arm}/seed-{seed}"]) for seed in seeds], d.eval_rows
        )

    d.say(f"[{d.stages}/{d.stages}] Writing the report")
    summary = d.summary = {
        "config": asdict(c),
        "host": describe_host(),  # hosts differ in speed and in float results: say which this was
        "sft": d.base_info,
        "time_s": None,
        "neural_rm_skipped": d.skipped_rm,
        "reward_model": d.rm_info if isinstance(d.rm_info, dict) else None,
        "failed": d.failed,
        "base": model_entry(d.base_results, None),
    }
    summary["base"]["by_digits"] = by_digits(d.base_results, d.eval_rows)
    for arm, seeds in d.main_arms.items():
        summary[arm] = over(arm, seeds)
    if c.full:  # outcome supervision: the GRPO arm's own runs of the extra arms' seeds
        summary[OUTCOME] = over("grpo", d.extra_seeds)
    for name in d.extra:
        summary[name] = over(name, d.extra_seeds)
        if name in d.iterations:
            summary[name]["iterations"] = d.iterations[name]
    summary["findings"] = findings(summary)
    _plots(out, summary, plot_curves, plot_rewards)
    summary["time_s"] = time.perf_counter() - d.started
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_report(out / "report.md", summary)
    d.say(f"Done in {summary['time_s'] / 60:.1f} min: {out / 'report.md'}")


# The demo, stage by stage; each reads what the ones before it left in the _DemoRun.
STAGES = (
    _write_data,
    _warm_up,
    _evaluate_base,
    _plan_main_arms,
    _reward_model,
    _plan_extra_arms,
    _train_runs,
    _evaluate_runs,
    _report,
)


@run_workers()  # any worker it starts here stops with it (each training run, in a process of its own, stops its own)
def demo(
    output: str | Path = "runs/demo",
    config: DemoConfig | None = None,
    *,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Run the whole demo, its `STAGES` in turn; return what summary.json holds. `overwrite`
    replaces an earlier demo's output (a directory holding its data/ and base/), never anything else."""
    c = config or DemoConfig()
    _check(c)
    out = fresh_output(output, overwrite, "demo")
    say = print if progress else (lambda *a, **k: None)
    d = _DemoRun(c, out, say, progress, stages=5 + (1 if c.neural_rm or c.full else 0))
    for stage in STAGES:
        stage(d)
    return d.summary


def _plots(out: Path, s: dict, plot_curves, plot_rewards) -> None:
    arms = {arm: label for arm, label in ARMS.items() if arm in s}
    names = {"base": "base (SFT)", **arms}
    plot_curves(
        {label: s[key] for key, label in names.items()},
        out / "pass_maj_at_k.png",
        title="Held-out addition problems (means over seeds)",
    )
    plot_rewards(
        {label: list(enumerate(s[arm]["reward"], start=1)) for arm, label in arms.items()},
        out / "rewards.png",
        ylabel="mean reward (fraction correct), mean over seeds",
    )
    curve = lambda values: list(enumerate(values, start=1))  # noqa: E731
    rms = rm_arms(s)
    if rms:  # the hacking curve: the score optimised against the truth, each arm in its colour
        plot_rewards(
            {f"true accuracy, {rm_label(i, short=True)}": curve(s[name]["true_accuracy"]) for i, name in rms},
            out / "neural_rm.png",
            ylabel="true accuracy of the samples (solid)",
            right={f"RM score, {rm_label(i, short=True)}": curve(s[name]["rm_score"]) for i, name in rms},
            right_label="reward model's score (dashed)",
            title="GRPO on the neural reward model, means over seeds",
        )
    if PROCESS in s:
        plot_rewards(
            {ARM_LABELS[name]: curve(s[name]["true_accuracy"]) for name in (OUTCOME, PROCESS)},
            out / "supervision.png",
            ylabel="true accuracy of the samples, mean over seeds",
        )
    if len(rms) > 1:
        plot_rewards(
            {rm_label(i, short=True): curve(s[name]["true_accuracy"]) for i, name in rms},
            out / "iterative.png",
            ylabel="true accuracy of the samples, mean over seeds",
        )
