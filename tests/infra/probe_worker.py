"""Each probe under torchrun, with process 1's copy planted broken (its packed layout, the
attention switch's registration, the critic's packing); writes every process's verdicts to OUT
(tests/infra/test_probes.py checks that they are the same).

    torchrun --standalone --nproc_per_node 2 -m tests.infra.probe_worker OUT
"""

import json
import sys

import torch

from grpo.infra import attention
from grpo.infra.distributed import init_world
from grpo.train import layouts, networks
from tests.train.test_packing import build


def plant() -> None:
    packed_positions, completion_states = layouts.packed_positions, networks.completion_states

    def refuses():
        raise ValueError("planted: no registration")

    layouts.packed_positions = lambda *args, **kwargs: packed_positions(*args, **kwargs).flip(0)  # wrong slots

    def states(backbone, batch, packed):
        out = completion_states(backbone, batch, packed)
        return out.flip(0) if packed else out

    networks.completion_states = states
    attention._register = refuses


def main(out: str) -> None:
    world = init_world(torch.device("cpu"), "gloo")
    if world.rank == 1:
        plant()
    model = build("llama")
    decided = layouts.decide_layouts(model, False, world=world)
    taken = [decided.plain, decided.checkpointed]
    switched = attention.enable(build("llama"), world)
    critic = networks.backbone_packs(build("llama").model, world)
    verdicts = world.gather_objects([taken, switched, critic])
    if world.is_main:
        with open(out, "w") as f:
            json.dump(verdicts, f)
    world.close()


if __name__ == "__main__":
    main(sys.argv[1])
