"""DKEF at the paper's protocol (benchmarks/tools/dkef_paper_protocol.py): per-point tails, the table, the verdict
of every §4.2 claim by both rules, and ``--add``; and run_grid's Table 3 claims against every depth."""

from __future__ import annotations

from benchmarks.tools import dkef_paper_protocol as pp
from benchmarks.tools import run_grid


def test_paper_protocol_tail_summary_and_validation_curve(tmp_path):
    values = [float(v) for v in range(-49, 51)]  # 100 points, the largest 2 dropped by the trimmed mean
    out = pp.tail_summary(values)
    assert out == {"n": 100, "mean": 0.5, "median": 0.5, "trimmed_mean": sum(values[:-2]) / 98, "max": 50.0}
    log = tmp_path / "csv" / "version_0" / "metrics.csv"
    log.parent.mkdir(parents=True)
    log.write_text("epoch,step,train/loss,val/sm_loss\n0,8,-3.0,\n0,8,,-10.5\n1,17,,-12.25\n1,20,-4.0,\n")
    assert pp.validation_curve(tmp_path) == [(8, -10.5), (17, -12.25)]


def _run(method, seed, sm, ll, refit_sm, mb, s, group="redwine"):
    return {"group": group, "method": method, "seed": seed, "ok": True, "val_curve": [(9, sm + 1)],
            "metrics": {"test/sm_loss": sm, "test/log_likelihood": ll, "final_refit/test/sm_loss": refit_sm,
                        "final_refit/test/log_likelihood": ll, "profile/saved_bytes_mean": mb * 1e6,
                        "profile/time_per_step_s": s, "global_step": 2700}}


def test_paper_protocol_table_and_verdicts_from_known_runs():
    jobs = [_run("DEQ-SM", i, -30 - i, -12.9, -31 - i, 60, 0.3) for i in range(3)]
    jobs += [_run("SM 16-layer", i, -25 + i, -13.3, -25 + i, 120, 0.6) for i in range(3)]
    # the DEQ's -31 ± 1 against the 8-layer's -29 ± 1: beyond 2 s.e. = 1.63, within t₀.₉₇₅(4) s.e. = 2.27
    jobs += [_run("SM 8-layer", i, -28 - i, -13.0, -28 - i, 90, 0.5) for i in range(3)]
    jobs += [_run("SSM-VR", i, -20 - i, -13.8, -20 - i, 50, 0.2) for i in range(2)]
    md = pp.render({"meta": {"command": "c", "machine": "m", "grid_commands": ["g"]}, "jobs": jobs})
    assert "| redwine | DEQ-SM | 3 | 2700 ± 0 | -31.00 ± 1.00 | -12.90 ± 0.00 | -32.00 ± 1.00 |" in md
    assert "| 60.0 ± 0.0 | 0.300 ± 0.000 | -44.5 / -12.2 |" in md
    # -31 ± 1 vs -24 ± 1 over 3 seeds: difference 7, se sqrt(2/3), Welch df 4
    assert ('"DEQ-SM beats SM 16-layer on test SM loss" (as trained): agree at 2 s.e. (difference 7.00 > 2 s.e. = '
            "1.63); agree by Welch's t-test (p = 0.001, df = 4.0: needs > 2.78 s.e. = 2.27); -31.00 vs -24.00") in md
    assert ('"DEQ-SM beats SM 8-layer on test SM loss" (as trained): agree at 2 s.e. (difference 2.00 > 2 s.e. = '
            "1.63); undecided by Welch's t-test (p = 0.070, df = 4.0: needs > 2.78 s.e. = 2.27)") in md
    assert ('"DEQ-SM needs less saved bytes per step than SM 16-layer": agree (no spread on either side: any '
            "difference decides) at 2 s.e. and by Welch's t-test; 60 MB vs 120 MB (ratio 0.50)") in md
    assert "redwine, DEQ-SM vs SM 3-layer: undecided — SM 3-layer not run at this protocol" in md
    assert "redwine, DEQ-SM vs DSM: undecided — DSM not run at this protocol" in md
    assert '"DEQ-SM beats SSM-VR on test LL" (as trained)' in md and "than SSM-VR" not in md  # no cost claim
    assert "redwine, DEQ-SSM-VR vs SSM-VR: undecided — DEQ-SSM-VR not run at this protocol" in md
    assert "redwine DEQ-SM SM: -31.00 ± 1.00 vs paper -44.5 ± 4.1 — 13.5 seed sds away (far" in md
    assert "Each verdict names its rule." in md


def test_paper_protocol_add_keeps_saved_jobs_and_replaces_reruns():
    """``--add``: grids of a later session join the saved result (whose run directories are gone); a job of the
    same data set, method and seed replaces the saved one; every command that built the result is listed."""

    def job(group, method, seed, sm):
        return {"group": group, "method": method, "seed": seed, "ok": True, "metrics": {"test/sm_loss": sm}}

    saved = {"meta": {"command": "first", "machine": "m", "grid_commands": ["g1"], "note": "n"},
             "jobs": [job("redwine", "DEQ-SM", 0, -30.0), job("redwine", "DEQ-SM", 1, -31.0)]}
    new = [job("redwine", "DEQ-SM", 1, -33.0), job("whitewine", "DEQ-SM", 0, -40.0)]
    jobs, meta = pp.added_to_saved(saved, new, {"command": "second", "machine": "m2", "grid_commands": ["g2", "g1"]})
    assert [(j["group"], j["seed"], j["metrics"]["test/sm_loss"]) for j in jobs] == [
        ("redwine", 0, -30.0), ("redwine", 1, -33.0), ("whitewine", 0, -40.0)]
    assert meta["grid_commands"] == ["g1", "g2"] and meta["commands"] == ["first", "second"]
    assert meta["note"] == "n" and meta["machine"] == "m2"
    _, again = pp.added_to_saved({"meta": meta, "jobs": jobs}, [], dict(meta, command="third", grid_commands=[]))
    assert again["commands"] == ["first", "second", "third"]
    md = pp.render({"meta": again, "jobs": jobs})
    assert md.startswith("Commands, in the order they built this result") and "- `third`" in md


def test_table3_claims_compare_the_deq_with_every_depth_run_at_two_seeds_or_more():
    def job(method, seed, sm):
        return {"group": "gaussian100", "method": method, "seed": seed, "ok": True,
                "metrics": {"test/sm_loss": sm, "test/log_likelihood": -140.0 - seed,
                            "test/fisher_divergence": 5.0 + seed}}

    results = [job("DEQ-SM", s, -46.0 - s) for s in range(3)] + [job("SM 16-layer", s, -44.0 - s) for s in range(3)]
    results += [job("SM 3-layer", s, -45.0 - s) for s in range(2)] + [job("SM 8-layer", 0, -40.0)]
    lines = run_grid.gaussian_claim_lines(results)
    assert [line.split(" on ")[0] for line in lines[::3]] == [
        "- gaussian100: DEQ-SM (3 seeds) beats SM 16-layer (3)", "- gaussian100: DEQ-SM (3 seeds) beats SM 3-layer (2)"]
    assert lines[0].startswith("- gaussian100: DEQ-SM (3 seeds) beats SM 16-layer (3) on test SM loss: agree at 2 s.e. "
                               "(difference 2.00 > 2 s.e. = 1.63); undecided by Welch's t-test (p = 0.070")
    assert lines[0].endswith("— -47.00 vs -45.00; paper -46.03 vs -44.92")


def test_a_collected_table_says_how_its_grids_ran_not_how_the_collect_call_did():
    meta = {"command": "collect", "machine": "x86_64, 2 cores", "device": "cpu", "python": "3", "torch": "2",
            "parallel_jobs": 1, "threads_per_job": None, "collect": True, "grid_commands": ["g1", "g2"]}
    rows = [{"group": "gaussian100", "method": "DEQ-SM", "seed": 0, "ok": True, "metrics": {"test/sm_loss": -1.0}}]
    line = run_grid.to_markdown(rows, run_grid.DKEF_COLUMNS, meta).splitlines()[2]
    assert line.endswith("; 1 job(s) at once, default torch thread(s) each")
    meta["ran_with"] = "g1 and g2 at once, each --jobs 1 --threads 1"
    line = run_grid.to_markdown(rows, run_grid.DKEF_COLUMNS, meta).splitlines()[2]
    assert line == "Machine: x86_64, 2 cores; device cpu; python 3; torch 2; g1 and g2 at once, each --jobs 1 --threads 1"
