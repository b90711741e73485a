"""``python -m mta_repro.estimate --memory`` says the shape its estimate is for, and sets
PyTorch's FSDP2 memory tracker beside it."""

import re

from mta_repro.estimate.cli import main


def test_memory_states_its_assumptions_and_flags_the_demo_shape(capsys):
    main(["model=tiny", "attention=mta", "--memory", "--no-tracker"])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    # configs/data/mini.yaml and the CPU default: seq_len 256, 4 sequences, one fp32 rank
    assert first.startswith("assumes: seq_len 256, micro-batch 4 x 256 tokens per rank, grad_accum 1")
    assert "world size 1, float32 parameters on CPU" in first
    assert "no experiment= given" in out and "experiment=pretrain_880m_mta" in out
    assert "| **total** |" in out
    # on CPU: the process and the allocator's slack on top, against this machine's memory
    assert re.search(r"^on this CPU: [\d.]+ GB per rank \([\d.]+ GB pre-flight \+ [\d.]+ GB process", out, re.M)
    assert "FSDPMemTracker" not in out


def test_memory_sets_the_fsdp_tracker_beside_the_pre_flight(capsys):
    main(["model=tiny", "model.n_layers=2", "data.seq_len=64", "data.batch_size=2", "--memory"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "FSDPMemTracker" in ln)
    assert "a fake process group of world size 1" in line
    ratio = float(re.search(r"pre-flight / tracker = ([\d.]+)", line).group(1))
    assert 0.9 <= ratio <= 1.1, out  # tests/test_memory.py checks the two against each other


def test_memory_of_a_paper_experiment(capsys):
    main(["experiment=pretrain_300m_baseline", "trainer.grad_accum=2", "--memory", "--world-size", "8", "--no-tracker"])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    # the paper's batch: 4 x 2048 tokens per GPU, bf16 parameters
    assert first.startswith("assumes: seq_len 2048, micro-batch 4 x 2048 tokens per rank, grad_accum 2")
    assert "world size 8, bfloat16 parameters on GPU" in first
    assert "no experiment= given" not in out
    assert "world size 8, activation checkpointing off" in out
