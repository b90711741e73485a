"""The training state: everything a resumed run needs, as one object the loop advances and a
checkpoint saves and restores (``mta_repro.train.checkpoint``).

    state = TrainState(model, optimizer, scheduler, loader, rank=info.rank)
    ...                      # one optimiser update
    state.advance(tokens)    # step + 1, tokens seen + this update's global tokens
    manager.save(state)      # its state_dict(), through DCP
    manager.resume(state)    # load_state_dict() of the newest readable checkpoint

``state_dict()`` is the checkpoint's DCP entries (layout in checkpoint.py): the model and
optimizer as torch's (sharded) state dicts, and the scheduler and this rank's RNG, data
position and token count as run-state bytes (plain types and tensors, read back with
``weights_only=True``). Like Lingua's ``TrainState``, it is a DCP ``Stateful``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from mta_repro.weights.safe import decode_state, encode_state


def rng_state() -> dict:
    """Python's, numpy's, torch's (and CUDA's) RNG state in plain types and tensors (numpy's
    key array as a tensor), so that it reads back with weights_only."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = {**np_state["state"], "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64))}
    state = {
        "python": random.getstate(),
        "numpy": np_state,
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np_state["state"] = {**np_state["state"], "key": np_state["state"]["key"].numpy().astype(np.uint32)}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rank_key(rank: int) -> str:
    return f"rank{rank}"


@dataclass
class TrainState(Stateful):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LR scheduler (state_dict / load_state_dict)
    loader: Any = None  # the data loader (state_dict / load_state_dict), or None
    rank: int = 0  # this process's rank: the key of its per-rank entry
    step: int = 0  # optimiser updates done
    # Tokens trained on, summed over ranks. None: restored from a checkpoint that predates
    # the count; the loop then derives it from the step (every update has the same tokens).
    tokens_seen: int | None = 0
    # The global mean losses of the steps since the last metrics line: saved, so that the
    # first line after a resume averages the same steps as without the stop. ``losses``: the
    # loop's callable giving them; ``restored_losses``: what a checkpoint gave back (None:
    # none saved, or another world size).
    losses: Any = None
    restored_losses: list | None = None

    def advance(self, tokens: int) -> None:
        """One optimiser update of ``tokens`` tokens (all ranks) is done."""
        if self.tokens_seen is None:
            self.tokens_seen = self.step * tokens
        self.step += 1
        self.tokens_seen += tokens

    # ---------------------------------------------------------------- saved entries
    def rank_state(self) -> dict:
        """This rank's share of the state: RNG, data position and the token count."""
        return {
            "rng": rng_state(),
            "data": self.loader.state_dict() if self.loader is not None else None,
            "tokens_seen": self.tokens_seen,
            "losses": [float(x) for x in self.losses()] if self.losses is not None else None,
        }

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": encode_state(self.scheduler.state_dict()),
            "step": self.step,
            rank_key(self.rank): encode_state(self.rank_state()),
        }

    def template(self, ranks: Sequence[int]) -> dict:
        """The entries a load fills in: the model and optimizer in place, the run-state
        entries of ``ranks`` (this rank's, or every saved rank's when resharding)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": b"", "step": -1, **{rank_key(r): b"" for r in ranks}}

    def load_state_dict(self, state_dict: dict, where: str = "checkpoint") -> None:
        """Restore what ``state_dict()`` saved; a missing entry of this rank (another world
        size) leaves the RNG, data and count to ``load_rank_states``."""
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )
        self.scheduler.load_state_dict(decode_state(state_dict["scheduler"], f"{where}: scheduler"))
        self.step = int(state_dict["step"])
        key = rank_key(self.rank)
        if key in state_dict:
            mine = decode_state(state_dict[key], f"{where}: {key}")
            set_rng_state(mine["rng"])
            if self.loader is not None and mine["data"] is not None:
                self.loader.load_state_dict(mine["data"])
            self.tokens_seen = mine.get("tokens_seen")  # None: saved before the count existed
            losses = mine.get("losses")
            self.restored_losses = [float(x) for x in losses] if isinstance(losses, list) else None
