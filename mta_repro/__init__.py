"""mta-repro: reproduction framework for Multi-Token Attention (Golovneva et al., 2025)."""

__version__ = "0.1.0"


def _release_placeholder(field: str):
    """``${release_placeholder:data.root_dir}``: a value the official release's config left
    as a placeholder (``<path_to_dataset>``); reading it says which override to pass."""
    raise ValueError(f"{field} is a placeholder in the official release's config: pass {field}=... on the command line")


try:  # resolvers must exist before any config is resolved (mta_repro/release.py writes these)
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("release_placeholder"):
        OmegaConf.register_new_resolver("release_placeholder", _release_placeholder)
except ImportError:  # pragma: no cover - omegaconf is a dependency
    pass
