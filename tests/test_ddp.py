"""Every family under DDP (``trainer=ddp_cpu``: 2 CPU processes, gloo) against one process.

DDP gives each rank its share of the global batch and all-reduces the *mean* of the ranks' gradients. So:

- **always** (check A): the gradient every rank's optimiser gets equals the mean over ranks of the gradient
  each rank's own batch gives, recomputed here in one process from that batch and the rank's RNG state
  (``tests/ddp_probe.py``); for the VAE, for each of its two manual optimisers' updates. The ranks then end
  with identical parameters (``ddp/ranks_identical``, src.runs.training.ddp_consistency).
- **where the loss is a deterministic mean over the batch** (check B: NICE with ``loss=mle``, the supervised
  studies with ``mse``; ``half_sse`` is a sum, so the supervised family scales it by the world size): that
  mean of gradients is the one-process gradient on the whole global batch (the training loaders give the
  ranks the same global batch as one process with twice the batch size, and draw each item's noise from
  its position, not from the rank): the DDP run's gradients and final parameters equal the one-process
  run's, and its sharded test phase gives the one-process test metrics.
- **where it is not** (the VAE: encoder noise and projections; NCSN: noise levels and perturbations; DKEF: α
  fitted on half of each rank's batch): every rank draws that noise for its own rows from the same seeded
  RNG stream, so a 2-rank step is not a one-process step on the global batch (nor should it be); check A
  pins what DDP does instead.

Check A replays in float32 and compares at float32 rounding, so the ranks and the replay must run the same
float32 kernels: the ranks are started with the replay's intra-op thread count (``_ranks_on_replay_threads``;
with OMP_NUM_THREADS=2 in the caller's environment they used to run on 2 threads and the replay on 1). For the
NCSN under SSM-VR the thread count alone moves the gradient by 3e-5 of its scale (σ_L⁻² = 1e4 terms that
cancel), which check A's 1e-5 would flag although DDP is right (figures at :func:`assert_same_gradients`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from src.runs.build import build
from src.runs.training import train
from tests.conftest import FAST, compose_train
from tests.ddp_probe import load_records, replay_gradients
from tests.test_infra import run_train


@pytest.fixture(autouse=True)
def _ranks_on_replay_threads(one_thread, monkeypatch):
    """The training subprocesses (the DDP ranks) get the intra-op thread count the replay runs with (one, from
    ``one_thread``), whatever OMP_NUM_THREADS the caller set: see the module docstring."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))

QUIET = ["trainer.enable_progress_bar=false", "logger=none"]


def probe(path: Path) -> list[str]:
    return ["+callbacks.ddp_probe._target_=tests.ddp_probe.GradientProbe", f"+callbacks.ddp_probe.path={path}"]


def run_ddp(overrides: list[str], tmp_path: Path) -> tuple[dict, list[dict]]:
    """A 2-process run with the gradient probe: its metrics.json and the two ranks' probe records."""
    run_dir = tmp_path / "ddp"
    res = run_train([*QUIET, *overrides, "trainer=ddp_cpu", *probe(tmp_path / "probe_ddp")], run_dir, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["ddp/world_size"] == 2
    fps = metrics["ddp/param_fingerprints"]
    assert len(fps) == 2 and fps[0] == fps[1] and metrics["ddp/ranks_identical"] is True
    records = load_records(tmp_path / "probe_ddp")
    assert [r["rank"] for r in records] == [0, 1] and all(r["world_size"] == 2 for r in records)
    return metrics, records


def run_single(overrides: list[str], tmp_path: Path) -> tuple[dict, list[dict], object]:
    """The same run in one process (in-process), with the probe; returns its metrics, record and config."""
    cfg = compose_train([*QUIET, *overrides, *probe(tmp_path / "probe_one")], tmp_path / "one")
    metrics = train(cfg)
    return metrics, load_records(tmp_path / "probe_one"), cfg


def check_mean_of_rank_gradients(cfg, records: list[dict]) -> int:
    """Check A: each optimiser step's gradient on every rank = the mean of the ranks' replayed gradients."""
    module = build(cfg.model)
    threads = torch.get_num_threads()
    assert all(r["threads"] == threads for r in records), (
        f"ranks ran on {[r['threads'] for r in records]} intra-op threads, the replay on {threads}: their float32 "
        "reductions differ in order (see the module docstring)")
    n_steps = len(records[0]["steps"])
    assert n_steps >= 1 and all(len(r["steps"]) == n_steps for r in records)
    for k in range(n_steps):
        per_rank = [replay_gradients(module, rec, k) for rec in records]
        names = per_rank[0].keys()
        assert names and all(g.keys() == names for g in per_rank)
        # the ranks' own gradients differ (their rows differ): the all-reduce has something to average
        assert any(not torch.allclose(per_rank[0][n], per_rank[1][n]) for n in names)
        mean = {n: torch.stack([g[n] for g in per_rank]).mean(0) for n in names}
        for rec in records:
            assert_same_gradients({n: rec["steps"][k]["grads"][n] for n in names}, mean)
    return n_steps


def assert_same_gradients(a: dict, b: dict, rel: float = 1e-5) -> None:
    """Equal up to float32 rounding: within ``rel`` of each tensor's largest entry.

    Measured for NICE (one process on 16 images vs 2 ranks on 8: sums in another order): 6e-5 on entries up to
    3.6e2, 2e-7 of the scale. For the NCSN of ``test_ncsn_under_ddp`` (SSM-VR, σ_L = 0.01) the worst tensor's
    gap, of its scale: DDP vs the replay on the same thread count 6e-8 (the all-reduce's rounding); the replay
    on 2 vs 1 threads 6e-5 (``net.begin.weight``: 3e-5, 4.3e-3 on entries up to 142); the float32 replay vs
    the same replay in float64 (module, batch, state and warm starts cast, the same draws) 2.3e-4, 3.3e-4 for
    one rank's own gradient. So 1e-5 holds NCSN's check A only because the ranks and the replay run the same
    kernels (``_ranks_on_replay_threads``), and there it still catches a rank computing something else: the
    replay from another RNG state moves the gradient by 5-6 times its scale, its DEQ solve warm-started from
    another fixed point by up to 1.8e-4 (a float64 reference would need 3.3e-4 or more and miss that)."""
    assert a.keys() == b.keys() and a
    for n, value in a.items():
        torch.testing.assert_close(value, b[n], rtol=0, atol=rel * float(b[n].abs().max()) + 1e-12, msg=n)


# ---------------------------------------------------------------------------------------------- VAE
VAE = ["experiment=vae_mnist", "callbacks=minimal", "data.limit=256", "data.batch_size=8", "data.eval_batch_size=16",
       "model.latent_dim=4", "model.hidden=16", "model.channels=8", "deq=false", "trainer.max_steps=4",
       "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "model.metrics.vae.val_points=8",
       "model.metrics.log_likelihood.ais.n_steps=5", "model.metrics.log_likelihood.ais.n_chains=2",
       "model.metrics.log_likelihood.ais.leapfrog=2", "model.metrics.log_likelihood.test_points=6",
       "model.metrics.fid.n_samples=8", "model.metrics.fid.bootstrap=4", "trainer.limit_test_batches=1",
       "model.n_samples_grid=0"]


def test_vae_two_optimisers_under_ddp(tmp_path, mnist_root):
    """The SSM-VAE's alternating updates (score estimator, then encoder + decoder) under DDP: each update's
    gradient is the mean of the ranks' gradients of that update (check A), for both optimisers; the ranks end
    identical; validation and test run sharded, AIS on the same 6 test points as one process (3 per rank)."""
    overrides = [*VAE, f"data.root={mnist_root}"]
    metrics, records = run_ddp(overrides, tmp_path)
    cfg = compose_train([*QUIET, *overrides], tmp_path / "cfg")
    assert check_mean_of_rank_gradients(cfg, records) == 2  # the score update, then the VAE update
    names = [set(s["grads"]) for s in records[0]["steps"]]
    assert all(n.startswith("score_net.") for n in names[0])
    assert any(n.startswith("encoder.") for n in names[1]) and any(n.startswith("decoder.") for n in names[1])
    assert metrics["global_step"] == 4
    assert metrics["test/ais_points"] == 6
    for key in ("val/recon_error", "test/recon_error", "test/score_ssm_loss", "test/log_likelihood", "test/fid",
                "test/fid_bootstrap_sd"):  # the bootstrap over both ranks' gathered features
        assert torch.isfinite(torch.tensor(metrics[key])), key
    assert 200 < metrics["test/recon_error"] < 1000  # binarised 28x28 images, a nearly untrained decoder
    # white-out counts summed over both ranks: the 8 real images are binarised, so their white share is their
    # share of ones (MNIST: 10-20 %); the generated ones are Bernoulli means, never above 0.99 untrained
    assert 0.05 < metrics["test/white_fraction_real"] < 0.3 and 0 <= metrics["test/white_fraction"] < 0.05


# ------------------------------------------------------------------------------ DKEF, NCSN (check A)
@pytest.mark.slow
def test_dkef_alpha_fit_under_ddp(tmp_path):
    """DEQ-DKEF, exact SM: α is fitted on half of each rank's batch, the loss on the other half (check A).

    The paper's Frobenius-normalised block, not the family's spectral block of record: spectral normalisation's
    power-iteration vector is a buffer that every forward updates, so a replay from the state recorded at the
    optimiser step (after the forward) would take one power iteration more than the rank did."""
    frobenius = ["deq.norm=frobenius", "deq.norm_lambda=2"]
    metrics, records = run_ddp([*FAST, *frobenius, "callbacks=minimal", "trainer.max_steps=3", "trainer.max_epochs=1"],
                               tmp_path)
    cfg = compose_train([*QUIET, *FAST, *frobenius], tmp_path / "cfg")
    assert check_mean_of_rank_gradients(cfg, records) == 1
    assert metrics["global_step"] == 3 and torch.isfinite(torch.tensor(metrics["test/sm_loss"]))


NCSN = ["model=ncsn", "data=mnist_images", "callbacks=minimal", "data.limit=200", "data.batch_size=4",
        "data.eval_batch_size=8", "model.ngf=4", "model.noise.num_classes=3", "model.sampling.n_steps_each=2",
        "model.metrics.fid.n_samples=8", "model.n_samples_grid=0", "trainer.max_steps=2", "trainer.max_epochs=1",
        "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]


@pytest.mark.slow
def test_ncsn_under_ddp(tmp_path, mnist_root):
    """NCSN (DEQ, SSM-VR): random noise levels, perturbations and projections per rank (check A)."""
    overrides = [*NCSN, f"data.root={mnist_root}", "loss=ssm_vr", "deq=true"]
    metrics, records = run_ddp(overrides, tmp_path)
    cfg = compose_train([*QUIET, *overrides], tmp_path / "cfg")
    assert check_mean_of_rank_gradients(cfg, records) == 1
    for key in ("test/dsm_loss", "test/ssm_vr_loss", "test/fid"):
        assert torch.isfinite(torch.tensor(metrics[key])), key


# ------------------------------------------------------------------- NICE, supervised (checks A and B)
NICE = ["experiment=nice_mnist", "callbacks=minimal", "loss=mle", "deq=false", "depth=2", "model.hidden=16",
        "data.limit=400", "trainer.gradient_clip_val=null", "trainer.max_steps=3", "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1"]


@pytest.mark.slow
def test_nice_mle_under_ddp_equals_one_process(tmp_path, mnist_root):
    """NICE by maximum likelihood: the loss is a deterministic mean, so 2 ranks x 8 images per step equal one
    process with 16 (gradients at the first step, parameters after 3 Adam steps, the exact test
    log-likelihood of the sharded test set)."""
    overrides = [*NICE, f"data.root={mnist_root}"]
    ddp, records = run_ddp([*overrides, "data.batch_size=8"], tmp_path)
    one, one_records, cfg = run_single([*overrides, "data.batch_size=16"], tmp_path)
    check_mean_of_rank_gradients(cfg, records)
    assert_same_gradients(records[0]["steps"][0]["grads"], one_records[0]["steps"][0]["grads"])
    for key in ("test/log_likelihood", "test/bits_per_dim", "test/sm_loss"):
        if key in one:
            assert ddp[key] == pytest.approx(one[key], rel=1e-4), key
    assert ddp["global_step"] == one["global_step"] == 3


STUDIES = {  # tiny versions of conf/experiment/<study>.yaml; the global batch is the whole training split
    "gotu": ["data.dim=4", "data.steps_per_epoch=4"],
    "high_frequency": ["data.task_kwargs.n_train=64", "data.task_kwargs.n_test=256", "data.steps_per_epoch=4"],
    "implicit_bias": ["data.steps_per_epoch=4", "data.task_kwargs.n_test=64"],
    "linear_regions": ["deq=false", "data.task_kwargs.n_train=64", "data.task_kwargs.n_val=32",
                       "data.batch_size=GLOBAL", "trainer.check_val_every_n_epoch=1"],
    "steep": ["data.task_kwargs.n_train=64", "data.task_kwargs.n_val=32", "data.task_kwargs.n_test=64",
              "data.batch_size=GLOBAL", "trainer.check_val_every_n_epoch=1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("study", sorted(STUDIES))
def test_supervised_study_under_ddp_equals_one_process(tmp_path, study):
    """The supervised studies: mean (or world-scaled sum) losses on deterministic data, so the 2-rank run equals
    one process on the global batch — gradients, final parameters and the gathered test metrics."""
    base = [f"experiment={study}", "callbacks=minimal", "trainer.max_epochs=1", *STUDIES[study]]
    ddp_over = [o.replace("GLOBAL", "32") for o in base]
    one_over = [o.replace("GLOBAL", "64") for o in base]
    ddp, records = run_ddp(ddp_over, tmp_path)
    one, one_records, _ = run_single(one_over, tmp_path)
    if records[0]["steps"]:  # linear_regions' construction is frozen: nothing to train
        assert_same_gradients(records[0]["steps"][0]["grads"], one_records[0]["steps"][0]["grads"])
    assert ddp["global_step"] == one["global_step"]
    for key in ("test/mse", "test/linf"):
        assert ddp[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    if study == "implicit_bias":  # v(t) of Theorem 3 gathered over the ranks' rows
        for key in ("test/closed_form_gap_mirror", "test/gap_to_q_minimiser"):
            assert ddp[key] == pytest.approx(one[key], rel=1e-3, abs=1e-9), key
