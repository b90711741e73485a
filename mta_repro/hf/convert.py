"""Conversions between this project's baseline and ``LlamaForCausalLM`` (see __init__)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict

from mta_repro.errors import UserError
from mta_repro.model import ModelArgs

TOKENIZER_NOTE = "mta_repro_tokenizer.json"  # our tokenizer settings, for the way back


def _halves_from_pairs(d: int) -> torch.Tensor:
    """Row order that turns interleaved pairs (2i, 2i+1) into halves (i, i + d/2)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _permute_heads(w: torch.Tensor, n_heads: int, order: torch.Tensor) -> torch.Tensor:
    d = w.shape[0] // n_heads
    return w.view(n_heads, d, -1)[:, order].reshape(n_heads * d, -1)


def _check_baseline(args: ModelArgs) -> None:
    if args.diff_transformer or args.mta.use_mta:
        kind = "Differential" if args.diff_transformer else "MTA/talking-heads"
        raise UserError(
            f"hf: this is a {kind} model; only baseline weights map onto LlamaForCausalLM "
            "(python -m mta_repro.hf export writes a trust_remote_code folder for the other variants)"
        )


def _kv_heads(args: ModelArgs) -> int:
    """Key/value heads of ``args`` (grouped-query attention when fewer than n_heads)."""
    return getattr(args, "resolved_n_kv_heads", args.n_heads)


def _has_rope_parameters() -> bool:
    from transformers import LlamaConfig

    return "rope_parameters" in LlamaConfig().to_dict()  # transformers >= 5


def llama_config(
    args: ModelArgs, bos_id: int | None = None, eos_id: int | None = None, max_position_embeddings: int | None = None
):
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=_kv_heads(args),
        head_dim=args.resolved_head_dim,
        hidden_act="silu",
        rms_norm_eps=args.norm_eps,
        max_position_embeddings=int(max_position_embeddings or args.max_seqlen),
        tie_word_embeddings=bool(args.weight_tying),
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    rope = {"rope_type": "default"}
    scaled = args.rope_scaling.rope_type != "default"
    if scaled:  # Llama 3.1/3.2: the same rope_scaling back
        rope = dataclasses.asdict(args.rope_scaling)
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    if _has_rope_parameters():
        kw["rope_parameters"] = {**rope, "rope_theta": float(args.rope_theta)}
    else:
        kw["rope_theta"] = float(args.rope_theta)
        if scaled:
            kw["rope_scaling"] = rope
    return LlamaConfig(**kw)


def state_to_hf(sd: dict, args: ModelArgs) -> dict:
    """Our baseline state dict (Lingua keys) -> LlamaForCausalLM keys."""
    _check_baseline(args)
    order = _halves_from_pairs(args.resolved_head_dim)
    kv = _kv_heads(args)
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(args.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = _permute_heads(sd[p + "attention.wq.weight"], args.n_heads, order)
        out[q + "self_attn.k_proj.weight"] = _permute_heads(sd[p + "attention.wk.weight"], kv, order)
        out[q + "self_attn.v_proj.weight"] = sd[p + "attention.wv.weight"]
        out[q + "self_attn.o_proj.weight"] = sd[p + "attention.wo.weight"]
        out[q + "mlp.gate_proj.weight"] = sd[p + "feed_forward.w1.weight"]
        out[q + "mlp.up_proj.weight"] = sd[p + "feed_forward.w3.weight"]
        out[q + "mlp.down_proj.weight"] = sd[p + "feed_forward.w2.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "attention_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ffn_norm.weight"]
    out["lm_head.weight"] = sd["tok_embeddings.weight"] if args.weight_tying else sd["output.weight"]
    return {k: v.contiguous() for k, v in out.items()}


# The files an export writes (a sharded save and the trust_remote_code folder included).
EXPORT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    TOKENIZER_NOTE,
    "modeling_mta_repro.py",
    "provenance.json",
)


def _is_export(folder: Path) -> bool:
    """Whether ``folder`` holds an export of ours (our tokenizer note, or our model type)."""
    if (folder / TOKENIZER_NOTE).is_file():
        return True
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type") == "mta_repro"
    except (OSError, ValueError, AttributeError):
        return False


def _check_out_dir(out_dir: Path, force: bool) -> list:
    """The files of an earlier export of ours in ``out_dir`` (replaced: removed before the
    new one is written); refuse another non-empty folder unless ``force``."""
    if not out_dir.exists():
        return []
    if not out_dir.is_dir():
        raise UserError(f"hf export: {out_dir} is a file; expected a new or empty folder")
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries:
        return []
    if _is_export(out_dir):
        return sorted({f for pattern in EXPORT_FILES for f in out_dir.glob(pattern) if f.is_file()})
    if not force:
        raise UserError(
            f"hf export: {out_dir} is not empty ({len(entries)} entries, e.g. {entries[:3]}) and is not an "
            "export of ours: choose a new or empty folder, or pass --force to write into it (files of "
            "the export's names are overwritten, others kept)"
        )
    return []


def _readable_as_umask(paths) -> None:
    """Give the written files the mode the umask gives new files (safetensors writes 0600,
    the rest of the export 0644): colleagues on a shared cluster read all of it or none."""
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    for p in paths:
        if p.is_file() and not p.is_symlink():
            os.chmod(p, stat.S_IMODE(0o666 & ~mask))


def export_hf(path: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write a ``LlamaForCausalLM`` folder (config.json, model.safetensors, the
    tokenizer file and our tokenizer settings) from a baseline run or .pt, with a
    provenance.json saying what the weights came from (mta_repro/runs/provenance.py).
    ``out_dir`` must be new, empty or an earlier export of ours (replaced); ``force``
    writes into another folder."""
    from transformers import LlamaForCausalLM

    from mta_repro.eval.load import load_model, load_tokenizer
    from mta_repro.train.config import trained_seq_len

    earlier = _check_out_dir(Path(out_dir), force)  # before any work: a refusal changes nothing
    model, cfg = load_model(path, device="cpu", dtype="float32", identity=True)
    args = model.args
    try:
        tok = load_tokenizer(cfg)
        bos, eos = int(tok.bos_id), int(tok.eos_id)
    except (ValueError, OSError):
        tok, bos, eos = None, None, None
    out_dir = Path(out_dir)
    for f in earlier:
        f.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.diff_transformer or args.mta.use_mta:
        # MTA, talking heads, Differential: our own modeling file (trust_remote_code).
        from mta_repro.hf.remote import export_remote

        export_remote(model, out_dir, bos, eos)
    else:
        config = llama_config(args, bos, eos, trained_seq_len(cfg) or args.max_seqlen)
        config.architectures = ["LlamaForCausalLM"]
        with torch.device("meta"):
            hf = LlamaForCausalLM(config)
        hf.load_state_dict(state_to_hf(model.state_dict(), args), assign=True, strict=True)
        if args.weight_tying:
            hf.tie_weights()
        hf.save_pretrained(out_dir, safe_serialization=True)
    # The tokenizer: its file as is, plus how to build it here (sentencepiece models
    # and Llama-3 ranks files are what Meta's checkpoints ship as tokenizer.model).
    tok_node = OmegaConf.to_container(cfg.data.tokenizer, resolve=True) if "data" in cfg else None
    tok_cfg = tok_node if isinstance(tok_node, dict) else None
    if tok_cfg and tok is not None:
        # tokenizer.json: AutoTokenizer gives training's ids (BOS + text ids)
        src = _find(tok_cfg["path"]) if tok_cfg.get("path") and tok_cfg.get("name") != "bytes" else None
        from mta_repro.hf.tokenizer import write_hf_tokenizer

        why = write_hf_tokenizer(
            {**tok_cfg, "path": str(src) if src else tok_cfg.get("path")},
            tok,
            out_dir,
            add_bos=bool(OmegaConf.select(cfg, "data.add_bos", default=True)),
        )
        if why:
            print(
                f"[mta_repro.hf] no tokenizer.json written ({why}); tokenizer.model and {TOKENIZER_NOTE} are",
                file=sys.stderr,
            )
    if tok_cfg and tok_cfg.get("path") and tok_cfg.get("name") != "bytes":
        src = _find(tok_cfg["path"])
        if src is not None:
            shutil.copyfile(src, out_dir / "tokenizer.model")
            tok_cfg = {**tok_cfg, "path": "tokenizer.model"}
    if tok_cfg:
        (out_dir / TOKENIZER_NOTE).write_text(json.dumps(tok_cfg, indent=1) + "\n")
    _record_source(model, cfg, path, out_dir)
    _readable_as_umask(sorted({f for pattern in EXPORT_FILES for f in out_dir.glob(pattern)}))
    return out_dir


# The sidecar of an exported folder: which run and step its weights are.
def _record_source(model, cfg, path, out_dir: Path) -> None:
    """Say which run and step were exported (an unfinished run's latest checkpoint exports
    as well: the step tells), and record it with what the weights came from (step, sha256,
    tokens seen, tokenizer, data, code) in ``<out_dir>/provenance.json``."""
    from mta_repro.runs import provenance

    tok_cfg = OmegaConf.to_container(cfg.data.tokenizer, resolve=True) if "data" in cfg else None
    record = provenance.weights_provenance(model, tok_cfg)
    steps = OmegaConf.select(cfg, "trainer.steps", default=None)
    record["export"] = {"run": str(Path(path).resolve()), "trainer_steps": steps}
    provenance.write_record(out_dir / provenance.RECORD, record)
    step = record["weights"]["step"]
    of = (
        f" of trainer.steps={steps}" + (" (an unfinished run)" if step is not None and step < steps else "")
        if isinstance(steps, int)
        else ""
    )
    print(
        f"[mta_repro.hf] exported step {step}{of} of {record['export']['run']} ({record['weights']['path']}); "
        f"recorded in {out_dir / provenance.RECORD}",
        file=sys.stderr,
    )


def _find(path: str) -> Path | None:
    from mta_repro.train.config import CONFIG_DIR

    p = Path(path)
    for cand in (p, Path(CONFIG_DIR).parent / p):
        if cand.is_file():
            return cand
    return None


# ------------------------------------------------------------------------------ import
INDEX = "model.safetensors.index.json"


def weight_files(hf_dir: Path) -> list:
    """The folder's safetensors files: those its ``model.safetensors.index.json`` names
    (sharded checkpoints, e.g. Llama 3.1 8B's four shards), else every ``*.safetensors``.
    An index may only name files of the folder itself."""
    from mta_repro.files import read_json

    index = hf_dir / INDEX
    if index.is_file():
        weight_map = read_json(index, {"weight_map": {"*": str}}, "a shard index")["weight_map"]
        outside = sorted(f for f in set(weight_map.values()) if Path(f).name != f or f in ("", ".", ".."))
        if outside:
            raise UserError(f"hf import: {index} names shard(s) outside {hf_dir}: {outside[:3]} (expected file names)")
        files = [hf_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(
                f"hf import: {index} names shard(s) {missing} that are not in {hf_dir} (incomplete download?)"
            )
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"hf import: {hf_dir} has no *.safetensors weights (pytorch_model.bin is not read)")
    return files


def _ffn_fields(dim: int, hidden: int) -> dict:
    """multiple_of / ffn_dim_multiplier that make ModelArgs.ffn_hidden_dim == hidden."""
    base = int(2 * 4 * dim / 3)
    if base <= hidden:
        fields = {"multiple_of": hidden, "ffn_dim_multiplier": 1.0}
    else:
        fields = {"multiple_of": hidden, "ffn_dim_multiplier": hidden / base}
    return fields


def _rope_of(c) -> tuple:
    """(rope_theta, RopeScalingArgs fields) of a LlamaConfig (transformers 4 or 5)."""
    rope = dict(getattr(c, "rope_parameters", None) or {})
    scaling = dict(getattr(c, "rope_scaling", None) or {})
    merged = {**scaling, **rope}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    theta = merged.get("rope_theta", getattr(c, "rope_theta", None))
    if theta is None:
        raise UserError("hf import: config.json has no rope_theta")
    if rope_type == "default":
        return float(theta), {"rope_type": "default"}
    if rope_type != "llama3":
        raise UserError(
            f"hf import: rope_scaling rope_type={rope_type!r} is not supported; supported: default and "
            "'llama3' (Llama 3.1/3.2)"
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    absent = [f for f in fields if merged.get(f) is None]
    if absent:
        raise UserError(f"hf import: rope_scaling (llama3) lacks {absent}")
    out = {f: float(merged[f]) for f in fields}
    out["original_max_position_embeddings"] = int(merged["original_max_position_embeddings"])
    return float(theta), {"rope_type": "llama3", **out}


def model_args_from_hf(c) -> ModelArgs:
    """Our ModelArgs for a LlamaForCausalLM config (grouped-query attention kept as it is)."""
    if getattr(c, "model_type", "llama") != "llama":
        raise UserError(f"hf import: model_type {c.model_type!r}; expected 'llama'")
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise UserError("hf import: attention_bias/mlp_bias checkpoints are not supported")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise UserError(f"hf import: hidden_act {c.hidden_act!r}; expected 'silu'")
    theta, scaling = _rope_of(c)
    H, KV = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    if H % KV:
        raise UserError(f"hf import: {H} attention heads are not a multiple of {KV} key/value heads")
    kv = {"n_kv_heads": None if KV == H else KV} if _NATIVE_GQA else {}
    args = ModelArgs(
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=H,
        head_dim=None if d * H == c.hidden_size else d,
        vocab_size=c.vocab_size,
        norm_eps=float(c.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seqlen=int(c.max_position_embeddings),
        weight_tying=bool(getattr(c, "tie_word_embeddings", False)),
        norm_order="hf",  # transformers' LlamaRMSNorm: normalise in fp32, cast, then the weight (all norms)
        **kv,
        **_ffn_fields(c.hidden_size, c.intermediate_size),
    )
    assert args.ffn_hidden_dim == c.intermediate_size, (args.ffn_hidden_dim, c.intermediate_size)
    return args


# Our ModelArgs has grouped-query attention (n_kv_heads): K/V stay at their head count.
_NATIVE_GQA = "n_kv_heads" in {f.name for f in dataclasses.fields(ModelArgs)}

_LAYER_KEYS = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _our_key(name: str, args: ModelArgs) -> str | None:
    """Our key for a LlamaForCausalLM tensor name, or None for a tensor we do not keep (a
    tied checkpoint's lm_head copy, old rotary inv_freq buffers)."""
    if name == "model.embed_tokens.weight":
        return "tok_embeddings.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    if name == "lm_head.weight":
        return None if args.weight_tying else "output.weight"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in _LAYER_KEYS:
        raise UserError(f"hf import: unexpected tensor {name!r} (not a LlamaForCausalLM weight)")
    return f"layers.{parts[2]}.{_LAYER_KEYS['.'.join(parts[3:])]}"


def _hf_shape(name: str, our_shape: tuple, c, args: ModelArgs) -> tuple:
    """The shape ``name`` has in a LlamaForCausalLM checkpoint of our model's ``our_shape``
    (the same, but for key/value heads that a model without n_kv_heads repeats)."""
    H, KV = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")) and KV != H and not _NATIVE_GQA:
        return (our_shape[0] * KV // H, *our_shape[1:])
    return our_shape


def check_hf_tensors(tensors: dict, c, args: ModelArgs, torch_dtype: str | None = None) -> None:
    """Every LlamaForCausalLM tensor ({name: (dtype name, shape, where)}) before any is
    read or permuted: a float dtype, all of one dtype and that of config.json's
    ``torch_dtype`` when it states one, the shape our model needs; none missing."""
    from mta_repro.weights import check_float, expected_shapes

    want = expected_shapes(args)
    seen: dict = {}
    first: tuple | None = None
    for name, (dtype, shape, where) in tensors.items():
        key = _our_key(name, args)
        if key is None:
            continue
        check_float(where, name, dtype)
        if first is None:
            first = (dtype, name)
        if torch_dtype is not None and dtype != torch_dtype:
            raise UserError(
                f"hf import: {where}: tensor {name!r} is {dtype} but config.json's torch_dtype is "
                f"{torch_dtype}: a relabelled or mixed file (if the weights are right, correct "
                "config.json's torch_dtype)"
            )
        if dtype != first[0]:
            raise UserError(
                f"hf import: {where}: tensor {name!r} is {dtype} but {first[1]!r} is {first[0]}: a "
                "relabelled or mixed file (a checkpoint stores its weights in one dtype)"
            )
        if key in seen:
            raise UserError(f"hf import: tensor {name!r} appears twice ({seen[key]} and {where})")
        seen[key] = where
        if key not in want:
            raise UserError(
                f"hf import: {where}: tensor {name!r} is not part of the model config.json describes "
                f"({args.n_layers} layers)"
            )
        expected = _hf_shape(name, want[key], c, args)
        if tuple(shape) != expected:
            raise UserError(
                f"hf import: {where}: tensor {name!r} has shape {list(shape)}, expected "
                f"{list(expected)} (from config.json)"
            )
    missing = sorted(k for k in set(want) - set(seen) if not (k == "output.weight" and args.weight_tying))
    if missing:
        raise UserError(f"hf import: the checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")


def _convert_tensor(name: str, w: torch.Tensor, c, args: ModelArgs) -> tuple | None:
    """One LlamaForCausalLM tensor (already checked: ``check_hf_tensors``) -> (our key,
    tensor), or None for a tensor we do not keep."""
    key = _our_key(name, args)
    if key is None or not name.startswith("model.layers."):
        return None if key is None else (key, w)
    tail = ".".join(name.split(".")[3:])
    H, KV = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    d = args.resolved_head_dim
    back = torch.argsort(_halves_from_pairs(d))  # HF's half-split rows -> our interleaved pairs
    if tail in ("self_attn.k_proj.weight", "self_attn.v_proj.weight") and KV != H and not _NATIVE_GQA:
        # A model without n_kv_heads: each key/value head serves H/KV query heads.
        w = w.view(KV, d, -1).repeat_interleave(H // KV, dim=0).reshape(H * d, -1)
        KV = H
    if tail == "self_attn.q_proj.weight":
        w = _permute_heads(w, H, back)
    elif tail == "self_attn.k_proj.weight":
        w = _permute_heads(w, KV, back)
    return key, w


def hf_to_state(hf_sd: dict, config) -> tuple:
    """LlamaForCausalLM weights (a dict) and config -> (our baseline state dict, ModelArgs)."""
    args = model_args_from_hf(config)
    check_hf_tensors(
        {n: (str(w.dtype).replace("torch.", ""), tuple(w.shape), "state dict") for n, w in hf_sd.items()}, config, args
    )
    sd = {}
    for name, w in hf_sd.items():
        got = _convert_tensor(name, w, config, args)
        if got is not None:
            sd[got[0]] = got[1].contiguous()
    return sd, args


def read_hf_weights(
    hf_dir: Path, config, args: ModelArgs, dtype: torch.dtype | None = None, torch_dtype: str | None = None
) -> dict:
    """Our state dict from the folder's safetensors, one tensor at a time: every file's
    header is checked first (``mta_repro.weights.SafetensorsFile``; the tensors' dtypes and
    shapes: ``check_hf_tensors``), then each tensor is read from its (memory-mapped) shard,
    converted and cast, and the shard is closed before the next is opened, so the host holds
    the converted weights plus one shard's mapping (an 8B bf16 checkpoint: ~16 GB + one
    ~5 GB shard), never two copies of the model."""
    from mta_repro.weights import SAFETENSORS_FLOAT_DTYPES, SafetensorsFile

    files = [SafetensorsFile(f) for f in weight_files(hf_dir)]
    check_hf_tensors(
        {
            name: (SAFETENSORS_FLOAT_DTYPES.get(t.dtype, t.dtype), t.shape, str(f.path))
            for f in files
            for name, t in f.tensors.items()
        },
        config,
        args,
        torch_dtype,
    )
    sd: dict = {}
    for f in files:
        with f:
            for name in f.tensors:
                raw = f.tensor(name)
                got = _convert_tensor(name, raw, config, args)
                if got is None:
                    continue
                key, w = got
                w = w.to(dtype) if dtype is not None else w
                w = w.contiguous()
                if w.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
                    w = w.clone()  # own memory, so that the shard's mapping goes when it closes
                sd[key] = w
                del raw, w
    return sd


def _tokenizer_of(hf_dir: Path) -> dict | None:
    note = hf_dir / TOKENIZER_NOTE
    if note.is_file():  # written by export_hf
        from mta_repro.files import read_json
        from mta_repro.weights.check import check_plain_config

        tok_cfg = read_json(note, {"*": (str, type(None), bool, int, float)}, "our tokenizer settings")
        check_plain_config(tok_cfg, str(note))
        if tok_cfg.get("name") != "bytes" and tok_cfg.get("path") and (hf_dir / tok_cfg["path"]).is_file():
            tok_cfg["path"] = str((hf_dir / tok_cfg["path"]).resolve())
        return tok_cfg
    # Meta's layout: tokenizer.model (or original/tokenizer.model)
    for f in (hf_dir / "tokenizer.model", hf_dir / "original" / "tokenizer.model"):
        if f.is_file():
            with open(f, "rb") as fh:
                name = "sentencepiece" if fh.read(1) == b"\n" else "tiktoken"  # protobuf vs base64 lines
            return {"name": name, "path": str(f.resolve())}
    return None


def import_hf(hf_dir: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """Write a consolidated ``.pt`` ({"model", "config", "step": 0}) of our baseline from a
    Llama checkpoint folder (config.json + safetensors, sharded with an index or not);
    its config is the default run config with these model fields and the folder's
    tokenizer (``tokenizer.model`` or ``original/tokenizer.model``: a sentencepiece model
    or a Llama-3 ranks file) when it has one. ``dtype`` "auto" keeps the checkpoint's
    dtype (bf16 for Meta's), else float32/bfloat16/float16."""
    from transformers import AutoConfig

    from mta_repro.eval.load import resolve_dtype
    from mta_repro.files import read_json, save_file_atomic
    from mta_repro.train.config import compose

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"hf import: {hf_dir}/config.json is missing (expected a Hugging Face model folder)")
    raw = read_json(hf_dir / "config.json", dict, "a model config")
    try:
        config = AutoConfig.from_pretrained(str(hf_dir))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"hf import: {hf_dir / 'config.json'}: transformers cannot read it ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]})"
        ) from None
    args = model_args_from_hf(config)
    stated = str(raw.get("torch_dtype") or raw.get("dtype")).replace("torch.", "")  # transformers 4 / 5
    floats = ("float32", "bfloat16", "float16", "float64")
    sd = read_hf_weights(
        hf_dir, config, args, None if dtype == "auto" else resolve_dtype(dtype), stated if stated in floats else None
    )
    cfg = compose([])
    for f in dataclasses.fields(args):
        if f.name != "mta":
            v = getattr(args, f.name)
            with open_dict(cfg):
                cfg.model[f.name] = v
    tok_cfg = _tokenizer_of(hf_dir)
    if not tok_cfg:
        print(
            f"[mta_repro.hf] note: {hf_dir} has no tokenizer.model (nor original/tokenizer.model); the .pt keeps "
            "the default data.tokenizer: set data.tokenizer.name/path (Llama 3: tiktoken, Meta's tokenizer.model) "
            "when you train or evaluate from it",
            file=sys.stderr,
        )
    if tok_cfg:
        for k, v in tok_cfg.items():
            OmegaConf.update(cfg, f"data.tokenizer.{k}", v)
    plain = OmegaConf.to_container(cfg, resolve=False)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_file_atomic({"model": sd, "config": plain, "step": 0, "source": str(hf_dir)}, out)
