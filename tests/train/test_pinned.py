"""A pinned 3-step trajectory of the tiny model: any unintended change of a number fails here.

Each run trains the tiny model of conftest.py for 3 steps and compares the per-step loss,
KL, grad norm (and PPO's value loss) with the values recorded below, to 1e-4 relative (1e-6
absolute). Hosts round differently (AVX2, AVX-512 and AMX kernels): grpo-epochs' lr 1e-2 and
two epochs carry that to a 1.3e-5 relative difference in its third step's grad norm between an
Intel AMX host and an AMD AVX-512 one; a real change moves these numbers by far more. The
pins were recorded on an AMD AVX2 host on 2026-12-05, when rollout.draw's default became the
fast draw (other tokens than generate's, so another trajectory). A change
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
            "reward/mean": 0.06640625,
            "loss": 7.450580596923828e-09,
            "kl": 0.0,
            "grad_norm": 1.1508499383926392,
            "entropy": 2.8788084983825684,
        },
        {
            "reward/mean": 0.0703125,
            "loss": 0.0004724264144897461,
            "kl": 0.011811373755335808,
            "grad_norm": 0.9958527684211731,
            "entropy": 2.8663413524627686,
        },
        {
            "reward/mean": 0.125,
            "loss": 0.001323901116847992,
            "kl": 0.03309761732816696,
            "grad_norm": 1.1336709260940552,
            "entropy": 2.848632335662842,
        },
    ],
    "grpo-epochs": [
        {
            "reward/mean": 0.06640625,
            "loss": 0.01212975475937128,
            "kl": 0.026578443124890327,
            "grad_norm": 1.0495431274175644,
            "entropy": 2.852664515376091,
        },
        {
            "reward/mean": 0.296875,
            "loss": 0.023180348798632622,
            "kl": 0.3899066299200058,
            "grad_norm": 0.8765990734100342,
            "entropy": 2.499172791838646,
        },
        {
            "reward/mean": 0.31640625,
            "loss": 0.01589444454293698,
            "kl": 0.45722086913883686,
            "grad_norm": 0.8736054971814156,
            "entropy": 2.460233613848686,
        },
    ],
    "grpo-process": [
        {
            "reward/mean": 0.08069196343421936,
            "loss": -0.04996785521507263,
            "kl": 0.0,
            "grad_norm": 2.3667964935302734,
            "entropy": 2.8788084983825684,
        },
        {
            "reward/mean": 0.09720981866121292,
            "loss": -0.19627082347869873,
            "kl": 0.011461306363344193,
            "grad_norm": 2.2175228595733643,
            "entropy": 2.8664896488189697,
        },
        {
            "reward/mean": 0.17072173953056335,
            "loss": 0.16468530893325806,
            "kl": 0.03558659553527832,
            "grad_norm": 2.5406153202056885,
            "entropy": 2.845590114593506,
        },
    ],
    "grpo-eos": [
        {
            "reward/mean": 0.0625,
            "loss": -0.11826209723949432,
            "kl": 0.0,
            "grad_norm": 0.9784872531890869,
            "entropy": 2.8788317251896514,
        },
        {
            "reward/mean": 0.0625,
            "loss": -0.14939042925834656,
            "kl": 0.01019088246605613,
            "grad_norm": 0.8743908405303955,
            "entropy": 2.867987199263139,
        },
        {
            "reward/mean": 0.11328125,
            "loss": -0.1436028778553009,
            "kl": 0.029863345356414113,
            "grad_norm": 0.7969793677330017,
            "entropy": 2.8522563117761583,
        },
    ],
    "ppo": [
        {
            "reward/mean": 0.078125,
            "loss": -0.05634333286434412,
            "kl": 0.0,
            "grad_norm": 1.480146884918213,
            "entropy": 2.8796489238739014,
            "value_loss": 0.0041422160575166345,
        },
        {
            "reward/mean": 0.03125,
            "loss": -0.03088049532379955,
            "kl": 0.018164124339818954,
            "grad_norm": 1.641061246395111,
            "entropy": 2.8617258071899414,
            "value_loss": 0.0014791114954277873,
        },
        {
            "reward/mean": 0.109375,
            "loss": -0.027659206767566502,
            "kl": 0.027523066848516464,
            "grad_norm": 1.6800388097763062,
            "entropy": 2.847545623779297,
            "value_loss": 0.002493668464012444,
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
