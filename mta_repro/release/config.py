"""Config conversion: the official release's training YAML (or the ``params.json`` beside a
Lingua checkpoint) -> our config, field by field (``release_to_config``,
``release_file_to_config``; ``python -m mta_repro.release convert`` writes it as an experiment).

Fields absent from the YAML take the *release's* defaults
(``MTATransformerArgs``, ``BaseTransformerArgs``/``LMTransformerArgs``, Lingua's
``OptimArgs``, ``DistributedArgs``, ``DataArgs``, ...), which differ from ours: e.g. the
release's key-query kernel sizes default to 1, so ``use_mta: true`` with no kernel sizes
builds a learned 1x1 per-head score scale in every MTA layer; ``rope_theta`` 10000,
``weight_tying`` false, ``scheduler`` cosine. Fields we cannot honour raise ``ValueError``
naming the field; fields without effect on training (profiling, dump_dir, wandb, eval,
...) are dropped with a note.

``key=value`` overrides use the *release's* names (``model.vocab_size=32000``) and apply
before conversion. Values that are placeholders in the release (``<path_to_dataset>``)
become ``${release_placeholder:F}``, which fails naming the override to pass (``F=...``)
only when read.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from mta_repro.errors import UserError
from mta_repro.model.args import ModelArgs, MTAArgs

# What a value of the release means when it is written as a placeholder: ``<path_to_dataset>``.
PLACEHOLDER = re.compile(r"<[A-Za-z0-9_\-]+>")
MISSING = "???"  # a placeholder value in Conversion.config (see experiment_yaml)
OPAQUE = object()  # a release section we ignore whole (any content accepted)

# Lingua's TikTokenTokenizer: n_vocab of Llama-3's tokenizer.model (128,000 BPE ranks +
# 256 special tokens), the tokenizer every release config names.
LLAMA3_N_WORDS = 128256
# Lingua's ByteTokenizer: 256 bytes + BOS + EOS (ours alike).
BYTES_N_WORDS = 258

# The release's defaults: projects/mta/train.py (TrainArgs), projects/mta/mta_transformer.py
# (MTATransformerArgs, BaseTransformerArgs), projects/mta/transformer.py (LMTransformerArgs),
# projects/mta/data.py (DataArgs) and Lingua at the release's submodule commit 3360e12
# (lingua/optim.py OptimArgs, distributed.py DistributedArgs, checkpoint.py CheckpointArgs,
# metrics.py LoggingArgs, tokenizer.py TokenizerArgs).
RELEASE_MTA_DEFAULTS: dict[str, Any] = {
    "use_mta": False,
    "query_kernel_size": 1,
    "key_kernel_size": 1,
    "pad_key": "both",
    "mta_layers": None,
    "after_sm_query_kernel_size": None,
    "after_sm_key_kernel_size": None,
    "init_method": "identity",
    "head_kernel_size": None,
    "group_norm": False,
    "layer_norm_rescale": False,
    "curse_norm": False,
    "pre_sm_linear_head": False,
    "post_sm_linear_head": False,
    "add_gating": False,
    "gate_1d": True,
}
RELEASE_DEFAULTS: dict[str, Any] = {
    "name": "lingua",
    "dump_dir": "",
    "seed": 42,
    "grad_acc_steps": 1,
    "gc_collect_freq": 1000,
    "probe_freq": None,
    "steps": 1000,
    "async_eval_gpus": None,
    "eval": OPAQUE,
    "env": OPAQUE,
    "profiling": OPAQUE,
    "optim": {
        "lr": 3e-4,
        "weight_decay": 0.1,
        "epsilon": 1e-8,
        "beta1": 0.9,
        "beta2": 0.95,
        "clip": 1.0,
        "scheduler": "cosine",
        "warmup": 2000,
        "lr_min_ratio": 0.1,
        "cycle_length": 1.0,
        "cosine_theta": 1.0,
        "annealing_step": 1000,
        "decay_fraction": 0.1,
        "exp_factor": 0.5,
    },
    "model": {
        "dim": 512,
        "n_layers": 8,
        "head_dim": None,
        "n_heads": None,
        "n_kv_heads": None,
        "ffn_dim_multiplier": None,
        "multiple_of": 256,
        "norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "init_base_std": None,
        "init_std_factor": "disabled",
        "max_seqlen": 1024,
        "cache_attention_maps": False,
        "mta": RELEASE_MTA_DEFAULTS,
        "dropout": 0.0,
        "seed": 42,
        "vocab_size": -1,
        "weight_tying": False,
        "sliding_window": None,
    },
    "distributed": {
        "dp_shard": 1,
        "dp_replicate": 1,
        "tp_size": 1,
        "selective_activation_checkpointing": False,
        "compile": False,
        "fsdp_type": "no_shard",
        "model_dtype": "bf16",
        "float8_recipe": None,
        "float8_filter": r"layers\.[0-9]+\.",
        "matmul_allow_tf32": False,
        "detect_anomaly": False,
        "compile_cache_size_limit": 8,
        "spawn_method": "forkserver",
    },
    "checkpoint": {
        "dump": {"every": 1000, "keep": 0},
        "eval": {"every": 1000, "keep": 0},
        "path": None,
        "init_ckpt_path": None,
        "continue_training_from_init": False,
    },
    "logging": {"freq": 10, "acc_freq": None, "wandb": OPAQUE},
    "data": {
        "root_dir": None,
        "sources": OPAQUE,  # a free {domain: weight} dict, checked below
        "batch_size": 2,
        "seq_len": 2048,
        "n_views": 2,
        "seed": 42,
        "add_bos": True,
        "add_eos": True,
        "load_async": True,
        "prefetch_size": 64,
        "tokenizer": {"name": "bytes", "path": None},
        "src_tgt_format": False,
        "no_loss_prompt": True,
        "src_tgt_sep": "",
    },
}
# Unset in the release means: sources {}, logging.wandb None, eval/env/profiling defaults.
_OPAQUE_DEFAULTS = {"data.sources": {}, "logging.wandb": None, "eval": None, "env": None, "profiling": None}

TOKENIZER_NAMES = {"sp": "sentencepiece", "tiktoken": "tiktoken", "bytes": "bytes"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SCHEDULERS = ("linear", "cosine", "constant")


@dataclasses.dataclass
class Conversion:
    """Our config (nested plain dict, root-config layout) and what the conversion decided."""

    config: dict
    notes: list[str]
    source: str = ""

    def model_args(self) -> ModelArgs:
        return ModelArgs(**copy.deepcopy(self.config["model"]))


# --------------------------------------------------------------------------- loading
def load_release_config(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> dict:
    """The release YAML (or a Lingua ``params.json``) as a plain dict, with ``key=value``
    overrides (release names) applied."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such release config file")
    try:
        raw = yaml.load(path.read_text(), Loader=_ReleaseLoader)
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not a YAML/JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of release config fields at the top level")
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep or not key:
            raise UserError(f"override {ov!r}: expected key=value (release field names)")
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[parts[-1]] = yaml.load(value, Loader=_ReleaseLoader) if value != "" else ""
    return raw


class _ReleaseLoader(yaml.SafeLoader):
    """YAML 1.1 (PyYAML) reads ``1e-05`` (no dot), as json.dump writes Lingua's
    params.json, as a string; JSON, YAML 1.2 and OmegaConf read it as a float."""


_ReleaseLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _schema_typed(config: dict) -> dict:
    """``config`` with every value of our root schema's type (``TrainConfig``), as the
    Hydra route would read it (e.g. a float field given the int 0 becomes 0.0); a value
    of the wrong type raises ValueError naming the field."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mta_repro.train.config import TrainConfig

    try:
        typed = OmegaConf.to_container(
            OmegaConf.merge(OmegaConf.structured(TrainConfig), config), resolve=False, throw_on_missing=False
        )
    except OmegaConfBaseException as e:
        raise UserError(f"converted field {e.full_key}: {e.msg}") from None

    def pick(ours: Any, t: Any) -> Any:
        if isinstance(ours, dict):
            return {k: pick(v, t[k]) for k, v in ours.items()}
        return ours if ours == MISSING else t  # a merged "???" keeps the schema's default

    return pick(config, typed)


def _merge_defaults(user: Any, defaults: Any, where: str) -> Any:
    """User values over the release's defaults; a field the release does not have raises."""
    if defaults is OPAQUE:
        return _OPAQUE_DEFAULTS.get(where) if user is OPAQUE else user
    if not isinstance(defaults, dict):
        return user
    if user is None:
        user = {}
    if not isinstance(user, dict):
        raise UserError(f"release field {where}: expected a mapping, got {user!r}")
    out = {}
    for k, _v in user.items():
        if k not in defaults:
            known = ", ".join(sorted(defaults))
            raise UserError(
                f"release field {_join(where, k)} is not a field of the release's config (known here: {known})"
            )
    for k, d in defaults.items():
        out[k] = _merge_defaults(user.get(k, OPAQUE if d is OPAQUE else d), d, _join(where, k))
    return out


def _join(where: str, k: str) -> str:
    return f"{where}.{k}" if where else k


def _set_fields(user: Any, where: str = "") -> set[str]:
    """Dotted names of the leaves the user's YAML sets (to note only what they wrote)."""
    if not isinstance(user, dict):
        return {where}
    out = {where} if where else set()
    for k, v in user.items():
        out |= _set_fields(v, _join(where, k))
    return out


def _placeholder(value: Any) -> bool:
    return isinstance(value, str) and bool(PLACEHOLDER.search(value))


# --------------------------------------------------------------------------- conversion
class _Fields:
    """What every section's conversion shares: the release config with its defaults merged
    (``r``), the fields the file itself set (``given``) and the notes collected so far."""

    def __init__(self, release: dict):
        self.given = _set_fields(release)
        self.r = _merge_defaults(release, RELEASE_DEFAULTS, "")
        self.notes: list[str] = []

    def refuse(self, field: str, why: str) -> None:
        raise UserError(f"release field {field}={_get(self.r, field)!r} is not supported: {why}")

    def ignore(self, field: str, why: str) -> None:
        if field in self.given:
            self.notes.append(f"ignored {field}: {why}")

    def path_value(self, field: str, override: str) -> str | None:
        v = _get(self.r, field)
        if _placeholder(v):
            self.notes.append(f"{field} is a placeholder in the release ({v}): pass {override}=... when training")
            return MISSING
        return v


def release_to_config(release: dict, name: str = "release", source: str = "") -> Conversion:
    """A release config dict -> our root config (plain dict) and notes, one section at a time."""
    f = _Fields(release)
    _ignore_top_level(f)
    data = _convert_data(f)  # first: the model's vocabulary may come from the tokenizer
    model = _convert_model(f.r["model"], f.given, f.r["data"], data["tokenizer"]["path"], f.notes)
    optim = _convert_optim(f)
    distributed = _convert_distributed(f)
    checkpoint = _convert_checkpoint(f)
    f.ignore("logging.acc_freq", "we log optimiser steps")
    f.ignore("logging.wandb", "wandb logs offline to logging.wandb_project (pass logging.wandb_mode=online ...)")
    f.notes.append(
        "the global batch is data.batch_size x data.seq_len x GPUs: the release ran 32 GPUs "
        "(1B: 64; its README), so pass slurm.nodes=4 (8) with slurm.gpus_per_node=8"
    )
    config = {
        "run_dir": f"runs/{name}",
        "seed": f.r["seed"],
        "model": model,
        "optim": optim,
        "trainer": {
            "steps": f.r["steps"],
            "grad_accum": f.r["grad_acc_steps"],
            # The release trains on GPUs; "auto" also lets the converted config run on CPU.
            "device": "auto",
            # The release validates on separate files (its eval.ppl_files, not mapped): our
            # validation reads *.val.jsonl beside each domain's training files, which a
            # release corpus does not have. Set trainer.eval_every=N once they exist.
            "eval_every": 0,
        },
        "checkpoint": checkpoint,
        "logging": {"every": f.r["logging"]["freq"]},
        "distributed": distributed,
        "data": data,
    }
    conv = Conversion(config=_schema_typed(config), notes=f.notes, source=source)
    conv.model_args()  # our validation: raises naming the field
    return conv


def _ignore_top_level(f: _Fields) -> None:
    for field, why in (
        ("name", "the run directory is run_dir (runs/<experiment>)"),
        ("dump_dir", "outputs go to run_dir; pass run_dir=... to choose it"),
        ("gc_collect_freq", "Python GC scheduling"),
        ("probe_freq", "Lingua's activation probes"),
        ("async_eval_gpus", "evaluation is a separate job: python -m mta_repro.eval <run_dir>"),
        ("eval", "evaluation is a separate job: python -m mta_repro.eval <run_dir> (ppl uses data.seq_len)"),
        ("env", "environment variables of Lingua's launcher"),
        ("profiling", "the profiler; scripts/bench_train.py measures throughput"),
    ):
        f.ignore(field, why)


def _convert_data(f: _Fields) -> dict:
    d = f.r["data"]
    sources = d["sources"]
    if not isinstance(sources, dict) or not sources:
        raise UserError("release field data.sources: expected a non-empty {domain: weight} mapping")
    if d["n_views"] != 2:
        f.refuse("data.n_views", "the trainer reads (input, target) pairs, n_views 2")
    if d["src_tgt_format"]:
        f.refuse("data.src_tgt_format", "source/target loss masking is not implemented")
    f.ignore("data.no_loss_prompt", "used only with src_tgt_format")
    f.ignore("data.src_tgt_sep", "used only with src_tgt_format")
    tok = d["tokenizer"]
    if tok["name"] not in TOKENIZER_NAMES:
        f.refuse("data.tokenizer.name", f"expected one of {sorted(TOKENIZER_NAMES)}")
    root_dir = d["root_dir"]
    if root_dir is None:
        f.notes.append("data.root_dir is unset in the release config: pass data.root_dir=... when training")
        root_dir = MISSING
    else:
        root_dir = f.path_value("data.root_dir", "data.root_dir")
    tok_path = f.path_value("data.tokenizer.path", "data.tokenizer.path")
    # Lingua shuffles blocks of prefetch_size * batch_size sequences; ours keeps a buffer
    # of that many sequences and draws uniformly from it.
    return {
        "root_dir": root_dir,
        "layout": "domains",  # the release reads <root_dir>/<domain>/*.chunk.*.jsonl
        "sources": {**{k: 0.0 for k in _default_domains() if k not in sources}, **sources},
        "seq_len": d["seq_len"],
        "batch_size": d["batch_size"],
        "seed": d["seed"],
        "shuffle_buffer": d["prefetch_size"] * d["batch_size"],
        "prefetch": 4 if d["load_async"] else 0,
        "add_bos": d["add_bos"],
        "add_eos": d["add_eos"],
        "tokenizer": {"name": TOKENIZER_NAMES[tok["name"]], "path": tok_path if tok["name"] != "bytes" else None},
    }


def _convert_optim(f: _Fields) -> dict:
    o = f.r["optim"]
    if o["scheduler"] not in SCHEDULERS:
        f.refuse("optim.scheduler", f"expected one of {SCHEDULERS}")
    if o["scheduler"] == "cosine":
        for field in ("cycle_length", "cosine_theta"):
            if float(o[field]) != 1.0:
                f.refuse(f"optim.{field}", "our cosine schedule is one half cycle (Lingua's 1.0)")
    for field in ("annealing_step", "decay_fraction", "exp_factor"):
        f.ignore(f"optim.{field}", "used only by schedulers we do not have (wsd, inv_sqrt)")
    return {
        "lr": o["lr"],
        "beta1": o["beta1"],
        "beta2": o["beta2"],
        "eps": o["epsilon"],
        "weight_decay": o["weight_decay"],
        "exclude_norms_and_1d": False,  # Lingua decays every parameter
        "clip": o["clip"],
        "warmup": o["warmup"],
        "scheduler": o["scheduler"],
        "lr_min_ratio": o["lr_min_ratio"],
    }


def _convert_distributed(f: _Fields) -> dict:
    g = f.r["distributed"]
    if g["tp_size"] != 1:
        f.refuse("distributed.tp_size", "tensor parallelism is not implemented (FSDP2 only)")
    if g["fsdp_type"] not in ("full_shard", "no_shard"):
        f.refuse("distributed.fsdp_type", "expected full_shard or no_shard")
    if g["float8_recipe"] is not None:
        f.refuse("distributed.float8_recipe", "float8 training is not implemented")
    if g["model_dtype"] not in DTYPES:
        f.refuse("distributed.model_dtype", f"expected one of {sorted(DTYPES)}")
    f.ignore("distributed.fsdp_type", "FSDP2 shards over all ranks (same math as Lingua's full_shard/no_shard)")
    for field in ("dp_shard", "dp_replicate"):
        f.ignore(f"distributed.{field}", "the data-parallel size is the world size")
    for field in ("float8_filter", "detect_anomaly", "compile_cache_size_limit", "spawn_method"):
        f.ignore(f"distributed.{field}", "no effect on the trained model")
    if g["selective_activation_checkpointing"]:
        f.notes.append(
            "distributed.selective_activation_checkpointing -> distributed.activation_checkpointing "
            "(recomputes whole blocks; same numbers, different speed)"
        )
    return {
        "param_dtype": DTYPES[g["model_dtype"]],
        "reduce_dtype": "float32",  # Lingua's MixedPrecisionPolicy
        "compile": bool(g["compile"]),
        "allow_tf32": bool(g["matmul_allow_tf32"]),
        "activation_checkpointing": bool(g["selective_activation_checkpointing"]),
    }


def _convert_checkpoint(f: _Fields) -> dict:
    c = f.r["checkpoint"]
    keep = c["dump"]["keep"]
    if keep <= 0:
        f.notes.append(f"checkpoint.dump.keep={keep} keeps every checkpoint in Lingua: checkpoint.keep=1000000")
        keep = 1_000_000
    f.ignore("checkpoint.eval", "Lingua's extra saves for its in-training evals; evaluate any checkpoint later")
    f.ignore("checkpoint.path", "checkpoints go to <run_dir>/checkpoints")
    f.ignore("checkpoint.continue_training_from_init", "unused by Lingua's CheckpointManager")
    init_from = c["init_ckpt_path"]
    if init_from is not None:
        init_from = f.path_value("checkpoint.init_ckpt_path", "checkpoint.init_from")
    return {"every": c["dump"]["every"], "keep": keep, "init_from": init_from, "init_mode": "model"}


def _convert_model(m: dict, given: set[str], data: dict, tok_path: str | None, notes: list[str]) -> dict:
    def refuse(field: str, value: Any, why: str) -> None:
        raise UserError(f"release field model.{field}={value!r} is not supported: {why}")

    # Release: head_dim = head_dim or dim // n_heads; n_heads = n_heads or dim // head_dim.
    n_heads, head_dim, dim = m["n_heads"], m["head_dim"], m["dim"]
    if n_heads is None and head_dim is None:
        raise UserError("release fields model.n_heads and model.head_dim are both unset: set one")
    if n_heads is None:
        n_heads = dim // head_dim
    if dim % n_heads:
        refuse("n_heads", n_heads, f"the release asserts model.dim ({dim}) % model.n_heads == 0")
    # Grouped-query attention as the release: wk/wv at n_kv_heads, repeated after RoPE.
    n_kv_heads = m["n_kv_heads"]
    if n_kv_heads is not None and (not isinstance(n_kv_heads, int) or n_kv_heads < 1 or n_heads % n_kv_heads):
        refuse("n_kv_heads", n_kv_heads, f"the release asserts model.n_heads ({n_heads}) % model.n_kv_heads == 0")
    from mta_repro.model.args import INIT_STD_FACTORS

    if m["init_std_factor"] not in INIT_STD_FACTORS:  # Lingua's InitStdFactor values
        refuse("init_std_factor", m["init_std_factor"], f"expected one of {INIT_STD_FACTORS}")
    sw = m["sliding_window"]
    if sw is not None:
        if isinstance(sw, bool) or not isinstance(sw, int) or sw < 1:
            refuse("sliding_window", sw, "expected a positive integer or null")
        # projects/mta/transformer.py create_causal_mask: the window acts only with
        # attn_impl=xformers; the release's train.py calls the model with the default
        # attn_impl=sdpa (and its MTA layers build their own causal mask), so it trains
        # with full causal attention, as ours does.
        notes.append(
            f"ignored model.sliding_window={sw}: the release applies it only with attn_impl=xformers; "
            "its training uses sdpa, where it has no effect (full causal attention, as here)"
        )
    if "model.cache_attention_maps" in given:
        notes.append("ignored model.cache_attention_maps: an inference-time debugging buffer")

    vocab = m["vocab_size"]
    if vocab is None or vocab < 0:
        vocab = _tokenizer_vocab(data["tokenizer"], tok_path, notes)

    # The release sets model.max_seqlen = data.seq_len when training starts; ours is only
    # the length of the precomputed RoPE table (grown on demand).
    max_seqlen = data["seq_len"]

    mta = _convert_mta(m["mta"], given, notes)

    ours = ModelArgs()
    out = {
        "dim": dim,
        "n_layers": m["n_layers"],
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "ffn_dim_multiplier": 1.0 if m["ffn_dim_multiplier"] is None else m["ffn_dim_multiplier"],
        "multiple_of": m["multiple_of"],
        "norm_eps": m["norm_eps"],
        "norm_order": "release",  # the release's block norms cast before the weight
        "rope_theta": m["rope_theta"],
        "max_seqlen": max_seqlen,
        "weight_tying": m["weight_tying"],
        "seed": m["seed"],
        "init_base_std": m["init_base_std"],
        "init_std_factor": m["init_std_factor"],
        "dropout": m["dropout"],
        "diff_transformer": False,  # not in the release's MTA project
        "attn_impl": ours.attn_impl,
        "attn_block_size": ours.attn_block_size,
        "attn_selfcheck": ours.attn_selfcheck,  # ours alone: the check before training
        "attn_selfcheck_cpu": ours.attn_selfcheck_cpu,
        "kq_conv_layers": mta["mta_layers"],
        "mta": mta,
        # Lingua's RoPE has no frequency scaling (rope_theta only): the plain frequencies.
        "rope_scaling": dataclasses.asdict(ours.rope_scaling),
        # ours alone: how the kernels compute (the defaults; free to change within a run dir)
        "kernels": dataclasses.asdict(ours.kernels),
    }
    assert set(out) == {f.name for f in dataclasses.fields(ModelArgs)}, "ModelArgs gained a field: map it here"
    return out


def _convert_mta(release_mta: dict, given: set[str], notes: list[str]) -> dict:
    """The release's ``model.mta`` section -> our MTAArgs fields (same names), with notes on
    settings that have no effect in the release and on combinations its init asserts against."""
    mt = dict(release_mta)
    if mt["mta_layers"] is not None:
        mt["mta_layers"] = str(mt["mta_layers"])
    # The release builds a key-query kernel only when both sizes of a pair are set.
    for q, k in (("query_kernel_size", "key_kernel_size"), ("after_sm_query_kernel_size", "after_sm_key_kernel_size")):
        if (mt[q] is None) != (mt[k] is None):
            set_one = q if mt[q] is not None else k
            if f"model.mta.{set_one}" in given:
                notes.append(
                    f"model.mta.{set_one}={mt[set_one]} has no effect without its pair (the release builds no kernel)"
                )
            mt[q] = mt[k] = None
    if not mt["use_mta"]:
        # Without use_mta the release builds plain SDPA attention: none of these exist.
        # (group_norm, gating and curse_norm still apply, as in the release.)
        for f in (
            "query_kernel_size",
            "key_kernel_size",
            "after_sm_query_kernel_size",
            "after_sm_key_kernel_size",
            "head_kernel_size",
            "mta_layers",
        ):
            if mt[f] is not None and f"model.mta.{f}" in given:
                notes.append(f"model.mta.{f} has no effect with use_mta false (as in the release)")
            mt[f] = None
        for f in ("pre_sm_linear_head", "post_sm_linear_head"):
            if mt[f] and f"model.mta.{f}" in given:
                notes.append(f"model.mta.{f} has no effect with use_mta false (as in the release)")
            mt[f] = False
    elif mt["query_kernel_size"] == 1 and mt["key_kernel_size"] == 1 and "model.mta.query_kernel_size" not in given:
        notes.append(
            "model.mta.query_kernel_size/key_kernel_size unset: the release's default 1x1 kernel "
            "(a learned per-head score scale) in every MTA layer"
        )
    if mt["use_mta"]:
        # Combinations the release's init asserts against; ours runs them (README).
        has_kernel = mt["query_kernel_size"] is not None or mt["after_sm_query_kernel_size"] is not None
        if has_kernel and mt["init_method"] == "identity" and mt["pad_key"] != "both":
            notes.append(
                "the release asserts pad_key 'both' for identity kernels; ours uses the true identity for any pad_key"
            )
        if mt["after_sm_query_kernel_size"] is not None and mt["init_method"] != "identity":
            notes.append(
                "the release asserts init_method identity with post-softmax kernels; ours starts them at identity"
            )
        if mt["head_kernel_size"] is not None and mt["init_method"] != "identity":
            notes.append(
                "the release raises for head_kernel_size with a non-identity init_method; "
                "ours starts head_kernel at identity"
            )
    return {f.name: mt[f.name] for f in dataclasses.fields(MTAArgs)}


def _tokenizer_vocab(tok: dict, tok_path: str | None, notes: list[str]) -> int:
    """The release sets vocab_size from the tokenizer when the YAML leaves it at -1."""
    name = TOKENIZER_NAMES[tok["name"]]
    if name == "bytes":
        return BYTES_N_WORDS
    if tok_path not in (None, MISSING):
        from mta_repro.data.args import TokenizerArgs, resolve_path

        if resolve_path(tok_path).is_file():
            from mta_repro.data import build_tokenizer

            return build_tokenizer(TokenizerArgs(name=name, path=tok_path)).n_words
    if name == "tiktoken":
        notes.append(
            f"model.vocab_size unset and data.tokenizer.path unreadable: {LLAMA3_N_WORDS} "
            "(Llama-3's tokenizer.model, as every release config names; the trainer checks it)"
        )
        return LLAMA3_N_WORDS
    raise UserError(
        f"release field model.vocab_size is unset (the release takes it from the tokenizer) and "
        f"data.tokenizer.path={tok['path']!r} cannot be read: pass model.vocab_size=<n> or a real data.tokenizer.path"
    )


def _default_domains() -> list[str]:
    """Domains of our default data group, zeroed when the release names fewer (Hydra merges dicts)."""
    from mta_repro.data.args import PAPER_WEIGHTS

    return list(PAPER_WEIGHTS)


def _missing_fields(d: dict, where: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _missing_fields(v, _join(where, k))
        elif v == MISSING:
            out.append(_join(where, k))
    return out


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d[p]
    d[last] = value


def _get(d: dict, dotted: str) -> Any:
    node: Any = d
    for p in dotted.split("."):
        node = node[p] if isinstance(node, dict) else None
    return node


def release_model_args(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> ModelArgs:
    """Our ModelArgs for a release config file (what ``params --release-config`` counts)."""
    return release_file_to_config(path, overrides=overrides).model_args()


def release_file_to_config(
    path: str | Path, name: str | None = None, overrides: tuple[str, ...] | list[str] = ()
) -> Conversion:
    """A release YAML or Lingua ``params.json`` (with release-named ``key=value`` overrides) -> our config."""
    path = Path(path)
    raw = load_release_config(path, overrides)
    try:
        return release_to_config(raw, name or default_name(path), source=str(path))
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def default_name(path: str | Path) -> str:
    """release_<file stem>, lower case, e.g. 830M_mta.yaml -> release_830m_mta."""
    path = Path(path)
    stem = path.parent.name if path.name == "params.json" else path.stem
    return "release_" + re.sub(r"[^a-z0-9_]+", "_", stem.lower()).strip("_")


def experiment_yaml(conv: Conversion, name: str) -> str:
    """``configs/experiment/<name>.yaml`` text: every field explicit, so nothing comes
    from the default groups (model=tiny, attention=baseline, data=mini)."""
    head = [
        "# @package _global_",
        f"# Converted from the official release config {conv.source or '(dict)'} by",
        f"#   python -m mta_repro.release convert {conv.source or 'PATH'} --name {name}",
        f"# Train: python -m mta_repro.train experiment={name} [overrides]",
        "# Every field is explicit; ${release_placeholder:F}: pass F=... on the command line.",
    ]
    if conv.notes:
        head.append("# Notes:")
        head += [f"#  - {n}" for n in conv.notes]
    if conv.config["checkpoint"]["init_from"] == MISSING:
        # A "???" here would merge under the default null and silently train from scratch.
        raise UserError(
            "release field checkpoint.init_ckpt_path is a placeholder: give the real checkpoint "
            "to convert (checkpoint.init_ckpt_path=<dir> after the path), or drop it and pass "
            "checkpoint.init_from=<dir> when training"
        )
    # A placeholder becomes ${release_placeholder:<field>} (registered in mta_repro/__init__),
    # which raises naming the override when read; Hydra's "???" would merge *under* the
    # defaults (the bundled corpus) and be silently replaced.
    config = copy.deepcopy(conv.config)
    for field in _missing_fields(config):
        _set(config, field, f"${{release_placeholder:{field}}}")
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
    return "\n".join(head) + "\n" + body
