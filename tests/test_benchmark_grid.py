"""The paper-table grid runner (benchmarks/tools/run_grid.py): job lists, tables and target checks on known numbers."""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks.lib import jobs, results, step
from benchmarks.lib.generative_grids import GRIDS as GENERATIVE
from benchmarks.tools import run_grid, training_curves
from tests.conftest import compose_train


class Args:
    datasets = "redwine,gaussian200"
    root = "data"
    epochs = None
    variants = False


def job(group, method, seed=0, **metrics):
    return {"group": group, "method": method, "seed": seed, "ok": True, "metrics": metrics}


def test_dkef_grid_has_the_papers_rows_with_their_overrides():
    jobs = run_grid.dkef_grid(Args())
    red = {j["method"]: j["overrides"] for j in jobs if j["group"] == "redwine"}
    assert list(red) == ["DSM", "CP", "SSM", "SSM-VR", "DEQ-SSM-VR", "SM 3-layer", "SM 8-layer", "SM 16-layer", "DEQ-SM"]
    assert {"experiment=dkef_uci", "data=redwine", "loss=ssm_vr", "deq=true", "deq.injection=linear"} <= set(
        red["DEQ-SSM-VR"])
    assert "deq.injection=linear" in red["DEQ-SM"]
    assert {"loss=sm", "deq=false", "depth=16"} <= set(red["SM 16-layer"])
    gauss = {j["method"]: j["overrides"] for j in jobs if j["group"] == "gaussian200"}
    assert list(gauss) == ["SM 3-layer", "SM 8-layer", "SM 16-layer", "DEQ-SM"]
    assert {"experiment=dkef_gaussian", "data.dim=200"} <= set(gauss["DEQ-SM"])
    # every DEQ row pins the paper's block and the stop rule its committed numbers were made with; the explicit
    # rows set no DEQ key
    pins = {"deq.norm=frobenius", "deq.norm_lambda=2", "deq.stop_mode=abs", "deq.tol=1e-5"}
    for overrides in [*red.values(), *gauss.values()]:
        assert (pins <= set(overrides)) == ("deq=true" in overrides), overrides
    Args.variants = True
    red = {j["method"]: j["overrides"] for j in run_grid.dkef_grid(Args()) if j["group"] == "redwine"}
    assert {"model.deq_width=30", "deq.phantom_steps=1"} <= set(red["DEQ-SM (width 30 K=1)"])
    assert "deq.injection=softplus" in red["DEQ-SSM-VR (softplus injection)"]
    Args.variants = False
    Args.datasets = "bogus"
    with pytest.raises(SystemExit, match="unknown data set 'bogus'"):
        run_grid.dkef_grid(Args())
    Args.datasets = "redwine,gaussian200"


def test_targets_are_checked_with_the_right_ratios_and_verdicts():
    mb = 1e6
    results = [
        job("redwine", "SM 3-layer", **{"test/sm_loss": -20.0, "test/log_likelihood": -14.0,
                                        "profile/saved_bytes_mean": 40 * mb, "profile/time_per_step_s": 0.2}),
        job("redwine", "SM 16-layer", **{"test/sm_loss": -25.0, "test/log_likelihood": -13.5,
                                         "profile/saved_bytes_mean": 200 * mb, "profile/time_per_step_s": 1.0}),
        job("redwine", "DEQ-SM", seed=0, **{"test/sm_loss": -30.0, "test/log_likelihood": -13.0,
                                            "profile/saved_bytes_mean": 42 * mb, "profile/time_per_step_s": 0.25}),
        job("redwine", "DEQ-SM", seed=1, **{"test/sm_loss": -32.0, "test/log_likelihood": -13.4,
                                            "profile/saved_bytes_mean": 46 * mb, "profile/time_per_step_s": 0.35}),
        job("gaussian200", "DEQ-SM", **{"test/sm_loss": -80.0, "test/log_likelihood": -295.0,
                                        "test/true_log_likelihood": -283.0, "test/fisher_divergence": 20.0}),
    ]
    lines = "\n".join(run_grid.target_lines(results))
    assert "redwine: DEQ-SM beats 16-layer on SM loss and LL — met (SM -31.00 vs -25.00; LL -13.20 vs -13.50)" in lines
    assert "DEQ / 3-layer = 1.10 (target ≤ 1.1: met)" in lines
    assert "DEQ / 16-layer = 0.22 (target ≤ 0.25: met)" in lines
    assert "time per step DEQ / 16-layer = 0.30 (target ≤ 0.3: met)" in lines
    assert "gap 12.00 nats (target ≤ 10: MISSED); Fisher divergence 20.00 (target ≤ 25.42: met)" in lines
    meta = {"command": "x", "machine": "m", "device": "cpu", "python": "3", "parallel_jobs": 1, "threads_per_job": 1}
    md = run_grid.to_markdown(results, run_grid.DKEF_COLUMNS, meta)
    row = next(r for r in md.splitlines() if r.startswith("| DEQ-SM | 2 |"))
    assert "-31.00 ± 1.41" in row and "44.0 ± 2.8" in row and row.endswith("-44.5 / -12.2 / 1.1 |")


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_render_rewrites_markdown_and_figures_from_the_json_alone(tmp_path):
    shutil.copy(RESULTS / "nice.json", tmp_path / "nice.json")
    run_grid.main(["nice", "--render", "--out", str(tmp_path)])
    assert (tmp_path / "nice.md").read_text() == (RESULTS / "nice.md").read_text()
    assert (tmp_path / "nice_mnist.png").stat().st_size > 1000


class NiceArgs:
    root = "data"
    squash = "affine"


def test_nice_grid_names_the_injection_and_has_the_baselines():
    jobs = {j["method"]: j["overrides"] for j in run_grid.nice_grid(NiceArgs())}
    assert {"SSM", "DEQ-SSM", "MLE", "CP", "DSM σ=0.1", "DSM σ=1.74"} <= set(jobs)
    assert {"deq=true", "deq.injection=linear", "trainer.gradient_clip_val=null"} <= set(jobs["DEQ-SSM"])
    assert "trainer.gradient_clip_val=100" in jobs["SSM (clip 100)"]
    assert {"loss=dsm", "loss.sigma=1.74"} <= set(jobs["DSM σ=1.74"])
    # the DEQ rows pin the block and stop rule they were committed with (nice_mnist's default is spectral λ = 1.2)
    stop = {"deq.norm_lambda=2", "deq.stop_mode=abs", "deq.tol=1e-5"}
    for method, overrides in jobs.items():
        norm = "deq.norm=spectral" if "spectral" in method else "deq.norm=frobenius"
        assert (stop | {norm} <= set(overrides)) == ("deq=true" in overrides), method
    assert "deq.norm=frobenius" not in jobs["DEQ-SSM (spectral norm)"]
    NiceArgs.squash = "clamp"
    clamp = {j["method"]: j["overrides"] for j in run_grid.nice_grid(NiceArgs())}
    NiceArgs.squash = "affine"
    assert "data.squash=clamp" in clamp["DEQ-SSM [squash=clamp]"]
    assert run_grid.run_dir_of(Path("r"), {"group": "mnist", "method": "DSM σ=0.1"}, 0).name.isascii()


def test_old_rows_sit_beside_new_ones_and_nice_targets(tmp_path):
    import json

    mb = 1e6
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"jobs": [
        {**job("mnist", "DEQ-SSM", **{"test/log_likelihood": -2686.0}), "command": "python -m src.train data.root=/abs"},
        {**job("mnist", "Other", **{"test/log_likelihood": -1.0}), "command": "x"}]}))
    old_rows = run_grid.load_old([old], "softplus injection", {("mnist", "SSM"), ("mnist", "DEQ-SSM")})
    assert [r["method"] for r in old_rows] == ["DEQ-SSM — old (softplus injection)"]
    kept = run_grid.load_old([old], "x", {("mnist", "DEQ-SSM")}, keep_rest=True)
    assert [r["method"] for r in kept] == ["DEQ-SSM — old (x)", "Other"] and kept[1]["not_rerun"]
    assert old_rows[0]["command"] == "python -m src.train data.root=data"
    new = [job("mnist", "SSM", seed=s, **{"test/log_likelihood": -2160.0 + s, "test/sm_loss": -2.0,
                                          "profile/saved_bytes_mean": 158 * mb}) for s in (0, 1)]
    new += [job("mnist", "DEQ-SSM", seed=s, **{"test/log_likelihood": -2040.0 - s, "test/sm_loss": -3.0,
                                               "clamp/test/sm_loss": 5.0, "profile/saved_bytes_mean": 99 * mb})
            for s in (0, 1)]
    rows = new + old_rows
    assert run_grid.ordered_methods(rows) == ["SSM", "DEQ-SSM", "DEQ-SSM — old (softplus injection)"]
    lines = "\n".join(run_grid.nice_target_lines(rows))
    assert "DEQ-SSM test LL -2040.5 ± 0.7 vs SSM -2159.5 ± 0.7 (2 vs 2 seeds) — met" in lines
    assert "test SM loss (affine test data) -3.0 ± 0.0 vs SSM -2.0 ± 0.0 (2 vs 2 seeds) — met" in lines
    assert "clamp test data" not in lines  # SSM has no clamp evaluation: nothing to compare
    assert "saved bytes DEQ-SSM / SSM = 0.63 (target ≤ 0.8: met)" in lines
    meta = {"command": "x", "machine": "m", "device": "cpu", "python": "3", "parallel_jobs": 1, "threads_per_job": 1}
    md = run_grid.to_markdown(rows, run_grid.NICE_COLUMNS, meta)
    old_row = next(r for r in md.splitlines() if r.startswith("| DEQ-SSM — old"))
    assert old_row.endswith("-2548 / -1766 / 5.5 |")  # the paper's figures of the base method


def test_training_curves_records_where_training_and_evaluation_ran():
    facts = training_curves.machine_facts
    assert "; device cpu, 1 torch thread(s)" in facts(1, [], [])
    assert "; device cuda" in facts(1, ["data.batch_size=32", "trainer.accelerator=gpu"], [])
    assert "; training on cpu, evaluation on cuda" in facts(2, [], ["trainer.accelerator=gpu"])
    assert "; device cpu" in facts(1, ["trainer=gpu", "trainer.accelerator=cpu"], ["trainer.accelerator=cpu"])


def test_training_curves_shows_each_fid_with_its_bootstrap_sd_where_the_test_measured_one():
    """A checkpoint's FID cell carries its bootstrap sd (``test/fid_bootstrap_sd``) and nothing where none was
    measured; other metrics never take one."""
    cell = training_curves._cell
    assert cell({"test/fid": 236.8125, "test/fid_bootstrap_sd": 12.5077}, "test/fid", "{:.1f}") == "236.8 ± 12.5"
    assert cell({"test/fid": 236.8125}, "test/fid", "{:.1f}") == "236.8"
    assert cell({"test/fid_bootstrap_sd": 12.5}, "test/fid", "{:.1f}") == "—"
    assert cell({"test/dsm_loss": 23.5497, "test/fid_bootstrap_sd": 12.5}, "test/dsm_loss", "{:.3f}") == "23.550"
    text = (RESULTS / "ncsn_long_campaign_seed0.md").read_text()
    assert "| 6000 | 6000 | 2677 | 236.8 ± 12.5 |" in text and "FID ± its bootstrap sd" in text


def test_training_curves_merge_joins_parts_of_one_protocol_and_refuses_others(tmp_path):
    """Variants run side by side as one process each come back as one result: every run and point kept, each
    part's command listed, sample grids renamed; parts of different protocols or a variant twice are refused."""
    curves = training_curves
    whole = json.loads((RESULTS / "ncsn_mnist_curves.json").read_text())
    names = list(whole["runs"])
    paths = []
    for i, group in enumerate((names[:1], names[1:])):
        part = {"meta": dict(whole["meta"], command=f"python part{i}"), "runs": {n: whole["runs"][n] for n in group}}
        for n in group:
            if part["runs"][n].get("samples"):
                shutil.copy(RESULTS / part["runs"][n]["samples"], tmp_path / part["runs"][n]["samples"])
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(part))
    merged = curves.merge(paths, tmp_path / "out", "joined")
    assert list(merged["runs"]) == names
    assert merged["meta"]["commands"] == ["python part0", "python part1"]
    for n in names:
        assert merged["runs"][n]["points"] == whole["runs"][n]["points"]
        if whole["runs"][n].get("samples"):
            assert (tmp_path / "out" / merged["runs"][n]["samples"]).read_bytes() == (
                RESULTS / whole["runs"][n]["samples"]).read_bytes()
    text = curves.render(merged)
    assert "python part0\npython part1" in text and "Command: `" not in text
    other = json.loads(paths[1].read_text())
    other["meta"]["eval_overrides"] = ["model.metrics.fid.n_samples=1000"]
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="eval_overrides"):
        curves.merge(paths, tmp_path / "out", "joined")
    with pytest.raises(SystemExit, match="more than one part"):
        curves.merge([paths[0], paths[0]], tmp_path / "out", "joined")


def test_lib_runs_a_modules_own_training_step_outside_a_trainer():
    """``benchmarks.lib.step.training_step`` is the module's training step with its configured optimiser: the same update
    as the module's objective, backward and that optimiser's step by hand; a manual-optimisation module (the
    VAE) updates both its optimisers inside its own step."""
    import torch

    from src.lit.dkef import DKEFLitModule
    from src.lit.vae import VAELitModule
    from src.models.dkef import DKEF

    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    modules = []
    for _ in range(2):
        torch.manual_seed(0)
        net = functools.partial(DKEF, n_inducing=4, feature_dim=3, hidden=4)
        modules.append(DKEFLitModule(2, loss={"name": "sm"}, net=net, depth=1,
                                     optimizer=functools.partial(torch.optim.Adam, lr=0.01)))
    optimizers = step.trainer_free(modules[0])
    loss = step.training_step(modules[0], x, optimizers)
    opt = torch.optim.Adam(modules[1].parameters(), lr=0.01)
    reference = modules[1].training_objective(x).loss
    reference.backward()
    opt.step()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    for a, b in zip(modules[0].parameters(), modules[1].parameters()):
        assert torch.allclose(a, b, atol=1e-7)

    torch.manual_seed(0)
    vae = VAELitModule((1, 4, 4), loss={"name": "ssm"}, depth=0,
                       net={"_target_": "src.models.vae.build_vae_networks", "latent_dim": 2, "hidden": 8, "channels": 4},
                       optimizer={"score": {"_target_": "torch.optim.Adam", "lr": 0.01},
                                  "vae": {"_target_": "torch.optim.Adam", "lr": 0.01}})
    before = {n: p.detach().clone() for n, p in vae.named_parameters()}
    optimizers = step.trainer_free(vae)
    assert len(optimizers) == 2 and step.training_step(vae, torch.rand(4, 1, 4, 4).round(), optimizers) is None
    moved = {n.split(".")[0] for n, p in vae.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"encoder", "decoder", "score_net"}


def test_the_job_runner_reuses_a_finished_run_resumes_a_killed_one_reruns_on_request_and_stops_at_its_time_limit(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"global_step": 3}')
    assert jobs.train_job(["bogus=1"], run) == {"ok": True, "reused": True, "wall_s": None,
                                                 "metrics": {"global_step": 3}}
    calls = []
    monkeypatch.setattr(jobs, "run_process", lambda cmd, env=None, capture=True, timeout_s=None: (
        calls.append(cmd) or {"code": 1, "wall_s": 0.1, "stdout": "", "stopped": False,
                              "tail": "Could not find 'model/no_such_model'"}))
    failed = jobs.train_job(["model=no_such_model"], run, rerun=True)
    assert calls == [[sys.executable, "-m", "src.train", "model=no_such_model", f"hydra.run.dir={run}"]]
    assert not failed["ok"] and not failed["reused"] and "no_such_model" in failed["error"]
    assert not (run / "metrics.json").exists()  # --rerun moved the old run aside before running
    (kept,) = tmp_path.glob("run.replaced-*")
    assert (kept / "metrics.json").read_text() == '{"global_step": 3}'  # nothing a user had is deleted
    # a killed run (a last.ckpt, no metrics.json) continues from its newest state instead of being refused
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    calls.clear()
    jobs.train_job(["model=dkef"], run)
    assert calls == [[sys.executable, "-m", "src.train", "model=dkef", f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
                      f"hydra.run.dir={run}"]]
    monkeypatch.undo()
    code, tail = jobs.run_module("json.tool", ["--no-such-flag"])  # a real process, its stderr's tail
    assert code == 2 and "--no-such-flag" in tail
    slow = jobs.run_process([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1)
    assert slow["stopped"] and slow["code"] is None and slow["wall_s"] < 30
    assert results.script_command("benchmarks.tools.x", ["--ckpt", "a b=c"]) == (
        "python -m benchmarks.tools.x --ckpt 'a b=c'")
    assert results.made_by("python benchmarks/x.py --a", "old", "new") == "old"
    assert results.made_by(None, "old", "new") == "old"
    assert results.made_by("python -m benchmarks.tools.x", "old", "new") == "new"


@pytest.mark.parametrize("overrides", [
    next(j["overrides"] for j in run_grid.dkef_grid(Args()) if j["method"] == "DEQ-SM"),
    next(j["overrides"] for j in run_grid.nice_grid(NiceArgs()) if j["method"] == "DEQ-SSM"),
    ["experiment=vae_mnist", *GENERATIVE["vae"]["variants"]["DEQ-SSM VAE"]],
    ["experiment=ncsn_mnist", *GENERATIVE["ncsn"]["variants"]["DEQ-SSM-VR NCSN"]],
], ids=["dkef", "nice", "vae", "ncsn"])
def test_paper_table_grids_compose_the_papers_block_and_stop_rule(overrides):
    """The experiments' defaults moved to blocks of record and a relative stop rule; the grids that reproduce the
    paper's tables still compose the block and stop rule their committed numbers were made with."""
    deq = compose_train(overrides).deq
    assert (deq.enabled, deq.norm, float(deq.norm_lambda), deq.stop_mode, float(deq.tol)) == (
        True, "frobenius", 2.0, "abs", 1e-5)


def test_training_curves_render_stores_a_note_in_the_result_and_shows_it(tmp_path):
    """``--render --note``: a fact written after the runs (which points were copied from another result) goes into
    the JSON's meta.note and the table, below the machine line."""
    name = "ncsn_long_extension_seed0"
    shutil.copy(RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    note = tmp_path / "note.md"
    note.write_text("Points up to 6000 steps are copies.\n")
    training_curves.main(["ncsn_long", "--render", "--out", str(tmp_path), "--name", name, "--note", str(note)])
    assert json.loads((tmp_path / f"{name}.json").read_text())["meta"]["note"] == note.read_text()
    md = (tmp_path / f"{name}.md").read_text()
    assert "per process\n\nPoints up to 6000 steps are copies.\n\nEach checkpoint tested" in md


def test_collect_add_joins_new_runs_to_a_saved_result_whose_run_directories_are_gone(tmp_path):
    """``run_grid --collect --add``: the saved result's jobs stay (their run directories live on another machine),
    a collected run of the same data set, method and seed replaces its saved row, and every command is listed."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    out.mkdir()

    def job(method, seed, sm):
        return {"group": "gaussian100", "method": method, "seed": seed, "ok": True, "command": "c", "run_dir": "r",
                "metrics": {"test/sm_loss": sm, "test/log_likelihood": -140.0, "global_step": 10}}

    saved = {"meta": {"command": "first collect", "machine": "m", "device": "cpu", "python": "3", "parallel_jobs": 1,
                      "threads_per_job": 1, "collect": True, "grid_commands": ["grid A"]},
             "jobs": [job("DEQ-SM", 0, -40.0), job("SM 3-layer", 0, -10.0)]}
    (out / "t3.json").write_text(json.dumps(saved))
    for method, seed, sm in (("SM 3-layer", 0, -20.0), ("SM 8-layer", 1, -30.0)):
        run_dir = run_grid.run_dir_of(runs, {"group": "gaussian100", "method": method}, seed)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.json").write_text(json.dumps({"test/sm_loss": sm, "test/log_likelihood": -141.0}))
    argv = ["dkef", "--collect", "--add", "--datasets", "gaussian100", "--methods", "SM 3-layer,SM 8-layer",
            "--seeds", "0,1", "--runs", str(runs), "--out", str(out), "--name", "t3", "--grid-command", "grid B"]
    run_grid.main(argv)
    res = json.loads((out / "t3.json").read_text())
    rows = {(j["method"], j["seed"]): j["metrics"]["test/sm_loss"] for j in res["jobs"]}
    assert rows == {("DEQ-SM", 0): -40.0, ("SM 3-layer", 0): -20.0, ("SM 8-layer", 1): -30.0}
    assert res["meta"]["grid_commands"] == ["grid A", "grid B"]
    assert res["meta"]["commands"][0] == "first collect" and "--add" in res["meta"]["commands"][1]
    md = (out / "t3.md").read_text()
    assert md.startswith("Commands, in the order they built this result") and "- `first collect`" in md
    with pytest.raises(SystemExit):  # nothing saved to add to
        run_grid.main([*argv[:-4], "--name", "none"])
    with pytest.raises(SystemExit):  # --add only joins collected runs
        run_grid.main(["dkef", "--add", "--datasets", "gaussian100", "--out", str(out), "--name", "t3"])
