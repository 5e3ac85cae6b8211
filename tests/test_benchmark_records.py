"""What the benchmarks publish (benchmarks/record.py) and the page generated from it (benchmarks/table.py)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from turnopd.analysis.frontier import bootstrap_difference, load_run

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import their siblings as top-level modules

import record  # noqa: E402
import table  # noqa: E402


def test_a_summary_is_the_median_and_range_of_its_repeats():
    s = record.Summary.of("vLLM / transformers", [4.3, 3.6, 4.09], "x")
    assert (s.median, s.low, s.high, s.repeats) == (4.09, 3.6, 4.3, 3)
    assert s.text() == "4.09x (3.60-4.30)"
    even = record.Summary.of("rate", [10.0, 30.0, 20.0, 40.0], "tok/s")
    assert even.median == 25.0  # the mean of the middle two
    assert even.text() == "25.0 tok/s (10.0-40.0)"
    assert record.Summary.of("share", [99.71, 99.75], "%").text() == "99.7% (99.7-99.8, only 2 repeats)"
    assert record.Summary.of("big", [1234.4, 1300.0, 1100.0], "steps/s").text() == "1234 steps/s (1100-1300)"
    with pytest.raises(ValueError, match="no values"):
        record.Summary.of("empty", [], "x")


def test_a_saved_result_holds_its_rows_machine_versions_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "alfworld_engine.py"), "--games", "2"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rows = [record.Summary.of("speed-up", [2.0, 3.0, 4.0], "x")]
    path = record.save_result("demo", "a demo benchmark", rows, [{"repeat": 0}], notes="n", results_dir=tmp_path)
    saved = json.loads(path.read_text())
    assert saved["command"] == "OMP_NUM_THREADS=1 python benchmarks/alfworld_engine.py --games 2"
    assert saved["summaries"] == [{"label": "speed-up", "median": 3.0, "low": 2.0, "high": 4.0, "repeats": 3,
                                   "unit": "x"}]
    assert saved["machine"]["cores"] >= 1 and saved["machine"]["OMP_NUM_THREADS"] == "1"
    assert {"python", "torch"} <= saved["versions"].keys()
    assert record.load_summaries(saved) == rows
    assert not list(tmp_path.glob("*.tmp"))  # written atomically

    line = table.row(saved)
    assert line.startswith("| a demo benchmark | `OMP_NUM_THREADS=1 python benchmarks/alfworld_engine.py --games 2` | "
                           "speed-up: **3.00x (2.00-4.00)** n |")
    assert f"{saved['machine']['cores']} cores" in line and "OMP_NUM_THREADS=1" in line


def test_the_published_page_is_what_the_saved_results_give():
    page = table.PAGE.read_text()
    assert table.render(page, table.table()) == page, "run python benchmarks/table.py"
    for path in record.RESULTS.glob("*.json"):
        assert table.row(json.loads(path.read_text())) in page


def test_the_cross_tokenizer_page_is_what_its_saved_runs_give():
    import cross_tokenizer

    result = json.loads((cross_tokenizer.RESULTS / "full.json").read_text())
    pages = sorted((BENCHMARKS.parent / "docs" / "results").glob("*-cross-tokenizer.md"))
    assert pages, "no dated cross-tokenizer results page"
    ratios = json.loads((cross_tokenizer.RESULTS / "log_ratios.json").read_text())
    page = pages[-1].read_text()
    for generated in (cross_tokenizer.page_tables(result), cross_tokenizer.ratio_table(ratios)):
        assert generated in page, "paste python benchmarks/cross_tokenizer.py --page"
    # and the saved result is what the saved runs give
    saved = {arm: {seed: load_run(cross_tokenizer.RESULTS / "runs" / f"xtok-{arm}-s{seed}") for seed in r["per_seed"]}
             for arm, r in {**result["per_arm"], **result["exploratory"]}.items()}
    for part in ("per_arm", "exploratory"):
        again = {arm: cross_tokenizer.arm_result(saved[arm]) for arm in result[part]}
        assert json.loads(json.dumps(again)) == result[part]
    finals = {arm: {seed: run.final for seed, run in saved[arm].items()} for arm in ("smollm2", "tiny")}
    difference = bootstrap_difference(finals["smollm2"], finals["tiny"], np.random.default_rng(0))
    assert record.interval(difference) == result["smollm2_minus_tiny"]


def test_the_multi_env_page_is_what_its_saved_runs_give():
    import multi_env

    result = json.loads((multi_env.RESULTS / "full.json").read_text())
    pages = sorted((BENCHMARKS.parent / "docs" / "results").glob("*-multi-env.md"))
    assert pages, "no dated multi-env results page"
    assert multi_env.page_tables(result) in pages[-1].read_text(), "paste python benchmarks/multi_env.py --page"
    # and the saved result is what the saved runs give (the script's own order of bootstrap draws)
    saved = multi_env.RESULTS / "runs"
    runs = {arm: {seed: saved / f"multi-alfworld-search{'' if arm == 'mixture' else '-' + arm}-s{seed}"
                  for seed in range(result["seeds"])} for arm in ("mixture", *result["per_env"])}
    rng = np.random.default_rng(0)
    again = {env: multi_env.env_result(env, runs["mixture"], runs[env], rng) for env in result["per_env"]}
    assert json.loads(json.dumps(again)) == result["per_env"]
    assert json.loads(json.dumps(multi_env.work(runs, list(result["per_env"])))) == result["work"]


def test_the_multi_env_verdicts_follow_the_designs_floor_and_margin():
    import multi_env

    def env(teacher, lo, hi):
        return {"teacher": teacher, "mixture_minus_alone": {"value": (lo + hi) / 2, "lo": lo, "hi": hi}}

    # a teacher at 5% is under the 10% floor: nothing is claimed, whatever the interval
    assert multi_env.verdict(env(0.05, -0.01, 0.01)).startswith("no headroom (its teacher wins 5%)")
    # [-0.10, +0.06]: above -15 points, not wholly below 0
    assert multi_env.verdict(env(0.72, -0.10, 0.06)) == "holds the specialist (interval above -15 points)"
    # [-0.12, -0.02]: above -15 points and wholly below 0, so both
    assert multi_env.verdict(env(0.72, -0.12, -0.02)) == ("holds the specialist (interval above -15 points); "
                                                           "interference (interval below 0)")
    # [-0.30, -0.16]: below the margin and below 0
    assert multi_env.verdict(env(0.72, -0.30, -0.16)) == "interference (interval below 0)"
    # [-0.20, +0.05]: reaches below -15 points and above 0
    assert multi_env.verdict(env(0.72, -0.20, 0.05)) == "neither shown at this power"


def test_the_equal_budget_tables_give_the_figures_the_8_seed_page_published():
    import frontier_alfworld

    saved = BENCHMARKS / "results" / "frontier_alfworld"
    tables = frontier_alfworld.equal_budget_tables("equal_budget", saved / "equal_budget")
    # docs/results/2026-12-05-equal-budget.md, typed from turnopd frontier's tables: the arms' means
    # [t 95%] and work, the paired differences [t 95%], detectable effects and env-step ratios
    assert "| equal_budget-vanilla_opd | 8 | 50.7 [47.6, 53.8] | 4,279 | 386,808 |" in tables
    assert "| turnopd | 8 | 50.0 [47.3, 52.7] | 3,504 | 316,498 |" in tables
    assert ("| **primary:** TurnOPD - the equal-work control | 8 | +3.2 [-2.3, +8.7] | 7.6 | 1.01x [1.00, 1.03] | "
            "difference not shown: the interval holds 0; non-inferior at the 5-point margin |") in tables
    assert "| secondary: TurnOPD - vanilla OPD, equal steps | 8 | -0.7 [-3.7, +2.3] | 4.1 | 1.23x [1.08, 1.40] |" in tables
    # the control ran before budgets held: 6 of 8 ended by theirs, the worst 140 env steps past it
    assert "6 of 8 runs ended by theirs, at most +140 env steps past it (one episode: 40)" in tables
    assert "code not recorded" in tables  # those runs predate the code build in start records


def test_the_30_seed_page_and_the_readme_agree_with_the_saved_runs():
    import frontier_alfworld

    saved = BENCHMARKS / "results" / "frontier_alfworld" / "equal_budget_30"
    tables = frontier_alfworld.equal_budget_tables("equal_budget_30", saved)
    page = (BENCHMARKS.parent / "docs" / "results" / "2026-12-07-equal-budget-30.md").read_text()
    assert tables in page  # the page's block is --page's output, unedited
    # the design's done-when: 30 seeds an arm, one code build, every control ended within one episode
    assert "seeds per arm: equal_budget_30-vanilla_opd 30; equal_budget_30-vanilla_opd_at_turnopd_work 30; turnopd 30" in tables
    assert "- Builds: code af6cd63beefee4e0; models: one build of each" in tables
    assert "30 of 30 runs ended by theirs, at most +38 env steps past it (one episode: 40)" in tables
    # the README's headline figures are the tables' (primary and secondary rows)
    readme = " ".join((BENCHMARKS.parent / "README.md").read_text().split())
    for figure in ("+0.0 points, interval -1.2 to +1.2", "1.22x [1.16, 1.28] TurnOPD's env steps",
                   "by 2.0 points** (+0.1 to +3.9 over the seeds, 2.7 detectable)", "interval is -0.4 to +4.7"):
        assert figure in readme
    assert "| secondary: TurnOPD - vanilla OPD, equal steps | 30 | +0.0 [-1.2, +1.2] | 1.7 | 1.22x [1.16, 1.28] |" in tables
    assert "| **primary:** TurnOPD - the equal-work control | 30 | +2.0 [+0.1, +3.9] | 2.7 |" in tables
    assert tables.count("+2.0 [-0.4, +4.7]") == 1  # games and seeds resampled together


def test_the_task_clustered_difference_averages_each_task_over_seeds():
    from frontier_alfworld import by_task

    from turnopd.analysis.frontier import EvalPoint

    def run(seed, scores):
        final = EvalPoint(step=20, train_time_s=0.0, avg_at_k=sum(scores) / 3, per_task=dict(zip("abc", scores, strict=True)))
        return type("Run", (), {"seed": seed, "final": final})

    ours = [run(0, [1.0, 0.5, 0.0]), run(1, [1.0, 1.0, 0.5])]
    theirs = [run(1, [0.5, 1.0, 0.5]), run(0, [0.0, 0.5, 0.5])]  # paired by seed, not by position
    # per task, averaged over the seeds: a (1-0 + 1-0.5)/2 = 0.75, b (0 + 0)/2 = 0, c (-0.5 + 0)/2 = -0.25
    # mean 0.5/3 = 1/6; sd of (0.75, 0, -0.25) = sqrt(((7/12)^2 + (1/6)^2 + (5/12)^2) / 2) = 0.520416;
    # t(0.975, 2) = 4.303 (three decimals, as the table): half-width 4.303 x 0.520416 / sqrt(3) = 1.292889
    d = by_task(ours, theirs)
    assert d.value == pytest.approx(1 / 6)
    assert (d.lo, d.hi) == (pytest.approx(1 / 6 - 1.292889, abs=1e-5), pytest.approx(1 / 6 + 1.292889, abs=1e-5))


def test_equal_budget_verdict_words_follow_the_interval():
    from frontier_alfworld import difference_words

    from turnopd.analysis.frontier import Interval

    assert difference_words(Interval(0.03, 0.01, 0.05), 0.05) == ("ahead: the interval lies above 0; "
                                                                   "non-inferior at the 5-point margin")
    assert difference_words(Interval(0.01, -0.02, 0.04), 0.05) == ("difference not shown: the interval holds 0; "
                                                                    "non-inferior at the 5-point margin")
    # [-8, -2]: behind, and reaching past -5: inconclusive at the margin
    assert difference_words(Interval(-0.05, -0.08, -0.02), 0.05) == ("behind: the interval lies below 0; "
                                                                      "inconclusive at the 5-point margin")
    assert difference_words(Interval(-0.09, -0.12, -0.06), 0.05) == ("behind: the interval lies below 0; "
                                                                      "inferior at the 5-point margin")


def test_the_end_to_end_breakdown_puts_each_sides_parts_in_shared_columns():
    import trl_end_to_end as e2e

    def run(side, s_per_step, phases, kept=True):
        return {"model": "m", "side": side, "kept": kept, "figures": {"s_per_step": s_per_step},
                "run": {"phases_per_step_s": phases}}

    turnopd = {"generation": 3.0, "rollout, other": 0.5, "teacher": 1.0, "forward_backward": 4.0, "optimizer": 0.5,
               "train, other": 0.2, "weight_sync": 0.001}
    trl = {"generation": 2.0, "teacher": 1.5, "student forward and loss": 1.0, "backward": 2.5, "optimizer": 0.4}
    raw = {"runs": [run("turnopd", 12.0, {}), run("turnopd", 10.0, turnopd), run("turnopd", 9.0, {}),
                    run("turnopd", 10.5, {}, kept=False), run("trl", 8.0, trl)]}
    lines = e2e.phase_table(raw).splitlines()
    assert lines[0] == ("| model | side | s / step | generation | rollout, other (env, batching) | teacher forward | "
                        "student forward + loss + backward | optimizer | weight sync | other |")
    # the kept run of median speed (10.0 of 9, 10, 12); other = 10 - (3 + 0.5 + 1 + 4 + 0.5 + 0.001) = 0.999
    assert lines[2] == "| m | turnopd | 10.000 | 3.000 | 0.500 | 1.000 | 4.000 | 0.500 | 0.001 | 0.999 |"
    # TRL: forward and loss + backward = 1.0 + 2.5; other = 8 - (2 + 1.5 + 3.5 + 0.4) = 0.6
    assert lines[3] == "| m | trl | 8.000 | 2.000 | – | 1.500 | 3.500 | 0.400 | – | 0.600 |"


def test_trls_parts_are_timed_around_its_calls_with_the_teacher_taken_out_of_the_loss(monkeypatch):
    """A stand-in trainer on a fake clock: generation 2 s; the loss 3 s of which the teacher's forward
    1 s; backward 4 s; the optimizer (callbacks) 0.5 s."""
    from types import SimpleNamespace

    import torch
    import trl_end_to_end as e2e

    now = [0.0]
    monkeypatch.setattr(e2e.time, "perf_counter", lambda: now[0])

    def advance(seconds):
        now[0] += seconds

    class Backbone(torch.nn.Module):
        def forward(self, x):
            advance(1.0)
            return x

    backbone = Backbone()
    teacher = SimpleNamespace(get_decoder=lambda: backbone)

    def compute_loss(x):
        advance(1.5)
        backbone(x)  # the teacher's forward, inside the loss
        advance(0.5)

    trainer = SimpleNamespace(_generate_single_turn=lambda: advance(2.0), _compute_loss=compute_loss,
                              accelerator=SimpleNamespace(backward=lambda loss: advance(4.0)))
    parts = e2e.StepParts()
    e2e.time_parts(trainer, teacher, parts)
    trainer._generate_single_turn()
    trainer._compute_loss(torch.zeros(1))
    trainer.accelerator.backward(None)
    parts.begin("optimizer")
    advance(0.5)
    parts.end("optimizer")
    parts.end_step()
    assert parts.steps == [{"generation": 2.0, "teacher": 1.0, "student forward and loss": 2.0, "backward": 4.0,
                            "optimizer": 0.5}]
    assert parts.current == {}


def test_a_30_task_difference_is_called_only_when_both_intervals_exclude_zero():
    from frontier_autoresearch import called

    from turnopd.analysis.frontier import Interval

    assert called(Interval(0.1, 0.02, 0.2), Interval(0.1, 0.01, 0.2)) == "ahead"
    assert called(Interval(-0.1, -0.2, -0.02), Interval(-0.1, -0.3, -0.01)) == "behind"
    assert called(Interval(0.1, 0.02, 0.2), Interval(0.1, -0.01, 0.2)) == "no difference at this power"  # tasks: 0 inside
    assert called(Interval(0.1, -0.02, 0.2), Interval(0.1, 0.01, 0.2)) == "no difference at this power"  # seeds: 0 inside
    assert called(Interval(0.1, 0.02, 0.2), None) == "no difference at this power"
    assert called(Interval(0.0, 0.0, 0.0), Interval(0.0, 0.0, 0.0)) == "equal in every seed and task"
    assert called(Interval(0.0, 0.0, 0.0), Interval(0.0, -0.01, 0.01)) == "no difference at this power"  # a task moved


def test_the_30_task_tables_read_the_first_regimes_saved_runs():
    """On the 2026-12-05 equal-executions runs (6 tasks, 3 seeds): the budget overshoot the issue found
    by hand (201-228 real env steps against 192), and the arms' rows."""
    from frontier_autoresearch import tables_30

    tables = tables_30("equal_executions", BENCHMARKS / "results" / "frontier_autoresearch" / "equal_executions")
    assert "- Budgets (env_steps): 12 of 12 runs ended by theirs, past it by +9 to +36." in tables
    assert "- At the start: not evaluated in these runs." in tables
    assert "| vanilla_opd_world_model_reward - vanilla_opd_reward | 3 |" in tables
    assert "Real executions to reach" not in tables  # these runs evaluated at the end only


def test_the_30_task_builds_are_saved_restored_and_never_mixed(tmp_path, monkeypatch):
    import frontier_autoresearch

    saved, live = tmp_path / "builds", tmp_path / "live"
    monkeypatch.setattr(frontier_autoresearch, "BUILDS", saved)
    monkeypatch.setattr(frontier_autoresearch, "BUILD_FOLDERS", {"teacher": str(live / "teacher")})
    (live / "teacher").mkdir(parents=True)
    (live / "teacher" / "model.safetensors").write_bytes(b"weights one")
    frontier_autoresearch.sync_builds()  # saved: the live build, copied
    assert (saved / "teacher" / "model.safetensors").read_bytes() == b"weights one"
    (live / "teacher" / "model.safetensors").unlink()
    (live / "teacher").rmdir()
    frontier_autoresearch.sync_builds()  # restored where the folder is missing
    assert (live / "teacher" / "model.safetensors").read_bytes() == b"weights one"
    (live / "teacher" / "model.safetensors").write_bytes(b"weights two")  # another build in the folder
    with pytest.raises(SystemExit, match="is not the build saved"):
        frontier_autoresearch.sync_builds()
    monkeypatch.setattr(frontier_autoresearch, "BUILD_FOLDERS", {"job_model": str(live / "job_model")})
    (live / "job_model").mkdir()
    (live / "job_model" / "job_model.pt").write_bytes(b"ensemble one")
    frontier_autoresearch.sync_builds()
    (live / "job_model" / "job_model.pt").write_bytes(b"ensemble two")  # the job model's torch file counts too
    with pytest.raises(SystemExit, match="is not the build saved"):
        frontier_autoresearch.sync_builds()


def test_the_autoresearch_30_page_is_its_saved_runs():
    """docs/results/2026-12-07-autoresearch-30.md embeds --page's output for both regimes, unedited, and
    its words quote the saved runs: one build, the gate's models, budgets held, every run at 8 of 30."""
    from frontier_autoresearch import tables_30

    saved = BENCHMARKS / "results" / "frontier_autoresearch"
    page = (BENCHMARKS.parent / "docs" / "results" / "2026-12-07-autoresearch-30.md").read_text()
    for regime, unit in (("equal_executions_30", "env_steps"), ("equal_clock_30", "train_time_s")):
        tables = tables_30(regime, saved / regime)
        assert tables in page
        assert "seeds per arm: turnopd 5; vanilla_opd 5; vanilla_opd_reward 5; vanilla_opd_world_model_reward 5; " \
               "vanilla_opd_world_model_wmrl 5." in tables
        assert "code 9ff5fe96cea0e742; models: one build of each (student 10db39b3a217212b, " \
               "teacher:autoresearch a82b2880694707e6)" in tables
        assert f"Budgets ({unit}): 25 of 25 runs ended by theirs" in tables
        # 8 of 30 tasks is 26.7%; every arm's interval has no width, so every comparison is "equal"
        assert tables.count("| 5 | 26.7 [26.7, 26.7] |") == 5 and tables.count("equal in every seed and task") == 3
    assert "| vanilla_opd_world_model_reward | 54 | 4 (4) | 3.42x [2.44, 5.42] | 100% |" in page
    assert "| vanilla_opd_world_model_wmrl | 93 | 4 (4) | 1.97x [1.89, 2.04] | 100% |" in page


def test_the_reading_layout_table_pairs_pages_across_layouts():
    """Two pages a layout, worked by hand with t(0.975, 1) = 12.706. Grid: gaps 0.5-0.4 = 0.1 and
    0.3-0.3 = 0, mean 0.05, sd 0.0707107, half-width 12.706 x 0.0707107 / sqrt(2) = 0.6353. Row tiles:
    gaps 0.3 and 0.5, mean 0.4, half-width 12.706 x 0.141421 / sqrt(2) = 1.2706. Paired by page: 0.2
    and 0.5, mean 0.35, half-width 12.706 x 0.212132 / sqrt(2) = 1.9059."""
    from screenshot_reading import layout_table

    def page(right, swapped, cells=0.99):
        return {"token_accuracy": right, "token_accuracy_swapped": swapped, "cell_accuracy": cells,
                "cell_accuracy_swapped": 0.05}

    samples = [{"layout": "grid", "pages": [page(0.5, 0.4), page(0.3, 0.3)]},
               {"layout": "row_tiles", "pages": [page(0.6, 0.3), page(0.9, 0.4)]}]
    table = layout_table(samples)
    assert "| grid | 2 | +0.050 [-0.585, +0.685] | no | 0.400 / 0.350 | 0.990 / 0.050 |" in table
    assert "| row_tiles | 2 | +0.400 [-0.871, +1.671] | no | 0.750 / 0.350 |" in table
    assert "row_tiles - grid, the reading gap paired by page: +0.350 [-1.556, +2.256]" in table
    # a layout reads only when its interval's lower end is above 0.05
    many = [{"layout": "row_tiles", "pages": [page(0.9, 0.3), page(0.8, 0.3), page(0.85, 0.3)]}]
    assert "| row_tiles | 3 | +0.550 [+0.426, +0.674] | yes |" in layout_table(many)


def test_the_reading_layout_table_in_the_docs_is_the_saved_run():
    """docs/screenshots.md embeds `screenshot_reading.py --table`'s output for the saved layout run."""
    from screenshot_reading import layout_table

    saved = json.loads((BENCHMARKS / "results" / "screenshot_reading_layouts.json").read_text())
    table = layout_table(saved["samples"])
    assert table in (BENCHMARKS.parent / "docs" / "screenshots.md").read_text()
    assert "| row_tiles | 16 | +0.022 [+0.011, +0.034] | no |" in table and "| grid | 16 | +0.000 [-0.005, +0.005] | no |" in table


def test_the_throughput_table_pairs_each_mode_with_sync_by_seed():
    """Hand-worked: sync's steps take 2 s (seed 0) and 3 s (seed 1), pool's 4 s and 2 s: pool's speed-ups
    are 2/4 = 0.50 and 3/2 = 1.50, median 1.00; 4 trajectories a step give 2.000 and 1.333 a second
    (median 1.667) for sync, 1.000 and 2.000 for pool."""
    from pipeline_overlap import RESOURCES, speed_ups, throughput_table

    def sample(variant, seed, step_s, idle, generator_idle=float("nan"), missing=0):
        return {"variant": variant, "seed": seed, "step_s": step_s, "trajectories_s": 4 / step_s,
                **{f"idle_{r}": idle for r in RESOURCES}, "generator_idle": generator_idle,
                "staleness": 0.0 if variant == "sync-t2" else 1.0, "dropped": 0, "screens_missing": missing}

    samples = [sample("sync-t2", 0, 2.0, 0.5), sample("sync-t2", 1, 3.0, 0.7),
               sample("pool", 1, 2.0, 0.2, 0.3), sample("pool", 0, 4.0, 0.4, 0.1, missing=2)]
    assert speed_ups(samples, "pool") == pytest.approx([0.5, 1.5]) and speed_ups(samples, "sync-t2") == []
    table = throughput_table(samples)
    assert ("| sync-t2 | 2 | 1.667 (1.333-2.000) | - | 60% (50-70) | 60% (50-70) | 60% (50-70) | 60% (50-70) | - | "
            "0.00 (0.00-0.00) | 0 | 0 |") in table
    assert ("| pool | 2 | 1.500 (1.000-2.000) | 1.00x (0.50-1.50) | 30% (20-40) | 30% (20-40) | 30% (20-40) | "
            "30% (20-40) | 20% (10-30) | 1.00 (1.00-1.00) | 0 | 2 |") in table


def gated_page(page, folder: Path, lead: dict) -> str:
    """A gated experiment's page from `folder` with a passing gate of `lead`; with a failing one the
    page must stop after the gate's line."""
    def write_gate(passes: bool) -> None:
        (folder / "gate.json").write_text(json.dumps({"passes": passes, "envs": {"alfworld": {"lead": lead}}}))

    write_gate(False)
    assert page(folder).endswith("fails: the comparison shows nothing.")
    write_gate(True)
    return page(folder)


def test_the_normalizer_tables_pair_the_arms_by_seed_and_by_game(tmp_path):
    """Two seeds of each arm, worked by hand. Won turns over steps 17-24 (step 16 is outside the window):
    per-trajectory 10 and 12, constant 8 and 9 (seed 1: 8 at steps 17-20, 10 at 21-24): differences -2
    and -3, mean -2.5, sd 0.707107, half-width 12.706 x 0.707107 / sqrt 2 = 6.353 -> [-8.853, +3.853]:
    no difference at this power; detectable (12.706 + 1.376) x 0.707107 / sqrt 2 = 7.041. Final Avg@1
    over games a, b: per-trajectory seed 0 (1, 0), seed 1 (1, 1); constant seed 0 (1, 1), seed 1 (0, 1):
    per game averaged over seeds a (0 - 1)/2 = -0.5, b (1 + 0)/2 = 0.5: mean 0, sd 0.707107 -> +0.0
    [-635.3, +635.3] points: inconclusive at 10 points."""
    from normalizer import CONSTANT, PER_TRAJECTORY, page

    def run(method, seed, won, final):
        folder = tmp_path / "runs" / f"normalizer-{method}-s{seed}"
        folder.mkdir(parents=True)
        records = [{"kind": "start", "name": folder.name, "method": method, "seed": seed, "total_steps": 24,
                    "resumed_from_step": 0}]
        records += [{"kind": "train", "step": s, "train_time_s": float(s), "mean_turns_won": won(s),
                     "mean_turns_lost": 20.0, "invalid_action_rate": 0.1, "success_rate": 0.5} for s in range(16, 25)]
        records += [{"kind": "eval", "step": s, "train_time_s": float(s), "split": "valid", "k": 1,
                     "avg_at_k": sum(scores.values()) / 2, "per_task": scores, "mean_turns": 30.0 - s / 4}
                    for s, scores in ((0, {"a": 0.0, "b": 0.0}), (24, dict(zip("ab", final, strict=True))))]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    run(PER_TRAJECTORY, 0, lambda s: 99.0 if s == 16 else 10.0, (1.0, 0.0))
    run(PER_TRAJECTORY, 1, lambda s: 12.0, (1.0, 1.0))
    run(CONSTANT, 0, lambda s: 8.0, (1.0, 1.0))
    run(CONSTANT, 1, lambda s: 8.0 if s <= 20 else 10.0, (0.0, 1.0))
    text = gated_page(page, tmp_path, {"tasks": 2, "teacher": 70.0, "student": 30.0, "lead_points": 40.0, "interval": [25.0, 55.0], "min_points": 20.0})
    assert "lead +40.0 points [+25.0, +55.0] against the bar of 20: passes" in text
    assert f"| {PER_TRAJECTORY} | 0 | 10.00 | 20.00 | 0.10 | 0.50 | 0% / 50% | 24.0 |" in text
    assert f"| {CONSTANT} | 1 | 9.00 | 20.00 | 0.10 | 0.50 | 0% / 50% | 24.0 |" in text
    assert "| mean_turns_won, steps 17-24 (turns) | 2 | -2.50 [-8.85, +3.85] | 7.0 | no difference at this power |" in text
    assert "| mean_turns_lost, steps 17-24 (turns) | 2 | +0.00 [+0.00, +0.00] | - (no spread) | equal in every seed |" in text
    assert "over the games (per game averaged over the seeds) +0.0 [-635.3, +635.3] points" in text
    assert "inconclusive at 10 points" in text


def test_the_smollm2_chat_tables_pair_before_and_after_by_game(tmp_path):
    """Two seeds an arm, games a, b, c, worked by hand. Both arms start at (0, 0, 1) (greedy: one
    vector). chat after: seed 0 (1, 0, 1), seed 1 (1, 1, 1): per game averaged over the seeds 1, 0.5, 0;
    mean 0.5, sd 0.5, half-width 4.303 x 0.5 / sqrt 3 = 1.242 -> +50.0 [-74.2, +174.2] points,
    detectable (4.303 + 1.061) x 0.5 / sqrt 3 = 154.8. history_block after: (0, 0, 1) in both seeds:
    unchanged. chat minus history_block after: 1, 0.5, 0 again. Per run (2 steps): step time 10 and
    20 s (median 15), rollout 4 then a probe of 8 (6), teacher 2 and 4 (3), update 2.5 + 0.5 and 4 + 1 (4),
    teacher tokens (100 + 300) / (10 + 10) env steps = 20, invalid actions 0.1 and 0.2 (15.0%), peak
    memory the last record's 2048.4 MiB, held-out mean turns 20.0 -> 15.0."""
    from smollm2_chat import ARMS, page

    def run(arm, seed, after):
        folder = tmp_path / "runs" / f"{ARMS[arm]}-turnopd-s{seed}"
        folder.mkdir(parents=True)
        records = [{"kind": "start", "name": folder.name, "method": "turnopd", "seed": seed, "total_steps": 2,
                    "resumed_from_step": 0}]
        records += [{"kind": "train", "step": 1, "train_time_s": 10.0, "step_time_s": 10.0, "phases": {"rollout": 4.0, "train": 5.0},
                     "train_parts": {"teacher": 2.0, "forward_backward": 2.5, "optimizer": 0.5}, "tokens_scored": 100,
                     "env_steps": 10, "invalid_action_rate": 0.1, "peak_memory_mib": {"host": 1000.0}},
                    {"kind": "train", "step": 2, "train_time_s": 30.0, "step_time_s": 20.0, "phases": {"probe": 8.0, "train": 9.0},
                     "train_parts": {"teacher": 4.0, "forward_backward": 4.0, "optimizer": 1.0}, "tokens_scored": 300,
                     "env_steps": 10, "invalid_action_rate": 0.2, "peak_memory_mib": {"host": 2048.4}}]
        records += [{"kind": "eval", "step": step, "train_time_s": clock, "split": "valid", "k": 1,
                     "avg_at_k": sum(scores) / 3, "per_task": dict(zip("abc", scores, strict=True)), "mean_turns": turns}
                    for step, clock, scores, turns in ((0, 0.0, (0.0, 0.0, 1.0), 20.0), (2, 30.0, after, 15.0))]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    run("chat", 0, (1.0, 0.0, 1.0))
    run("chat", 1, (1.0, 1.0, 1.0))
    run("history_block", 0, (0.0, 0.0, 1.0))
    run("history_block", 1, (0.0, 0.0, 1.0))
    text = gated_page(page, tmp_path, {"tasks": 3, "teacher": 90.0, "student": 30.0, "lead_points": 60.0, "interval": [40.0, 80.0], "min_points": 20.0})
    assert "lead +60.0 points [+40.0, +80.0] against the bar of 20: passes" in text
    assert "| chat | 0 | 33% -> 67% | 20.0 -> 15.0 | 15.0% | 15 | 6 / 3 / 4 | 20 | 2048 |" in text
    assert "| history_block | 1 | 33% -> 33% |" in text
    assert "| chat | 2 | +50.0 [-74.2, +174.2] points | 154.8 | no difference at this power |" in text
    assert "| history_block | 2 | +0.0 [+0.0, +0.0] points | - (no spread) | unchanged in every task |" in text
    assert "chat minus history_block after (per game averaged over the seeds both ran): **+50.0 [-74.2, +174.2] points**" in text


def test_the_screen_reader_distill_page_reports_each_gate_then_pairs_by_goal(tmp_path):
    """Two seeds, goals a, b, c, worked by hand. The S = 16 build fails its gate and S = 4 passes;
    both are reported, most steps first (the teacher's 4.25 turns print as 4.2: round half to even). Before (0, 0, 1) in both seeds; after seed 0 (1, 0, 1), seed 1
    (0, 0, 1): per goal averaged over the seeds 0.5, 0, 0; mean 0.1667, sd 0.288675, half-width
    4.303 x 0.288675 / sqrt 3 = 0.7172 -> +16.7 [-55.0, +88.4] points, detectable (4.303 + 1.061) x
    0.288675 / sqrt 3 = 89.4. Per run (3 steps): step time 10, 20, 30 s (median 20), rollout 4, a probe
    of 6, 8 (6), teacher 1, 2, 3 (2), update 2 + 1, 4 + 1, 6 + 2 (5); held-out invalid actions 40.0% ->
    25.0% (seed 1's records predate the rate: n/a), mean turns 15.0 -> 12.5."""
    from screen_reader_distill import SWEEP, page

    assert page(tmp_path).startswith("No gate saved")

    def gate(steps, student, passes):
        lead = {"tasks": 3, "teacher": 66.7, "student": student, "lead_points": 66.7 - student,
                "interval": [10.0, 90.0], "teacher_ahead": 2, "student_ahead": 0, "min_points": 10.0}
        players = {"teacher": {"avg_at_k": 2 / 3, "mean_turns": 4.25, "invalid_action_rate": 0.125},
                   "student": {"avg_at_k": student / 100, "mean_turns": 15.0}}  # a record from before the rate
        (tmp_path / f"gate-s{steps}.json").write_text(
            json.dumps({"passes": passes, "envs": {"webshop_screenshot": {"lead": lead, **players}}}))

    def run(seed, after, invalid):
        folder = tmp_path / "runs" / f"{SWEEP}-turnopd-s{seed}"
        folder.mkdir(parents=True)
        records = [{"kind": "start", "name": folder.name, "method": "turnopd", "seed": seed, "total_steps": 3,
                    "resumed_from_step": 0}]
        records += [{"kind": "train", "step": step, "train_time_s": 10.0 * step, "step_time_s": 10.0 * step,
                     "phases": {("probe" if step == 2 else "rollout"): 2.0 + 2 * step, "train": 5.0},
                     "train_parts": {"teacher": float(step), "forward_backward": 2.0 * step, "optimizer": float(step // 3 + 1)}}
                    for step in (1, 2, 3)]
        records += [{"kind": "eval", "step": step, "train_time_s": 10.0 * step, "split": "test", "k": 1,
                     "avg_at_k": sum(scores) / 3, "per_task": dict(zip("abc", scores, strict=True)), "mean_turns": turns,
                     **({"invalid_action_rate": rate} if rate is not None else {})}
                    for step, scores, turns, rate in ((0, (0.0, 0.0, 1.0), 15.0, invalid[0]), (3, after, 12.5, invalid[1]))]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    gate(4, 0.0, True)
    gate(16, 60.0, False)
    run(0, (1.0, 0.0, 1.0), (0.4, 0.25))
    run(1, (0.0, 0.0, 1.0), (None, None))
    text = page(tmp_path)
    assert ("| S = 16 SFT steps | 3 | 66.7% / 12.5% / 4.2 | 60.0% / n/a / 15.0 | +6.7 [+10.0, +90.0] | 2 / 0 | no (bar 10) |\n"
            "| S = 4 SFT steps | 3 | 66.7% / 12.5% / 4.2 | 0.0% / n/a / 15.0 | +66.7 [+10.0, +90.0] | 2 / 0 | yes (bar 10) |") in text
    assert "| 0 | 33% -> 67% | 40.0% -> 25.0% | 15.0 -> 12.5 | 20 | 6 / 2 / 5 |" in text
    assert "| 1 | 33% -> 33% | n/a -> n/a | 15.0 -> 12.5 |" in text
    assert "| TurnOPD | 2 | +16.7 [-55.0, +88.4] points | 89.4 | no difference at this power |" in text
    (tmp_path / "gate-s4.json").unlink()  # no build passed: the page says so and stops at the gates
    assert page(tmp_path).endswith("| no (bar 10) |\n\nNo build passed the gate: the comparison shows nothing, so no "
                                   "distillation runs.")


def test_the_screen_reader_results_page_is_its_saved_gates():
    from screen_reader_distill import page

    text = (BENCHMARKS.parent / "docs" / "results" / "2026-12-07-screen-reader.md").read_text()
    generated = text.split("(checked by tests/test_benchmark_records.py) -->\n")[1].split("\n<!-- end generated -->")[0]
    assert generated == page()
    assert "| S = 4 SFT steps | 100 | 14.0% / 26.5% / 4.3 | 0.0% / 100.0% / 15.0 | +14.0 [+7.2, +20.8] |" in generated


def test_the_screen_reader_table_by_hand():
    """Three pages. Text cells 0.9, 1.0, 0.95: mean 0.95, sd 0.05, half-width 4.303 x 0.05 / sqrt 3 =
    0.124 -> [0.826, 1.074]; from another page's screen 0.0, 0.1, 0.05: 0.050 [-0.074, 0.174]; the other
    measures constant. 0.95 >= 0.90 and 0.05 < 0.10: reads; with 0.12 from another page's (mean of
    0.0, 0.26, 0.1) it does not."""
    from screen_reader import table

    def record(swapped):
        return {"samples": [{"pages": [{"cell_accuracy": own, "cell_accuracy_swapped": other, "char_accuracy": 0.8,
                                        "char_accuracy_swapped": 0.2, "lines_exact": 0.5, "lines_exact_swapped": 0.0}
                                       for own, other in zip((0.9, 1.0, 0.95), swapped, strict=True)]}]}

    text = table(record((0.0, 0.1, 0.05)))
    assert "| 3 held-out pages | own screen [t 95% over pages] | another page's screen |" in text
    assert "| text cells read right | 0.950 [0.826, 1.074] | 0.050 [-0.074, 0.174] |" in text
    assert "| characters (1 - CER) | 0.800 [0.800, 0.800] | 0.200 [0.200, 0.200] |" in text
    assert "**reads** (0.950 / 0.050)" in text
    assert "**does not read** (0.950 / 0.120)" in table(record((0.0, 0.26, 0.1)))
    confused = record((0.0, 0.1, 0.05))
    confused["samples"][0]["confusions"] = [["q", "g", 3], ["-", " ", 1]]
    assert table(confused).endswith("held-out pages): `q` -> `g` 3, `-` -> ` ` 1.\n")


def test_the_screen_reader_table_in_the_docs_is_the_saved_file():
    from screen_reader import table

    saved = table(json.loads((BENCHMARKS / "results" / "screen_reader.json").read_text()))
    assert saved in (BENCHMARKS.parent / "docs" / "screenshots.md").read_text()
    assert "**reads** (0.993 / 0.050)" in saved


def test_the_screenshot_throughput_page_is_its_saved_runs():
    """The page embeds `pipeline_overlap.py --table` of the saved file, whose samples the saved run
    records give again."""
    from pipeline_overlap import summarize, throughput_table

    saved = json.loads((BENCHMARKS / "results" / "pipeline_overlap_screenshots.json").read_text())
    for sample in saved["samples"]:
        again = summarize(BENCHMARKS / "results" / "pipeline_overlap_screenshots" / f"{sample['variant']}-s{sample['seed']}")
        assert again == pytest.approx({k: v for k, v in sample.items() if k not in ("variant", "seed")}, nan_ok=True)
    table = throughput_table(saved["samples"])
    assert table in (BENCHMARKS.parent / "docs" / "results" / "2026-12-07-asyncwebrl.md").read_text()
    assert "| one_step_off | 3 | 1.094 (1.078-1.098) | 0.85x (0.83-0.85) |" in table


def test_every_published_result_file_is_rerun_by_run_all():
    import run_all

    published = {p.stem for p in (BENCHMARKS / "results").glob("*.json")}
    assert published - {b.name for b in run_all.BENCHMARKS} - set(run_all.WRITTEN_ELSEWHERE) == set()


def test_the_normalizer_page_is_its_saved_runs():
    from normalizer import page

    tables = page()
    assert tables in (BENCHMARKS.parent / "docs" / "results" / "2026-12-07-asyncwebrl.md").read_text()
    assert "| mean_turns_won, steps 17-24 (turns) | 5 | -0.50 [-5.17, +4.17] | 6.2 | no difference at this power |" in tables


def test_saved_reading_builds_are_labelled_and_paired_by_page(tmp_path):
    """Two builds' files: each build labelled by its steps and pages, the second's gap paired with the
    first's by page. Gaps (0.1, 0.0) then (0.3, 0.2): differences 0.2 and 0.2, no spread."""
    from screenshot_reading import layout_table, saved_samples

    def build(name, steps, pages, gaps, layout="row_tiles"):
        rows = [{"token_accuracy": 0.5 + g, "token_accuracy_swapped": 0.5, "cell_accuracy": 0.99,
                 "cell_accuracy_swapped": 0.04} for g in gaps]
        other = {"layout": "grid", "steps": steps, "train_pages": pages, "pages": rows}
        (tmp_path / name).write_text(json.dumps({"samples": [other, {"layout": layout, "steps": steps,
                                                                         "train_pages": pages, "pages": rows}]}))
        return str(tmp_path / name)

    files = [build("a.json", 300, 317, [0.1, 0.0]), build("b.json", 2000, 1252, [0.3, 0.2])]
    samples = saved_samples(files, ["row_tiles"])
    assert [s["layout"] for s in samples] == ["row_tiles, 300 steps on 317 pages", "row_tiles, 2000 steps on 1252 pages"]
    assert "the reading gap paired by page: +0.200 [+0.200, +0.200]" in layout_table(samples)
    assert [s["layout"] for s in saved_samples(files[:1])] == ["grid", "row_tiles"]  # one file: as saved


def test_the_reading_scale_table_in_the_docs_is_the_saved_runs():
    from screenshot_reading import layout_table, saved_samples

    files = [str(BENCHMARKS / "results" / f"screenshot_reading_{tag}.json") for tag in ("layouts", "scale")]
    table = layout_table(saved_samples(files, ["row_tiles"]))
    assert table in (BENCHMARKS.parent / "docs" / "screenshots.md").read_text()
    assert "| row_tiles, 2000 steps on 1252 pages | 16 | +0.055 [+0.036, +0.073] | no |" in table


def test_the_screenshots_pages_per_seed_rows_are_its_saved_held_out_file():
    """docs/results/2026-12-05-screenshots.md's before/after rows: Avg@1, held-out KL and invalid
    actions of each seed, from screenshot_heldout_kl.json (its training clock column has no saved source)."""
    saved = json.loads((BENCHMARKS / "results" / "screenshot_heldout_kl.json").read_text())["samples"]
    page = (BENCHMARKS.parent / "docs" / "results" / "2026-12-05-screenshots.md").read_text()
    for seed, run in enumerate(saved):
        b, a = run["before"], run["after"]
        assert run["run"].endswith(f"-s{seed}")
        assert (f"| {seed} | {b['won']}/{b['goals']} | {a['won']}/{a['goals']} | {b['kl']:.3f} | {a['kl']:.3f} | "
                f"{b['invalid']:.2f} | {a['invalid']:.2f} |") in page
