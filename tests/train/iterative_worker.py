"""An iterative RL run (`grpo.train`) that records every update of the reward model, in this
process or in every process of a torchrun launch (tests/train/test_distributed.py):

    torchrun --standalone --nproc_per_node 2 -m tests.train.iterative_worker CONFIG OUT

OUT/rank-R.pt holds, per update, what process R sampled and labelled (`learn`'s arguments,
its part of the update's prompts), the update's statistics and its reward model's weights
after the update, so that a test can check that the processes' replicas agree, and that one
process learning from all their samples gets the same model.
"""

import os
import sys

import torch

import grpo
from grpo.train.iterative import RewardModelUpdater


def recording(records: list):
    """RewardModelUpdater.learn, recording each call into `records`."""
    learn = RewardModelUpdater.learn

    def recorded(self, prompts, completions, labels):
        stats = learn(self, prompts, completions, labels)
        weights = {k: v.detach().clone() for k, v in self.model.model.state_dict().items()}
        records.append(
            {"prompts": prompts, "completions": completions, "labels": labels, "stats": stats, "weights": weights}
        )
        return stats

    return recorded


if __name__ == "__main__":
    torch.set_num_threads(1)
    config, out = sys.argv[1:3]
    records = []
    RewardModelUpdater.learn = recording(records)
    grpo.train(config, progress=False)
    torch.save(records, os.path.join(out, f"rank-{os.environ.get('RANK', '0')}.pt"))
