"""deqsm: score matching with deep equilibrium layers (Hydra + PyTorch Lightning)."""

from src.hydra_compat import install as _install_hydra_compat

_install_hydra_compat()
