"""mta-repro: reproduction framework for Multi-Token Attention (Golovneva et al., 2025)."""

__version__ = "0.1.0"
