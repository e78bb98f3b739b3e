"""A pinned 3-step trajectory of the tiny model: any unintended change of a number fails here.

Each run trains the tiny model of conftest.py for 3 steps and compares the per-step loss,
KL, grad norm (and PPO's value loss) with the values recorded below, to 1e-6. A change
that is meant to move these numbers updates the pins in the same commit and says why in
its message; the assertion prints the new values to paste in.
"""

import pytest

import grpo

KEYS = ("reward/mean", "loss", "kl", "grad_norm", "entropy", "value_loss")

RUNS = {
    # GRPO as shipped: group baseline, k3 KL in the loss, one epoch (ratio 1).
    "grpo": ("grpo", {}),
    # The old policy moves between updates: a pass for old log-probs, ratios off 1, clipping.
    "grpo-epochs": ("grpo", {"train": {"steps": 3, "lr": 1e-2, "epochs": 2, "minibatches": 2, "micro_batch_size": 5}}),
    # Process supervision: per-step rewards, normalised over the group.
    "grpo-process": (
        "grpo",
        {
            "rewards": [{"function": "tests.train.rewards_for_tests:sevens_steps"}],
            "loss": {"beta": 0.04, "supervision": "process"},
        },
    ),
    # Completions that stop at EOS (lengths differ: the mask and the aggregation matter),
    # sampled in chunks, the token-mean aggregation.
    "grpo-eos": (
        "grpo",
        {
            "rollout": {
                "group_size": 8,
                "prompts_per_step": 4,
                "max_new_tokens": 12,
                "min_new_tokens": 0,
                "generation_batch_size": 12,
            },
            "loss": {"beta": 0.04, "aggregation": "token-mean"},
        },
    ),
    # PPO: critic + GAE, k1 KL in the per-token reward, clipped value loss.
    "ppo": ("ppo", {"train": {"steps": 3, "lr": 1e-3, "epochs": 2}}),
}

PINS = {
    "grpo": [
        {"reward/mean": 0.0625, "loss": 0.0, "kl": 0.0, "grad_norm": 1.0061513185501099, "entropy": 2.8796498775482178},
        {
            "reward/mean": 0.1171875,
            "loss": 0.0005063917487859726,
            "kl": 0.012659814208745956,
            "grad_norm": 1.134406328201294,
            "entropy": 2.8670198917388916,
        },
        {
            "reward/mean": 0.125,
            "loss": 0.0012963861227035522,
            "kl": 0.03240950033068657,
            "grad_norm": 1.1252307891845703,
            "entropy": 2.845686912536621,
        },
    ],
    "grpo-eos": [
        {
            "reward/mean": 0.04296875,
            "loss": -0.1209113597869873,
            "kl": 0.0,
            "grad_norm": 0.9937147498130798,
            "entropy": 2.879413087726076,
        },
        {
            "reward/mean": 0.08203125,
            "loss": -0.15743905305862427,
            "kl": 0.011575727642707105,
            "grad_norm": 0.9193786978721619,
            "entropy": 2.8699324697818396,
        },
        {
            "reward/mean": 0.0859375,
            "loss": -0.3445515036582947,
            "kl": 0.022002085120277067,
            "grad_norm": 1.1842701435089111,
            "entropy": 2.8577759329196626,
        },
    ],
    "grpo-epochs": [
        {
            "reward/mean": 0.0625,
            "loss": 0.010428591165691614,
            "kl": 0.04061072552576661,
            "grad_norm": 0.9018126875162125,
            "entropy": 2.8523402884602547,
        },
        {
            "reward/mean": 0.0859375,
            "loss": 0.018273262459842954,
            "kl": 0.13751647528260946,
            "grad_norm": 0.7402713596820831,
            "entropy": 2.6779880821704865,
        },
        {
            "reward/mean": 0.0859375,
            "loss": -0.0055830348283052444,
            "kl": 0.17865887144580483,
            "grad_norm": 0.7534290254116058,
            "entropy": 2.7035961747169495,
        },
    ],
    "grpo-process": [
        {
            "reward/mean": 0.0740327462553978,
            "loss": 0.04472503811120987,
            "kl": 0.0,
            "grad_norm": 2.2934212684631348,
            "entropy": 2.8796498775482178,
        },
        {
            "reward/mean": 0.1402529776096344,
            "loss": 0.21551495790481567,
            "kl": 0.012353694066405296,
            "grad_norm": 2.551790237426758,
            "entropy": 2.8660964965820312,
        },
        {
            "reward/mean": 0.15758928656578064,
            "loss": 0.3257453739643097,
            "kl": 0.03815779834985733,
            "grad_norm": 2.800041437149048,
            "entropy": 2.84271502494812,
        },
    ],
    "ppo": [
        {
            "reward/mean": 0.015625,
            "loss": -0.041551147849531844,
            "kl": 0.0,
            "grad_norm": 1.4442952871322632,
            "entropy": 2.878035068511963,
            "value_loss": 0.0005718764732591808,
        },
        {
            "reward/mean": 0.109375,
            "loss": -0.028484265320003033,
            "kl": -0.012060340493917465,
            "grad_norm": 1.422824740409851,
            "entropy": 2.865623950958252,
            "value_loss": 0.005991871585138142,
        },
        {
            "reward/mean": 0.171875,
            "loss": -0.01920546218752861,
            "kl": 0.09698961675167084,
            "grad_norm": 1.773902416229248,
            "entropy": 2.8497517108917236,
            "value_loss": 0.007665917975828052,
        },
    ],
}


def trajectory(metrics):
    return [{k: m.get(k) for k in KEYS if m.get(k) is not None} for m in metrics]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_pinned_trajectory_has_not_moved(name, make_config):
    algorithm, sections = RUNS[name]
    sections = {"train": {"steps": 3, "lr": 1e-3}, **sections}
    result = grpo.train(make_config(algorithm, **sections), progress=False)
    got = trajectory(result.metrics)
    pinned = PINS.get(name)
    assert pinned is not None, f"no pin for {name!r}; the run gave\n{got!r}"
    assert len(got) == len(pinned) == 3
    for step, (g, p) in enumerate(zip(got, pinned), 1):
        assert set(g) == set(p), (name, step, g)
        for key in p:
            assert g[key] == pytest.approx(p[key], rel=1e-6, abs=1e-6), (
                f"{name} step {step} {key}: {g[key]!r} != pinned {p[key]!r}; the run gave\n{got!r}"
            )
