"""The demos behind `grpo demo`: `default` (DeepSeekMath's findings on a tiny model: SFT, GRPO
against PPO, a reward model, with --full process supervision and iterative RL), `tools` (a
model that learns to call a tool), `findings` (whether the default demo reproduced DeepSeekMath's
figures, from its numbers) and `report` (its report.md, in words)."""
