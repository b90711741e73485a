"""TrainState: the run's state as one object. It round-trips through a checkpoint (model,
optimizer, scheduler, data position, RNG, step, tokens seen), so that what follows a resume
equals what follows without one; a checkpoint saved before the token count existed still
resumes, its count derived from the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_config import tiny_train

from mta_repro.data import DataArgs, build_train_loader
from mta_repro.model import build_model
from mta_repro.model.args import ModelArgs
from mta_repro.train.checkpoint import CheckpointManager
from mta_repro.train.config import compose
from mta_repro.train.optim import OptimArgs, build_lr_scheduler, build_optimizer
from mta_repro.train.state import TrainState

B, T = 2, 16


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = build_model(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=8192, multiple_of=16), device="cpu")
    opt = build_optimizer(model, OptimArgs(lr=1e-2, warmup=2))
    sched = build_lr_scheduler(opt, OptimArgs(lr=1e-2, warmup=2), 10)
    loader = build_train_loader(DataArgs(seq_len=T, batch_size=B, shuffle_buffer=4), 0, 1)
    return TrainState(model, opt, sched, loader)


def _update(state: TrainState) -> float:
    """One plain optimiser update, advancing the state; its loss."""
    batch = next(state.loader)
    logits = state.model(batch["input"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.advance(batch["input"].numel())
    return float(loss.detach()) + float(torch.rand(()))  # the RNG's next draw is part of what must continue


def test_a_train_state_round_trips_through_a_checkpoint(tmp_path):
    a = _state()
    for _ in range(3):
        _update(a)
    assert (a.step, a.tokens_seen) == (3, 3 * B * T)
    manager = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1)
    manager.save(a)
    after_save = [_update(a) for _ in range(2)]  # the uninterrupted continuation

    b = _state(seed=1)  # other weights, a fresh loader, another RNG state
    assert manager.resume(b) == tmp_path / "checkpoints" / "0000000003"
    assert (b.step, b.tokens_seen) == (3, 3 * B * T)
    assert [_update(b) for _ in range(2)] == after_save  # same batches, weights, lr and draws
    assert (b.step, b.tokens_seen) == (5, 5 * B * T)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert b.scheduler.state_dict() == a.scheduler.state_dict()


def test_a_checkpoint_without_the_token_count_resumes_with_it_derived(tmp_path, monkeypatch):
    a = _state()
    for _ in range(2):
        _update(a)
    old_rank_state = TrainState.rank_state
    monkeypatch.setattr(
        TrainState,
        "rank_state",  # what a checkpoint of an earlier version holds
        lambda self: {k: v for k, v in old_rank_state(self).items() if k != "tokens_seen"},
    )
    manager = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1)
    manager.save(a)
    monkeypatch.undo()
    b = _state(seed=1)
    manager.resume(b)
    assert b.step == 2 and b.tokens_seen is None
    _update(b)
    assert b.tokens_seen == 3 * B * T  # every update has the same tokens


def test_the_trainer_logs_tokens_seen_across_a_resume(tmp_path):
    from mta_repro.train.loop import train

    common = [*tiny_train("checkpoint.every=1"), f"run_dir={tmp_path / 'run'}"]
    train(compose([*common, "trainer.steps=2"]))
    train(compose([*common, "trainer.steps=4", "checkpoint.allow_config_change=true"]))
    rows = [json.loads(line) for line in Path(tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["tokens_seen"]) for r in rows] == [(s, s * 2 * 32) for s in (1, 2, 3, 4)]


class _CtrlCWhilePickled:
    """Raises KeyboardInterrupt when DCP's writer pickles it: where a second Ctrl-C lands
    during a save (the handler raises between two bytecodes of torch.save)."""

    def __reduce__(self):
        raise KeyboardInterrupt


def test_a_ctrl_c_inside_a_dcp_save_is_a_keyboard_interrupt_and_leaves_no_partial(tmp_path, monkeypatch):
    # DCP catches every BaseException of its writers and raises a CheckpointException
    # (not an Exception): unwrapped, the second Ctrl-C would end the run with a traceback, rc 1.
    a = _state()
    _update(a)
    manager = CheckpointManager(tmp_path, keep=2, rank=0, world_size=1)
    first = manager.save(a)
    _update(a)
    old_state_dict = TrainState.state_dict  # an entry DCP's writer pickles itself
    monkeypatch.setattr(TrainState, "state_dict", lambda self: {**old_state_dict(self), "x": _CtrlCWhilePickled()})
    with pytest.raises(KeyboardInterrupt):
        manager.save(a)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [first.name]
