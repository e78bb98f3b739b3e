"""A pinned 3-step trajectory of the tiny model: any unintended change of a number fails here.

Each run trains the tiny model of conftest.py for 3 steps and compares the per-step loss,
KL, grad norm (and PPO's value loss) with the values recorded below, to 1e-4 relative (1e-6
absolute). Hosts round differently (AVX2, AVX-512 and AMX kernels): grpo-epochs' lr 1e-2 and
two epochs carry that to a 1.3e-5 relative difference in its third step's grad norm between an
Intel AMX host, where the pins were recorded, and an AMD AVX-512 one; a real change moves
these numbers by far more. A change
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
        {
            "reward/mean": 0.0625,
            "loss": -1.1175870895385742e-08,
            "kl": 0.0,
            "grad_norm": 1.0061513185501099,
            "entropy": 2.879650115966797,
        },
        {
            "reward/mean": 0.078125,
            "loss": 0.0003645066171884537,
            "kl": 0.009112830273807049,
            "grad_norm": 1.0142152309417725,
            "entropy": 2.866581439971924,
        },
        {
            "reward/mean": 0.11328125,
            "loss": 0.0011561214923858643,
            "kl": 0.028904035687446594,
            "grad_norm": 1.0364335775375366,
            "entropy": 2.848270893096924,
        },
    ],
    "grpo-eos": [
        {
            "reward/mean": 0.04296875,
            "loss": -0.12091132998466492,
            "kl": 0.0,
            "grad_norm": 0.9937148094177246,
            "entropy": 2.879413311298077,
        },
        {
            "reward/mean": 0.0625,
            "loss": -0.14553652703762054,
            "kl": 0.009118467458561893,
            "grad_norm": 0.7907246947288513,
            "entropy": 2.8694156235478623,
        },
        {
            "reward/mean": 0.09765625,
            "loss": -0.1267443299293518,
            "kl": 0.025052888525856867,
            "grad_norm": 0.9653111100196838,
            "entropy": 2.8612308502197266,
        },
    ],
    "grpo-epochs": [
        {
            "reward/mean": 0.0625,
            "loss": 0.0066024609841406345,
            "kl": 0.03569760173559189,
            "grad_norm": 0.8613808304071426,
            "entropy": 2.8576126247644424,
        },
        {
            "reward/mean": 0.1875,
            "loss": -0.020984219736419618,
            "kl": 0.22658217325806618,
            "grad_norm": 0.697095662355423,
            "entropy": 2.6067988723516464,
        },
        {
            "reward/mean": 0.2421875,
            "loss": 0.011466914787888527,
            "kl": 0.30240809032693505,
            "grad_norm": 1.0054515153169632,
            "entropy": 2.482261337339878,
        },
    ],
    "grpo-process": [
        {
            "reward/mean": 0.0740327462553978,
            "loss": 0.04472506791353226,
            "kl": 0.0,
            "grad_norm": 2.293421506881714,
            "entropy": 2.879650115966797,
        },
        {
            "reward/mean": 0.1036086231470108,
            "loss": 0.05555933713912964,
            "kl": 0.00985703244805336,
            "grad_norm": 2.1757309436798096,
            "entropy": 2.86552357673645,
        },
        {
            "reward/mean": 0.1406250149011612,
            "loss": -0.007275160402059555,
            "kl": 0.033989306539297104,
            "grad_norm": 2.3032195568084717,
            "entropy": 2.843860149383545,
        },
    ],
    "ppo": [
        {
            "reward/mean": 0.0625,
            "loss": -0.06890436739195138,
            "kl": 0.0,
            "grad_norm": 1.589200496673584,
            "entropy": 2.879305839538574,
            "value_loss": 0.002202342380769551,
        },
        {
            "reward/mean": 0.03125,
            "loss": -0.03420630423352122,
            "kl": 0.04134673997759819,
            "grad_norm": 1.645622432231903,
            "entropy": 2.8591203689575195,
            "value_loss": 0.0015830445918254554,
        },
        {
            "reward/mean": 0.09375,
            "loss": -0.02228562906384468,
            "kl": 0.017549168318510056,
            "grad_norm": 1.832906723022461,
            "entropy": 2.8516592979431152,
            "value_loss": 0.006433594040572643,
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
            assert g[key] == pytest.approx(p[key], rel=1e-4, abs=1e-6), (
                f"{name} step {step} {key}: {g[key]!r} != pinned {p[key]!r}; the run gave\n{got!r}"
            )
