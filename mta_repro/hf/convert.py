"""Conversions between this project's baseline and ``LlamaForCausalLM`` (see __init__)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Optional, Union

import torch
from omegaconf import OmegaConf

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


def llama_config(args: ModelArgs, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 max_position_embeddings: Optional[int] = None):
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads,
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
    if "rope_parameters" in LlamaConfig().to_dict():  # transformers >= 5
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    else:
        kw["rope_theta"] = float(args.rope_theta)
    return LlamaConfig(**kw)


def state_to_hf(sd: dict, args: ModelArgs) -> dict:
    """Our baseline state dict (Lingua keys) -> LlamaForCausalLM keys."""
    _check_baseline(args)
    order = _halves_from_pairs(args.resolved_head_dim)
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(args.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = _permute_heads(sd[p + "attention.wq.weight"], args.n_heads, order)
        out[q + "self_attn.k_proj.weight"] = _permute_heads(sd[p + "attention.wk.weight"], args.n_heads, order)
        out[q + "self_attn.v_proj.weight"] = sd[p + "attention.wv.weight"]
        out[q + "self_attn.o_proj.weight"] = sd[p + "attention.wo.weight"]
        out[q + "mlp.gate_proj.weight"] = sd[p + "feed_forward.w1.weight"]
        out[q + "mlp.up_proj.weight"] = sd[p + "feed_forward.w3.weight"]
        out[q + "mlp.down_proj.weight"] = sd[p + "feed_forward.w2.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "attention_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ffn_norm.weight"]
    out["lm_head.weight"] = sd["tok_embeddings.weight"] if args.weight_tying else sd["output.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(path: Union[str, Path], out_dir: Union[str, Path]) -> Path:
    """Write a ``LlamaForCausalLM`` folder (config.json, model.safetensors, the
    tokenizer file and our tokenizer settings) from a baseline run or .pt."""
    from transformers import LlamaForCausalLM

    from mta_repro.eval.lm_eval_model import trained_seq_len
    from mta_repro.eval.load import load_model, load_tokenizer

    model, cfg = load_model(path, device="cpu", dtype="float32")
    args = model.args
    try:
        tok = load_tokenizer(cfg)
        bos, eos = int(tok.bos_id), int(tok.eos_id)
    except (ValueError, OSError):
        tok, bos, eos = None, None, None
    out_dir = Path(out_dir)
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
    tok_cfg = OmegaConf.to_container(cfg.data.tokenizer, resolve=True) if "data" in cfg else None
    if tok_cfg and tok_cfg.get("path") and tok_cfg.get("name") != "bytes":
        src = _find(tok_cfg["path"])
        if src is not None:
            shutil.copyfile(src, out_dir / "tokenizer.model")
            tok_cfg = {**tok_cfg, "path": "tokenizer.model"}
    if tok_cfg:
        (out_dir / TOKENIZER_NOTE).write_text(json.dumps(tok_cfg, indent=1) + "\n")
    return out_dir


def _find(path: str) -> Optional[Path]:
    from mta_repro.config import CONFIG_DIR

    p = Path(path)
    for cand in (p, Path(CONFIG_DIR).parent / p):
        if cand.is_file():
            return cand
    return None


def _read_hf_state(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"hf import: {hf_dir} has no *.safetensors weights (pytorch_model.bin is not read)")
    sd: dict = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def _ffn_fields(dim: int, hidden: int) -> dict:
    """multiple_of / ffn_dim_multiplier that make ModelArgs.ffn_hidden_dim == hidden."""
    base = int(2 * 4 * dim / 3)
    if base <= hidden:
        fields = {"multiple_of": hidden, "ffn_dim_multiplier": 1.0}
    else:
        fields = {"multiple_of": hidden, "ffn_dim_multiplier": hidden / base}
    return fields


def hf_to_state(hf_sd: dict, config) -> tuple:
    """LlamaForCausalLM weights and config -> (our baseline state dict, ModelArgs)."""
    c = config
    if getattr(c, "model_type", "llama") != "llama":
        raise UserError(f"hf import: model_type {c.model_type!r}; expected 'llama'")
    rope = getattr(c, "rope_parameters", None) or {}
    scaling = getattr(c, "rope_scaling", None)
    rope_type = rope.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type != "default":
        raise UserError(
            f"hf import: rope_scaling rope_type={rope_type!r} is not supported (our RoPE has plain "
            "frequencies); Llama 3.1/3.2 checkpoints use 'llama3' scaling"
        )
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise UserError("hf import: attention_bias/mlp_bias checkpoints are not supported")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise UserError(f"hf import: hidden_act {c.hidden_act!r}; expected 'silu'")
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    H, KV = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    if H % KV:
        raise UserError(f"hf import: {H} attention heads are not a multiple of {KV} key/value heads")
    tied = bool(getattr(c, "tie_word_embeddings", False))
    args = ModelArgs(
        dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=H,
        head_dim=None if d * H == c.hidden_size else d, vocab_size=c.vocab_size,
        norm_eps=float(c.rms_norm_eps), rope_theta=float(theta), max_seqlen=int(c.max_position_embeddings),
        weight_tying=tied, **_ffn_fields(c.hidden_size, c.intermediate_size),
    )
    assert args.ffn_hidden_dim == c.intermediate_size, (args.ffn_hidden_dim, c.intermediate_size)
    back = torch.argsort(_halves_from_pairs(d))

    def kv(w):  # (KV*d, dim) -> (H*d, dim): each key/value head serves H/KV query heads
        return w.view(KV, d, -1).repeat_interleave(H // KV, dim=0).reshape(H * d, -1)

    sd = {"tok_embeddings.weight": hf_sd["model.embed_tokens.weight"], "norm.weight": hf_sd["model.norm.weight"]}
    for i in range(c.num_hidden_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        sd[p + "attention.wq.weight"] = _permute_heads(hf_sd[q + "self_attn.q_proj.weight"], H, back)
        sd[p + "attention.wk.weight"] = _permute_heads(kv(hf_sd[q + "self_attn.k_proj.weight"]), H, back)
        sd[p + "attention.wv.weight"] = kv(hf_sd[q + "self_attn.v_proj.weight"])
        sd[p + "attention.wo.weight"] = hf_sd[q + "self_attn.o_proj.weight"]
        sd[p + "feed_forward.w1.weight"] = hf_sd[q + "mlp.gate_proj.weight"]
        sd[p + "feed_forward.w3.weight"] = hf_sd[q + "mlp.up_proj.weight"]
        sd[p + "feed_forward.w2.weight"] = hf_sd[q + "mlp.down_proj.weight"]
        sd[p + "attention_norm.weight"] = hf_sd[q + "input_layernorm.weight"]
        sd[p + "ffn_norm.weight"] = hf_sd[q + "post_attention_layernorm.weight"]
    if not tied:
        sd["output.weight"] = hf_sd["lm_head.weight"]
    return {k: v.contiguous() for k, v in sd.items()}, args


def import_hf(hf_dir: Union[str, Path], out: Union[str, Path], dtype: str = "float32") -> Path:
    """Write a consolidated ``.pt`` ({"model", "config", "step": 0}) of our baseline from a
    Llama checkpoint folder; its config is the default run config with these model
    fields and the folder's tokenizer (``tokenizer.model``: a sentencepiece model or a
    Llama-3 ranks file) when it has one."""
    from transformers import AutoConfig

    from mta_repro.config import compose
    from mta_repro.eval.load import resolve_dtype
    from mta_repro.model import build_model
    from mta_repro.train.checkpoint import save_file_atomic

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"hf import: {hf_dir}/config.json is missing (expected a Hugging Face model folder)")
    config = AutoConfig.from_pretrained(str(hf_dir))
    sd, args = hf_to_state(_read_hf_state(hf_dir), config)
    model = build_model(args, device="cpu", init=False)
    model.load_state_dict(sd, strict=True)
    cfg = compose([])
    model_fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "mta"}
    for k, v in model_fields.items():
        OmegaConf.update(cfg, f"model.{k}", v, force_add=True)
    note = hf_dir / TOKENIZER_NOTE
    tok_cfg = None
    if note.is_file():  # written by export_hf
        tok_cfg = json.loads(note.read_text())
        if tok_cfg.get("name") != "bytes" and tok_cfg.get("path") and (hf_dir / tok_cfg["path"]).is_file():
            tok_cfg["path"] = str((hf_dir / tok_cfg["path"]).resolve())
    else:  # Meta's layout: tokenizer.model (or original/tokenizer.model)
        for f in (hf_dir / "tokenizer.model", hf_dir / "original" / "tokenizer.model"):
            if f.is_file():
                name = "sentencepiece" if f.read_bytes()[:1] == b"\n" else "tiktoken"  # protobuf vs base64 lines
                tok_cfg = {"name": name, "path": str(f.resolve())}
                break
    if tok_cfg:
        for k, v in tok_cfg.items():
            OmegaConf.update(cfg, f"data.tokenizer.{k}", v)
    plain = OmegaConf.to_container(cfg, resolve=False)
    dt = resolve_dtype(dtype)
    state = {k: v.to(dt) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_file_atomic({"model": state, "config": plain, "step": 0, "source": str(hf_dir)}, out)
