"""Progress of long evaluation loops (ppl batches, lm-eval batches): a tqdm bar on a
terminal, otherwise (SLURM .err files, pipes) a plain line at most every ``every_s``
seconds and one at the end, never carriage returns. Only rank 0 reports."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, desc: str, total: int | None = None, every_s: float = 30.0, stream: TextIO | None = None):
        from mta_repro.eval import dist

        self.desc, self.total, self.every_s = desc, total, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.n, self.t0 = 0, time.monotonic()
        self.last = self.t0
        self.enabled = dist.rank_world()[0] == 0
        self.bar = None
        isatty = getattr(self.stream, "isatty", lambda: False)()
        if self.enabled and isatty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=self.stream, dynamic_ncols=True, leave=False)

    def _line(self, final: bool = False) -> str:
        if final and self.total and self.n < self.total:
            # the data ran out before the limit: not stuck at n/total, finished
            done = f"{self.n} of at most {self.total} (all the data holds)"
        else:
            done = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else str(self.n)
        return f"[eval] {self.desc}: {done}, {time.monotonic() - self.t0:.0f} s"

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            print(self._line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.n:
            print(self._line(final=True) + ", done", file=self.stream, flush=True)
