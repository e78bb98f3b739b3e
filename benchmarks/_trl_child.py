"""One TRL GRPOTrainer run, in its own process, for `bench_grpo_step.py`.

Usage (the benchmark writes the spec): python benchmarks/_trl_child.py SPEC.json RESULT.json

The spec names the model directory, the prompts JSONL, the reward function
("module:function", importable from `spec["pythonpath"]`; it gets the completions' token ids
as `completion_ids`, as TRL passes them) and the settings to match; a setting given as null
(gradient_checkpointing) or 0 (min_new_tokens) is left to TRL's default. The
result is one JSON object: TRL's version, the resolved settings that matter, and per step
the wall-clock time from `on_step_begin` to `on_step_end` (generation, scoring, reference
log-probs, loss, backward, clipping and the optimizer step: TRL's whole step), the
completion tokens generated, the time spent in `model.generate`, and the peak RSS so far.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import time
from pathlib import Path

from grpo.infra.memory import peak_rss_mb  # this process's own peak (VmHWM on Linux), as ours reports it


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, spec["pythonpath"])
    rss_at_start = peak_rss_mb()

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    print(
        f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}",
        file=sys.stderr,
        flush=True,
    )

    module_name, function_name = spec["reward"].split(":")
    reward_fn = getattr(importlib.import_module(module_name), function_name)
    counter = {"completion_tokens": 0, "generate_s": 0.0}

    @functools.wraps(reward_fn)
    def counted_reward(prompts, completions, completion_ids=None, **columns):
        # TRL passes the completions' token ids to every reward function: count the
        # generated tokens here, without touching the trainer.
        if completion_ids is not None:
            counter["completion_tokens"] += sum(len(ids) for ids in completion_ids)
        return reward_fn(prompts, completions, completion_ids=completion_ids, **columns)

    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines() if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    # Activation checkpointing: as the spec says, or TRL's default (on) when it says null.
    checkpointing = (
        {}
        if spec.get("gradient_checkpointing", False) is None
        else {"gradient_checkpointing": spec.get("gradient_checkpointing", False)}
    )

    config = GRPOConfig(
        output_dir=spec["output_dir"],
        seed=spec["seed"],
        # One optimizer step = one generation round = prompts_per_step x G completions, all
        # in one forward/backward (our micro_batch_size 0): batch 32, no accumulation, so
        # generation_batch_size = 32 and steps_per_generation = 1.
        per_device_train_batch_size=spec["prompts_per_step"] * spec["group_size"],
        gradient_accumulation_steps=1,
        num_generations=spec["group_size"],
        num_iterations=1,  # mu = 1: one update per batch, old log-probs = current (no extra pass)
        max_steps=spec["steps"],
        # Sampling: min_new_tokens suppresses EOS for the first 64 tokens (the fixed-length
        # workloads); without it completions end where the model puts EOS.
        max_completion_length=spec["max_new_tokens"],
        generation_kwargs={"min_new_tokens": spec["min_new_tokens"]} if spec["min_new_tokens"] else None,
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        # Loss and optimizer.
        beta=spec["beta"],
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",  # ours is constant; TRL's default is linear decay
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # Machine and precision: CPU, fp32 (TRL defaults to bf16 and gradient checkpointing).
        use_cpu=True,
        bf16=spec.get("precision") == "bf16",  # accelerate's bf16 autocast; the weights stay fp32
        fp16=False,
        **checkpointing,
        model_init_kwargs={"dtype": "float32"},
        dataloader_num_workers=0,
        shuffle_dataset=False,  # the file's order, as ours takes them (bench_grpo_step.ours_config)
        # No evaluation, no saving, no reporting; log every step.
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []
            self.logs: list[dict] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            counter["completion_tokens"] = 0
            counter["generate_s"] = 0.0
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(
                {
                    "step": state.global_step,
                    "time/step": time.perf_counter() - self._start,
                    "time/generate": counter["generate_s"],
                    "tokens/completion": counter["completion_tokens"],
                    "memory/peak_mb": peak_rss_mb(),
                }
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.logs.append(
                    {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
                )

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=[counted_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )

    # Time model.generate inside TRL's step (an instance attribute shadows the method; on one
    # CPU process the trainer generates with this very object).
    policy = trainer.model
    original_generate = policy.generate

    @functools.wraps(original_generate)
    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original_generate(*args, **kwargs)
        finally:
            counter["generate_s"] += time.perf_counter() - t0

    policy.generate = timed_generate
    rss_before_train = peak_rss_mb()
    trainer.train()

    result = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "settings": {
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "generation_batch_size": config.generation_batch_size,
            "steps_per_generation": config.steps_per_generation,
            "num_generations": config.num_generations,
            "num_iterations": config.num_iterations,
            "max_completion_length": config.max_completion_length,
            "generation_kwargs": config.generation_kwargs,
            "temperature": config.temperature,
            "beta": config.beta,
            "learning_rate": config.learning_rate,
            "lr_scheduler_type": str(config.lr_scheduler_type),
            "loss_type": config.loss_type,
            "scale_rewards": config.scale_rewards,
            "optim": str(config.optim),
            "bf16": config.bf16,
            "gradient_checkpointing": config.gradient_checkpointing,
            "mask_truncated_completions": config.mask_truncated_completions,
            "max_grad_norm": config.max_grad_norm,
            "model_dtype": str(trainer.model.dtype),
            "reference_model": trainer.ref_model is not None,
        },
        "rss_at_start_mb": rss_at_start,
        "rss_before_train_mb": rss_before_train,
        "steps": timer.steps,
        "logs": timer.logs,
    }
    Path(result_path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
