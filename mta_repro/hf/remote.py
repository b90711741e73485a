"""Export of MTA, talking-heads and Differential runs to a Hugging Face folder that
``transformers`` loads with ``trust_remote_code=True``.

The folder's ``modeling_mta_repro.py`` is a copy of this package's own module
``mta_repro/hf/modeling_mta_repro.py``: a thin ``PreTrainedModel`` wrapper that imports
``mta_repro.model``. So the exported model computes what ours does, with the loading
side's installed mta-repro (which it needs: from a clone or a wheel, docs/interop.md);
config.json records the version that wrote it (``mta_repro_version``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

import mta_repro

MODULE = "modeling_mta_repro"
MODELING_FILE = Path(__file__).resolve().with_name(f"{MODULE}.py")


def export_remote(model, out_dir: Path, bos_id=None, eos_id=None) -> Path:
    """Write config.json (with auto_map), model.safetensors and the modeling file (a copy of
    ``modeling_mta_repro.py``, which imports the installed mta-repro)."""
    from safetensors.torch import save_file

    args = dataclasses.asdict(model.args)
    # How this machine's kernels were tuned (model.kernels) is no property of the model: the
    # loading side runs its defaults whatever was set here.
    args.pop("kernels", None)
    config = {
        "architectures": ["MTAReproForCausalLM"],
        "model_type": "mta_repro",
        "auto_map": {"AutoConfig": f"{MODULE}.MTAReproConfig", "AutoModelForCausalLM": f"{MODULE}.MTAReproForCausalLM"},
        "mta_repro_args": args,
        # The modeling file imports the installed mta-repro: the version that wrote this folder.
        "mta_repro_version": mta_repro.__version__,
        "vocab_size": model.args.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    shutil.copyfile(MODELING_FILE, out_dir / f"{MODULE}.py")
    sd = {f"model.{k}": v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
