"""Training data that continues where the source run stopped (long-context finetune).

``trainer.loader=mta_repro.pipeline.data:build_continued_loader`` (the pipeline sets it
for stages with ``continue_data: true``) builds the usual loader
(``mta_repro.data:build_train_loader``) and moves every domain's document stream to where
the ``checkpoint.init_from`` run's latest complete checkpoint left it on the same rank. The
finetune therefore reads documents pretraining never reached (the paper's "10.5B more
tokens"), instead of re-reading the first ones with the same seed. Documents the source
had read but not yet trained on (its packing remainder and shuffle buffer, at most
``shuffle_buffer + 1`` windows per rank) are skipped, not repeated.

Only the stream positions carry over (and the files the source started with): the
finetune's own seq_len, batch size and seed apply, and its own checkpoints resume it
exactly as usual. A file whose text the source read has changed since is refused like on
a resume (``checkpoint.accept_changed_data``). It needs the same number of
ranks as the source (file shards are per rank) and a source with DCP checkpoints (a
consolidated .pt has no data position); otherwise it stops with an error naming the field.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from mta_repro.errors import UserError


def source_of(data_args) -> Path:
    root = data_args._get_parent() if isinstance(data_args, DictConfig) else None
    src = root.checkpoint.get("init_from") if isinstance(root, DictConfig) and "checkpoint" in root else None
    if not src:
        raise UserError(
            "trainer.loader=mta_repro.pipeline.data:build_continued_loader: needs "
            "checkpoint.init_from (the run whose data position to continue)"
        )
    return Path(str(src))


def source_stream_state(src: Path, rank: int, world_size: int) -> dict:
    """{domain: stream state} of rank ``rank`` at the source's latest complete checkpoint."""
    from mta_repro.errors import UnsafeFileError
    from mta_repro.weights import COMPLETE, latest_checkpoint
    from mta_repro.weights.safe import dcp_load, decode_state

    if src.is_file():
        raise UserError(
            f"checkpoint.init_from={src}: a consolidated .pt holds no data position; continuing the "
            "data needs the source run directory (or one of its checkpoint directories)"
        )
    ckpt = src if (src / COMPLETE).exists() else latest_checkpoint(src)
    if ckpt is None:
        raise UserError(f"checkpoint.init_from={src}: no complete checkpoint to continue the data from")
    key = f"rank{rank}"
    state = {key: b""}
    try:
        dcp_load(state, ckpt, no_dist=True)
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001 - name what is missing
        raise UserError(
            f"{ckpt}: no data-loader state of rank {rank} ({e}); the source must have run on "
            f"{world_size} rank(s) like this stage"
        ) from None
    per_rank = decode_state(state[key], f"checkpoint {ckpt}: {key}")
    data = per_rank.get("data") if isinstance(per_rank, dict) else None
    if not data or "streams" not in data:
        raise UserError(f"{ckpt}: rank {rank} saved no data-loader state")
    if data.get("world_size") != world_size:
        raise UserError(
            f"{ckpt}: saved by {data.get('world_size')} rank(s), this stage runs on {world_size}; "
            "file shards are per rank, so continuing the data needs the same number of ranks"
        )
    return data["streams"]


def build_continued_loader(data_args, rank: int = 0, world_size: int = 1):
    from mta_repro.data import build_train_loader

    streams = source_stream_state(source_of(data_args), rank, world_size)
    loader = build_train_loader(data_args, rank, world_size)
    for domain, stream in loader.streams.items():
        if domain in streams:
            stream.load_state_dict(streams[domain])
    # The text the source read of the files it was in: unchanged (the trainer decides on
    # what this finds, as after a resume).
    loader.check_inputs()
    return loader
