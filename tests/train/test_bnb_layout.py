"""The 8-bit step in pieces (grpo.train.optimizers) trusts bitsandbytes by what it finds, not by
its version: the blockwise update is called by keyword, the block size is read from the state
bitsandbytes made, and where either does not fit, bitsandbytes' own step runs, after one
warning line."""

import importlib.util
import inspect

import pytest
import torch

import grpo.train.optimizers as optimizers

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")

NUMEL = 10_000  # 100 x 100: pieces of CHUNK = 1,024 values below, the last one partial
WARNING = "grpo: warning: train.optimizer: adamw_8bit: "


@pytest.fixture
def bnb(monkeypatch):
    import bitsandbytes

    monkeypatch.setattr(optimizers, "CHUNK", 1024)
    for cached in (optimizers._warn_once, optimizers._takes_keywords):
        cached.cache_clear()
    yield bitsandbytes
    for cached in (optimizers._warn_once, optimizers._takes_keywords):
        cached.cache_clear()


def blocks_of(bnb, monkeypatch, block=None, second=None):
    """Plant bitsandbytes' state layout: its moments' scales as for blocks of `block` values
    (`second` for the second moment's, where it differs)."""
    real = bnb.optim.optimizer.Optimizer2State.init_state

    def init_state(self, group, p, gindex, pindex):
        real(self, group, p, gindex, pindex)
        state = self.state[p]
        for key, size in (("absmax1", block), ("absmax2", second or block)):
            if size is not None and key in state:
                state[key] = torch.zeros(-(-p.numel() // size), dtype=torch.float32)

    monkeypatch.setattr(bnb.optim.optimizer.Optimizer2State, "init_state", init_state)


def recording_update(bnb, monkeypatch, calls, renamed=False):
    """Plant bitsandbytes' blockwise update: one that records how it was called (by keyword or
    by position; the values and the scales it was given; the keywords) and changes nothing;
    with `renamed`, its gradient argument renamed, as a bitsandbytes release might."""

    def update(optimizer_name, g, p, state1, state2, beta1, beta2, beta3, alpha, eps, step, lr, qmap1, qmap2,
               absmax1, absmax2, weight_decay=0.0, gnorm_scale=1.0, skip_zeros=False):  # fmt: skip
        pass

    signature = inspect.signature(update)
    if renamed:
        names = {"g": "grad"}
        signature = signature.replace(
            parameters=[q.replace(name=names.get(q.name, q.name)) for q in signature.parameters.values()]
        )

    def planted(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments  # a TypeError where the names do not fit
        values = given["grad" if renamed else "g"]
        how = "keywords" if "absmax1" in kwargs else "positions"
        calls.append((how, values.numel(), given["absmax1"].numel(), given["absmax2"].numel(), tuple(kwargs)))

    planted.__signature__ = signature
    monkeypatch.setattr(bnb.functional, "optimizer_update_8bit_blockwise", planted)


def two_steps(capsys):
    """Two 8-bit steps of a 100 x 100 tensor; the warnings they printed."""
    p = torch.nn.Parameter(torch.randn(100, 100, generator=torch.Generator().manual_seed(0)))
    optimizer = optimizers.adamw_8bit([{"params": [p]}], lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        optimizer.step()
    assert optimizer.state[p]["state1"].dtype == torch.uint8
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith(WARNING)]


def pieces(block):
    """What each call of the step in pieces is given for blocks of `block` values: the values
    of each piece of 1,024, and their scales."""
    sizes = [min(1024, NUMEL - start) for start in range(0, NUMEL, 1024)]
    return [("keywords", size, -(-size // block), -(-size // block), optimizers.UPDATE_KEYWORDS) for size in sizes]


@pytest.mark.parametrize("block", [256, 512])
def test_the_pieces_slice_the_scales_by_the_block_bitsandbytes_made(block, bnb, monkeypatch, capsys):
    """bitsandbytes' own blocks (256 values) and a planted layout of 512: each piece's call gets
    the scales of its own values, by keyword, all of them."""
    blocks_of(bnb, monkeypatch, block)
    calls = []
    recording_update(bnb, monkeypatch, calls)
    assert two_steps(capsys) == []
    assert calls == pieces(block) * 2


@pytest.mark.parametrize("planted", ["2048", "apart", "none"])
def test_a_block_layout_the_pieces_cannot_slice_steps_whole_after_one_warning(planted, bnb, monkeypatch, capsys):
    """Blocks of 2,048 values (more than a piece holds), the two moments' scales in different
    layouts, a count of scales no block gives: bitsandbytes' own step on the whole tensor, one
    line said once."""
    if planted == "2048":
        blocks_of(bnb, monkeypatch, 2048)
    elif planted == "apart":
        blocks_of(bnb, monkeypatch, 256, second=512)
    else:
        blocks_of(bnb, monkeypatch, 3)  # 3,334 scales: between the counts of blocks of 2 and 4
    calls = []
    recording_update(bnb, monkeypatch, calls)
    (line,) = two_steps(capsys)
    assert line.endswith("each tensor steps whole (more transient memory)")
    assert [call[:2] for call in calls] == [("positions", NUMEL)] * 2  # bitsandbytes' own step, twice


def test_a_changed_update_signature_steps_whole_after_one_warning(bnb, monkeypatch, capsys):
    calls = []
    recording_update(bnb, monkeypatch, calls, renamed=True)
    (line,) = two_steps(capsys)
    assert "optimizer_update_8bit_blockwise takes other arguments" in line
    assert [call[:2] for call in calls] == [("positions", NUMEL)] * 2


def test_the_block_size_is_read_from_the_scales():
    def scales(n, block, second=None):
        return {"absmax1": torch.zeros(-(-n // block)), "absmax2": torch.zeros(-(-n // (second or block)))}

    for n in (1, 255, 256, 257, 10_000, (1 << 20) + 1):
        for block in (1, 64, 256, 512, 4096):
            if block <= n:
                assert optimizers._block_size(n, scales(n, block)) == block, (n, block)
    assert optimizers._block_size(10_000, scales(10_000, 768)) is None  # 14 scales: no power of two gives them
    assert optimizers._block_size(10_000, scales(10_000, 256, second=512)) is None
