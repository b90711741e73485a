"""A test-only batch source with the data contract (dict input/target, state_dict),
whose *global* batches are the same for any world size and accumulation: row j of the
global stream is made from seed (seed, j), and call n of rank r of W (batch b) returns
rows [n*W*b + r*b, n*W*b + (r+1)*b). So 1 rank with batch 4, 2 ranks with batch 2, and
2 ranks with batch 1 and 2 accumulation steps all update on the same 4 rows.

Sequences repeat a random motif of 4..12 tokens, so a model can learn to copy and the
loss falls quickly. Plugged in with ``trainer.loader=batch_source:build``.
"""

from __future__ import annotations

import torch


class GlobalBatchSource:
    def __init__(self, batch_size: int, seq_len: int, vocab: int, seed: int, rank: int, world: int):
        self.b, self.t, self.v, self.seed = batch_size, seq_len, vocab, seed
        self.rank, self.world = rank, world
        self.k = 0  # batches consumed

    def row(self, j: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + j)
        period = int(torch.randint(4, 13, (1,), generator=g))
        motif = torch.randint(3, self.v, (period,), generator=g)
        return motif.repeat(self.t // period + 2)[: self.t + 1]  # (T+1,)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = self.k * self.world * self.b + self.rank * self.b
        rows = torch.stack([self.row(j) for j in range(start, start + self.b)])  # (b, T+1)
        self.k += 1
        return {"input": rows[:, :-1].contiguous(), "target": rows[:, 1:].contiguous()}

    def state_dict(self) -> dict:
        return {"k": self.k, "b": self.b, "world": self.world}

    def load_state_dict(self, sd: dict) -> None:
        self.k = int(sd["k"])

    def load_other_world_state(self, states: list) -> None:
        """Another world size: the same global row position (k calls of W ranks x b rows)."""
        rows = states[0]["k"] * states[0]["world"] * states[0]["b"]
        assert rows % (self.world * self.b) == 0, (rows, self.world, self.b)
        self.k = rows // (self.world * self.b)

    def close(self) -> None:
        pass


def build(data_args, rank: int, world_size: int) -> GlobalBatchSource:
    get = (lambda k, d: data_args.get(k, d)) if data_args is not None else (lambda k, d: d)
    return GlobalBatchSource(
        int(get("batch_size", 2)),
        int(get("seq_len", 32)),
        256,
        int(get("seed", 0)),
        rank,
        world_size,
    )
