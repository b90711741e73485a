"""mta-repro: reproduction framework for Multi-Token Attention (Golovneva et al., 2025)."""

__version__ = "0.1.0"

try:  # the configs' resolvers exist before any config is resolved (mta_repro/resolvers.py)
    from mta_repro.resolvers import register_resolvers

    register_resolvers()
except ImportError:  # pragma: no cover - omegaconf is a dependency
    pass
