"""Frontier math and the `turnopd frontier` command, on hand-made metrics files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from turnopd.analysis.frontier import (
    CurvePoint,
    EvalPoint,
    FrontierError,
    Interval,
    accuracy_at,
    bootstrap_accuracy,
    bootstrap_difference,
    busy_shares,
    compare,
    load_run,
    mean_curve,
    mixed_builds,
    pareto_front,
    phase_shares,
    speedup,
    time_to_reach,
    turn_kl_bands,
)
from turnopd.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(root: Path, name: str, *, method: str, seed: int = 0, total_steps: int,
              train: list[tuple[int, float]], evals: list[tuple[int, float, float]],
              config: dict | None = None, models: dict | None = None, code: dict | None = None,
              **train_fields) -> Path:
    """A run folder: train = [(step, train_time_s)], evals = [(step, train_time_s, avg_at_k)];
    models, code: the start record's; train_fields are added to every train record."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    records = [{"kind": "start", "name": name, "method": method, "seed": seed, "total_steps": total_steps,
                "resumed_from_step": 0, **({"models": models} if models else {}), **({"code": code} if code else {})}]
    records += [{"kind": "train", "step": s, "train_time_s": t, "wall_time_s": t, **train_fields}
                for s, t in train]
    records += [{"kind": "eval", "step": s, "train_time_s": t, "split": "valid_unseen", "k": 1, "avg_at_k": a,
                 "eval_time_s": 2.0} for s, t, a in evals]
    records.sort(key=lambda r: (r.get("step", -1), r["kind"] == "eval"))  # the order a run writes them
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (run_dir / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    return run_dir


def by_label(cmp) -> dict:
    return {row.group.label: row for row in cmp.rows}


def evals_of(*points: tuple[int, float, float]) -> list[EvalPoint]:
    return [EvalPoint(*p) for p in points]


# ---- pure functions ---------------------------------------------------------------------------------


def test_accuracy_between_evaluations_is_the_last_one_at_or_before():
    evals = evals_of((5, 50.0, 0.1), (10, 100.0, 0.4), (20, 200.0, 0.6))
    assert accuracy_at(evals, 4, "step") is None  # before the first evaluation
    assert accuracy_at(evals, 5, "step") == 0.1
    assert accuracy_at(evals, 15, "step") == 0.4
    assert accuracy_at(evals, 25, "step") == 0.6  # holds after the last
    assert accuracy_at(evals, 199.9, "time") == 0.4
    assert accuracy_at(evals, 200.0, "time") == 0.6


def test_pareto_front_keeps_only_undominated_points():
    points = [(1, 0.5), (2, 0.4), (2, 0.6), (3, 0.6), (4, 0.8), (0.5, 0.1), (4, 0.8)]
    # (2, .4) loses to (2, .6); (3, .6) to (2, .6) (same accuracy, earlier); the repeated (4, .8) once
    assert pareto_front(points) == [(0.5, 0.1), (1, 0.5), (2, 0.6), (4, 0.8)]


def test_speedup_and_time_to_reach():
    curve = [CurvePoint(0, 0.2, 0), CurvePoint(50, 0.6, 0), CurvePoint(80, 0.72, 0)]
    assert time_to_reach(curve, 0.7) == 80
    assert time_to_reach(curve, 0.8) is None
    assert speedup(200.0, 80.0) == 200 / 80
    assert speedup(200.0, None) is None
    assert speedup(200.0, 0.0) == math.inf  # reached at the start, before any training
    assert speedup(0.0, 0.0) == 1.0


def test_time_to_reach_counts_a_target_only_once_it_holds():
    # 0.72 at 50 s, then 0.6 at 80 s, then 0.71 and 0.75: reached (and held) from 120 s on
    curve = [CurvePoint(50, 0.72, 0), CurvePoint(80, 0.6, 0), CurvePoint(120, 0.71, 0), CurvePoint(200, 0.75, 0)]
    assert time_to_reach(curve, 0.7) == 120
    assert time_to_reach(curve[:2], 0.7) is None  # a lucky evaluation that did not hold


def test_a_baseline_ending_below_its_start_is_not_reached_by_the_start(tmp_path: Path):
    # vanilla starts at 0.5 and ends at 0.4; its step-0 evaluation does not count as reaching 0.4,
    # so it reaches its target at its first evaluation after step 0 that holds: step 2 (0.4)
    runs = [
        write_run(tmp_path, "opd", method="vanilla_opd", total_steps=2, train=[(1, 10.0), (2, 20.0)],
                  evals=[(0, 0.0, 0.5), (1, 10.0, 0.3), (2, 20.0, 0.4)]),
        write_run(tmp_path, "td", method="turnopd", total_steps=2, train=[(1, 5.0), (2, 10.0)],
                  evals=[(0, 0.0, 0.5), (1, 5.0, 0.45), (2, 10.0, 0.42)]),
    ]
    cmp = compare([load_run(d) for d in runs])
    opd, td = cmp.rows
    assert cmp.baseline_time_s == 20.0 and td.time_to_target_s == 5.0 and td.speedup == 4.0
    assert opd.speedup == 1.0  # not infinity: nobody reached it at 0 s


def test_bootstrap_intervals_on_hand_made_per_task_scores():
    rng = np.random.default_rng(0)
    # one seed, 4 tasks all won: every resample means 1 -> 1.0 [1.0, 1.0]
    won = EvalPoint(10, 1.0, 1.0, {f"t{i}": 1.0 for i in range(4)})
    assert bootstrap_accuracy([won], rng) == Interval(1.0, 1.0, 1.0)
    # seed A: t0..t3 = 1, 1, 0, 0; seed B: 1, 0, 0, 0 -> mean (0.5 + 0.25) / 2 = 0.375
    a = EvalPoint(10, 1.0, 0.5, {"t0": 1.0, "t1": 1.0, "t2": 0.0, "t3": 0.0})
    b = EvalPoint(10, 1.0, 0.25, {"t0": 1.0, "t1": 0.0, "t2": 0.0, "t3": 0.0})
    acc = bootstrap_accuracy([a, b], rng)
    assert acc.value == pytest.approx(0.375) and 0.0 <= acc.lo < 0.375 < acc.hi <= 1.0
    # paired by task and seed: a group against itself differs by exactly 0 in every resample
    assert bootstrap_difference({0: a, 1: b}, {0: a, 1: b}, rng) == Interval(0.0, 0.0, 0.0)
    # the same shift on every task (all won vs all lost): 1 [1, 1]
    lost = EvalPoint(10, 1.0, 0.0, {f"t{i}": 0.0 for i in range(4)})
    assert bootstrap_difference({0: won}, {0: lost}, rng) == Interval(1.0, 1.0, 1.0)


def test_work_ratio_to_the_baselines_accuracy(tmp_path: Path):
    # two seeds each; vanilla reaches its final 0.6 at step 2 having played 100 + 100 env steps;
    # turnopd reaches it at step 1 with 60 env steps: work ratio 200 / 60
    def run(name, method, seed, evals, env_steps):
        config = {"name": name, "seed": seed, "output_dir": str(tmp_path), "x": method}
        return write_run(tmp_path, name, method=method, seed=seed, total_steps=2,
                         train=[(1, 10.0), (2, 20.0)], evals=evals, config=config, env_steps=env_steps[0],
                         tokens_generated=10, tokens_scored=100, tokens_trained=50)

    dirs = [run(f"opd-s{s}", "vanilla_opd", s, [(0, 0.0, 0.2), (1, 10.0, 0.4), (2, 20.0, 0.6)], [100])
            for s in (0, 1)]
    dirs += [run(f"td-s{s}", "turnopd", s, [(0, 0.0, 0.2), (1, 10.0, 0.6), (2, 20.0, 0.6)], [60]) for s in (0, 1)]
    cmp = compare([load_run(d) for d in dirs])
    td = by_label(cmp)["turnopd"]
    ratio = td.work_ratio["env_steps"]
    assert ratio.value == pytest.approx(200 / 60) and ratio.lo == ratio.hi == pytest.approx(200 / 60)
    assert td.work["env_steps"] == 120  # a whole run: 2 steps of 60
    assert td.speedup == 2.0 and td.speedup_interval == (2.0, 2.0) and td.reached_share == 1.0


def test_seed_mean_curve_starts_where_every_seed_was_evaluated():
    seed0 = evals_of((0, 0.0, 0.2), (10, 10.0, 0.6))
    seed1 = evals_of((5, 5.0, 0.5), (12, 12.0, 0.8))
    curve = mean_curve([seed0, seed1, []], "time")  # the unevaluated seed is left out
    # x=0: seed1 not yet evaluated, skipped; x=5: (.2+.5)/2; x=10: (.6+.5)/2; x=12: (.6+.8)/2
    assert [p.x for p in curve] == [5.0, 10.0, 12.0]
    assert [p.mean for p in curve] == pytest.approx([0.35, 0.55, 0.7])
    # sample std of two values a, b is |a - b| / sqrt(2)
    assert [p.std for p in curve] == pytest.approx([d / math.sqrt(2) for d in (0.3, 0.1, 0.2)])


# ---- runs on disk -----------------------------------------------------------------------------------


@pytest.fixture
def cadence_runs(tmp_path: Path) -> tuple[Path, Path]:
    """A: complete, 30 steps at 10 s each, evaluated every 10 steps. B: in progress at step 17
    (4 s per step), evaluated every 5 steps."""
    a = write_run(tmp_path, "a", method="vanilla_opd", total_steps=30,
                  train=[(s, 10.0 * s) for s in range(1, 31)],
                  evals=[(0, 0.0, 0.10), (10, 100.0, 0.30), (20, 200.0, 0.50), (30, 300.0, 0.70)])
    b = write_run(tmp_path, "b", method="turnopd", total_steps=30,
                  train=[(s, 4.0 * s) for s in range(1, 18)],
                  evals=[(0, 0.0, 0.10), (5, 20.0, 0.20), (10, 40.0, 0.40), (15, 60.0, 0.60)])
    return a, b


def test_same_step_and_least_time_picks_with_different_cadences(cadence_runs):
    cmp = compare([load_run(d) for d in cadence_runs])
    a, b = cmp.rows
    # the largest step both reached: min(30, 17) = 17; A's last eval at or before it is step 10,
    # B's step 15
    assert cmp.same_step == 17
    assert (a.same_step.mean, b.same_step.mean) == (0.30, 0.60)
    # the shortest training clock: B's 17 * 4 s = 68 s; A was last evaluated at 0 s by then, B at 60 s
    assert cmp.least_time_s == 68.0 and cmp.least_time_run == "b"
    assert (a.least_time.mean, b.least_time.mean) == (0.10, 0.60)
    assert (a.final.mean, b.final.mean) == (0.70, 0.60)


def test_speedup_against_the_baseline(tmp_path: Path):
    runs = [
        write_run(tmp_path, "opd", method="vanilla_opd", total_steps=3,
                  train=[(1, 100.0), (2, 200.0), (3, 300.0)],
                  evals=[(0, 0.0, 0.2), (1, 100.0, 0.5), (2, 200.0, 0.7), (3, 300.0, 0.7)]),
        write_run(tmp_path, "fast", method="turnopd", total_steps=3, train=[(1, 50.0), (2, 80.0), (3, 150.0)],
                  evals=[(0, 0.0, 0.2), (1, 50.0, 0.6), (2, 80.0, 0.72), (3, 150.0, 0.75)]),
        write_run(tmp_path, "slow", method="tcod", total_steps=2, train=[(1, 100.0), (2, 250.0)],
                  evals=[(0, 0.0, 0.2), (1, 100.0, 0.65), (2, 250.0, 0.69)]),
    ]
    cmp = compare([load_run(d) for d in runs])  # vanilla_opd is the default baseline
    assert [r.group.label for r in cmp.rows] == ["fast", "opd", "slow"]  # sorted by label
    fast, opd, slow = cmp.rows
    # the baseline's final 0.7 is first reached at 200 s (not at its end, 300 s)
    assert cmp.target == 0.7 and cmp.baseline_time_s == 200.0
    assert opd.speedup == 1.0
    assert fast.time_to_target_s == 80.0 and fast.speedup == 200.0 / 80.0
    assert slow.time_to_target_s is None and slow.speedup is None
    # against another baseline: "fast" reaches its final 0.75 at 150 s; nobody else does
    by_fast = compare([load_run(d) for d in runs], baseline="fast")
    assert [r.speedup for r in by_fast.rows] == [1.0, None, None]


def test_the_target_is_on_the_curves_metric_not_the_final_sampled_one(tmp_path: Path):
    # greedy Avg@1 along the way, then a final sampled Avg@4 that scores lower (0.3)
    runs = [write_run(tmp_path, "opd", method="vanilla_opd", total_steps=2, train=[(1, 100.0), (2, 200.0)],
                      evals=[(0, 0.0, 0.2), (1, 100.0, 0.4), (2, 200.0, 0.5)]),
            write_run(tmp_path, "td", method="turnopd", total_steps=2, train=[(1, 50.0), (2, 100.0)],
                      evals=[(0, 0.0, 0.2), (1, 50.0, 0.35), (2, 100.0, 0.5)])]
    with (runs[0] / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "final_eval", "step": 2, "train_time_s": 200.0, "split": "valid_unseen",
                            "k": 4, "avg_at_k": 0.3, "eval_time_s": 2.0}) + "\n")
    cmp = compare([load_run(d) for d in runs])
    opd, td = cmp.rows
    assert opd.final.mean == 0.3  # the final column is the sampled evaluation
    # against 0.3 both would "reach" it at their first evaluation (0.4 at 100 s, 0.35 at 50 s: 2x);
    # against the curve's own 0.5: 200 s vs 100 s
    assert cmp.target == 0.5 and cmp.baseline_time_s == 200.0
    assert td.time_to_target_s == 100.0 and td.speedup == 2.0


def test_seeds_of_a_method_are_aggregated(tmp_path: Path):
    def run(name: str, method: str, seed: int, evals):
        # config.yaml differs between seeds only in the per-run keys (the tracker's group: seed 1 came
        # from another sweep), so the seeds form one group
        config = {"name": name, "seed": seed, "output_dir": str(tmp_path), "trainer": {"lr": 1e-6},
                  "tracker": {"group": f"sweep{seed}", "tags": [method]}}
        return write_run(tmp_path, name, method=method, seed=seed, total_steps=1,
                         train=[(1, evals[-1][1])], evals=evals, config=config)

    dirs = [run("opd-s0", "vanilla_opd", 0, [(0, 0.0, 0.2), (1, 100.0, 0.6)]),
            run("opd-s1", "vanilla_opd", 1, [(0, 0.0, 0.4), (1, 120.0, 0.8)]),
            run("td-s0", "turnopd", 0, [(0, 0.0, 0.2), (1, 60.0, 0.8)]),
            run("td-s1", "turnopd", 1, [(0, 0.0, 0.2), (1, 50.0, 0.6)])]
    cmp = compare([load_run(d) for d in dirs])
    assert [(r.group.label, len(r.group.runs)) for r in cmp.rows] == [("turnopd", 2), ("vanilla_opd", 2)]
    td, opd = cmp.rows
    # baseline final = mean(.6, .8) = .7, sample std |.6 - .8| / sqrt(2); its seed-mean curve:
    # t=100: (.6+.4)/2 = .5, t=120: (.6+.8)/2 = .7, so it reaches .7 at 120 s
    assert opd.final.mean == pytest.approx(0.7)
    assert opd.final.std == pytest.approx(0.2 / math.sqrt(2))
    assert cmp.baseline_time_s == 120.0
    # turnopd's curve: t=50: (.2+.6)/2 = .4, t=60: (.8+.6)/2 = .7, so it reaches .7 at 60 s
    assert td.time_to_target_s == 60.0
    assert td.speedup == pytest.approx(120.0 / 60.0)


def test_runs_of_one_method_with_different_recipes_stay_apart(tmp_path: Path):
    def run(name: str, lr: float):
        return write_run(tmp_path, name, method="turnopd", total_steps=1, train=[(1, 1.0)],
                         evals=[(1, 1.0, 0.5)], config={"name": name, "seed": 0, "trainer": {"lr": lr}})

    cmp = compare([load_run(run("lr-small", 1e-6)), load_run(run("lr-big", 1e-5))])
    assert [r.group.label for r in cmp.rows] == ["lr-big", "lr-small"]


def test_a_key_a_run_did_not_record_is_its_default_and_per_seed_keys_do_not_split(tmp_path: Path):
    def run(name: str, seed: int, env: dict, amount: float):
        config = {"name": name, "seed": seed, "env": env, "trainer": {"budget": {"unit": "env_steps", "amount": amount}}}
        return write_run(tmp_path, name, method="vanilla_opd", seed=seed, total_steps=1, train=[(1, 1.0)],
                         evals=[(1, 1.0, 0.5)], config=config)

    # seed 0 was saved before env.pool existed; seed 1 recorded its default "local"; seed 2 ran on Ray
    dirs = [run("a-s0", 0, {"name": "alfworld"}, 2842.0), run("a-s1", 1, {"name": "alfworld", "pool": "local"}, 4214.0),
            run("a-s2", 2, {"name": "alfworld", "pool": "ray"}, 3000.0)]
    labels = [r.group.label for r in compare([load_run(d) for d in dirs], baseline="a-s0").rows]
    assert labels == ["a-s0", "a-s1", "a-s2"]  # the budgets differ: three recipes
    grouped = compare([load_run(d, per_seed_keys=["trainer.budget.amount"]) for d in dirs], baseline="a").rows
    # two vanilla_opd groups: the one of two seeds is labelled by its names' stem, not its method
    assert [(r.group.label, [run.seed for run in r.group.runs]) for r in grouped] == [("a", [0, 1]), ("a-s2", [2])]


def test_runs_with_the_same_seed_are_not_aggregated(tmp_path: Path):
    dirs = [write_run(tmp_path, name, method="turnopd", seed=0, total_steps=1, train=[(1, 1.0)],
                      evals=[(1, 1.0, acc)]) for name, acc in (("first", 0.4), ("rerun", 0.6))]
    cmp = compare([load_run(d) for d in dirs])
    assert [(r.group.label, r.final.mean) for r in cmp.rows] == [("first", 0.4), ("rerun", 0.6)]


def builds(student: str, teacher: str, teacher_path: str = "/m/teacher") -> dict:
    return {"student": {"path": "/m/student", "weights": student},
            "teacher:alfworld": {"path": teacher_path, "weights": teacher}}


def test_runs_of_two_builds_of_one_model_folder_are_named(tmp_path: Path, capsys):
    # s0, s1 on one teacher build, s2 on another (say, built again on another install); the
    # relabelled teacher is another folder, so it differs on purpose; the old run has no record
    specs = {"turnopd-s0": builds("aa", "t1"), "turnopd-s1": builds("aa", "t1"), "turnopd-s2": builds("aa", "t2"),
             "relabelled-s0": builds("aa", "t9", "/m/teacher_dagger"), "old": None}
    dirs = [write_run(tmp_path, name, method="turnopd", seed=i, total_steps=1, train=[(1, 1.0)],
                      evals=[(1, 1.0, 0.5)], models=models) for i, (name, models) in enumerate(specs.items())]
    runs = [load_run(d) for d in dirs]
    assert mixed_builds(runs) == ["teacher:alfworld /m/teacher has 2 builds among these runs: "
                                  "t1 in turnopd-s0, turnopd-s1; t2 in turnopd-s2"]
    assert mixed_builds(runs[:2] + runs[3:]) == []
    assert main(["frontier", *map(str, dirs), "--md", "--out", str(tmp_path / "f.png")]) == 0
    assert ("WARNING: teacher:alfworld /m/teacher has 2 builds among these runs: t1 in turnopd-s0, turnopd-s1; "
            "t2 in turnopd-s2; differences between those runs mix the builds.") in capsys.readouterr().out


def test_runs_of_two_builds_of_the_code_are_named(tmp_path: Path):
    # s0 and s1 ran code build c1, s2 ran c2 (the library changed between them); the old run has no record
    codes = {"turnopd-s0": "c1", "turnopd-s1": "c1", "turnopd-s2": "c2", "old": None}
    dirs = [write_run(tmp_path, name, method="turnopd", seed=i, total_steps=1, train=[(1, 1.0)], evals=[(1, 1.0, 0.5)],
                      **({"code": {"version": "0.1.0", "source": code}} if code else {}))
            for i, (name, code) in enumerate(codes.items())]
    runs = [load_run(d) for d in dirs]
    assert [run.code for run in runs] == ["c1", "c1", "c2", None]
    assert mixed_builds(runs) == ["the code has 2 builds among these runs: c1 in turnopd-s0, turnopd-s1; c2 in turnopd-s2"]
    assert mixed_builds(runs[:2] + runs[3:]) == []


def test_a_run_resumed_on_another_build_of_the_code_is_warned_about(tmp_path: Path):
    run_dir = write_run(tmp_path, "resumed", method="turnopd", total_steps=2, train=[(1, 1.0), (2, 2.0)],
                        evals=[(2, 2.0, 0.5)], code={"version": "0.1.0", "source": "c1"})
    restart = {"kind": "start", "name": "resumed", "method": "turnopd", "seed": 0, "total_steps": 2,
               "resumed_from_step": 1, "code": {"version": "0.1.0", "source": "c2"}}
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(restart) + "\n")
    with pytest.warns(UserWarning, match="different builds of the code .*: c1 then c2"):
        assert load_run(run_dir).code == "c2"


def test_a_run_resumed_on_another_build_is_named(tmp_path: Path):
    run_dir = write_run(tmp_path, "r", method="turnopd", total_steps=2, train=[(1, 1.0), (2, 2.0)],
                        evals=[(2, 2.0, 0.5)], models=builds("aa", "t1"))
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "start", "name": "r", "method": "turnopd", "seed": 0, "total_steps": 2,
                            "resumed_from_step": 1, "models": builds("aa", "t2")}) + "\n")
    with pytest.warns(UserWarning, match="its starts name different model weights"):
        run = load_run(run_dir)
    assert run.models == builds("aa", "t2")


def test_phase_shares_are_of_the_training_clock(tmp_path: Path):
    # 2 steps of 10 s: rollout 6 + teacher 2 + train 1 = 9 s of 10 each; eval lies outside the clock
    run_dir = write_run(tmp_path, "r", method="turnopd", total_steps=2, train=[(1, 10.0), (2, 20.0)],
                        evals=[],
                        phases={"rollout": 6.0, "teacher": 2.0, "train": 1.0, "eval": 5.0})
    shares = phase_shares([load_run(run_dir)])
    assert shares == pytest.approx({"rollout": 0.6, "teacher": 0.2, "train": 0.1, "other": 0.1})


def test_busy_shares_overlap_and_are_of_the_training_clock(tmp_path: Path):
    # 2 steps of 10 s; generation and env worked at the same time (5 + 4 s of a 6 s rollout phase)
    run_dir = write_run(tmp_path, "r", method="turnopd", total_steps=2, train=[(1, 10.0), (2, 20.0)], evals=[],
                        phases={"rollout": 6.0, "train": 1.0}, busy={"generation": 5.0, "env": 4.0, "trainer": 1.0})
    run = load_run(run_dir)
    assert busy_shares([run]) == pytest.approx({"generation": 0.5, "env": 0.4, "trainer": 0.1})
    assert phase_shares([run]) == pytest.approx({"rollout": 0.6, "train": 0.1, "other": 0.3})


def test_mean_depth_and_deep_turn_share(tmp_path: Path):
    run_dir = write_run(tmp_path, "r", method="turnopd", total_steps=2, train=[(1, 1.0), (2, 2.0)], evals=[],
                        rollout_depth_cap=10, mean_turns=7.5, deep_turn_share=0.25)
    row = compare([load_run(run_dir)]).rows[0]
    assert (row.mean_cap, row.mean_turns, row.deep_turn_share) == (10, 7.5, 0.25)


def test_turn_kl_bands_average_the_profiles_per_band_of_turns(tmp_path: Path):
    # step 1 reached turns 0-4, step 2 turns 0-1; bands of 2 turns:
    # [0, 2): (0.1 + 0.3 + 0.5 + 0.7) / 4 = 0.4; [2, 4): (0.2 + 0.4) / 2 = 0.3; [4, 6): 0.9
    run_dir = write_run(tmp_path, "r", method="turnopd", total_steps=2, train=[(1, 1.0), (2, 2.0)], evals=[])
    run = load_run(run_dir)
    run.train[0].turn_kl_profile = [0.1, 0.3, 0.2, 0.4, 0.9]
    run.train[1].turn_kl_profile = [0.5, 0.7]
    assert turn_kl_bands([run], 2) == pytest.approx([0.4, 0.3, 0.9])
    assert turn_kl_bands([run], 10) == pytest.approx([(0.1 + 0.3 + 0.2 + 0.4 + 0.9 + 0.5 + 0.7) / 7])
    run.train[1].turn_kl_profile = None  # a record without a profile (an older run) counts for nothing
    assert turn_kl_bands([run], 2) == pytest.approx([0.2, 0.3, 0.9])


def test_familiarity_signal_bands_and_their_table(tmp_path: Path):
    # context_logprob: step 1 turns 0-2, step 2 turn 0; bands of 10: (-1 - 2 - 3 - 4) / 4 = -2.5
    run_dir = write_run(tmp_path, "r", method="turnopd", total_steps=2, train=[(1, 1.0), (2, 2.0)], evals=[],
                        familiarity_kept_share=0.75)
    run = load_run(run_dir)
    run.train[0].turn_signal_profiles = {"context_logprob": [-1.0, -2.0, -3.0], "action_entropy": [0.5]}
    run.train[1].turn_signal_profiles = {"context_logprob": [-4.0]}
    assert turn_kl_bands([run], 2, "context_logprob") == pytest.approx([-2.0 - 1 / 3, -3.0])
    row = compare([run]).rows[0]
    assert row.turn_signal_bands == {"action_entropy": [0.5], "context_logprob": [pytest.approx(-2.5)]}
    assert row.familiarity_kept_share == 0.75
    from turnopd.commands.frontier import familiarity_table
    _, headers, rows = familiarity_table(compare([run]))
    assert headers == ["run", "signal", "turns 1-10", "weight kept"]
    assert [r[1:] for r in rows] == [["action_entropy", "0.500", "75%"], ["context_logprob", "-2.500", "75%"]]


def test_a_folder_without_metrics_is_named(tmp_path: Path):
    (tmp_path / "sweep" / "x-s0").mkdir(parents=True)
    (tmp_path / "sweep" / "x-s0" / "metrics.jsonl").write_text("")
    with pytest.raises(FrontierError, match=r"sweep has no metrics\.jsonl; its subfolders x-s0 are runs"):
        load_run(tmp_path / "sweep")


def test_unknown_baseline_lists_the_choices(cadence_runs):
    with pytest.raises(FrontierError, match="allowed: a, b, turnopd, vanilla_opd"):
        compare([load_run(d) for d in cadence_runs], baseline="tcod")


def test_a_truncated_last_line_is_skipped_with_a_warning(tmp_path: Path):
    run_dir = write_run(tmp_path, "r", method="turnopd", total_steps=5, train=[(1, 1.0), (2, 2.0)],
                        evals=[(0, 0.0, 0.1), (2, 2.0, 0.3)])
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"kind": "eval", "step": 3, "train_ti')  # the run was killed mid-write
    with pytest.warns(UserWarning, match="truncated"):
        run = load_run(run_dir)
    assert [e.step for e in run.evals] == [0, 2]
    assert run.steps_done == 2 and not run.complete


# ---- the command ------------------------------------------------------------------------------------


def markdown_tables(text: str) -> list[dict[str, list[str]]]:
    """Each markdown table of the text as {first cell of a row: the row's cells}."""
    tables, current = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if current is None:
            current = {}
            tables.append(current)
        elif not line.startswith("|---"):
            current[cells[0]] = cells
    return tables


def test_frontier_command_prints_markdown_and_writes_the_png(cadence_runs, tmp_path: Path, capsys):
    out = tmp_path / "plots" / "f.png"
    assert main(["frontier", *map(str, cadence_runs), "--md", "--out", str(out), "--baseline", "a"]) == 0
    text = capsys.readouterr().out
    accuracy, work, by_seed, cost, turn_kl = markdown_tables(text)
    # final, the difference from the baseline (no per-task scores in the fixture: none), Same-Step
    # (step 17), Least-Time (68 s) in %, from the cadence_runs fixture; B is in progress
    assert accuracy["a"][5:9] == ["70.0", "–", "30.0", "10.0"]
    assert accuracy["b"][3] == "17/30 (in progress)"
    assert accuracy["b"][5:9] == ["60.0", "–", "60.0", "60.0"]
    # A's final 70% is first reached at 300 s; B never reaches it, in time or in work
    assert accuracy["a"][9:] == ["5.0 min", "1.00x", "1.00x"]
    assert accuracy["b"][9:] == ["not reached", "not reached", "not reached"]
    assert set(work) == set(cost) == {"a", "b"}
    assert set(by_seed) == {"b"}  # against the baseline a, paired by seed
    assert set(turn_kl) == {"a", "b"}  # the fixture's records carry no per-turn KL
    assert "step-wise interpolation" in text
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000


def test_frontier_by_step_on_runs_in_progress(tmp_path: Path, capsys):
    # one run evaluated only at the start, one not evaluated yet: nothing to plot for it, no error
    started = write_run(tmp_path, "started", method="turnopd", total_steps=100, train=[(1, 3.0), (2, 6.0)],
                        evals=[(0, 0.0, 0.1)], rollout_depth_cap=50, alpha=0.01)
    fresh = write_run(tmp_path, "fresh", method="vanilla_opd", total_steps=100, train=[(1, 5.0)], evals=[])
    assert main(["frontier", str(started), str(fresh), "--by", "step", "--md"]) == 0
    text = capsys.readouterr().out
    accuracy = markdown_tables(text)[0]
    assert accuracy["fresh"][3] == "1/100 (in progress)"
    assert accuracy["fresh"][5:8] == ["–", "–", "–"]  # not evaluated yet
    png = tmp_path / "frontier-by-step.png"  # default: beside the run folders
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_frontier_command_reports_a_missing_run(tmp_path: Path, capsys):
    assert main(["frontier", str(tmp_path / "nope")]) == 2
    assert f"run folder {tmp_path / 'nope'} has no metrics.jsonl" in capsys.readouterr().err


# ---- over seeds: t intervals, equal budgets, non-inferiority, order ----------------------------------


def test_t_interval_detectable_effect_and_verdicts_by_hand():
    from turnopd.analysis.frontier import Interval, detectable_effect, non_inferiority, t_interval

    # values .1 and .3: mean .2, s = .1 * sqrt(2) = .141421, n 2, t(0.975, 1) = 12.706:
    # half-width 12.706 * .141421 / sqrt(2) = 1.2706
    interval = t_interval([0.1, 0.3])
    assert (interval.value, interval.lo, interval.hi) == pytest.approx((0.2, 0.2 - 1.2706, 0.2 + 1.2706))
    assert t_interval([0.5]) is None
    # (t(0.975, 1) + t(0.80, 1)) s / sqrt(n) = (12.706 + 1.376) * .1 = 1.4082
    assert detectable_effect([0.1, 0.3]) == pytest.approx(1.4082)
    assert non_inferiority(Interval(0.01, -0.02, 0.04), margin=0.05) == "non-inferior"
    assert non_inferiority(Interval(-0.1, -0.2, -0.06), margin=0.05) == "inferior"
    assert non_inferiority(Interval(-0.03, -0.08, 0.02), margin=0.05) == "inconclusive"


def test_the_paired_ratio_is_a_geometric_mean_whose_inverse_is_its_reciprocal():
    from turnopd.analysis.frontier import ratio_interval

    # ratios 2, 1/2, 1: logs ln 2, -ln 2, 0: mean 0 (ratio 1), s = ln 2 = .693147, t(0.975, 2) = 4.303:
    # half 4.303 x .693147 / sqrt 3 = 1.72201, exp(-+1.72201) = .17870, 5.5958
    ratio = ratio_interval([2.0, 0.5, 1.0])
    assert (ratio.value, ratio.lo, ratio.hi) == pytest.approx((1.0, 0.17870, 5.5958), rel=1e-4)
    # the other way round (this run's over the baseline's) is 1/x [1/hi, 1/lo]: one ratio, either way
    forward, inverse = ratio_interval([1.5, 1.2, 1.0, 1.3]), ratio_interval([1 / 1.5, 1 / 1.2, 1.0, 1 / 1.3])
    assert (inverse.value, inverse.lo, inverse.hi) == pytest.approx((1 / forward.value, 1 / forward.hi, 1 / forward.lo))
    assert forward.value == pytest.approx((1.5 * 1.2 * 1.0 * 1.3) ** 0.25) and ratio_interval([1.2]) is None


def _seed_pair_runs(tmp_path: Path) -> list:
    """vanilla: 4 steps of 10 s and 6 env steps; turnopd seed 0: 8 s and 8 env steps a step, seed 1:
    10 s and 8 env steps; evaluations at steps 0, 2, 4."""
    runs = []
    for method, seed, seconds, env_steps, accuracies in (
            ("vanilla_opd", 0, 10.0, 6, (0.3, 0.5)), ("vanilla_opd", 1, 10.0, 6, (0.4, 0.4)),
            ("turnopd", 0, 8.0, 8, (0.45, 0.55)), ("turnopd", 1, 10.0, 8, (0.35, 0.5))):
        runs.append(load_run(write_run(
            tmp_path, f"{method}-s{seed}", method=method, seed=seed, total_steps=4,
            train=[(s, s * seconds) for s in range(1, 5)], env_steps=env_steps,
            evals=[(0, 0.0, 0.2), (2, 2 * seconds, accuracies[0]), (4, 4 * seconds, accuracies[1])])))
    return runs


def test_a_group_against_the_baseline_paired_by_seed_by_hand(tmp_path):
    cmp = compare(_seed_pair_runs(tmp_path), margin=0.5)
    s = next(row for row in cmp.rows if row.group.method == "turnopd").by_seed
    assert s.seeds == [0, 1]
    # final differences .55 - .5 = .05 and .5 - .4 = .10: mean .075, s = .035355, half 12.706 s / sqrt 2 = .31765
    assert (s.difference.value, s.difference.lo, s.difference.hi) == pytest.approx((0.075, -0.24265, 0.39265), abs=1e-4)
    assert s.detectable == pytest.approx((12.706 + 1.376) * 0.035355 / math.sqrt(2), abs=1e-4)
    assert s.verdict == "non-inferior"  # -.24265 > -.5
    # clock: the baseline's 40 s over 32 s and 40 s; env steps 24 over 32 in both seeds
    assert s.clock_ratio == pytest.approx([1.25, 1.0])
    # geometric mean sqrt(1.25 x 1) = 1.1180; logs .22314, 0: mean .11157, s .15779, half 12.706 x .15779 / sqrt 2
    # = 1.41766: exp(.11157 -+ 1.41766) = .27089, 4.6145
    clock = s.clock_ratio_interval
    assert (clock.value, clock.lo, clock.hi) == pytest.approx((1.1180, 0.27089, 4.6145), abs=1e-4)
    assert (s.work_ratio["env_steps"].value, s.work_ratio["env_steps"].hi) == pytest.approx((0.75, 0.75))
    # at the baseline's clock (40 s) both seeds' last evaluations count: the final differences again;
    # at the baseline's 24 env steps only step 2 (16 env steps) counts: .45 - .5 and .35 - .4
    assert s.equal_clock.value == pytest.approx(0.075)
    assert (s.equal_work.value, s.equal_work.lo, s.equal_work.hi) == pytest.approx((-0.05, -0.05, -0.05))
    assert by_label(compare(_seed_pair_runs(tmp_path / "b"), margin=0.1))["turnopd"].by_seed.verdict == "inconclusive"


def test_the_order_of_the_run_folders_does_not_change_the_intervals(tmp_path):
    runs = _seed_pair_runs(tmp_path)
    for run in runs:  # per-task scores, so that the bootstrap intervals exist
        for e in run.evals:
            e.per_task.update({f"t{i}": float((i + e.step + run.seed) % 3 == 0) for i in range(6)})
    forward, backward = compare(runs, baseline="vanilla_opd"), compare(runs[::-1], baseline="vanilla_opd")
    assert [row.group.label for row in forward.rows] == [row.group.label for row in backward.rows]
    for row, other in zip(forward.rows, backward.rows, strict=True):
        assert (row.final_interval, row.difference, row.speedup_interval) == (
            other.final_interval, other.difference, other.speedup_interval)
    assert by_label(forward)["turnopd"].final_interval is not None and by_label(forward)["turnopd"].difference is not None


def test_frontier_prints_the_paired_table_and_the_verdict(tmp_path, capsys):
    runs = _seed_pair_runs(tmp_path)
    assert main(["frontier", *(str(run.path) for run in runs), "--md", "--margin", "50",
                 "--out", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert "non-inferior at 50 points?" in out
    [row] = [line for line in out.splitlines() if line.startswith("| turnopd |") and "non-inferior" in line]
    assert "+7.5 [-24.3, 39.3]" in row and "1.25 1.00" in row and "non-inferior" in row


def test_differences_with_no_spread_have_no_detectable_figure(tmp_path, capsys):
    # turnopd ends 10 points above vanilla in both seeds: the differences' stdev is 0, so no power figure
    runs = []
    for method, seed, final in (("vanilla_opd", 0, 0.3), ("vanilla_opd", 1, 0.5), ("turnopd", 0, 0.4), ("turnopd", 1, 0.6)):
        runs.append(write_run(tmp_path, f"{method}-s{seed}", method=method, seed=seed, total_steps=2,
                              train=[(1, 1.0), (2, 2.0)], evals=[(0, 0.0, 0.2), (2, 2.0, final)]))
    assert main(["frontier", *map(str, runs), "--md", "--out", str(tmp_path / "f.png")]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| turnopd | 0 1 |")]
    assert "+10.0 [10.0, 10.0]" in row and "- (no spread)" in row and "| 0.0 |" not in row


def test_a_run_its_training_budget_ended_is_complete_at_that_step(tmp_path):
    run_dir = write_run(tmp_path, "budgeted", method="vanilla_opd", total_steps=10, train=[(1, 1.0), (2, 2.0)],
                        evals=[(0, 0.0, 0.1), (2, 2.0, 0.3)])
    assert not load_run(run_dir).complete  # 2 of 10 steps
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "budget_reached", "step": 2, "unit": "env_steps", "amount": 5, "spent": 6}) + "\n")
    run = load_run(run_dir)
    assert run.budget_step == 2 and run.complete


def test_the_plot_legend_is_below_the_panels_which_keep_the_figure_width(tmp_path):
    from turnopd.analysis.plot import frontier_figure

    runs = [load_run(write_run(tmp_path, f"r{i}", method=m, total_steps=2, train=[(1, 10.0), (2, 20.0)],
                               evals=[(0, 0.0, 0.2), (2, 20.0, 0.4 + 0.1 * i)], rollout_depth_cap=5, alpha=0.5,
                               probed=False))
            for i, m in enumerate(("turnopd", "vanilla_opd"))]
    fig = frontier_figure(compare(runs), runs, "time")
    fig.canvas.draw()
    [legend] = fig.legends
    acc_ax, depth_ax = fig.axes[:2]
    # the panels span most of the figure's width; the whole legend lies below the lower panel's x label
    assert acc_ax.get_position().width > 0.8 and depth_ax.get_position().width > 0.8
    renderer = fig.canvas.get_renderer()
    assert legend.get_window_extent(renderer).y1 <= depth_ax.get_tightbbox(renderer).y0
    assert len(legend.get_texts()) >= 4  # two methods, the frontier, the Least-Time point


EQUAL_BUDGET_RUNS = Path(__file__).parent.parent / "benchmarks/results/frontier_alfworld/equal_budget"


def test_the_saved_equal_budget_runs_give_the_same_tables_in_any_folder_order(capsys):
    from turnopd.commands.frontier import print_report

    # seeds 0-2 of the three arms: the full vanilla run and the equal-work control are both vanilla_opd
    folders = sorted(p for p in EQUAL_BUDGET_RUNS.glob("*-s[012]") if p.is_dir())
    assert len(folders) == 9
    shuffled = [folders[i] for i in np.random.default_rng(5).permutation(len(folders))]
    tables = []
    for order in (shuffled, folders[::-1]):
        runs = [load_run(d, ["trainer.budget.amount"]) for d in order]
        cmp = compare(runs, baseline="equal_budget-vanilla_opd", margin=0.05)
        print_report(cmp, runs, md=True)
        tables.append(capsys.readouterr().out)
        assert [row.group.label for row in cmp.rows] == [
            "equal_budget-vanilla_opd", "equal_budget-vanilla_opd_at_turnopd_work", "turnopd"]
    assert tables[0] == tables[1]
    with pytest.raises(FrontierError, match="'vanilla_opd' matches several groups \\(equal_budget-vanilla_opd, "
                                            "equal_budget-vanilla_opd_at_turnopd_work\\)"):
        compare(runs, baseline="vanilla_opd")


def test_an_ambiguous_baseline_is_refused_with_the_candidate_groups(tmp_path, capsys):
    # two vanilla_opd recipes (lr 1e-6 and 1e-5) of two seeds each, and one turnopd run
    dirs = [write_run(tmp_path, f"{arm}-s{seed}", method="vanilla_opd", seed=seed, total_steps=1, train=[(1, 1.0)],
                      evals=[(1, 1.0, 0.5)], config={"name": f"{arm}-s{seed}", "seed": seed, "trainer": {"lr": lr}})
            for arm, lr in (("opd-small", 1e-6), ("opd-big", 1e-5)) for seed in (0, 1)]
    dirs.append(write_run(tmp_path, "td", method="turnopd", total_steps=1, train=[(1, 1.0)], evals=[(1, 1.0, 0.6)]))
    runs = [load_run(d) for d in dirs]
    for choice in ("vanilla_opd", None):  # named, and the default (the vanilla_opd group)
        with pytest.raises(FrontierError, match=r"\(opd-big, opd-small\)"):
            compare(runs, baseline=choice)
    assert compare(runs[::-1], baseline="opd-small").baseline.label == "opd-small"
    assert compare(runs, baseline="opd-big-s1").baseline.label == "opd-big"  # a run names its group
    assert main(["frontier", *map(str, dirs), "--baseline", "vanilla_opd", "--out", str(tmp_path / "f.png")]) == 2
    assert "matches several groups (opd-big, opd-small)" in capsys.readouterr().err


def test_the_notes_give_the_work_each_budgeted_group_achieved(tmp_path, capsys):
    # two seeds ended by an env-step budget of 6 and 10 after 7 and 13 env steps, one seed not ended by it
    for seed, budget in ((0, (6, 7)), (1, (10, 13)), (2, None)):
        run_dir = write_run(tmp_path, f"ctl-s{seed}", method="vanilla_opd", seed=seed, total_steps=4,
                            train=[(1, 1.0), (2, 2.0)], evals=[(2, 2.0, 0.5)])
        if budget:
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"kind": "budget_reached", "step": 2, "unit": "env_steps", "amount": budget[0],
                                    "spent": budget[1]}) + "\n")
    assert main(["frontier", *(str(tmp_path / f"ctl-s{s}") for s in range(3)), "--md",
                 "--out", str(tmp_path / "f.png")]) == 0
    # mean achieved (7 + 13) / 2 = 10 against (6 + 10) / 2 = 8; the most past its budget: 13 - 10 = +3
    assert ("vanilla_opd: trainer.budget ended 2 of 3 runs; env_steps achieved 10 per run against 8 budgeted "
            "(at most +3); compared at the work achieved.") in capsys.readouterr().out
