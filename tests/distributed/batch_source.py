"""A test-only batch source with the data contract (dict input/target, state_dict),
whose *global* batch k is the same for any world size: rank r of W gets rows
[r*b, (r+1)*b) of a (W*b, T) batch made from seed (seed, k). So 1 rank with batch 2b
and 2 ranks with batch b see exactly the same tokens per update.

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

    def global_batch(self, k: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        rows = []
        for _ in range(self.b * self.world):
            period = int(torch.randint(4, 13, (1,), generator=g))
            motif = torch.randint(3, self.v, (period,), generator=g)
            rows.append(motif.repeat(self.t // period + 2)[: self.t + 1])
        return torch.stack(rows)  # (W*b, T+1)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = self.global_batch(self.k)[self.rank * self.b : (self.rank + 1) * self.b]
        self.k += 1
        return {"input": rows[:, :-1].contiguous(), "target": rows[:, 1:].contiguous()}

    def state_dict(self) -> dict:
        return {"k": self.k}

    def load_state_dict(self, sd: dict) -> None:
        self.k = int(sd["k"])

    def close(self) -> None:
        pass


def build(data_args, rank: int, world_size: int) -> GlobalBatchSource:
    get = (lambda k, d: data_args.get(k, d)) if data_args is not None else (lambda k, d: d)
    return GlobalBatchSource(
        int(get("batch_size", 2)), int(get("seq_len", 32)), 256, int(get("seed", 0)),
        rank, world_size,
    )
