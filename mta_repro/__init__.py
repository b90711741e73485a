"""mta-repro: reproduction framework for Multi-Token Attention (Golovneva et al., 2025).

Importing the package does nothing else: the configs' OmegaConf resolvers are registered
where configs are composed (``mta_repro.train.config``), so that ``import mta_repro.mta`` (the
op, for other codebases) pulls in neither Hydra nor OmegaConf.
"""

__version__ = "0.1.0"
