"""The teacher audit and the teacher's lead: their figures on hand-worked examples, and `turnopd teacher
audit` and `turnopd teacher lead` end to end on real ALFWorld games with tiny models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from envs import make_env_spec
from tests.conftest import loop_models
from turnopd.analysis.audit import (
    AuditMismatch,
    auc,
    bootstrap_auc,
    compare_audits,
    oriented,
    paired_difference,
    roc_curve,
    sample_states,
    teacher_lead,
    wilson_interval,
)
from turnopd.cli import main
from turnopd.orchestration.recipe import load_recipe


def test_auc_by_hand_with_ties_and_strata():
    # positives 0.9, 0.5; negatives 0.5, 0.1: pairs (0.9>0.5) (0.9>0.1) (0.5=0.5: 1/2) (0.5>0.1) -> 3.5 / 4
    assert auc([0.9, 0.5, 0.5, 0.1], [True, True, False, False]) == 0.875
    assert auc([1.0, 2.0], [True, True]) is None
    # within strata: stratum 0 has (0.9 vs 0.1) won, stratum 1 has (0.2 vs 0.8) lost: 1 / 2, while
    # pooled the pairs across strata count too: (0.9>0.1)(0.9>0.8)(0.2>0.1)(0.2<0.8) -> 3 / 4
    scores, labels, strata = [0.9, 0.1, 0.2, 0.8], [True, False, True, False], [0, 0, 1, 1]
    assert auc(scores, labels, strata) == 0.5
    assert auc(scores, labels) == 0.75
    assert oriented(0.3, higher_is_familiar=False) == -0.3


def test_bootstrap_interval_brackets_the_auc_and_shrinks_with_states():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=400)
    labels = (scores + rng.normal(size=400)) > 0
    small = bootstrap_auc(scores[:40].tolist(), labels[:40].tolist(), np.random.default_rng(1))
    large = bootstrap_auc(scores.tolist(), labels.tolist(), np.random.default_rng(1))
    assert large[0] < auc(scores.tolist(), labels.tolist()) < large[1]
    assert large[1] - large[0] < small[1] - small[0]
    assert bootstrap_auc([1.0, 2.0], [True, True], np.random.default_rng(0)) is None


def test_wilson_interval_by_hand():
    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416, half 1.96 sqrt(0.016 + 0.009604) / 1.38416
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx((0.99208 - 1.96 * math.sqrt(0.025604)) / 1.38416, abs=1e-4)
    assert high == pytest.approx((0.99208 + 1.96 * math.sqrt(0.025604)) / 1.38416, abs=1e-4)
    assert wilson_interval(0, 5)[0] == pytest.approx(0.0, abs=1e-12) and wilson_interval(0, 0) is None


def test_roc_curve_and_state_sampling_by_hand():
    fpr, tpr = roc_curve([0.9, 0.5, 0.5, 0.1], [True, True, False, False])
    assert (fpr, tpr) == ([0.0, 0.0, 0.5, 1.0], [0.0, 0.5, 1.0, 1.0])
    # depths 3 and 1, bands of 2 turns: band 0 holds (0,0) (0,1) (1,0), band 1 holds (0,2)
    states = sample_states([3, 1], band_width=2, per_band=2, seed=0)
    assert len(states) == 3 and (0, 2) in states
    assert sum(turn < 2 for _, turn in states) == 2
    assert sample_states([3, 1], 2, 2, seed=0) == states  # a pure function of the seed
    assert sample_states([3, 1], 2, 10, seed=5) == [(0, 0), (0, 1), (0, 2), (1, 0)]


AUDIT_RECIPE = """
name: audit
"""


def test_paired_difference_by_hand():
    rng = np.random.default_rng(0)
    # episode 0: two states the second teacher wins and the first does not; episode 1: the reverse once
    row = paired_difference([0, 0, 1, 1], [1, 1, -1, 0], rng, resamples=4000)
    assert row["difference"] == pytest.approx(0.25) and (row["states"], row["episodes"]) == (4, 2)
    assert (row["only_first"], row["only_second"]) == (1, 2)
    # by episode, a resample is episode 0 twice (+1), episode 1 twice (-1/2) or one of each (+1/4):
    # probabilities 1/4, 1/4, 1/2, so the 2.5% and 97.5% percentiles are -1/2 and +1
    assert row["by_episode"] == pytest.approx((-0.5, 1.0))
    lo, hi = row["by_state"]
    assert -0.5 <= lo < 0.25 < hi <= 1.0
    same = paired_difference([0, 1, 2], [1, 1, 1], rng)
    assert same["by_state"] == same["by_episode"] == (1.0, 1.0)


def test_teacher_lead_by_hand():
    # per-task Avg@k: d = 100 (t - s) = [+100, 0, 0, +50]; mean 37.5; sd = sqrt(6875 / 3) = 47.871;
    # t(0.975, 3) = 3.182 (frontier's table), half-width 3.182 x 47.871 / 2 = 76.163
    row = teacher_lead({"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.5}, {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0}, 20.0)
    assert (row["tasks"], row["teacher"], row["student"]) == (4, 62.5, 25.0)
    assert row["lead_points"] == pytest.approx(37.5)
    assert row["interval"] == pytest.approx([37.5 - 76.163, 37.5 + 76.163], abs=1e-3)
    assert (row["teacher_ahead"], row["student_ahead"], row["passes"]) == (2, 0, True)
    assert teacher_lead({"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 1.0}, 20.0)["passes"] is False  # 0 < 20
    assert teacher_lead({"a": 1.0}, {"a": 0.0}, 20.0)["interval"] is None  # one task: no interval
    with pytest.raises(ValueError, match="not the same ones"):
        teacher_lead({"a": 1.0, "b": 0.0}, {"a": 0.0}, 20.0)


def _report(teacher, wins):
    return {"teacher": teacher, "states": [{"episode": e, "turn": t, "task_id": f"g{e}", "student_won": False, "won": w}
                                           for (e, t), w in wins.items()]}


def test_compare_audits_pairs_the_states_and_bands_them():
    first = _report("a", {(0, 1): False, (0, 25): False, (1, 3): True, (1, 30): False})
    second = _report("b", {(0, 1): True, (0, 25): True, (1, 3): True, (1, 30): False})
    rows = compare_audits(first, second, band_width=20)
    assert [r["turns"] for r in rows] == ["all", "1-20", "21-40"]
    assert [(r["first"], r["second"], r["difference"], r["states"]) for r in rows] == [
        (0.25, 0.75, 0.5, 4), (0.5, 1.0, 0.5, 2), (0.0, 0.5, 0.5, 2)]
    with pytest.raises(AuditMismatch, match="different states \\(a: 4, b: 3, 3 shared\\)"):
        compare_audits(first, _report("b", {(0, 1): True, (0, 25): True, (1, 3): True}), band_width=20)


@pytest.mark.slow
def test_the_audit_command_takes_over_from_replayed_states(tmp_path, tiny_model_dir, capsys):
    recipe = loop_models(tmp_path, tiny_model_dir, AUDIT_RECIPE) / "recipe.yaml"
    assert main(["teacher", "audit", str(recipe), "--episodes", "3", "--per-band", "2", "--band-width", "1",
                 "policy.temperature=1.0"]) == 0
    out = capsys.readouterr().out
    assert "Takeover success from student states" in out and "AUC within bands" in out
    report = json.loads((tmp_path / "runs" / "audit-audit" / "audit.json").read_text())
    assert (tmp_path / "runs" / "audit-audit" / "audit.png").stat().st_size > 10_000
    assert report["diverged"] == 0  # ALFWorld replays the student's actions to the same observation
    assert [b["band"] for b in report["bands"]] == [0, 1, 2] and all(b["states"] <= 2 for b in report["bands"])
    assert sorted(report["signals"]) == ["action_entropy", "action_logprob", "context_logprob"]
    for state in report["states"]:
        assert state["turn"] == state["band"]
        assert 1 <= state["takeover_turns"] <= 3  # env.max_turns turns of its own
    for band in report["bands"]:
        won = [s["won"] for s in report["states"] if s["band"] == band["band"]]
        assert band["takeover"]["rate"] == sum(won) / len(won)
    assert main(["teacher", "audit", str(recipe), "--student", str(tmp_path / "nope")]) == 2
    # --held-out: the student's episodes, and so the states, come from the recipe's eval tasks
    assert main(["teacher", "audit", str(recipe), "--episodes", "2", "--per-band", "1", "--band-width", "1",
                 "--held-out", "policy.temperature=1.0"]) == 0
    held_out = json.loads((tmp_path / "runs" / "audit-audit" / "audit.json").read_text())
    spec = make_env_spec(load_recipe(recipe).env)
    assert held_out["split"] == "valid_seen" and report["split"] == "train"
    assert held_out["states"] and {s["task_id"] for s in held_out["states"]} <= set(spec.tasks("valid_seen"))
    assert {s["task_id"] for s in report["states"]} <= set(spec.tasks("train"))
    # turnopd teacher compare: an audit against itself differs by nothing; audits of other states are refused
    path = tmp_path / "runs" / "audit-audit" / "audit.json"
    capsys.readouterr()
    assert main(["teacher", "compare", str(path), str(path), "--band-width", "1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows[0][0] == "all" and all(row[7] == "+0.0" and row[8] == row[9] == "[0.0, 0.0]" for row in rows)
    (tmp_path / "train.json").write_text(json.dumps(report))
    assert main(["teacher", "compare", str(tmp_path / "train.json"), str(path)]) == 2
    assert "took over from different states" in capsys.readouterr().err


@pytest.mark.slow
def test_the_lead_command_plays_both_on_the_held_out_tasks(tmp_path, tiny_model_dir, capsys):
    recipe = loop_models(tmp_path, tiny_model_dir, "name: lead\neval: {{max_tasks: 2}}\n") / "recipe.yaml"
    # the teacher's own model as the student: the same greedy episodes, so it leads by nothing on every task
    out = tmp_path / "lead.json"
    assert main(["teacher", "lead", str(recipe), "--student", str(tiny_model_dir), "--min-points", "0",
                 "-o", str(out)]) == 0
    report = json.loads(out.read_text())
    tasks = make_env_spec(load_recipe(recipe).env).tasks("valid_seen")[:2]
    row = report["envs"]["alfworld"]
    assert sorted(row["teacher"]["per_task"]) == sorted(row["student"]["per_task"]) == sorted(tasks)
    assert row["teacher"]["per_task"] == row["student"]["per_task"] and row["student"]["mean_turns"] > 0
    assert (row["lead"]["lead_points"], row["lead"]["interval"]) == (0.0, [0.0, 0.0])
    # the builds and the code, as a run's start record names them
    assert report["models"]["student"]["path"] == str(tiny_model_dir)
    assert report["models"]["student"]["weights"] == report["models"]["teacher:alfworld"]["weights"] is not None
    assert len(report["code"]["source"]) == 16
    assert "lead (points)" in capsys.readouterr().out
    # the recipe's student against the teacher, asked for a 20-point lead neither untrained model has: exit 1
    assert main(["teacher", "lead", str(recipe)]) == 1
    assert not json.loads((tmp_path / "runs" / "lead-lead.json").read_text())["passes"]
    # a teacher behind a server is refused before any model loads
    (tmp_path / "server.yaml").write_text("name: served\nmodel: some/model\nbackend: vllm_server\n"
                                          "url: http://127.0.0.1:9\n")
    assert main(["teacher", "lead", str(recipe), f"teachers.alfworld={tmp_path / 'server.yaml'}"]) == 2
    assert "reached through a server" in capsys.readouterr().err
