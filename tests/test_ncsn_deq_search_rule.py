"""The pre-registered search's rule (benchmarks/studies/ncsn_deq_search.py) on hand-made rows: the gates and the
tie rule pick what the plan says they pick."""

from benchmarks.studies.ncsn_deq_search import gates, pick

REFINENET = {"time_ratio": 1.70, "bytes_ratio": 1.54}


def row(fid, sd, time_ratio, bytes_ratio, cap_hits=0, loss=-360.0, finite=True):
    r = {"fid": fid, "fid_sd": sd, "time_ratio": time_ratio, "bytes_ratio": bytes_ratio,
         "training": {"steps": 1500, "cap_hits": cap_hits, "loss_last": loss, "loss_all_finite": finite}}
    r["gates"] = gates(r, REFINENET)
    return r


def test_gates_follow_the_plan():
    assert row(500, 10, 1.70, 1.54)["gates"]["eligible"]  # at RefineNet's cost exactly: eligible
    assert not row(500, 10, 1.71, 1.0)["gates"]["cost_gate"]
    assert not row(500, 10, 1.0, 1.55)["gates"]["cost_gate"]
    assert row(500, 10, 1.27, 1.15)["gates"]["aim_cost"] and not row(500, 10, 1.28, 1.15)["gates"]["aim_cost"]
    assert row(500, 10, 1.0, 1.0, cap_hits=75)["gates"]["convergence_gate"]  # 5 % of 1500 steps
    assert not row(500, 10, 1.0, 1.0, cap_hits=76)["gates"]["convergence_gate"]
    assert not row(500, 10, 1.0, 1.0, loss=-1001.0)["gates"]["convergence_gate"]
    assert not row(500, 10, 1.0, 1.0, finite=False)["gates"]["convergence_gate"]


def test_lowest_fid_wins_and_a_tie_goes_to_the_cheaper():
    rows = {"A": row(500, 10, 1.3, 1.0), "B": row(520, 10, 1.1, 1.2), "C": row(560, 10, 0.9, 0.9),
            "D": row(400, 5, 2.0, 1.0), "E": row(450, 5, 1.0, 1.0, cap_hits=200)}
    d = pick(rows)
    # D and E are not eligible (cost, convergence); B is within 2·√(10² + 10²) = 28.3 of A and cheaper; C is not
    assert d["lowest_fid"] == "A" and d["tied"] == ["A", "B"] and d["winner"] == "B"
    rows["B"] = row(529, 10, 1.1, 1.2)  # 29 apart: no longer tied
    assert pick(rows)["winner"] == "A"


def test_no_eligible_design_means_no_winner():
    assert pick({"A": row(500, 10, 2.0, 1.0)})["winner"] is None
