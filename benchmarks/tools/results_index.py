"""Write ``benchmarks/results/README.md``: every table, figure and data file in ``benchmarks/results`` with the
command that made it, the command that rebuilds its table now, and what it shows.

    python -m benchmarks.tools.results_index            # rewrite the index
    python -m benchmarks.tools.results_index --check    # exit 1 (and say which) when the index is out of date

A result is a stem: ``<stem>.md`` (the table) and/or ``<stem>.json`` (its data; the table is rebuilt from it
with the script's ``--render``), plus its figures ``<stem>.png`` and ``<stem>_*.png``. Its command is read
from the JSON (``meta.command``, ``meta.commands`` of merged parts, or each section's ``meta.command``), else
from the table's header; the data root in it is shown as ``<data root>`` (a path of the machine that ran it).
That command is history: a result made before the benchmarks moved to ``benchmarks/{tools,studies}`` records
``python benchmarks/<script>.py``. :func:`rebuild_command` is how its table is rebuilt from its JSON today
(:data:`REBUILT_BY`; ``tests/test_results_index.py`` rebuilds every table with it and compares byte for byte); a
result whose script was retired (:data:`RETIRED`: a one-off study that answered its question) stays, and its row
names the last commit that had the script (``git show <commit>:<script>``; the tests check that it holds it).
What it shows is :data:`SHOWS` (one line a result; a new result without an entry shows its table's title).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks.lib.results import RESULTS

INDEX = "README.md"
CURVES = re.compile(r"(vae|ncsn)_mnist_curves")
# the tool or study whose --render rebuilds each result's table from its JSON (besides the training curves,
# :data:`CURVES`: ``benchmarks.tools.training_curves <grid> --render --name <stem>``)
REBUILT_BY = {
    "solvers_vs_torchdeq": "benchmarks.studies.solvers_vs_torchdeq --render",
    "ncsn_sampling_cost": "benchmarks.studies.ncsn_sampling_cost --render",
    "ncsn_deq_search": "benchmarks.studies.ncsn_deq_search --render",
    "dkef_block_cost_redwine": "benchmarks.studies.dkef_block_cost --render --name dkef_block_cost_redwine",
    "dkef": "benchmarks.tools.run_grid dkef --render",
    "dkef_table3": "benchmarks.tools.run_grid dkef --render --name dkef_table3",
    "dkef_paper_protocol": "benchmarks.tools.dkef_paper_protocol --render",
    "ncsn_protocol_probe_a": "benchmarks.tools.training_curves ncsn --render --name ncsn_protocol_probe_a",
    "vae_mnist_campaign": "benchmarks.tools.generative_seeds vae --render --name vae_mnist_campaign",
    "ncsn_protocol_probe_b": "benchmarks.tools.training_curves ncsn --render --name ncsn_protocol_probe_b",
    "ncsn_long_campaign_seed0": "benchmarks.tools.training_curves ncsn_long --render --name ncsn_long_campaign_seed0",
    "ncsn_mnist_campaign": "benchmarks.tools.generative_seeds ncsn_long --render --name ncsn_mnist_campaign",
    "ncsn_long_extension_seed0": "benchmarks.tools.training_curves ncsn_long --render --name ncsn_long_extension_seed0",
    "ncsn_deq_cost": "benchmarks.studies.ncsn_deq_cost --render",
    "ncsn_mdeq_cost": "benchmarks.studies.ncsn_mdeq_cost --render",
    "dkef_memory": "benchmarks.tools.step_cost dkef --render",
    "dkef_block_cost": "benchmarks.studies.dkef_block_cost --render",
    "dkef_block_cost_k": "benchmarks.studies.dkef_block_cost --render --name dkef_block_cost_k",
    "dkef_block_cost_main": "benchmarks.studies.dkef_block_cost --render --name dkef_block_cost_main",
    "dkef_main_block": "benchmarks.studies.dkef_main_block --render",
    "faults": "benchmarks.tools.fault_table --render",
    "gpu_suite": "benchmarks.tools.gpu_suite --render",
    "ncsn_langevin_step": "benchmarks.studies.ncsn_langevin_step --render",
    "ncsn_memory": "benchmarks.tools.step_cost ncsn --render",
    "ncsn_sampler_update": "benchmarks.studies.ncsn_langevin_step --render --name ncsn_sampler_update",
    "ncsn_sampler_drift": "benchmarks.studies.ncsn_sampler_drift --render",
    "ncsn_langevin_rank": "benchmarks.studies.ncsn_langevin_step --render --name ncsn_langevin_rank",
    "ncsn_langevin_step_long": "benchmarks.studies.ncsn_langevin_step --render --name ncsn_langevin_step_long",
    "ncsn_langevin_warm_start": "benchmarks.studies.ncsn_langevin_step --render --name ncsn_langevin_warm_start",
    "ncsn_share_by_level": "benchmarks.studies.ncsn_share_by_level --render",
    "deq_recurrence": "benchmarks.studies.deq_recurrence --render",
    "ncsn_white_out": "benchmarks.studies.ncsn_sampler_drift --render --name ncsn_white_out",
    "nice": "benchmarks.tools.run_grid nice --render",
    "profile_step": "benchmarks.tools.profile_step --render",
    "separation": "benchmarks.studies.separation_report --render",
    "vae_memory": "benchmarks.tools.step_cost vae --render",
}
# Results whose script was retired once it had answered its question (the result and its finding stay: the
# finding in docs/, the files here): the script, the last commit that had it, and the arguments of its
# ``--render``, which at that commit rebuilt the table from its JSON byte for byte (None: the script had none).
RETIRED_AT = "0d4b889"  # issue 49: the one-off studies and tools retired together
RETIRED = {
    "speed": ("benchmarks/speed.py", "108c9b8", None),
    "ais_bias": ("benchmarks/studies/ais_bias.py", RETIRED_AT, "--render"),
    "ais_bias_vae": ("benchmarks/studies/ais_bias.py", RETIRED_AT, "--render --name ais_bias_vae"),
    "deq_solvers": ("benchmarks/studies/deq_solvers.py", RETIRED_AT, "--render"),
    "dkef_step_profile": ("benchmarks/tools/dkef_step_profile.py", RETIRED_AT, "--render"),
    "ncsn_block_divergence": ("benchmarks/studies/ncsn_block_divergence.py", RETIRED_AT, "--render"),
    "ncsn_memory_cause": ("benchmarks/studies/ncsn_memory_cause.py", RETIRED_AT, "--render"),
    "ncsn_phantom_bias": ("benchmarks/studies/ncsn_phantom_bias.py", RETIRED_AT, "--render"),
    "objectives": ("benchmarks/tools/objectives_bench.py", RETIRED_AT, "--render"),
    "vae_estimator_depth": ("benchmarks/studies/vae_estimator_depth.py", RETIRED_AT, "--render"),
    "vae_estimator_variance": ("benchmarks/studies/vae_estimator_variance.py", RETIRED_AT, "--render"),
}

# what each result shows, one line (the paper's table or the question it answers)
SHOWS = {
    "ncsn_deq_search": "The pre-registered image-DEQ search (issue 59): each design's FID at 1500 steps, recurrence "
                       "share over all noise levels, solver counts, cost and sampling time beside TwoRes, and the "
                       "plan's rule applied: S4 (three resolutions, λ 1.5) wins and goes to the three-seed decision.",
    "solvers_vs_torchdeq": "Forward solvers beside TorchDEQ 0.1.0 (its Anderson at several m and λ) on the trained maps "
                           "of record (ncsn_mnist at step 150 of 500, ncsn_mnist_long at step 200 of a 300-step run, the "
                           "DKEF main job's three blocks): time to a per-sample relative 1e-4 and at equal work.",
    "ncsn_sampling_cost": "Annealed Langevin sampling seconds per image of trained DEQ-NCSN checkpoints against TwoRes "
                          "at the same settings (issue 60's bound: 1.15x).",
    "dkef_block_cost_main": "The main job's DKEF record at latent width 30, λ 1.8 (issue 60, item 5) against the "
                            "3-layer net, before and after the jets' and inducing points' joint solve, beside the "
                            "former record (width 64, λ 2); RedWine's record too: bytes and step time (CPU time "
                            "1.18x on the main job, 1.15-1.16x on RedWine).",
    "dkef_main_block": "The main job's DKEF arms trained over 3 seeds (record, former record, width 30 at λ 2, the "
                       "paper's block, the 3-layer net): test LL against the truth, Fisher divergence, each block's "
                       "recurrence share, solver iterations, time and bytes per step.",
    "dkef_block_cost_k": "DKEF's block of record with K = 5, 4 and 3 phantom steps (and the implicit and paper's "
                         "blocks) against the 3-layer net on the main job: bytes and step time per K (issue 60, "
                         "item 5: no K >= 3 meets the 1.2x time bound).",
    "dkef_block_cost": "DKEF's DEQ blocks (the record, its implicit backward, the paper's) against the 3-layer net, "
                       "bytes saved and step time interleaved, on the main job and RedWine, before and after the "
                       "implicit jet route's own products (issue 60's bounds: 1.1x bytes, 1.2x time).",
    "dkef_table3": "Paper Table 3 at its protocol (DKEF on the 100- and 200-d Gaussian, 200 epochs at batch 32, "
                   "early stopping with patience 20): DEQ-SM and SM 16-layer, 3 seeds each, beside the paper and "
                   "the ground-truth log-likelihood.",
    "ncsn_mdeq_cost": "The image-DEQ designs (multi-resolution equilibrium, MDEQ's group-norm cell, Jacobian "
                      "penalty) at experiment=ncsn_mnist_long: seconds and saved bytes per step, each beside a "
                      "TwoRes run, and their solvers' convergence over 20 steps.",
    "ncsn_deq_cost": "The NCSN DEQ's step by implicit-backward level (time, bytes saved) at ncsn_mnist and at the "
                     "authors' CIFAR-10 settings, every family's cost line (and before / after issue 60's changes, "
                     "side by side), the 40-step acceptance runs beside TwoRes (before and after issue 60's "
                     "rewrite), and the cheaper routes tried over "
                     "300 steps.",
    "ais_bias": "AIS log p(x) against the exact one (quadrature over a 2-d latent) on a Bernoulli decoder: the "
                "error in nats and how often the estimate lies above the truth, per step-size rule and number of "
                "steps T.",
    "deq_recurrence": "Issue 41: the recurrence share ‖z* − φ(0; p)‖/‖z*‖ of each family's DEQ block per candidate "
                      "block (the paper's Frobenius λ = 2, spectral, smaller λ; chooses the blocks of record), at "
                      "the end of each committed protocol, the DEQ vs paper DEQ vs one-pass control vs explicit "
                      "decision grid per family, and where a float32 Picard solve of a CIFAR-sized state bottoms "
                      "out (the stop rule).",
    "ncsn_block_divergence": "Issue 41: why the paper authors' normalised-residual DEQ-NCSN block stops converging "
                             "(trained on SSM-VR through the phantom K = 2 backward, not on DSM nor with the "
                             "implicit backward): ρ, w, norms and gains, and the K = 2 against the exact SSM-VR loss "
                             "every 5 steps.",
    "deq_solvers": "Forward solvers (Picard, Anderson, Broyden): iterations and time to tolerance, cold and "
                   "warm-started, on a trained DKEF block, a NICE-sized block and a slow rank-one block, at λ = 2 "
                   "and 1.1.",
    "dkef": "Paper Tables 2-3 and Figures 2-3: DKEF on UCI (RedWine, WhiteWine, Parkinsons) and Gaussian D = 100, "
            "200 — test SM loss, LL, Fisher divergence, saved memory and time per method, the paper's figures beside "
            "ours and the targets checked.",
    "dkef_paper_protocol": "Issue 30: DKEF at the paper's protocol (RedWine, WhiteWine, Parkinsons; 300 epochs, "
                           "batch 128, M = 200, 10⁶ importance samples), 3 seeds per method where run: test SM / "
                           "LL as trained and after the "
                           "reference's final λ refit, the per-point tail of the test SM loss, seed-band learning "
                           "curves, a verdict per §4.2 claim, and the controlled runs on the gap to the paper.",
    "dkef_memory": "Memory and time of one DKEF training step: DEQ features vs explicit 3-, 8- and 16-layer "
                   "features (the paper's headline ratio).",
    "dkef_softplus_injection": "The DKEF grid as committed before the linear DEQ injection (softplus "
                               "injection): the `— old` rows of `dkef.md` (`--old`).",
    "gpu_suite": "One run of `benchmarks/tools/gpu_suite.py` on a lent H100 (170 s budget): paper Tables 1 and 5 at batch "
                 "128 (peak CUDA memory, saved-for-backward bytes, s/iter), DDP on the one GPU present, a short "
                 "NCSN MNIST FID run. Its DEQ rows hit the 128-iteration cap (absolute tolerance 1e-5 at the "
                 "CIFAR-10 size in float32), so their s/iter is an upper bound.",
    "ncsn_memory": "NCSN at the CIFAR-10 size, RefineNet vs TwoRes vs DEQ: one SSM-VR step at the paper authors' "
                   "settings (232 levels, both conditionings, before/after the recomputing norm; saved bytes, max "
                   "RSS, s/step beside their code's, profile), and Table 5's setting (score graph and step).",
    "ncsn_memory_cause": "Score-graph memory of deqsm's NCSN variants and of the authors' code's networks: is the "
                         "architecture the cause of the 0.5 vs 0.28 memory-ratio gap?",
    "ncsn_sampler_update": "The DEQ authors' Langevin update (`model.sampling.update=authors`: 2/3 drift, MA(1) "
                           "noise) against the Euler step on two NCSN DEQ-of-record checkpoints: FID of 500 samples "
                           "± bootstrap sd and white-out, same seed for both rules.",
    "vae_mnist_campaign": "The SSM-VAE decision of issue 48 at experiment=vae_mnist's 20 000 steps: DEQ of record, its "
                          "one-pass control and the SSM VAE, FID of 1000 samples and AIS on 100 test images paired "
                          "by image; 3 seeds of each (`python -m benchmarks.tools.seeds_campaign vae "
                          "--root <data dir> --parallel 1 --seeds 0,1,2 --variants 'DEQ-SSM VAE (record),DEQ-SSM "
                          "VAE (one-pass),SSM VAE' --steps 20000 --every 10000 --fid-samples 1000 --ais-points 16 "
                          "--final-ais-points 100`). Wall times: the machine ran other jobs beside each part, "
                          "unevenly, so s/step and the equal-wall-time table are not comparable across arms.",
    "ncsn_protocol_probe_a": "NCSN protocol probe A (issue 48): DSM TwoRes, batch 32, EMA 0.999, "
                             "experiment=ncsn_mnist's noise (σ 1 → 0.01, 10 levels, T = 20, ε 2e-5, denoised): "
                             "FID of 500 samples at 1500 and 3000 steps (`notes/ncsn_protocol.md`).",
    "ncsn_long_campaign_seed0": "The NCSN decision of issue 48 at experiment=ncsn_mnist_long, seed 0's curves (FID of "
                                "1000 samples ± bootstrap sd every 1500 steps, test DSM / SSM-VR) of TwoRes, RefineNet, "
                                "the DEQ of record and its one-pass control, and the DSM-trained TwoRes quality reference line "
                                "(FID 170.6 at 6000 steps, 7.7× the floor; ahead of every SSM-VR arm at every checkpoint).",
    "ncsn_long_extension_seed0": "Issue 48: does the FID stop improving after 6000 steps? Seed 0 continued past the "
                                 "protocol (FID of 1000 samples): RefineNet SSM-VR 199.4 → 191.6 at 7500, the DSM "
                                 "TwoRes reference 170.6 → 168.0 → 158.4 at 7500 / 9000 — gains within 1 bootstrap sd a "
                                 "checkpoint, against 38–97 from 4500 to 6000. Its points up to 6000 steps are "
                                 "copies of `ncsn_long_campaign_seed0`'s (each run continued from a copy of the "
                                 "campaign's; its note says so).",
    "ncsn_mnist_campaign": "The NCSN decision of issue 48 over seeds (experiment=ncsn_mnist_long, 6000 steps, FID of 1000 "
                           "samples ± bootstrap sd, test DSM, saved bytes and time per step): the DEQ of record, its "
                           "one-pass control, TwoRes and RefineNet (SSM-VR), 3 seeds of each; equal-step "
                           "and equal-time verdicts at 2 s.e. and by Welch's t-test "
                           "(`python -m benchmarks.tools.seeds_campaign ncsn_long --root <data dir> --parallel 1 "
                           "--seeds 0,1,2 --curve-seeds 0`, two such processes side by side on 2 cores).",
    "ncsn_protocol_probe_b": "NCSN protocol probe B (issue 48): the same with NCSNv2's rules (σ₁ 16.9, 95 levels, "
                             "unconditional network, T = 5, ε 1.1e-5): FID of 500 samples (`notes/ncsn_protocol.md`).",
    "ncsn_mnist_curves": "Paper Table 5 protocol on MNIST, 600 steps: FID and test DSM / SSM-VR losses against "
                         "steps and wall time for RefineNet, TwoRes, DEQ and DEQ (spectral norm); sample grids."
                         " Measured before issue 29 (the old half Langevin step).",
    "ncsn_mnist_curves_corrected": "`ncsn_mnist_curves` re-run after issue 29 (the reference's Langevin step at "
                                   "step_lr 2e-5, T = 20); before/after in `notes/issue29_remeasure.md`.",
    "ncsn_mnist_curves_long": "The NCSN MNIST curves to 2000-3000 steps (RefineNet, TwoRes, DEQ with spectral norm "
                              "and the implicit backward), one process per variant, merged."
                              " Measured before issue 29 (the old half Langevin step).",
    "ncsn_mnist_curves_spectral_implicit": "DEQ-NCSN (spectral norm) trained with the implicit backward "
                                           "(`deq.backward=implicit`), 600 steps."
                                           " Measured before issue 29 (the old half Langevin step).",
    "ncsn_mnist_curves_spectral_k2": "DEQ-NCSN (spectral norm) with K = 2 phantom steps (the default), 600 steps."
                                     " Measured before issue 29 (the old half Langevin step).",
    "ncsn_mnist_curves_spectral_k8": "DEQ-NCSN (spectral norm) with K = 8 phantom steps, 600 steps."
                                     " Measured before issue 29 (the old half Langevin step).",
    "ncsn_phantom_bias": "Per checkpoint: the SSM-VR loss with the phantom backward (K = 1, 2, 4, 8) vs the exact "
                         "implicit one, and the learned map's contraction rate.",
    "ncsn_langevin_rank": "Issue 48: every NCSN arm's seed-0 checkpoint (6000 steps) sampled at ε 1.1e-5 and 2.2e-5 "
                          "(FID of 500 samples): the order RefineNet < TwoRes < one-pass < record holds at both; "
                          "every arm gains 12-44 at 2.2e-5.",
    "ncsn_langevin_step_long": "Issue 48: the long protocol's Langevin step ε on the campaign's TwoRes seed 0 at "
                               "6000 steps (FID of 500 samples): the rule's 1.1e-5 gives 241.8, 2.2e-5 197.9.",
    "ncsn_langevin_warm_start": "Issue 48: the campaign's DEQ of record (seed 0, 6000 steps) sampled with and "
                                "without the solver's warm start: FID 306.0 both (250 samples); not the cause of "
                                "its gap to TwoRes.",
    "ncsn_share_by_level": "Issue 48: the NCSN campaign's DEQ of record, per noise level and checkpoint: its "
                           "recurrence share, solver iterations and contraction rate; why the logged share fell "
                           "to 6.2 % (it looked at the 16 largest of 95 σ) while the all-level share is 12.9 → 10.0 %; "
                           "the last checkpoints of seeds 1 and 2 beside it (10.4 % and 9.1 %).",
    "ncsn_sampler_drift": "Annealed Langevin trajectories vs noisy data per noise level: the network's predicted "
                          "noise and the pixel statistics along the sampler.",
    "ncsn_white_out": "Issue 41: why the decision grid's 300-step NCSNs white out — the same per-level trajectory "
                      "diagnostics on eight of its checkpoints (DEQ of record, one-pass, paper DEQ, TwoRes), "
                      "from the sampler's U(0, 1) start and from noisy test images.",
    "nice": "Paper Table 4 and a figure: NICE on MNIST, SSM vs DEQ-SSM (3 seeds) and the MLE / CP / DSM "
            "baselines — test SM loss, LL, bits/dim, saved memory, time; the targets checked.",
    "nice_softplus_injection": "The NICE grid as committed before the linear DEQ injection (softplus "
                               "injection): the `— old` rows of `nice.md` (`--old`).",
    "nice_parts/nice_cuda_seed0": "A part of the NICE grid run on a GPU (seed 0, `--device cuda`).",
    "notes/dkef_paper_protocol": "The note printed above `dkef_paper_protocol.md` (`--note`): what ran where, "
                                 "and the controlled runs that isolate the gap to the paper's DEQ-SM row (the "
                                 "α/λ refit, early stopping, the per-point tail, the optimiser, the split and the "
                                 "whitening, the LL estimator).",
    "notes/dkef_block_cost_main": "The note printed under `dkef_block_cost_main.md` (`--note`): the main job's "
                                  "record at width 30 and what the joint solve changed.",
    "notes/dkef_block_cost_k": "The note printed under `dkef_block_cost_k.md` (`--note`): how the record's step "
                               "time scales with K.",
    "notes/dkef_table3": "The note printed above `dkef_table3.md` (`--note`): the protocol, and why early stopping "
                         "with patience 20 selects the full-length runs' checkpoints (checked on seed 0 of both "
                         "100-d methods against two full-length runs that are not committed).",
    "notes/ncsn_long_extension_seed0": "The note printed under `ncsn_long_extension_seed0.md`'s machine line "
                                       "(`--note`): its points up to 6000 steps are copies of the campaign's seed-0 "
                                       "runs; only 7500 and 9000 steps are new.",
    "notes/ncsn_deq_search_plan": "The pre-registered image-DEQ search (issue 59, a draft not yet run): the 1500-step "
                                  "protocol and whether it ranks the campaign's seed-0 arms, the designs as commands, "
                                  "the cost and convergence gates and the rule that picks the winner.",
    "notes/ncsn_protocol": "How experiment=ncsn_mnist_long's NCSN protocol was chosen: probes A and B side by side, "
                           "NCSNv2's rules computed for MNIST.",
    "notes/ncsn_deq_cost_frontier": "The note printed under `ncsn_deq_cost.md`'s frontier table (`--note`): why "
                                    "two routes stop early, the runs not kept, the backward tolerance's runs.",
    "notes/ncsn_langevin_step_long": "The note printed under `ncsn_langevin_step_long.md`: what the ε sweep "
                                     "found and why the campaign keeps the protocol's ε.",
    "notes/ncsn_langevin_warm_start": "The note printed above `ncsn_langevin_warm_start.md`'s sections: the "
                                      "question, the commands, the answer.",
    "notes/ncsn_share_by_level": "The note printed under `ncsn_share_by_level.md` (`--note`): the checkpoints "
                                 "measured and the finding.",
    "notes/ncsn_deq_cost_acceptance_after": "The note printed under `ncsn_deq_cost.md`'s second acceptance table "
                                            "(`--note`): the 40-step runs after issue 60's rewrite, four rounds on a "
                                            "quiet machine, and how to read them against the first.",
    "notes/ncsn_deq_cost_acceptance": "The note printed under `ncsn_deq_cost.md`'s acceptance table (`--note`): "
                                      "how the 40-step runs were run, and the ratios over rounds.",
    "notes/dkef_issue14": "The note printed above `dkef.md`'s tables (`--note`): the DEQ rows re-measured with "
                          "the linear injection.",
    "notes/issue29_remeasure": "Before/after of the NCSN and VAE MNIST curves re-measured with the corrected "
                               "Langevin step, AIS and VAE estimator (issue 29), and what else differs.",
    "notes/nice_issue14": "The note printed above `nice.md`'s tables (`--note`): NICE Table 4 with the linear "
                          "injection, 3 seeds.",
    "objectives": "Time of one training step of each score-matching objective and exact-trace route at D = 11 to "
                  "784, and the routes' agreement in float64.",
    "speed": "Issue 26: seconds per training step before (b3facaa) and after its change, per family; "
             "`python -m benchmarks.tools.profile_step --at REV` times the same steps at any commit.",
    "separation": "The studies of *Separation and Bias of Deep Equilibrium Models* (NeurIPS 2024): each claim "
                  "beside what was measured (linear regions, steep functions, implicit bias, GOTU, high "
                  "frequencies).",
    "vae_estimator_depth": "Does a deep MLP score estimator s(z|x) learn? Depth × learning rate on a known "
                           "conditional Gaussian score.",
    "vae_estimator_variance": "SSM vs SSM-VR on the MNIST SSM-VAE's score estimator: spread of the batch loss and "
                              "variance of the score net's gradient over projection draws, at initialisation and "
                              "after training with each estimator.",
    "vae_memory": "Paper Table 1 at the CIFAR-10 and CelebA sizes: parameters, saved bytes and time of one SSM-VAE "
                  "training iteration, SSM VAE vs Aug(8), Aug(16), DEQ.",
    "vae_mnist_curves_corrected": "`vae_mnist_curves` re-run after issue 29 (SSM-VR, RMSprop, pilot-adapted "
                                  "AIS; AIS on 500 test images at the last checkpoint); before/after in "
                                  "`notes/issue29_remeasure.md`.",
    "vae_mnist_curves": "Paper Table 1 protocol on binarised MNIST, 12000 steps: FID, AIS log p(x), "
                        "reconstruction and the estimator's SSM loss against steps for SSM VAE, Aug(8), Aug(16) and "
                        "DEQ; sample grids."
                        " Measured before issue 29 (SSM + Adam, per-chain-adapted AIS).",
    "vae_mnist_curves_lr1e-4": "The VAE curves with both learning rates 1e-4, 24000 steps, AIS on 100 test images "
                               "at the last checkpoint."
                               " Measured before issue 29 (SSM + Adam, per-chain-adapted AIS).",
    "vae_mnist_curves_lr1e-4_no_entropy": "The SSM VAE without the entropy term (`model.entropy_weight=0`), "
                                          "lr 1e-4, 24000 steps: what the score estimator contributes."
                                          " Measured before issue 29 (SSM + Adam, per-chain-adapted AIS).",
    "vae_mnist_curves_lr1e-4_seed1": "The lr 1e-4 VAE curves again with seed 1."
                                     " Measured before issue 29 (SSM + Adam, per-chain-adapted AIS).",
    "vae_mnist_curves_score_lr1e-4": "The VAE curves with the score estimator's learning rate 1e-4, 12000 steps."
                                     " Measured before issue 29 (SSM + Adam, per-chain-adapted AIS).",
}
FIGURES = {  # figures whose name does not say what they show
    "dkef_paper_protocol_curves": "validation exact SM loss against training steps per method, mean over seeds "
                                  "with a min-max band",
    "dkef_fig2_uci": "paper Figure 2: test SM loss, LL, memory and time per method on the UCI data sets",
    "dkef_fig3_gaussian": "paper Figure 3: the same on Gaussian D = 100, 200, with the Fisher divergence",
    "nice_mnist": "test SM loss, LL, memory and time per method",
    "separation_gotu_features": "GOTU: feature heatmaps of the FFNs, the DEQs and the diagonal network",
    "separation_implicit_bias": "Theorem 3: the diagonal linear DEQ's run against its predicted limit",
    "separation_regions": "Theorem 1: linear regions against width (construction) and FFN regions / L∞ "
                          "against depth",
    "separation_regions_deq_fit": "Theorem 1: the hand-built DEQ's fit",
    "separation_regions_trained_deq_fit": "Theorem 1: a 6-neuron DEQ trained on the sawtooth (seed 0)",
    "separation_signal": "high frequencies: relative error per tone",
    "separation_steep": "Theorem 2: L∞ error and weight ∞-norm against d",
}
_ROOT_ARG = re.compile(r"(--root[ =]|data\.root=)(?!<)('[^']*'|\S+)")


def _portable(command: str) -> str:
    """The command with its data root shown as ``<data root>``, pipes escaped for a table cell."""
    return _ROOT_ARG.sub(lambda m: m.group(1) + "<data root>", command).replace("|", "\\|")


def commands_of(stem: str, results: Path) -> list[str]:
    """The command(s) that made a result: from its JSON's meta, else the first one its table quotes."""
    out: list[str] = []
    js = results / f"{stem}.json"
    if js.exists():
        data = json.loads(js.read_text())
        metas = [data.get("meta")] if isinstance(data.get("meta"), dict) else [
            v["meta"] for v in data.values() if isinstance(v, dict) and isinstance(v.get("meta"), dict)]
        if isinstance(data.get("command"), str):  # results that keep their command at the top level
            metas.append({"command": data["command"]})
        for meta in metas:
            found = meta.get("commands") or meta.get("command")
            for c in [found] if isinstance(found, str) else found or []:
                if c.strip() and c.strip() not in out:
                    out.append(c.strip())
    md = results / f"{stem}.md"
    if not out and md.exists():
        m = re.search(r"`(python -m benchmarks\.[^`]+|(?:python )?benchmarks/[^`]+)`", md.read_text())
        if m:
            out.append(m.group(1) if m.group(1).startswith("python ") else "python " + m.group(1))
    return out


def rebuild_command(stem: str) -> str | None:
    """``python -m <tool> … --render`` that rebuilds ``<stem>.md`` from ``<stem>.json`` (None: no such tool)."""
    curves = CURVES.match(stem)
    if curves:
        return f"python -m benchmarks.tools.training_curves {curves.group(1)} --render --name {stem}"
    return f"python -m {REBUILT_BY[stem]}" if stem in REBUILT_BY else None


def retired_text(stem: str) -> str:
    """Where a retired result's script last lived, and how its table was rebuilt there."""
    script, commit, render = RETIRED[stem]
    text = f"retired: the script last lived at commit {commit}, `git show {commit}:{script}`"
    if render:
        module = script.removesuffix(".py").replace("/", ".")
        text += f"; there `python -m {module} {render}` rebuilt this table byte for byte"
    return text


def title_of(md: Path) -> str:
    for line in md.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def results_of(results: Path) -> dict[str, dict]:
    """``{stem: {"files": [...], "figures": {name: stem}}}`` for every file under ``results`` (but the index)."""
    files = sorted(p.relative_to(results).as_posix() for p in results.rglob("*")
                   if p.is_file() and p.name != INDEX)
    stems = sorted({f.rsplit(".", 1)[0] for f in files if f.endswith((".md", ".json"))}, key=len, reverse=True)
    out: dict[str, dict] = {}
    for f in files:
        base = f.rsplit(".", 1)[0]
        owner = base if base in stems else next(
            (s for s in stems if f.endswith(".png") and base.startswith(s + "_")), base)
        out.setdefault(owner, {"files": []})["files"].append(f)
    return dict(sorted(out.items()))


def sample_grids(stem: str, results: Path) -> dict[str, str]:
    """``{figure file: variant}`` of a training-curves result (each variant's ``runs[variant]["samples"]``)."""
    js = results / f"{stem}.json"
    runs = json.loads(js.read_text()).get("runs") if js.exists() else None
    if not isinstance(runs, dict):
        return {}
    return {run["samples"]: name for name, run in runs.items() if isinstance(run, dict) and run.get("samples")}


def figure_text(name: str, stem: str, grids: dict[str, str]) -> str:
    base = name.rsplit(".", 1)[0]
    if base in FIGURES:
        return FIGURES[base]
    if base == stem:
        return "the table's metrics against steps and wall time"
    if name in grids:
        return f"samples of {grids[name]}'s last checkpoint"
    return "figure"


def index(results: Path = RESULTS) -> str:
    """The index's markdown: a pure function of the files under ``results`` (and their content)."""
    lines = ["# Benchmark results", "",
             ("Generated by `python -m benchmarks.tools.results_index` (do not edit by hand; "
              "`tests/test_results_index.py` checks that it is up to date). One row per result: its table "
              "(`.md`), its data (`.json`), its figures, the command that made it as recorded (the data root "
              "shown as `<data root>`; results made before the benchmarks moved to `benchmarks/tools` and "
              "`benchmarks/studies` name the script's old path), the command that rebuilds its table from the "
              "JSON today (byte for byte: the tests check it) or, for a result whose script was retired, the "
              "commit that last had it, and what it shows."), "",
             "| result | files | command | what it shows |", "|---|---|---|---|"]
    for stem, entry in results_of(results).items():
        md = results / f"{stem}.md"
        files, grids = [], sample_grids(stem, results)
        for f in entry["files"]:
            link = f"[`{Path(f).name}`]({f})"
            if f.endswith(".png"):
                link += f" ({figure_text(Path(f).name, Path(stem).name, grids)})"
            files.append(link)
        cmds = commands_of(stem, results)
        cmd = "<br>".join(f"`{_portable(c)}`" for c in cmds) or "—"
        if rebuild_command(stem) and md.exists() and (results / f"{stem}.json").exists():
            cmd += f"<br>table rebuilt by `{rebuild_command(stem)}`"
        if stem in RETIRED:
            cmd += f"<br>{retired_text(stem)}"
        shows = SHOWS.get(stem) or (title_of(md) if md.exists() else "") or "—"
        lines.append(f"| {stem} | {'<br>'.join(files)} | {cmd} | {shows} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the index is out of date")
    args = p.parse_args(argv)
    text = index(args.results)
    path = args.results / INDEX
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run python -m benchmarks.tools.results_index", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
