"""Write samples of a trained generative model from any of its checkpoints.

    python -m src.sample ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt n=64 [seed=0] [out=…]
        [trust_checkpoint=true] [key=value …]

The run's composed config is read from ``<run dir>/.hydra/config.yaml`` (as :mod:`src.evaluate` does);
further ``key=value`` arguments override it (e.g. ``data.root=…``, ``model.sampling.n_steps_each=50`` for
an NCSN). The checkpoint's ``state_dict`` is loaded — with ``ema=true`` runs it holds the averaged weights,
so samples come from the EMA model — and ``module.sample_pixels(n, seed)`` is written as a PNG grid
(``out``, default ``<run dir>/samples_<checkpoint name>.png``) and as a tensor ``[n, C, H, W]`` in [0, 1]
next to it (``.pt``). Families that do not generate are refused with a clear error. The checkpoint loads
weights-only (:mod:`src.runtime.checkpoints`; ``trust_checkpoint=true`` for a trusted file holding other objects), and a
checkpoint of another family or other sizes is refused in one line naming both.
"""

from __future__ import annotations

import sys

from src.runs.errors import report_errors
from src.runs.load import parse_trust, split_arguments
from src.runs.sampling import sample_from_checkpoint

_OWN_KEYS = ("ckpt_path", "n", "seed", "out", "trust_checkpoint")


def main(argv: list[str] | None = None) -> None:
    own, overrides = split_arguments(list(sys.argv[1:] if argv is None else argv), _OWN_KEYS)
    if "ckpt_path" not in own:
        raise SystemExit("usage: python -m src.sample ckpt_path=<run dir>/checkpoints/last.ckpt n=64 [seed=0] "
                         "[out=<file.png>] [trust_checkpoint=true] [key=value ...]")
    sample_from_checkpoint(own["ckpt_path"], n=int(own.get("n", 64)), seed=int(own.get("seed", 0)),
                           out=own.get("out"), overrides=overrides,
                           trust=parse_trust(own.get("trust_checkpoint", "false")))


if __name__ == "__main__":
    report_errors(main)  # the project's own errors as one line (HYDRA_FULL_ERROR=1: the traceback)
