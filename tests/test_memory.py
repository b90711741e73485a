"""The memory pre-flight: its activation count equals a real run's, and every shipped
experiment fits an H200 by it (the reference path at 4K would not)."""

import pytest
import torch

from mta_repro.config import compose
from mta_repro.memory import CAPACITIES, estimate, estimate_from_config
from mta_repro.model import MTAArgs, ModelArgs, build_model


def real_saved_bytes(model, tokens):
    """Bytes autograd keeps in a real CPU forward + loss (each storage once, no params)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {}

    def pack(t):
        s = t.untyped_storage()
        sizes[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    return sum(n for k, n in sizes.items() if k not in params)


@pytest.mark.parametrize("n_kv_heads", [None, 2])  # 2: grouped-query attention
@pytest.mark.parametrize("mta", [MTAArgs(), MTAArgs(use_mta=True, query_kernel_size=2, key_kernel_size=3,
                                                     pre_sm_linear_head=True, head_kernel_size=2)])
def test_meta_count_equals_a_real_run(mta, n_kv_heads):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=101, mta=mta,
                     attn_block_size=16)
    est = estimate(args, batch_size=2, seq_len=48, world_size=1, activation_checkpointing=False,
                   dtype=torch.float32)
    tokens = torch.randint(0, 101, (2, 48), generator=torch.Generator().manual_seed(0))
    real = real_saved_bytes(build_model(args).float(), tokens)
    assert est.parts["saved activations (measured on meta)"] == pytest.approx(real, rel=0.02)


def test_activation_checkpointing_keeps_block_inputs_only():
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, vocab_size=101)
    on = estimate(args, 2, 48, 1, True, torch.float32).parts["saved activations (measured on meta)"]
    off = estimate(args, 2, 48, 1, False, torch.float32).parts["saved activations (measured on meta)"]
    assert on < off / 2


# The largest model of each stage and every variant: each must fit one H200.
SHIPPED = [f"pretrain_1b_{v}" for v in ("baseline", "diff", "talking_heads", "mta")] + [
    f"long_context_880m_{v}" for v in ("baseline", "diff", "talking_heads", "mta")
]


@pytest.mark.parametrize("experiment", SHIPPED)
def test_shipped_experiments_fit_an_h200(experiment):
    est = estimate_from_config(compose([f"experiment={experiment}"]))
    assert est.fits(CAPACITIES["H200 141 GB"]), est.table()


def test_reference_path_at_4k_does_not_fit():
    """Why the blocked path is the default: the reference keeps (B, H, T, T) tensors."""
    cfg = compose(["experiment=long_context_880m_mta", "model.attn_impl=torch"])
    assert not estimate_from_config(cfg).fits(CAPACITIES["H200 141 GB"])
