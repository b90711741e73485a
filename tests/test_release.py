"""The official release (facebookresearch/RAM projects/mta, on Meta Lingua) in and out.

- a release YAML converts to our config: absent fields take the *release's* defaults,
  unsupported fields are refused by name, fields without effect are noted;
- ``params --release-config`` prints the same JSON as our equivalent experiment, and the
  model section is identical field by field (fixtures in the release's layout; every
  config of the release itself when its mirror is on this machine);
- ``python -m mta_repro.release convert`` writes an experiment that composes to the same
  model and trains (2 steps, tiny, on a corpus in the release's per-domain layout),
  starting from a release consolidated checkpoint through ``checkpoint.init_from``;
- ``release_state_dict_to_ours`` maps a state dict in the release's layout (wrapper
  prefixes, TiedLinear's ``output.tied_module.weight``) to ours: equal logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from mta_repro.estimate import cli as params
from mta_repro.model import build_model
from mta_repro.release import (
    LLAMA3_N_WORDS,
    RELEASE_DEFAULTS,
    experiment_yaml,
    load_release_config,
    release_model_args,
)
from mta_repro.release import (
    main as release_main,
)
from mta_repro.release import release_file_to_config as convert_file  # short names in these tests
from mta_repro.release import release_to_config as convert
from mta_repro.release.config import _merge_defaults  # the defaults merge itself
from mta_repro.train.checkpoint import load_init_weights
from mta_repro.train.config import compose, model_args_from
from mta_repro.weights.lingua import release_checkpoint_path, release_state_dict_to_ours

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "release"
# Fields of our ModelArgs that differ from a release config by design, without effect on
# the model: the RoPE table length (the release sets max_seqlen = data.seq_len; ours grows
# on demand) and the size's conv-layer pointer (only read through attention=mta).
NO_EFFECT = {"max_seqlen", "kq_conv_layers"}
RELEASE_MIRROR = Path(os.environ.get("MTA_RELEASE_REPO", "/work/.mirror/facebookresearch+RAM/repo"))
SIZES = {"300M": "300m", "550M": "550m", "830M": "880m", "1B": "1b"}
VARIANTS = ("baseline", "talking_heads", "mta")


def _flat(d, p=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{p}{k}."))
        else:
            out[p + k] = v
    return out


def _model_diff(a, b) -> dict:
    fa, fb = _flat(dataclasses.asdict(a)), _flat(dataclasses.asdict(b))
    assert fa.keys() == fb.keys()
    return {k: (fa[k], fb[k]) for k in fa if fa[k] != fb[k]}


def _params_json(argv, capsys) -> dict:
    params.main(argv)
    return json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------ defaults, refusals, notes
def test_absent_fields_take_the_release_defaults():
    conv = convert_file(FIX / "defaults_mta.yaml")
    a = conv.model_args()
    # MTATransformerArgs: 1x1 pre-softmax kernels, in every layer (mta_layers unset).
    assert (a.mta.query_kernel_size, a.mta.key_kernel_size) == (1, 1)
    assert a.mta.after_sm_query_kernel_size is None and a.mta.head_kernel_size is None
    assert [a.layer_kind(i) for i in range(a.n_layers)] == ["kq_conv"] * 3
    # BaseTransformerArgs / LMTransformerArgs.
    assert (a.rope_theta, a.norm_eps, a.weight_tying, a.ffn_dim_multiplier, a.multiple_of) == (
        10000.0,
        1e-5,
        False,
        1.0,
        256,
    )
    assert a.max_seqlen == 2048  # the release sets it to data.seq_len (DataArgs default 2048)
    assert a.vocab_size == 258  # vocab from Lingua's default "bytes" tokenizer
    assert a.seed == 42 and a.dropout == 0.0
    # The model the release builds: a learned (H, 1, 1, 1) per-head score scale per layer.
    m = build_model(a, device="meta")
    for layer in m.layers:
        assert tuple(layer.attention.mta_kernel.shape) == (4, 1, 1, 1)
    assert any("1x1" in n for n in conv.notes)
    # Lingua's OptimArgs / trainer / checkpoint defaults.
    c = conv.config
    assert c["optim"] == {
        "lr": 3e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "exclude_norms_and_1d": False,
        "clip": 1.0,
        "warmup": 2000,
        "scheduler": "cosine",
        "lr_min_ratio": 0.1,
    }
    assert c["trainer"]["steps"] == 1000 and c["trainer"]["grad_accum"] == 1
    assert c["checkpoint"]["every"] == 1000 and c["checkpoint"]["keep"] == 1_000_000  # keep 0 = all
    assert c["data"]["batch_size"] == 2 and c["data"]["tokenizer"] == {"name": "bytes", "path": None}
    assert c["distributed"]["compile"] is False and c["distributed"]["param_dtype"] == "bfloat16"


def test_talking_heads_pair_and_baseline_leftovers():
    # query_kernel_size null + key_kernel_size at its default 1: the release builds no kernel.
    a = release_model_args(FIX / "880m_talking_heads.yaml")
    assert a.mta.query_kernel_size is None and a.mta.key_kernel_size is None
    assert {a.layer_kind(i) for i in range(a.n_layers)} == {"mixing"}
    # use_mta false: kernel sizes/mixing are ignored as in the release, group norm kept.
    conv = convert(
        {
            "model": {
                "dim": 64,
                "n_heads": 4,
                "n_layers": 2,
                "mta": {
                    "use_mta": False,
                    "query_kernel_size": 3,
                    "key_kernel_size": 3,
                    "pre_sm_linear_head": True,
                    "group_norm": True,
                },
            },
            "data": {"sources": {"c4": 1}},
        }
    )
    a = conv.model_args()
    assert a.mta.query_kernel_size is None and not a.mta.pre_sm_linear_head and a.mta.group_norm
    assert {a.layer_kind(i) for i in range(2)} == {"sdpa"}
    assert sum("has no effect with use_mta false" in n for n in conv.notes) == 3


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("model.sliding_window=0", "model.sliding_window"),
        ("model.init_std_factor=depth", "model.init_std_factor"),
        ("model.mta.kernel_size=3", "model.mta.kernel_size"),
        ("distributed.tp_size=2", "distributed.tp_size"),
        ("distributed.fsdp_type=hybrid", "distributed.fsdp_type"),
        ("distributed.float8_recipe=rowwise", "distributed.float8_recipe"),
        ("optim.scheduler=wsd", "optim.scheduler"),
        ("optim.cosine_theta=2.0", "optim.cosine_theta"),
        ("data.n_views=3", "data.n_views"),
        ("data.src_tgt_format=true", "data.src_tgt_format"),
        ("data.tokenizer.name=char", "data.tokenizer.name"),
        ("stepz=10", "stepz"),
    ],
)
def test_unsupported_fields_are_refused_by_name(override, field):
    raw = load_release_config(
        FIX / "tiny_mta.yaml", [override] + (["optim.scheduler=cosine"] if "cosine" in override else [])
    )
    with pytest.raises(ValueError, match=rf"release field {field.replace('.', '[.]')}\b"):
        convert(raw)


def test_our_validation_names_the_field():
    raw = load_release_config(FIX / "tiny_mta.yaml", ["model.mta.key_kernel_size=4"])
    with pytest.raises(ValueError, match="model.mta.key_kernel_size"):
        convert(raw)


def test_fields_without_effect_are_noted_and_placeholders_recorded():
    conv = convert_file(FIX / "tiny_mta.yaml")
    text = "\n".join(conv.notes)
    for field in ("profiling", "dump_dir", "logging.wandb", "probe_freq", "eval", "checkpoint.eval"):
        assert f"ignored {field}:" in text
    assert "pass data.root_dir=..." in text
    assert conv.config["data"]["root_dir"] == "???"
    assert conv.config["data"]["tokenizer"]["path"] == "data/tokenizer/mini_sp8192.model"
    assert conv.model_args().vocab_size == 8192  # read from the tokenizer, as the release does
    # The release names two domains; the rest of our default mixture is zeroed.
    assert conv.config["data"]["sources"]["c4"] == 0.5 and conv.config["data"]["sources"]["commoncrawl"] == 0.0
    # A Lingua params.json (every field written out) converts to the same config.
    full = _merge_defaults(load_release_config(FIX / "tiny_mta.yaml"), RELEASE_DEFAULTS, "")
    full["model"]["vocab_size"] = 8192
    assert convert(full, "release_tiny_mta").config == conv.config


def test_placeholder_tokenizer_vocab():
    a = release_model_args(FIX / "880m_mta.yaml")
    assert a.vocab_size == LLAMA3_N_WORDS
    with pytest.raises(ValueError, match="model.vocab_size"):
        release_model_args(FIX / "880m_mta.yaml", ["data.tokenizer.name=sp"])
    assert release_model_args(FIX / "880m_mta.yaml", ["model.vocab_size=32000"]).vocab_size == 32000


# ------------------------------------------------------------------ params and our experiments
@pytest.mark.parametrize("variant", VARIANTS)
def test_params_and_model_match_our_experiment(variant, capsys):
    path = FIX / f"880m_{variant}.yaml"
    ours = model_args_from(compose([f"experiment=pretrain_880m_{variant}"]))
    diff = _model_diff(release_model_args(path), ours)
    assert set(diff) <= NO_EFFECT, diff
    got = _params_json(["--release-config", str(path)], capsys)
    want = _params_json([f"experiment=pretrain_880m_{variant}"], capsys)
    assert got == want


def test_params_cli_error_is_one_line(capsys):
    assert params.cli(["--release-config", str(FIX / "880m_mta.yaml"), "model.n_kv_heads=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.n_kv_heads" in err


def _release_files(tmp_path) -> dict:
    if not (RELEASE_MIRROR / "HEAD").exists() and not (RELEASE_MIRROR / ".git").exists():
        pytest.skip(f"the official release is not mirrored at {RELEASE_MIRROR} (set MTA_RELEASE_REPO)")
    out = {}
    for size in SIZES:
        for v in VARIANTS:
            text = subprocess.run(
                ["git", "-C", str(RELEASE_MIRROR), "show", f"HEAD:projects/mta/configs/{size}_{v}.yaml"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            (tmp_path / f"{size}_{v}.yaml").write_text(text)
            out[size, v] = tmp_path / f"{size}_{v}.yaml"
    return out


@pytest.mark.slow
def test_every_release_config_matches_our_experiment(tmp_path, capsys):
    """Every YAML of projects/mta/configs: same JSON, same model field by field."""
    for (size, v), path in _release_files(tmp_path).items():
        exp = f"experiment=pretrain_{SIZES[size]}_{v}"
        diff = _model_diff(release_model_args(path), model_args_from(compose([exp])))
        assert set(diff) <= NO_EFFECT, (size, v, diff)
        assert _params_json(["--release-config", str(path)], capsys) == _params_json([exp], capsys), (size, v)


# ------------------------------------------------------------------ convert, compose, train
def _domains_corpus(root: Path, domains=("c4", "github"), docs=40):
    rng = random.Random(0)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "his",
        "an",
        "were",
        "are",
        "which",
        "this",
        "be",
    ]
    for d in domains:
        (root / d).mkdir(parents=True, exist_ok=True)
        with open(root / d / "data.chunk.00.jsonl", "w") as f:
            for _ in range(docs):
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(60))}) + "\n")


def _release_layout(sd: dict) -> dict:
    """Our state dict renamed as the release saves it: TiedLinear's second copy of the
    embedding, and wrapper components (compile, activation checkpointing) in the names."""
    out = {}
    for k, v in sd.items():
        if k.startswith("layers.0."):
            k = "layers.0._checkpoint_wrapped_module." + k[len("layers.0.") :]
        out["_orig_mod." + k if k.startswith("norm") else k] = v.clone()
    out["output.tied_module.weight"] = sd["tok_embeddings.weight"].clone()
    return out


def _save_release_checkpoint(step_dir: Path, model_sd: dict, params_json: dict) -> Path:
    """As Lingua's consolidate_checkpoints writes it: <step>/consolidated/{consolidated.pth, params.json}."""
    cons = step_dir / "consolidated"
    cons.mkdir(parents=True)
    torch.save({"model": model_sd, "optim": {"state": {}, "param_groups": []}}, cons / "consolidated.pth")
    (cons / "params.json").write_text(json.dumps(params_json))
    return cons


def test_state_dict_in_release_layout_gives_equal_logits(tmp_path):
    raw = load_release_config(FIX / "tiny_mta.yaml")
    args = convert(raw).model_args()
    src = build_model(args)  # seeded init
    with torch.no_grad():  # move the identity-initialised parts off identity
        for p in src.parameters():
            p.add_(0.01 * torch.randn_like(p))
    cons = _save_release_checkpoint(tmp_path / "0000000010", _release_layout(src.state_dict()), raw)
    assert release_checkpoint_path(tmp_path / "0000000010") == cons / "consolidated.pth"
    assert release_checkpoint_path(cons) == cons / "consolidated.pth"

    sd = torch.load(cons / "consolidated.pth", weights_only=True)["model"]
    assert "output.tied_module.weight" in sd and "_orig_mod.norm.weight" in sd
    dst = build_model(dataclasses.replace(args, seed=7))
    dst.load_state_dict(release_state_dict_to_ours(sd), strict=True)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    src.eval(), dst.eval()
    with torch.no_grad():
        torch.testing.assert_close(dst(tokens), src(tokens), rtol=0, atol=0)

    # Our own layout passes unchanged; an untied release model keeps output.weight.
    assert release_state_dict_to_ours(src.state_dict()).keys() == src.state_dict().keys()
    untied = build_model(dataclasses.replace(args, weight_tying=False), device="meta").state_dict()
    assert release_state_dict_to_ours(untied).keys() == untied.keys()
    bad = dict(sd, **{"output.tied_module.weight": sd["output.tied_module.weight"] + 1})
    with pytest.raises(ValueError, match="output.tied_module.weight differs"):
        release_state_dict_to_ours(bad)


def test_lingua_dcp_step_folders_and_dump_dirs_load(tmp_path):
    """Lingua's CheckpointManager layout: <dump_dir>/checkpoints/<step:010d>/ with DCP files
    of {"model", "optim"}, params.json and train_state_*.json (no consolidated/ yet)."""
    import torch.distributed.checkpoint as dcp

    raw = load_release_config(FIX / "tiny_mta.yaml")
    args = convert(raw).model_args()
    sds = {}
    for step, seed in ((100, 1), (200, 2)):
        sds[step] = build_model(dataclasses.replace(args, seed=seed)).state_dict()
        d = tmp_path / "dump" / "checkpoints" / f"{step:010d}"
        dcp.save(
            {"model": _release_layout(sds[step]), "optim": {"state": {}, "param_groups": []}},
            checkpoint_id=str(d),
            no_dist=True,
        )
        (d / "params.json").write_text(json.dumps(raw))
        (d / "train_state_00000.json").write_text(json.dumps({"step": step, "acc_step": 0}))
    for src, step in ((tmp_path / "dump" / "checkpoints" / f"{100:010d}", 100), (tmp_path / "dump", 200)):
        sd, got_step = load_init_weights(src)
        assert got_step == step and sd.keys() == sds[step].keys()
        assert all(torch.equal(sd[k], v) for k, v in sds[step].items())
    # Our own checkpoints still load through the same function (tested further in test_train).
    ours = tmp_path / "ours.pt"
    torch.save({"model": sds[100], "step": 7}, ours)
    sd, step = load_init_weights(ours)
    assert step == 7 and all(torch.equal(sd[k], v) for k, v in sds[100].items())


@pytest.mark.slow
def test_convert_cli_composes_and_trains_from_release_checkpoint(tmp_path, capsys):
    cfg_root = tmp_path / "cfg"
    assert release_main(["convert", str(FIX / "tiny_mta.yaml"), "--config-dir", str(cfg_root)]) == 0
    exp = cfg_root / "experiment" / "release_tiny_mta.yaml"
    assert exp.is_file()
    assert release_main(["convert", str(FIX / "tiny_mta.yaml"), "--config-dir", str(cfg_root)]) == 2  # no overwrite
    assert "exists" in capsys.readouterr().err

    conv = convert_file(FIX / "tiny_mta.yaml")
    base = ["experiment=release_tiny_mta", f"hydra.searchpath=[file://{cfg_root}]"]
    cfg = compose(base)
    assert _model_diff(model_args_from(cfg), conv.model_args()) == {}
    a, b = build_model(model_args_from(cfg), device="cpu"), build_model(conv.model_args(), device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert cfg.optim.lr == 0.003 and cfg.trainer.steps == 2 and cfg.data.layout == "domains"

    from mta_repro.train.loop import train

    run = ["trainer.device=cpu", "logging.wandb_mode=disabled", "logging.progress_bar=false", "checkpoint.export=true"]
    # The release's <path_to_dataset> is an error naming the override, not the bundled corpus.
    with pytest.raises(Exception, match=r"pass data\.root_dir=\.\.\."):
        train(compose(base + run + [f"run_dir={tmp_path / 'r0'}"]))

    # Start from a release consolidated checkpoint; lr 0 keeps its weights, so the export
    # equals them (a seeded init would not).
    src = build_model(dataclasses.replace(conv.model_args(), seed=3))
    cons = _save_release_checkpoint(tmp_path / "rel" / "0000000100", _release_layout(src.state_dict()), {})
    corpus = tmp_path / "corpus"
    _domains_corpus(corpus)
    out = train(
        compose(
            base
            + run
            + [
                f"run_dir={tmp_path / 'r1'}",
                f"data.root_dir={corpus}",
                f"checkpoint.init_from={cons}",
                "optim.lr=0",
            ]
        )
    )
    assert out["step"] == 2 and torch.isfinite(torch.tensor(out["loss"]))
    exported = torch.load(out["export"], weights_only=False)["model"]
    for k, v in src.state_dict().items():
        assert torch.equal(exported[k].float(), v), k
    lines = (tmp_path / "r1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


def test_convert_print_and_placeholder_init_checkpoint(capsys):
    assert release_main(["convert", str(FIX / "880m_mta.yaml"), "--print", "--name", "x"]) == 0
    out = capsys.readouterr()
    assert "root_dir: ${release_placeholder:data.root_dir}" in out.out
    assert "path: ${release_placeholder:data.tokenizer.path}" in out.out
    assert "note: data.root_dir is a placeholder" in out.err
    # key=value (release names) also after the options; release-refused combinations noted.
    assert release_main(["convert", str(FIX / "tiny_mta.yaml"), "--print", "model.mta.init_method=const"]) == 0
    out = capsys.readouterr()
    assert "init_method: const" in out.out and "note: the release raises for head_kernel_size" in out.err
    conv = convert_file(FIX / "880m_mta.yaml", overrides=["checkpoint.init_ckpt_path=<path_to_ckpt>/0000010000"])
    with pytest.raises(ValueError, match="checkpoint.init_ckpt_path is a placeholder"):
        experiment_yaml(conv, "x")
