"""The `startup` bench section's arithmetic and table (benchmarks/startup.py), on made-up
rounds: no fit runs here (`python -m benchmarks.startup --quick` runs the real thing)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks import startup
from benchmarks.common import QUICK

pytestmark = pytest.mark.timeout(60)


def _round(ours_first: float, bare_first: float, ours_ms: float, ref_ms: float, same: bool = True) -> dict:
    return {"ours_embedded": {"first_step_s": ours_first, "wall_s": ours_first + 6, "last_to_exit_s": 1.5,
                              "step_ms": ours_ms},
            "ours_joined": {"first_step_s": ours_first - 4},
            "ours_torchrun": {"first_step_s": 5.0, "same_weights": same},
            "torchrun_ref": {"first_step_s": 4.0, "step_ms": ref_ms},
            "bare_trainer": {"first_step_s": bare_first},
            "bare_joined": {"first_step_s": bare_first - 2}}


def test_medians_paired_ratios_and_the_table_beside_each_target():
    rounds = [_round(12.0, 20.0, 11.0, 10.0), _round(9.0, 10.0, 10.0, 10.0), _round(15.0, 30.0, 30.0, 10.0)]
    table = {row["figure"]: row for row in startup.figures(rounds)}
    assert table["first step, embedded Ray (s)"]["value"] == 12.0 and table["first step, embedded Ray (s)"]["met"]
    # paired: the median of 0.6, 0.9, 0.5 -- not 12 / 20
    assert table["first step / bare TorchTrainer's, same run"]["value"] == pytest.approx(0.6)
    assert table["steady step / torchrun + torch DDP's"]["value"] == pytest.approx(1.1)
    assert table["torchrun launcher's weights == the Ray path's"]["value"] is True
    # the references issue #53 states its targets against: a bare TorchTrainer on the same head, torchrun
    assert table["first step, running head / a bare TorchTrainer joining it"]["value"] == pytest.approx(8 / 18)
    assert table["first step, torchrun launcher / torchrun + torch DDP's"]["value"] == pytest.approx(1.25)
    assert table["wall time, embedded Ray (s)"]["met"] is True and table["last step -> exit (s)"]["value"] == 1.5
    assert table["kill -> next trained step, live (s)"]["value"] is None  # the recovery section's
    assert len(table) == len(startup.TARGETS)
    # what the docs cite: each system's median over rounds (a failed system's metrics are absent)
    medians = startup.medians(rounds)
    assert medians["ours_embedded"]["first_step_s"] == 12.0 and medians["bare_trainer"] == {"first_step_s": 20.0}
    assert "same_weights" not in medians["ours_torchrun"]
    lines = startup.table_lines(list(table.values()))
    assert "| first step, embedded Ray (s) | 12.00 | 14 | 10 | yes |" in lines
    assert any(line.startswith("| kill -> next trained step, replica (s) | the recovery section") for line in lines)
    rounds[1]["ours_torchrun"]["same_weights"] = False
    assert {r["figure"]: r for r in startup.figures(rounds)}["torchrun launcher's weights == the Ray path's"]["met"] is False


def test_each_override_s_gain_is_paired_within_a_round_and_decides_whether_it_stays():
    rounds = [_round(12.0, 20.0, 11.0, 10.0), _round(9.0, 10.0, 10.0, 10.0), _round(15.0, 30.0, 30.0, 10.0)]
    for one, (slower, later_exit) in zip(rounds, ((3.0, 0.5), (0.5, 0.2), (1.5, 2.0))):
        one["ours_embedded-lean_node"] = {"first_step_s": one["ours_embedded"]["first_step_s"] + slower,
                                          "wall_s": one["ours_embedded"]["wall_s"] + 2 * slower}
        one["ours_embedded-fast_exit"] = {"first_step_s": 1.0, "last_to_exit_s": 1.5 + later_exit}
    del rounds[2]["ours_embedded"]["wall_s"]  # a failed metric: left out of the median, not counted as 0
    ab = startup.overrides(rounds)
    assert set(ab) == set(startup.AB_SYSTEMS) and "ours_embedded-lean_trainer" in ab
    node, exit_ = ab["ours_embedded-lean_node"], ab["ours_embedded-fast_exit"]
    assert node["first_step_s_gain_by_round"] == [3.0, 0.5, 1.5] and node["first_step_s_gain"] == 1.5
    assert node["wall_s_gain_by_round"] == [6.0, 1.0, None] and node["wall_s_gain"] == 3.5
    assert node["keep"] is True
    assert exit_["metric"] == "last_to_exit_s" and exit_["last_to_exit_s_gain"] == pytest.approx(0.5)
    assert exit_["keep"] is False  # judged on what it is for (the exit), not the first step
    assert ab["ours_embedded-torch_free_backend"]["keep"] is None  # not run: no verdict
    lines = startup.ab_lines(ab)
    assert "| `lean_node` | `ours_embedded` | first_step_s | 3.00, 0.50, 1.50 | 1.50 | 3.50 | yes |" in lines
    # every system is run each round, each round starting at a different point of the order
    assert set(startup.SYSTEMS + startup.AB_SYSTEMS) <= set(startup.RUNNERS) | set(startup.AB_SYSTEMS)
    assert startup._runner("ours_embedded-lean_node") is not startup.RUNNERS["ours_embedded"]


def test_a_run_directory_is_read_into_the_figures(tmp_path):
    rows = [{"phase": "fit_start", "attempt": None, "t": 100.0}, {"phase": "first_step", "attempt": 1, "t": 108.0},
            {"phase": "last_step", "attempt": None, "t": 113.0}]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "samples_per_s": sps}) + "\n"
                                                    for s, sps in ((22, 10.0), (44, 6400.0), (66, 3200.0))))
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint": "c", "status": "ok",
                                                       "final_metrics": {"val_accuracy": 0.9916},
                                                       "startup": {"attempts": [{"phases": {"cli": 1.0}}]}}))
    got = startup.read_ours(tmp_path, started=99.0, ended=114.0)
    assert got["first_step_s"] == 9.0 and got["wall_s"] == 15.0 and got["last_to_exit_s"] == 1.0
    assert got["val_accuracy"] == 0.9916  # the demo's accuracy, published beside its first step
    assert got["step_ms"] == pytest.approx(15.0)  # the median of 10 ms and 20 ms; the first line is left out
    assert startup.run(dataclasses.replace(QUICK, name="smoke"))["skipped"]  # the suite's smoke preset runs no fit


def test_the_suite_report_prints_the_table_when_the_section_ran():
    from benchmarks import report

    one = [_round(12.0, 20.0, 11.0, 10.0)]
    ran = report.markdown({"meta": {}, "startup": {"rounds": one, "figures": startup.figures(one)}})
    assert "**Targets** (startup, issue #39)" in ran and "| wall time, embedded Ray (s) | 18.00 | 20 | 18 | yes |" in ran
    assert "| `ours_embedded` | 12.0 | 18.0 | 1.5 | 11.0 | - |" in ran  # the rounds, as the docs show them
    assert "issue #39" not in report.markdown({"meta": {}, "startup": {"skipped": "smoke"}})
