"""Per-study test-time analyses of :class:`src.lit.supervised.SupervisedLitModule` (``model.analysis=<name>``).

Each takes the module, the data module, the run directory and the gathered test arrays (x, y, pred: float64
numpy), returns extra ``test/…`` metrics and writes its figure (``<name>.png``, plus ``features.npz`` for GOTU)
into the run directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from src.models.supervised import MLP, DEQNet, DiagonalLinearDEQ, DiagonalLinearNet
from src.separation import implicit_bias as ib
from src.separation import regions as rg
from src.separation import tasks


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_dir: Path, name: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
    _plt().close(fig)


# ------------------------------------------------------------------------------------------ Theorem 1
def deq_regions(net: DEQNet):
    """The PL map x ↦ output of a 1-input ReLU DEQNet with one layer in f on [0, 1] (else None): unrolled
    exactly when its W (as the forward uses it, after normalisation) is strictly lower-triangular, hence
    nilpotent (Theorem 1's construction); otherwise walked piece by piece through its activation patterns
    (:func:`src.separation.regions.relu_deq_pl`: a trained DEQ, whose normalised W contracts)."""
    b = net.block
    if b.in_dim != 1 or b.n_layers != 1 or b.activation != "relu" or not isinstance(b.injection, torch.nn.Linear):
        return None
    with torch.no_grad():
        params = [p.double().numpy() for p in b.map_params(torch.zeros(1, 1, dtype=b.weights[0].dtype))]
    W = params[1]
    u = b.injection.weight.detach().double().numpy()[:, 0]
    c = b.injection.bias.detach().double().numpy()
    if np.any(np.triu(W) != 0):
        z = rg.relu_deq_pl(W, u, c, 0.0, 1.0)
    else:
        z = rg.relu_deq_unrolled(W, u, c, b.width, exact=False)
    return z.affine(net.readout.weight.detach().double().numpy(), net.readout.bias.detach().double().numpy())


def regions_analysis(lit, dm, out_dir: Path, x, y, pred, **_) -> dict:
    net, m = lit.net, int(dm.meta["m"])
    res = {"test/target_regions": float(2 ** m), "test/m": float(m)}
    pl = None
    if isinstance(net, MLP) and net.activation == "relu" and x.shape[1] == 1:
        pl = rg.relu_mlp(net.linear_layers(), 0.0, 1.0, exact=False)
        res["test/neurons"] = float(net.readout.in_features * len(net.hidden_layers))
    elif isinstance(net, DEQNet):
        pl = deq_regions(net)
        res["test/neurons"] = float(net.block.width)
        if lit.hparams.get("construction") == "theorem1":
            its0, z_star = rg.picard_iterations_to_fixed_point(x[:, 0], m)
            its1, _ = rg.picard_iterations_to_fixed_point(x[:, 0], m, z0=z_star)
            res["test/picard_iterations_from_zero_max"] = float(its0.max())
            res["test/picard_iterations_from_rebuttal_init_max"] = float(its1.max())
            res["test/rebuttal_init_is_fixed_point"] = float(
                np.array_equal(rg.theorem1_map(z_star, x[:, 0], m), z_star))
    if pl is not None:
        res["test/regions"] = float(rg.count_regions(pl))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3))
    order = np.argsort(x[:, 0])
    ax.plot(x[order, 0], y[order, 0], lw=0.8, label=f"target ({2 ** m} regions)")
    lab = f"model ({int(res['test/regions'])} regions)" if "test/regions" in res else "model"
    ax.plot(x[order, 0], pred[order, 0], lw=0.8, label=lab)
    ax.set_xlabel("x"), ax.legend(fontsize=8)
    ax.set_title(f"Theorem 1 target, m = {m}: L∞ error {np.abs(pred - y).max():.3g}")
    _save(fig, out_dir, "regions.png")
    return res


# ------------------------------------------------------------------------------------------ Theorem 2
def steep_analysis(lit, dm, out_dir: Path, x, y, pred, eps: float = 1e-6, **_) -> dict:
    delta, dim = float(dm.meta["delta"]), int(dm.meta["dim"])
    it = tasks.picard_vs_bisection(1.0, delta, eps)
    res = {"test/delta": delta, "test/log2_inv_delta": float(np.log2(1 / delta)), "test/dim": float(dim),
           "test/err_at_peak": float(abs(pred[0, 0] - y[0, 0])),
           "test/target_picard_iterations": float(it["picard"]), "test/target_bisection_iterations": float(it["bisection"])}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3))
    dist = np.maximum(1 - x[:64, 0], delta / 100)
    o = np.argsort(dist)
    ax.semilogx(dist[o], y[:64, 0][o], "k-", lw=1, label="target δ/(δ+1−x₁)")
    ax.semilogx(dist[o], pred[:64, 0][o], "o", ms=3, label="model")
    ax.set_xlabel("1 − x₁"), ax.legend(fontsize=8)
    ax.set_title(f"d = {dim}, δ = 2^{-np.log2(1 / delta):.0f}: L∞ {np.abs(pred - y).max():.3g}")
    _save(fig, out_dir, "steep.png")
    return res


# ------------------------------------------------------------------------------------------ Theorem 3
def implicit_bias_analysis(lit, dm, out_dir: Path, x, y, pred, gf_time: float = 200.0, **_) -> dict:
    net = lit.net
    X = dm.split_tensor("train").double().numpy()
    yt = dm.targets("train").double().numpy()[:, 0]
    beta = net.beta.detach().double().numpy()
    d = X.shape[1]
    b0 = float(lit.hparams.get("beta0", 1.0)) * np.ones(d)
    alpha = float(lit.hparams.get("alpha", 0.1))
    beta_q, _, _ = ib.q_minimiser(X, yt, b0)
    beta_h, _, _ = ib.hyperbolic_entropy_minimiser(X, yt, alpha)
    beta_l1, beta_l2 = ib.min_l1(X, yt), ib.min_l2(X, yt)
    res = {"test/train_loss": 0.5 * float(np.sum((X @ beta - yt) ** 2))}
    dens = ib.density(beta)
    res.update({"test/beta_participation": dens["participation"], "test/beta_active_fraction": dens["active_fraction"],
                "test/beta_l1": dens["l1"], "test/gap_to_min_l1": float(np.abs(beta - beta_l1).max()),
                "test/gap_to_min_l2": float(np.abs(beta - beta_l2).max())})
    if isinstance(net, DiagonalLinearDEQ):
        res["test/gap_to_q_minimiser"] = float(np.abs(beta - beta_q).max())
        res["test/kkt_stationarity_q_plus"] = ib.q_kkt_residual(beta, X, yt, b0, 1.0)["stationarity"]
        res["test/kkt_stationarity_q_minus"] = ib.q_kkt_residual(beta, X, yt, b0, -1.0)["stationarity"]
        if lit.gd_v is not None:
            v = lit.gd_v.double().cpu().numpy()
            res["test/closed_form_gap_beta"] = float(np.abs(ib.closed_form_beta(X, v, b0) - beta).max())
            res["test/closed_form_gap_mirror"] = float(np.abs(beta ** -3 - (3 * X.T @ v + b0 ** -3)).max())
        beta_gf, v_gf = ib.gradient_flow_diag_deq(X, yt, b0, gf_time)
        res["test/gradient_flow_gap_to_q_minimiser"] = float(np.abs(beta_gf - beta_q).max())
        res["test/gradient_flow_closed_form_gap"] = float(np.abs(ib.closed_form_beta(X, v_gf, b0) - beta_gf).max())
    elif isinstance(net, DiagonalLinearNet):
        res["test/gap_to_hyperbolic_minimiser"] = float(np.abs(beta - beta_h).max())
    for name, b in (("q_minimiser", beta_q), ("hyperbolic_minimiser", beta_h), ("min_l1", beta_l1)):
        res[f"test/{name}_participation"] = ib.density(b)["participation"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3))
    idx = np.arange(d)
    truth = dm.meta.get("beta_true")
    ax.plot(idx, beta_q, "s", mfc="none", label="argmin Q₊ (diag. DEQ limit)")
    ax.plot(idx, beta_h, "^", mfc="none", label=f"hyperbolic entropy α={alpha:g} (diag. net limit)")
    ax.plot(idx, beta_l1, "x", label="min ℓ₁")
    ax.plot(idx, beta, ".", color="k", label=f"learned ({type(net).__name__})")
    if truth is not None:
        ax.plot(idx, truth, "_", color="gray", label="β* (generating)")
    ax.set_xlabel("coordinate i"), ax.set_ylabel("βᵢ"), ax.legend(fontsize=7, ncol=2)
    _save(fig, out_dir, "implicit_bias.png")
    return res


# ----------------------------------------------------------------------------------------------- GOTU
def feature_density(F: np.ndarray, rel: float = 1e-2) -> dict:
    """Mean over samples of the participation ratio (‖f‖₁/‖f‖₂)²/k and of the fraction of units with
    |f_j| > rel · max|F|."""
    A = np.abs(F)
    pr = (A.sum(1) ** 2) / np.maximum(A.shape[1] * (A ** 2).sum(1), 1e-300)
    return {"participation": float(pr.mean()), "active_fraction": float((A > rel * A.max()).mean())}


def gotu_analysis(lit, dm, out_dir: Path, x, y, pred, **_) -> dict:
    unseen = np.asarray(dm.meta["unseen"])
    sq = (pred - y)[:, 0] ** 2
    res = {"test/gotu_error": float(sq.mean()), "test/gotu_error_unseen": float(sq[unseen].mean()),
           "test/seen_error": float(sq[~unseen].mean())}
    net = lit.net
    if isinstance(net, (DiagonalLinearDEQ, DiagonalLinearNet)):
        res["test/beta_frozen"] = float(net.beta[0].item())
        res["test/bias"] = float(net.bias.item()) if net.bias is not None else 0.0
    with torch.no_grad():
        p = next(net.parameters())
        F = net.features(torch.as_tensor(x, dtype=p.dtype)).double().numpy()
    dens = feature_density(F)
    res["test/feature_participation"], res["test/feature_active_fraction"] = dens["participation"], dens["active_fraction"]
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / "features.npz", features=F[:64], x=x[:64])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3))
    A = np.abs(F[:64])
    ax.imshow((A / max(A.max(), 1e-300)).T, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    ax.set_xlabel("sample"), ax.set_ylabel("feature unit")
    ax.set_title(f"{type(net).__name__}: |features| / max, participation {dens['participation']:.2f}", fontsize=8)
    _save(fig, out_dir, "gotu_features.png")
    return res


# -------------------------------------------------------------------------------------- high frequency
def signal_analysis(lit, dm, out_dir: Path, x, y, pred, **_) -> dict:
    freqs = dm.meta["freqs"]
    be = tasks.band_errors(pred, y, freqs)
    res = {f"test/band_err_{k}": v for k, v in be.items()}
    plt = _plt()
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 4.5))
    t = (x[:, 0] + 1) / 2
    sel = t < 0.25
    a1.plot(t[sel], y[sel, 0], "k-", lw=1, label="target")
    a1.plot(t[sel], pred[sel, 0], lw=1, label="model")
    a1.legend(fontsize=8), a1.set_xlabel("t")
    kmax = int(2 * max(freqs))
    a2.semilogy(np.abs(np.fft.rfft(y[:, 0]))[:kmax] / len(t), "k-", label="target")
    a2.semilogy(np.abs(np.fft.rfft(pred[:, 0]))[:kmax] / len(t), label="model")
    a2.semilogy(np.abs(np.fft.rfft(pred[:, 0] - y[:, 0]))[:kmax] / len(t), ":", label="residual")
    a2.set_xlabel("frequency (cycles on [0, 1))"), a2.legend(fontsize=8)
    _save(fig, out_dir, "signal.png")
    return res


ANALYSES = {"regions": regions_analysis, "steep": steep_analysis, "implicit_bias": implicit_bias_analysis,
            "gotu": gotu_analysis, "signal": signal_analysis}
