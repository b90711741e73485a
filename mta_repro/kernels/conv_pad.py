"""Where a key-query convolution's kernel sits on the key axis: shared by the reference
and blocked paths (attention_math.py, attention_blocked.py) and the kernels, so none
imports another for it (the Hugging Face bundle, hf/remote.py, inlines this file before
them)."""


def pad_left(pad_key: str, c_k: int) -> int:
    """Keys padded before the window (the kernel's key offset 0 sits at this column):
    the release's ``pad_key`` = "both" / "left" / "right" for a kernel of c_k keys."""
    return {"both": (c_k - 1) // 2, "left": c_k - 1, "right": 0}[pad_key]
