"""``python -m mta_repro.train.submit`` moved to the pipeline's engine: one line naming the
command that does the same (``python -m mta_repro.pipeline.submit``), exit status 2."""

from __future__ import annotations

import shlex
import sys

NEW = "python -m mta_repro.pipeline.submit"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print(
        f"mta_repro.train.submit: error: this command moved; run {NEW} {' '.join(map(shlex.quote, argv))}".rstrip(),
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
