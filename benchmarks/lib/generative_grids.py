"""The generative training-curve grids (``benchmarks.tools.training_curves``, ``seeds_campaign``,
``generative_seeds``): per grid its experiment, its variants' overrides and the metrics each checkpoint is
tested with.

Each grid reproduces a paper table (Table 1, Table 5): its DEQ variants pin the block and stop rule their
committed curves were made with (``paper.PAPER_DEQ`` / ``PAPER_STOP``), since the experiments' defaults moved to
each family's block of record and the relative stop rule.
"""

from benchmarks.lib.paper import PAPER_DEQ, PAPER_NCSN_BLOCK, PAPER_STOP

# name -> (overrides, Lightning optimiser steps per model iteration)
GRIDS = {
    "vae": {
        "experiment": "experiment=vae_mnist",
        "steps_per_iteration": 2,  # one score-estimator update + one encoder/decoder update
        "variants": {
            "SSM VAE": ["deq=false", "depth=0"],
            "Aug(8)-SSM VAE": ["deq=false", "depth=8"],
            "Aug(16)-SSM VAE": ["deq=false", "depth=16"],
            "DEQ-SSM VAE": ["deq=true", *PAPER_DEQ],  # experiment=vae_mnist: spectral λ = 2 now
            # the campaign's arms (issue 48): the block of record (the experiment's default) and its one-pass
            # control (the same network applied once from z = 0: what the recurrence adds)
            "DEQ-SSM VAE (record)": ["deq=true"],
            "DEQ-SSM VAE (one-pass)": ["deq=true", "deq.one_pass=true"],
        },
        # what each checkpoint is tested with (on top of the run's config)
        "metrics": [("test/fid", "FID", "{:.1f}"), ("test/log_likelihood", "AIS log p(x)", "{:.2f}"),
                    ("test/recon_error", "recon −log p(x\\|z)", "{:.2f}"), ("test/score_ssm_loss", "SSM loss s(z\\|x)",
                                                                          "{:.3f}")],
    },
    "ncsn": {
        "experiment": "experiment=ncsn_mnist",
        "steps_per_iteration": 1,
        "variants": {
            "SSM-VR NCSN (RefineNet)": ["model.arch=refinenet"],
            "TwoRes-SSM-VR NCSN": ["deq=false", "depth=1"],
            # the quality reference line: the same network trained by DSM (what the NCSN references train)
            "TwoRes-DSM NCSN": ["deq=false", "depth=1", "loss=dsm"],
            # the campaign's arms (issue 48): the block of record (the experiment's default) and its one-pass control
            "DEQ-SSM-VR NCSN (record)": ["deq=true"],
            "DEQ-SSM-VR NCSN (one-pass)": ["deq=true", "deq.one_pass=true"],
            # ncsn_mnist defaults to the normalised block now: the paper's DEQ-ResBlock pinned
            "DEQ-SSM-VR NCSN": ["deq=true", *PAPER_NCSN_BLOCK, *PAPER_STOP],
            # each conv of the DEQ map normalised by its operator norm: contracts at ≈ 0.08 at init, not 3e-4;
            # relative stopping tolerance 1e-5 (an absolute one meets float32's floor on large states: step_cost ncsn;
            # the default is relative 1e-4 now);
            # the exact implicit backward: with the phantom one (K = 2) this map's contraction rate rises in
            # training until the truncated SSM-VR loss parts from the real one (ncsn_phantom_bias.md)
            "DEQ-SSM-VR NCSN (spectral norm)": ["deq=true", "deq.block=null", "deq.norm=spectral",
                                                "deq.stop_mode=rel", "deq.tol=1e-5", "deq.backward=implicit"],
        },
        "metrics": [("test/fid", "FID", "{:.1f}"), ("test/dsm_loss", "test DSM loss", "{:.3f}"),
                    ("test/ssm_vr_loss", "test SSM-VR loss", "{:.3f}")],
    },
}

# The generative decision's NCSN protocol (issue 48; conf/experiment/ncsn_mnist_long.yaml: NCSNv2's noise rules,
# EMA 0.999, batch 32, FID of 1000 samples): the arms of the decision and the DSM reference line.
GRIDS["ncsn_long"] = {**GRIDS["ncsn"], "experiment": "experiment=ncsn_mnist_long",
                      "variants": {v: GRIDS["ncsn"]["variants"][v] for v in (
                          "DEQ-SSM-VR NCSN (record)", "DEQ-SSM-VR NCSN (one-pass)", "TwoRes-SSM-VR NCSN",
                          "SSM-VR NCSN (RefineNet)", "TwoRes-DSM NCSN")}}

# The pre-registered image-DEQ search (issue 59; benchmarks/results/notes/ncsn_deq_search_plan.md): each design's
# overrides on experiment=ncsn_mnist_long, trained 1500 steps at seed 0 and tested by the FID of 1000 samples.
# Every design keeps the experiment's exact implicit backward unless it says otherwise; deq.block=null because the
# experiment's normalized_residual block is single-resolution.
_MDEQ = ["model.arch=mdeq", "deq=true", "deq.block=null", "deq.norm=spectral"]
_GN_K1_JR = ["model.cell=mdeq_gn", "deq=true", "deq.block=null", "deq.solver=anderson", "deq.max_iter=12",
             "deq.backward=phantom", "deq.phantom_steps=1", "deq.backward_tol=null", "deq.jacobian_penalty=1"]
_FPC = ["deq.correction_states=2", "deq.correction_gamma=0.8"]
GRIDS["ncsn_search"] = {**GRIDS["ncsn_long"], "variants": {
    "S1 mdeq_res": [*_MDEQ, "deq.norm_lambda=2"],
    "S2 mdeq_res_l15": [*_MDEQ, "deq.norm_lambda=1.5"],
    "S3 mdeq_res_l15_jr": [*_MDEQ, "deq.norm_lambda=1.5", "deq.jacobian_penalty=1"],
    "S4 mdeq_res3_l15": [*_MDEQ, "deq.norm_lambda=1.5", "model.scales=3"],
    "S5 mdeq_gn_k1_jr": ["model.arch=mdeq", *_GN_K1_JR],
    "S6 deq_gn_k1_jr": _GN_K1_JR,
    # fixed-point correction (Bai et al. 2022; TorchDEQ's n_states = 2, gamma = 0.8): the plan's amendment of
    # 2026-12-02 gives their 20-step costs beside TwoRes
    "C1 mdeq_res_fpc": [*_MDEQ, "deq.norm_lambda=1.5", *_FPC],
    "C2 mdeq_gn_fpc_jr": ["model.arch=mdeq", *_GN_K1_JR, *_FPC],
}}
# each design's own one-pass control (its overrides + deq.one_pass=true): the plan's rule 4 trains the winner's
# beside it in the three-seed decision (benchmarks/results/ncsn_deq_decision.*)
GRIDS["ncsn_search"]["variants"].update({f"{name} (one-pass)": [*overrides, "deq.one_pass=true"]
                                         for name, overrides in list(GRIDS["ncsn_search"]["variants"].items())
                                         if name.startswith("S")})
