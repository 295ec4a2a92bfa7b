"""The shared reporting library (src/reports/tables.py) and the sweep report built on it (src/report.py)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from benchmarks.lib.results import seed_verdict, welch_t_test
from src.reports import sweeps as report
from src.reports.tables import (
    figure,
    format_summary,
    group_rows,
    load_run,
    markdown_table,
    parse_overrides,
    summarise,
    summarise_metrics,
)


def test_seed_verdict_follows_the_standard_error_of_the_difference():
    # means -30 vs -20, sds 1 (3 seeds each): s.e. of the difference 0.816, difference 10 -> agree by both rules
    verdict, a, b = seed_verdict([-31, -30, -29], [-21, -20, -19], lower_is_better=True)
    assert verdict.startswith("agree at 2 s.e.") and (a, b) == (-30, -20) and "2 s.e. = 1.63" in verdict
    assert "; agree by Welch's t-test (p < 0.001, df = 4.0: needs > 2.78 s.e. = 2.27)" in verdict
    assert seed_verdict([-21, -20, -19], [-31, -30, -29], lower_is_better=True)[0].startswith("disagree at 2 s.e.")
    assert seed_verdict([-13.0, -12.9], [-13.2, -13.1], lower_is_better=False)[0].startswith("agree at 2 s.e.")
    # difference 1 against 2 s.e. = 2 * sqrt(2 * 9 / 3) = 4.9 -> undecided
    assert seed_verdict([-33, -30, -27], [-32, -29, -26], lower_is_better=True)[0].startswith(
        "undecided at 2 s.e. (difference 1.00 ≤ 2 s.e. = 4.90); undecided by Welch's t-test")
    assert seed_verdict([-30], [-20, -21], lower_is_better=True)[0].startswith("undecided (fewer than 2 seeds")
    assert seed_verdict([5, 5], [5, 5], lower_is_better=True)[0].startswith("undecided (equal means) at 2 s.e. and by Welch")
    assert seed_verdict([4, 4], [5, 5], lower_is_better=True)[0].startswith(  # no spread: any difference decides
        "agree (no spread on either side: any difference decides) at 2 s.e. and by Welch's t-test")


def test_the_two_rules_part_where_the_t_quantile_exceeds_two():
    """At 3 seeds a side the t threshold is 2.78-4.30 s.e., not 2: a 3.1-s.e. gap agrees at 2 s.e. only."""
    # a = 1, 2, 3 (mean 2, sd 1), b = 4, 6, 8 (mean 6, sd 2): se² = 1/3 + 4/3 = 5/3, difference 4 = 3.10 se
    verdict = seed_verdict([1, 2, 3], [4, 6, 8], lower_is_better=True)[0]
    assert verdict == ("agree at 2 s.e. (difference 4.00 > 2 s.e. = 2.58); undecided by Welch's t-test "
                       "(p = 0.055, df = 2.9: needs > 3.22 s.e. = 4.16)")
    assert seed_verdict([1, 2, 3], [4, 6, 8], lower_is_better=True, detail=False)[0] == (
        "agree at 2 s.e., undecided by Welch's t-test (p = 0.055)")


def _t_sf(t: float, df: float) -> float:
    """P(T > t) of Student's t by quadrature of its density (mpmath, 30 digits): an independent reference."""
    import mpmath

    mpmath.mp.dps = 30
    c = mpmath.gamma((df + 1) / 2) / (mpmath.sqrt(df * mpmath.pi) * mpmath.gamma(df / 2))
    return float(mpmath.quad(lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2), [t, mpmath.inf]))


def test_welch_statistic_df_and_p_against_hand_values():
    # the example above by hand: t = -4 / sqrt(5/3), df = (5/3)² / ((1/3)²/2 + (4/3)²/2) = 50/17
    t, df, p, q = welch_t_test((2.0, 1.0, 3), (6.0, 2.0, 3))
    assert math.isclose(t, -4 / math.sqrt(5 / 3), rel_tol=1e-12) and math.isclose(df, 50 / 17, rel_tol=1e-12)
    assert math.isclose(p, 2 * _t_sf(4 / math.sqrt(5 / 3), 50 / 17), rel_tol=1e-9)
    assert math.isclose(_t_sf(q, 50 / 17), 0.025, rel_tol=1e-9)
    # one side without spread: df = n - 1 = 2, where Student's t has a closed form, P(|T| > t) = 1 - t / sqrt(2 + t²)
    t, df, p, q = welch_t_test((2.0, 1.0, 3), (5.0, 0.0, 3))
    assert math.isclose(t, -3 * math.sqrt(3), rel_tol=1e-12) and math.isclose(df, 2.0, rel_tol=1e-12)
    assert math.isclose(p, 1 - math.sqrt(27) / math.sqrt(29), rel_tol=1e-9)  # 0.03510
    assert round(q, 3) == 4.303  # the printed table's t_0.975 at 2 df
    # equal sizes and sds: df = 2(n - 1); the printed table's quantiles at 4, 10 and 58 df
    for n, table in ((3, 2.776), (6, 2.228), (30, 2.002)):
        t, df, p, q = welch_t_test((0.0, 1.0, n), (1.0, 1.0, n))
        assert math.isclose(df, 2 * (n - 1), rel_tol=1e-12) and round(q, 3) == table
        assert math.isclose(p, 2 * _t_sf(abs(t), df), rel_tol=1e-9)
    for bad in (((0.0, 1.0, 1), (1.0, 1.0, 3)), ((0.0, 0.0, 3), (1.0, 0.0, 3))):
        with pytest.raises(ValueError, match="Welch's t-test needs"):
            welch_t_test(*bad)


def test_summaries_and_their_cells():
    assert summarise([1.0, 3.0, None, float("nan")]) == (2.0, 2 ** 0.5, 2)
    assert summarise([5.0]) == (5.0, 0.0, 1)
    assert summarise([None])[2] == 0
    assert format_summary("test/sm_loss", 2.0, 2 ** 0.5, 2, 2) == "2.00 ± 1.41"
    assert format_summary("test/sm_loss", -3.0, 0.0, 1, 1) == "-3.0"  # one value: no ± 0
    assert format_summary("profile/saved_bytes_mean", 44e6, 2.83e6, 2, 1) == "44.0 ± 2.8"  # bytes shown in MB
    assert format_summary("n_params", float("nan"), float("nan"), 0, 0) == "—"
    got = summarise_metrics([{"a": 1.0}, {"a": 2.0, "b": 7.0}], ["a", "b", "c"])
    assert got["a"] == {"mean": 1.5, "std": 0.5 ** 0.5, "n": 2} and got["b"]["n"] == 1 and got["c"]["n"] == 0


def test_grouping_keeps_first_seen_order_and_tables_render():
    rows = [{"g": "b", "v": 1}, {"g": "a", "v": 2}, {"g": "b", "v": 3}]
    groups = group_rows(rows, lambda r: r["g"])
    assert list(groups) == ["b", "a"] and [r["v"] for r in groups["b"]] == [1, 3]
    assert markdown_table(["x", "y"], [["1", "2"]]) == ["| x | y |", "|---|---|", "| 1 | 2 |"]


def test_load_run_reads_metrics_and_overrides(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "metrics.json").write_text(json.dumps({"test/sm_loss": -1.5}))
    (tmp_path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["+loss=sm", "seed=1"]))
    run = load_run(tmp_path)
    assert run["metrics"] == {"test/sm_loss": -1.5} and run["overrides"] == ["+loss=sm", "seed=1"]
    assert parse_overrides(run["overrides"]) == {"loss": "sm", "seed": "1"}
    png = tmp_path / "f.png"
    with figure(png, 1, 2) as (_, axes):
        axes[0][1].plot([0, 1], [1, 0])
    assert png.stat().st_size > 1000


def _job(depth, seed, loss, saved):
    metrics = {"test/sm_loss": loss, "profile/saved_bytes_mean": saved, "n_params": 10}
    return {"dir": f"d{depth}s{seed}", "metrics": metrics,
            "overrides": {"depth": str(depth), "seed": str(seed), "loss": "sm"}}


def test_sweep_report_from_loaded_jobs_is_a_pure_function():
    jobs = [_job(3, 0, -10.0, 2e6), _job(3, 1, -12.0, 4e6), _job(16, 0, -20.0, 8e6)]
    rep = report.summarise_jobs(jobs)
    assert rep["keys"] == ["depth"]  # seed averaged, loss never varies
    assert [r["n_seeds"] for r in rep["rows"]] == [1, 2]  # rows sorted by the values' text
    md = report.to_markdown(json.loads(json.dumps(rep)))  # the same from report.json
    assert md.splitlines() == [
        "| depth | seeds | test SM loss | params | saved MB/step |",
        "|---|---|---|---|---|",
        "| 16 | 1 | -20.00 | 10 | 8.00 |",
        "| 3 | 2 | -11.00 ± 1.41 | 10 ± 0 | 3.00 ± 1.41 |",
    ]


def test_sweep_table_shows_each_deq_rows_recurrence_share_beside_its_iterations():
    def job(deq, seed, iters, share):
        metrics = {"test/sm_loss": -1.0, "profile/deq_iterations_mean": iters, "test/deq_recurrence_share": share}
        return {"dir": f"{deq}{seed}", "metrics": {k: v for k, v in metrics.items() if v is not None},
                "overrides": {"deq": deq, "seed": str(seed)}}

    jobs = [job("true", 0, 8.0, 0.2513), job("true", 1, 10.0, 0.2587), job("false", 0, None, None)]
    # a model with three DEQ blocks (DKEF's feature networks) logs the share per block: the row shows the mean
    three = job("three", 0, 4.0, None)
    three["metrics"].update({f"test/deq_recurrence_share/net.features.{i}.block": v for i, v in
                             enumerate((0.287, 0.309, 0.318))})
    three["metrics"]["test/deq_recurrence_share_max/net.features.0.block"] = 0.9  # not a share of the mean
    md = report.to_markdown(report.summarise_jobs([*jobs, three]))
    assert md.splitlines() == [
        "| deq | seeds | test SM loss | DEQ iters | DEQ recurrence share |",
        "|---|---|---|---|---|",
        "| false | 1 | -1.00 | — | — |",
        "| three | 1 | -1.00 | 4.00 | 0.305 |",
        "| true | 2 | -1.00 ± 0.00 | 9.00 ± 1.41 | 0.255 ± 0.005 |",
    ]


def test_labelled_checkpoint_splits_at_the_last_equals_sign():
    import argparse

    import pytest

    from benchmarks.lib.results import labelled_checkpoint

    assert labelled_checkpoint("trained with K=2=runs/a/step_0000600.ckpt") == ("trained with K=2",
                                                                               "runs/a/step_0000600.ckpt")
    assert labelled_checkpoint("DEQ=last.ckpt") == ("DEQ", "last.ckpt")
    with pytest.raises(argparse.ArgumentTypeError, match="LABEL=PATH"):
        labelled_checkpoint("last.ckpt")


def test_result_files_are_written_atomically_merged_and_rerendered(tmp_path):
    from benchmarks.lib.results import load_results, rerender, write_results

    def render(res):
        return "\n".join(f"| {k} | {v['x']:.1f} |" for k, v in res.items()) + "\n"

    assert load_results(tmp_path, "r") == {}
    write_results(tmp_path, "r", {"b": {"x": 2.0}, "a": {"x": 1.25}}, render, indent=2, sort_keys=True)
    assert (tmp_path / "r.json").read_text() == '{\n  "a": {\n    "x": 1.25\n  },\n  "b": {\n    "x": 2.0\n  }\n}'
    assert not (tmp_path / "r.json.tmp").exists()
    merged = {**load_results(tmp_path, "r"), "c": {"x": float("nan")}}
    write_results(tmp_path, "r", merged, render)  # NaN written as JSON's NaN, read back as nan
    assert (tmp_path / "r.md").read_text() == "| a | 1.2 |\n| b | 2.0 |\n| c | nan |\n"
    (tmp_path / "r.md").write_text("edited by hand")
    assert rerender(tmp_path, "r", render)["b"] == {"x": 2.0}
    assert (tmp_path / "r.md").read_text() == "| a | 1.2 |\n| b | 2.0 |\n| c | nan |\n"
