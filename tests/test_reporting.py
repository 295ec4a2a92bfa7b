"""The shared reporting library (src/reports/tables.py) and the sweep report built on it (src/report.py)."""

from __future__ import annotations

import json

import yaml

from benchmarks.lib.results import seed_verdict
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
    # means -30 vs -20, sds 1 (3 seeds each): s.e. of the difference 0.816, difference 10 -> agree
    verdict, a, b = seed_verdict([-31, -30, -29], [-21, -20, -19], lower_is_better=True)
    assert verdict.startswith("agree") and (a, b) == (-30, -20) and "2 s.e. = 1.63" in verdict
    assert seed_verdict([-21, -20, -19], [-31, -30, -29], lower_is_better=True)[0].startswith("disagree")
    assert seed_verdict([-13.0, -12.9], [-13.2, -13.1], lower_is_better=False)[0].startswith("agree")
    # difference 1 against 2 s.e. = 2 * sqrt(2 * 9 / 3) = 4.9 -> undecided
    assert seed_verdict([-33, -30, -27], [-32, -29, -26], lower_is_better=True)[0].startswith("undecided (difference")
    assert seed_verdict([-30], [-20, -21], lower_is_better=True)[0] == "undecided (fewer than 2 seeds)"
    assert seed_verdict([5, 5], [5, 5], lower_is_better=True)[0] == "undecided (equal means)"
    assert seed_verdict([4, 4], [5, 5], lower_is_better=True)[0].startswith("agree")  # no spread: any difference


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
