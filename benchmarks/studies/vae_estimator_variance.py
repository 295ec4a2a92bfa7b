"""SSM vs SSM-VR for the SSM-VAE's score estimator: the noise each estimator adds, on the same modules.

The score estimator s(z|x) of ``experiment=vae_mnist`` (binarised MNIST, D_z = 8, 256 units) is trained by
sliced score matching on z ~ q(z|x). Both estimators are unbiased for the same exact score-matching loss
(paper eqs. 3 and 4, Gaussian projections v, E[vvᵀ] = I); SSM-VR computes ½‖s‖² exactly and slices only
the trace. This measures, on one batch of 128 training images with z ~ q(z|x) drawn once and kept:

- the standard deviation of the batch-mean loss over ``--draws`` projection draws v (the estimator's own
  noise: the same v for both estimators, the z fixed);
- the score-network gradient variance over the same draws, tr Cov(∇_θ loss) summed over parameters;
- the same two with z redrawn as well (the training step's noise: encoder noise + projections),

at initialisation and after ``--steps`` training iterations of the old default (``loss=ssm``, Adam 1e-3,
wd 1e-12) and of the reference's (``loss=ssm_vr``, RMSprop 1e-3), each module measured with both
estimators.

    python -m benchmarks.studies.vae_estimator_variance --data-root <data dir>
        # -> benchmarks/results/vae_estimator_variance.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import lightning.pytorch as L
import torch

from benchmarks.lib.config import train_config
from benchmarks.lib.results import rendered, result_options
from src.models.vae import ConditionalScore
from src.objectives.ssm import ssm, ssm_vr
from src.reports.tables import markdown_table, write_results
from src.runs.build import build

ESTIMATORS = {"ssm": ssm, "ssm_vr": ssm_vr}
TRAININGS = {  # the trainings the modules come from (overrides of experiment=vae_mnist)
    "old default (ssm, Adam)": ["loss=ssm", "+model.optimizer.score.name=adam", "+model.optimizer.vae.name=adam",
                                "model.optimizer.score.weight_decay=1e-12", "model.optimizer.vae.weight_decay=1e-12"],
    "reference (ssm_vr, RMSprop)": ["loss=ssm_vr", "+model.optimizer.score.name=rmsprop",
                                    "+model.optimizer.vae.name=rmsprop", "model.optimizer.score.weight_decay=0",
                                    "model.optimizer.vae.weight_decay=0"],
}


def compose_cfg(overrides: list[str]):
    return train_config(["experiment=vae_mnist", "logger=none", *overrides])


def clean(overrides: list[str], cfg) -> list[str]:
    """Drop '+key=' for keys the config already has (the experiment may set them), keeping the value."""
    from omegaconf import OmegaConf

    out = []
    for o in overrides:
        if o.startswith("+") and OmegaConf.select(cfg, o[1:].split("=")[0]) is not None:
            o = o[1:]
        out.append(o)
    return out


def statistics(module, x: torch.Tensor, draws: int, redraw_z: bool, seed: int) -> dict:
    """Per estimator: sd of the batch-mean loss and tr Cov of the score-net gradient over ``draws`` draws."""
    params = [p for p in module.score_net.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        z_fixed = module.encoder(x, generator=g)
    losses = {k: [] for k in ESTIMATORS}
    grads = {k: [] for k in ESTIMATORS}
    for _ in range(draws):
        with torch.no_grad():
            z = module.encoder(x, generator=g) if redraw_z else z_fixed
        v = torch.randn(z.shape, generator=g)  # the same Gaussian projection for both estimators
        for name, fn in ESTIMATORS.items():
            loss = fn(ConditionalScore(module.score_net, x), z, projection="gaussian", v=v).loss
            gr = torch.autograd.grad(loss, params)
            losses[name].append(float(loss))
            grads[name].append(torch.cat([t.flatten() for t in gr]).double())
    out = {}
    for name in ESTIMATORS:
        loss_t = torch.tensor(losses[name], dtype=torch.float64)
        gm = torch.stack(grads[name])
        out[name] = {"loss_mean": float(loss_t.mean()), "loss_sd": float(loss_t.std()),
                     "grad_var": float(gm.var(0).sum()), "grad_mean_sq": float(gm.mean(0).pow(2).sum())}
    return out


def measure(module, x, draws: int, seed: int) -> dict:
    module.eval()
    res = {"fixed_z": statistics(module, x, draws, False, seed), "redrawn_z": statistics(module, x, draws, True, seed)}
    module.train()
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--steps", type=int, default=100, help="training iterations (1 score + 1 VAE update each)")
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    result_options(ap)
    args = ap.parse_args(argv)
    if rendered(args, "vae_estimator_variance", render):
        return
    torch.set_num_threads(1)
    root = [f"data.root={args.data_root}"] if args.data_root else []
    rows = []
    t0 = time.perf_counter()
    x = None
    for label, overrides in TRAININGS.items():
        cfg = compose_cfg([*root, f"seed={args.seed}"])
        cfg = compose_cfg([*root, f"seed={args.seed}", *clean(overrides, cfg)])
        L.seed_everything(args.seed, workers=True)
        dm = build(cfg.data)
        module = build(cfg.model)
        if x is None:  # one batch of binarised training images, the same for every module
            dm.setup("fit")
            x = next(iter(dm.train_dataloader()))
            x = (x[0] if isinstance(x, (list, tuple)) else x).float()
        if not rows:
            rows.append({"state": "initialisation", **measure(module, x, args.draws, args.seed + 1)})
            print(json.dumps(rows[-1]), flush=True)
        trainer = L.Trainer(max_steps=2 * args.steps, logger=False, enable_checkpointing=False, limit_val_batches=0,
                            enable_progress_bar=False, enable_model_summary=False, inference_mode=False,
                            accelerator="cpu", devices=1)
        trainer.fit(module, datamodule=dm)
        rows.append({"state": f"{args.steps} iterations, {label}", **measure(module, x, args.draws, args.seed + 1)})
        print(json.dumps(rows[-1]), flush=True)
    res = {"meta": {"command": "python -m benchmarks.studies.vae_estimator_variance --data-root <data dir>",
                    "machine": f"{platform.machine()} CPU", "torch": torch.__version__, "steps": args.steps,
                    "draws": args.draws, "batch": int(x.shape[0]), "seconds": time.perf_counter() - t0},
           "rows": rows}
    write_results(args.out, "vae_estimator_variance", res, render)


def render(res: dict) -> str:
    head = ["module", "z", "loss sd SSM", "loss sd SSM-VR", "sd ratio", "grad var SSM", "grad var SSM-VR",
            "var ratio"]
    body = []
    for r in res["rows"]:
        for key, label in (("fixed_z", "fixed"), ("redrawn_z", "redrawn")):
            a, b = r[key]["ssm"], r[key]["ssm_vr"]
            body.append([r["state"], label, f"{a['loss_sd']:.4g}", f"{b['loss_sd']:.4g}",
                         f"{a['loss_sd'] / b['loss_sd']:.1f}", f"{a['grad_var']:.4g}", f"{b['grad_var']:.4g}",
                         f"{a['grad_var'] / b['grad_var']:.1f}"])
    m = res["meta"]
    return "\n".join([
        "# SSM vs SSM-VR noise for the SSM-VAE score estimator (experiment=vae_mnist)", "",
        (f"`{m['command']}` — {m['machine']}, torch {m['torch']}, 1 thread; batch {m['batch']} binarised MNIST "
         f"training images, {m['draws']} draws of Gaussian projections v (z fixed: one z ~ q(z|x) kept; z "
         f"redrawn: a fresh z per draw as well); loss sd = standard deviation of the batch-mean loss over draws; "
         f"grad var = tr Cov of the score network's gradient over draws. Both estimators share each draw's v."),
        "", *markdown_table(head, body), ""])


if __name__ == "__main__":
    main()
