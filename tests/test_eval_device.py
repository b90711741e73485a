"""Device choice and the trained-length default of the lm-eval model."""

import pytest
import torch
from eval_helpers import make_run

from mta_repro.device import resolve_device
from mta_repro.eval.lm_eval_model import MTAReproLM
from mta_repro.eval.load import load_model


def test_auto_device_follows_the_machine():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want and resolve_device(None).type == want
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="'cuda' was asked for but this machine has no CUDA GPU"):
        resolve_device("cuda")
    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    with pytest.raises(ValueError, match="no CUDA GPU"):
        load_model(run_dir, device="cuda:1")
    with pytest.raises(ValueError, match="expected 'auto', 'cpu'"):
        resolve_device("gpu0")


def test_max_length_defaults_to_trained_seq_len(tmp_path):
    run_dir, _ = make_run(tmp_path / "run", attention="baseline")
    from mta_repro.eval.load import load_config

    seq_len = int(load_config(run_dir).data.seq_len)
    lm = MTAReproLM(pretrained=str(run_dir))
    assert lm.max_length == seq_len != lm.model.args.max_seqlen
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert MTAReproLM(pretrained=str(run_dir), max_length=100).max_length == 100


def test_long_contexts_are_left_truncated_like_hf():
    from eval_helpers import make_tokenizer, tiny_model

    tok = make_tokenizer()
    model = tiny_model("mta", vocab_size=tok.n_words, seed=1, dtype=torch.float64)
    lm = MTAReproLM(model=model, tokenizer=tok, max_length=16)
    ctx, cont = (
        tok.encode("a long context that does not fit", add_bos=True, add_eos=False),
        tok.encode(" end", add_bos=False, add_eos=False),
    )
    [(ll, _)] = lm._score([(ctx, cont)])
    # lm-eval's HF rule: inp = (ctx + cont)[-(max_length + 1):][:-1]
    whole = (ctx + cont)[-17:]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0], -1)
    ref = sum(float(logp[len(whole) - 1 - len(cont) + j, cont[j]]) for j in range(len(cont)))
    assert ll == pytest.approx(ref, rel=1e-9)
