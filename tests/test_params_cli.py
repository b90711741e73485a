"""``python -m mta_repro.estimate --memory`` says the shape its estimate is for."""

from mta_repro.estimate.params import main


def test_memory_states_its_assumptions_and_flags_the_demo_shape(capsys):
    main(["model=tiny", "attention=mta", "--memory"])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    # configs/data/mini.yaml and the CPU default: seq_len 256, 4 sequences, one fp32 rank
    assert first.startswith("assumes: seq_len 256, micro-batch 4 x 256 tokens per rank, grad_accum 1")
    assert "world size 1, float32 parameters on CPU" in first
    assert "no experiment= given" in out and "experiment=pretrain_880m_mta" in out
    assert "| **total** |" in out


def test_memory_of_a_paper_experiment(capsys):
    main(["experiment=pretrain_300m_baseline", "trainer.grad_accum=2", "--memory", "--world-size", "8"])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    # the paper's batch: 4 x 2048 tokens per GPU, bf16 parameters
    assert first.startswith("assumes: seq_len 2048, micro-batch 4 x 2048 tokens per rank, grad_accum 2")
    assert "world size 8, bfloat16 parameters on GPU" in first
    assert "no experiment= given" not in out
    assert "world size 8, activation checkpointing off" in out
