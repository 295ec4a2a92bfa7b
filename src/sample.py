"""Write samples of a trained generative model from any of its checkpoints.

    python -m src.sample ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt n=64 [seed=0] [out=…]
        [trust_checkpoint=true] [key=value …]

The run's composed config is read from ``<run dir>/.hydra/config.yaml`` (as :mod:`src.evaluate` does);
further ``key=value`` arguments override it (e.g. ``data.root=…``, ``model.sampling.n_steps_each=50`` for
an NCSN). The checkpoint's ``state_dict`` is loaded — with ``ema=true`` runs it holds the averaged weights,
so samples come from the EMA model — and ``module.sample_pixels(n, seed)`` is written as a PNG grid
(``out``, default ``<run dir>/samples_<checkpoint name>.png``) and as a tensor ``[n, C, H, W]`` in [0, 1]
next to it (``.pt``). Families that do not generate are refused with a clear error. The checkpoint loads
weights-only (:mod:`src.checkpoints`; ``trust_checkpoint=true`` for a trusted file holding other objects), and a
checkpoint of another family or other sizes is refused in one line naming both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from hydra.utils import instantiate

from src.checkpoints import check_matches_model, load_checked
from src.evaluate import parse_trust, run_of_checkpoint
from src.runtime import set_float_environment

_OWN_KEYS = ("ckpt_path", "n", "seed", "out", "trust_checkpoint")


def load_module(ckpt_path: str | Path, overrides: list[str] | None = None, trust: bool = False):
    """The LightningModule of ``ckpt_path`` with its weights loaded (EMA-averaged for ``ema=true`` runs), in
    eval mode and the run's precision, with its data module set up for testing: ``(module, datamodule,
    config, run directory)``."""
    ckpt, cfg, run_dir = run_of_checkpoint(ckpt_path, overrides, trust)
    set_float_environment(cfg)
    L.seed_everything(int(cfg.seed), workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    state = load_checked(ckpt, trust=trust)
    check_matches_model(state, model, ckpt)
    model.load_state_dict(state["state_dict"])
    precision = str(cfg.trainer.get("precision", "32-true"))
    if precision.startswith("64"):
        model = model.double()
    datamodule.prepare_data()
    datamodule.setup("test")
    model.attach_datamodule(datamodule)
    model.eval()
    return model, datamodule, cfg, run_dir


def sample_from_checkpoint(ckpt_path: str | Path, n: int = 64, seed: int = 0, out: str | Path | None = None,
                           overrides: list[str] | None = None, trust: bool = False) -> Path:
    """Samples of the model in ``ckpt_path``: returns the PNG path (the ``.pt`` tensor lies beside it)."""
    if int(n) < 1:
        raise ValueError(f"n={n}: ask for at least one sample")
    model, datamodule, _, run_dir = load_module(ckpt_path, overrides, trust=trust)
    images = model.sample_pixels(int(n), seed=int(seed))
    if images is None:
        raise ValueError(f"{type(model).__name__} does not generate samples (or {type(datamodule).__name__} "
                         "holds no images)")
    from src.callbacks.samples import save_image_grid

    path = Path(out) if out is not None else run_dir / f"samples_{Path(ckpt_path).stem}.png"
    save_image_grid(images, path)
    torch.save(images, path.with_suffix(".pt"))
    print(f"{images.shape[0]} samples -> {path} (+ {path.with_suffix('.pt').name})")
    return path


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] in _OWN_KEYS and "=" in a}
    if "ckpt_path" not in own:
        raise SystemExit("usage: python -m src.sample ckpt_path=<run dir>/checkpoints/last.ckpt n=64 [seed=0] "
                         "[out=<file.png>] [trust_checkpoint=true] [key=value ...]")
    sample_from_checkpoint(own["ckpt_path"], n=int(own.get("n", 64)), seed=int(own.get("seed", 0)),
                           out=own.get("out"), overrides=[a for a in argv if a.split("=", 1)[0] not in _OWN_KEYS],
                           trust=parse_trust(own.get("trust_checkpoint", "false")))


if __name__ == "__main__":
    main()
