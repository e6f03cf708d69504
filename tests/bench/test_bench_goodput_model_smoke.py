"""The goodput model (benchmarks.goodput_model) reports the contract keys and reacts right."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import goodput_model as model

RESULTS = Path(model.__file__).resolve().parent / "results"
SHORT_WEEK = ((3 * 3600.0, "preempted"), (900.0, "crashed"), (3600.0, "running"))


@pytest.fixture(scope="module")
def figures() -> model.Figures:
    scale = json.loads((RESULTS / "scale.json").read_text())
    latest = json.loads((RESULTS / "latest.json").read_text())
    return model.load_figures(scale, latest)[0]


def test_the_committed_result_holds_every_contract_key_and_names_its_sources() -> None:
    result = json.loads((RESULTS / "goodput.json").read_text())
    summary = result["summary"]
    for key in ("week_goodput", "week_goodput_best_interval"):
        assert set(summary[key]) == set(model.METHODS)
        assert all(0.0 < value <= 1.0 for value in summary[key].values())
        assert all(summary[key]["limit"] >= value for value in summary[key].values())
    assert len(summary["sweep"]) == (len(model.SWEEP_STEPS) * len(model.SWEEP_GRACES)
                                     * len(model.SWEEP_NAS))
    for row in summary["sweep"]:
        assert {"step_s", "grace_s", "nas_gbps", *model.METHODS} <= set(row)
        assert all(row["limit"] >= row[key] for key in model.METHODS)
    assert set(result["figures"]) <= set(result["sources"])


def test_a_longer_grace_window_never_lowers_goodput_until_the_end_save_fits(
        figures: model.Figures) -> None:
    # Methods that train until the kill gain nothing and lose nothing from the window.
    # resumekit and the SIGTERM handler stop at the first step boundary after the
    # signal: a longer window first lets their end save fit (goodput rises), then past
    # that they give the rest of the window up - at most that much more per preemption.
    job = 3 * 3600.0
    for name, method in model.methods(figures, state=7.5e9, nas=1e9).items():
        values = [model.week_goodput(method, 8, step_s=30.0, grace_s=grace,
                                     week=((job, "preempted"),), samples=4)
                  for grace in (5.0, 30.0, 120.0)]
        if method.end in ("none", "limit"):
            assert values[0] == values[1] == values[2], name
        else:
            assert values[1] >= values[0], (name, values)
            if method.end == "resumekit":  # 5 s holds no copy and write; 30 s does
                assert values[1] > values[0], (name, values)
            assert values[1] - values[2] <= (120.0 - 30.0) / job + 1e-9, (name, values)


def test_the_limit_bounds_every_method_and_a_slower_nas_costs_the_savers(
        figures: model.Figures) -> None:
    def week(nas: float) -> dict[str, float]:
        return {name: model.week_goodput(m, 8, step_s=30.0, grace_s=30.0,
                                         week=SHORT_WEEK, samples=4)
                for name, m in model.methods(figures, state=7.5e9, nas=nas).items()}

    fast, slow = week(2e9), week(0.25e9)
    for values in (fast, slow):
        assert all(values["limit"] >= value for value in values.values())
    for name in ("resumekit_sync", "dcp_sync", "torch_save", "upstream"):
        assert slow[name] < fast[name], name


def test_resumekit_keeps_the_last_completed_step_where_the_handler_loses_an_interval(
        figures: model.Figures) -> None:
    # A 110 s step in a 30 s window: the step in progress rarely ends in time, so a
    # handler that saves after it falls back to the interval save; the emergency copy
    # at the signal keeps the step before it.
    costs = model.methods(figures, state=7.5e9, nas=1e9)
    preempted = ((3 * 3600.0, "preempted"),)
    ours = model.week_goodput(costs["resumekit_async_thread"], 20, step_s=110.0,
                              grace_s=30.0, week=preempted, samples=6)
    theirs = model.week_goodput(costs["dcp_async_sigterm_best"], 20, step_s=110.0,
                                grace_s=30.0, week=preempted, samples=6)
    assert ours > theirs + 0.05
    # Without time for the copy and the write, resumekit falls back like the handler.
    starved = replace(costs["resumekit_async_thread"], final_estimate_s=1e6)
    assert model.week_goodput(starved, 20, step_s=110.0, grace_s=30.0, week=preempted,
                              samples=6) < ours - 0.05


def test_a_crash_costs_more_the_longer_the_interval(figures: model.Figures) -> None:
    method = model.methods(figures, state=7.5e9, nas=1e9)["limit"]
    crash_only = ((3600.0, "crashed"),)
    saver = replace(method, end="none", name="free saves")
    values = [model.week_goodput(saver, every, step_s=30.0, grace_s=30.0,
                                 week=crash_only, samples=6) for every in (1, 10, 40)]
    assert values == sorted(values, reverse=True)


def test_the_headroom_says_whether_any_method_can_beat_the_handler_by_a_hundredth(
        figures: model.Figures) -> None:
    # The +0.01 target is measured at the interval the defaults choose: the limit minus
    # the handler there bounds what any method can gain, and async saves as the default
    # make "auto" choose a shorter interval than blocking ones.
    result = model.headroom(figures, samples=4)
    blocking, async_ = result["blocking_default"], result["async_default"]
    assert async_["interval_steps"] < blocking["interval_steps"]
    costs = model.methods(figures, state=model.STATE_BYTES_PER_RANK,
                          nas=model.NAS_BYTES_PER_S)
    for row in (blocking, async_):
        handler = model.week_goodput(costs["dcp_async_sigterm_best"], row["interval_steps"],
                                     step_s=model.STEP_S, grace_s=model.GRACE_S,
                                     samples=4)
        ours = model.week_goodput(costs[row["config"]], row["interval_steps"],
                                  step_s=model.STEP_S, grace_s=model.GRACE_S, samples=4)
        assert row["dcp_async_sigterm_best"] == round(handler, 4)
        assert row["resumekit_defaults"] == round(ours, 4)
        assert row["headroom"] == pytest.approx(row["limit"] - handler, abs=2e-4)
        assert row["plus_0.01_reachable"] == (row["limit"] >= handler + 0.01)
        assert row["resumekit_defaults"] <= row["limit"]


def test_the_committed_result_reports_the_headroom_of_both_defaults() -> None:
    result = json.loads((RESULTS / "goodput.json").read_text())
    for label in ("blocking_default", "async_default"):
        row = result["headroom"][label]
        assert row["interval_steps"] >= 1
        assert row["headroom"] == pytest.approx(
            row["limit"] - row["dcp_async_sigterm_best"], abs=2e-4)
    assert result["headroom"]["blocking_default"]["interval_steps"] == \
        result["week"]["interval_steps"]
