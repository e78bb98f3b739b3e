"""What the engine decides for a model (its layouts, checkpointing, whether its head runs chunk
by chunk, what a bf16-stored reference computes in) is returned by what decides it and held by
`grpo.train.step.Decisions` and the layout objects built from it (issue 57), never set on the
model for later code to read: no module of grpo/train or grpo/algo sets an attribute on a model
object but the few that change how the model itself runs (`ALLOWED`)."""

import ast
from pathlib import Path

import torch

import grpo
from grpo.train import layouts
from grpo.train.networks import FrozenCopy
from tests.train.test_engine import engine_for, train_step

PACKAGE = Path(grpo.__file__).parent
# Names that hold a model or one of its modules in grpo/train and grpo/algo.
MODEL_NAMES = {"model", "policy", "backbone", "reference", "network", "net", "module", "layer", "embedding", "head"}
# (module, function, target): the model's own state, not a decision kept for later code.
ALLOWED = {
    # dropout off for good: what the model computes in training mode (checkpointing) is eval mode's
    ("train/models.py", "_no_dropout", "module.p"),
    ("train/models.py", "_no_dropout", "setattr(module, name, 0.0)"),
    # the tied weight's backward hands its gradient over in place: how the model runs its backward
    ("train/models.py", "tie_gradients_in_place", "embedding.weight._grpo_tied_gradient"),
    ("train/models.py", "tie_gradients_in_place", "embedding.__class__"),
    # peft's own record of merged adapters, emptied so that the merge stays the new base
    ("train/networks.py", "reset_to", "module.merged_adapters"),
    # switches set for the duration of one forward and put back after it
    ("train/shared_prompt.py", "handed_a_cache", "layer._can_checkpoint_with_cache"),
    ("train/shared_prompt.py", "handed_a_cache", "module.gradient_checkpointing"),
    # bitsandbytes' own switch on a 4-bit layer: its CPU kernel's bf16 repacking off, how it computes
    ("train/models.py", "prepare_4bit", "module.support_avx512bf16_for_cpu"),
    # a KV cache's layer, not a model's
    ("train/shared_prompt.py", "_turn", "layer.__class__"),
    # a 4-bit model built from its folder's tensors read one at a time: named as from_pretrained names it
    ("train/models.py", "_load_read", "model.name_or_path"),
    ("train/models.py", "_load_read", "model.config._name_or_path"),
}


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def model_attributes_set(source: str):
    """(function, target) of each attribute set on (or deleted from) a name in MODEL_NAMES,
    by assignment or by setattr/delattr."""
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            targets = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                        if _root(sub) in MODEL_NAMES:
                            yield function.name, ast.unparse(sub)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
                if node.func.id in ("setattr", "delattr") and _root(node.args[0]) in MODEL_NAMES:
                    yield function.name, ast.unparse(node)


def test_no_module_of_train_or_algo_sets_an_attribute_on_a_model():
    found = {
        (str(path.relative_to(PACKAGE)), function, target)
        for folder in ("train", "algo")
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for function, target in model_attributes_set(path.read_text())
    }
    assert found - ALLOWED == set()


def test_the_scan_finds_a_verdict_set_on_a_model():
    planted = (
        "def decide(model, verdicts):\n    setattr(model, '_grpo_layouts', verdicts)\n    model._grpo_computes_in = 1\n"
    )
    assert set(model_attributes_set(planted)) == {
        ("decide", "setattr(model, '_grpo_layouts', verdicts)"),
        ("decide", "model._grpo_computes_in"),
    }


def test_the_engine_hands_its_verdicts_to_the_passes_and_probes_no_head_in_a_step(make_config, monkeypatch):
    """The policy and its frozen copy carry no verdict of grpo's (only the attention switch, a
    state of the model: grpo.infra.attention); the reference runs the layout decided for the
    policy's passes without a gradient, its mask made in the float32 its bf16 weights are cast
    up to (a CPU without bf16 instructions); a step runs no probe of the head (the verdict is
    the engine's, not found again on the model or its copy)."""
    monkeypatch.setattr("grpo.train.networks.native", lambda dtype, device: False)
    e, c, stream = engine_for(make_config(train={"reference_dtype": "bfloat16"}))
    assert isinstance(e.reference, FrozenCopy)
    for model in (e.policy, e.reference.model):
        assert {name for name in vars(model) if name.startswith("_grpo")} <= {"_grpo_segments"}
    decided = e.decisions.no_grad_passes
    assert decided.chunked_head is True and e.update_layout.chunked_head is True
    assert e.reference.layout.name == decided.name == e.decisions.no_grad_layout
    assert e.reference.layout.chunked_head is True
    assert e.reference.layout.name == "packed" and e.reference.layout.computes_in == torch.float32
    probes = []
    real = layouts.chunkable_head
    monkeypatch.setattr(layouts, "chunkable_head", lambda model: probes.append(model) or real(model))
    train_step(e, stream.take(c.rollout.prompts_per_step))
    assert probes == []
