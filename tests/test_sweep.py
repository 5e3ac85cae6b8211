"""`turnopd sweep`: the command lines it builds, resuming, and a whole sweep with a fake distill."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.test_frontier import markdown_tables
from turnopd.cli import main
from turnopd.orchestration.sweep import SweepError, command_for, plan_sweep, run_state

REPO = Path(__file__).resolve().parents[1]

# Stands in for `turnopd distill RECIPE overrides [--resume DIR]`: logs its arguments, writes the
# config.yaml and metrics.jsonl of a run of trainer.steps steps (an evaluation every 2 steps), and
# crashes after step 2 when the run is named in $FAKE_CRASH and not resumed.
# Per step: 5 s of training clock with adaptive depth, else 10 s; Avg@k = 0.2 + 0.1 * step + 0.02 * seed.
FAKE_DISTILL = '''
import json, os, sys
from pathlib import Path

from omegaconf import OmegaConf

from turnopd.core.methods import method_of

args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
resume = None
if "--resume" in args:
    i = args.index("--resume")
    resume = args[i + 1]
    del args[i:i + 2]
cfg = OmegaConf.merge(OmegaConf.load(args[0]), OmegaConf.from_dotlist(args[1:]))
run_dir = Path(cfg.output_dir) / cfg.name
assert resume is None or Path(resume) == run_dir, (resume, run_dir)
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
step_s = 5.0 if cfg.depth.mode == "adaptive" else 10.0
crash = os.environ.get("FAKE_CRASH") == cfg.name and resume is None
with open(run_dir / "metrics.jsonl", "w") as f:
    def write(**record):
        f.write(json.dumps(record) + "\\n")
    write(kind="start", name=cfg.name, method=method_of(OmegaConf.to_container(cfg)), seed=cfg.seed,
          total_steps=cfg.trainer.steps, resumed_from_step=0)
    for step in range(cfg.trainer.steps + 1):
        if step:
            write(kind="train", step=step, train_time_s=step * step_s, phases={"rollout": step_s / 2},
                  rollout_depth_cap=10, alpha=step / cfg.trainer.steps)
        if step % 2 == 0:
            write(kind="eval", step=step, train_time_s=step * step_s, split="valid_unseen", k=1,
                  avg_at_k=0.2 + 0.1 * step + 0.02 * cfg.seed, eval_time_s=1.0)
        if crash and step == 2:
            sys.exit(3)
'''


def test_plan_builds_one_command_per_method_and_seed():
    plan = plan_sweep("recipes/r.yaml", ["turnopd", "tcod_f2b"], 2, "out", "abl", ["trainer.steps=5"],
                      launcher=["turnopd", "distill"])
    # interleaved: seed 0 of every method, then seed 1
    assert [run.name for run in plan] == ["abl-turnopd-s0", "abl-tcod_f2b-s0", "abl-turnopd-s1", "abl-tcod_f2b-s1"]
    assert plan[2].argv == ("turnopd", "distill", "recipes/r.yaml", "name=abl-turnopd-s1", "seed=1",
                            "output_dir=out", "tracker.group=abl", "tracker.tags=[turnopd]", "depth.mode=adaptive",
                            "loss.mode=progressive",
                            "trainer.steps=5")
    assert plan[1].argv[3:] == ("name=abl-tcod_f2b-s0", "seed=0", "output_dir=out", "tracker.group=abl",
                                "tracker.tags=[tcod_f2b]", "depth.mode=curriculum",
                                "depth.curriculum_first_step=1", "loss.mode=turn_row_mean",
                                "trainer.turn_rows_per_update=64", "trainer.steps=5")
    assert plan[1].run_dir == Path("out/abl-tcod_f2b-s0")


@pytest.mark.parametrize(("methods", "seeds", "overrides", "message"), [
    (["turnopd", "distilbert"], 1, [], "unknown method.*distilbert; allowed: adaptive_depth_only, asyncwebrl_constant, "
     "asyncwebrl_constant_reward, asyncwebrl_decoupled, curriculum_trajectory, fixed_cap, progressive_loss_only, tcod_f2b, tcod_f2b_token_mean, "
     "turnopd, turnopd_continuous, turnopd_familiarity_gate, turnopd_familiarity_weight, turnopd_world_model, "
     "vanilla_opd, vanilla_opd_reward, vanilla_opd_world_model, vanilla_opd_world_model_reward, "
     "vanilla_opd_world_model_wmrl"),
    (["turnopd"], 0, [], "--seeds must be at least 1"),
    (["turnopd"], 1, ["seed=3"], "seed=3 would overrule"),
    (["turnopd"], 1, ["depth.mode=full"], "depth.mode=full would overrule"),
    (["turnopd"], 1, ["tracker.group=g"], "tracker.group=g would overrule"),
    (["turnopd"], 1, ["trainer.steps"], "must be key=value"),
])
def test_plan_rejects_bad_input(methods, seeds, overrides, message):
    with pytest.raises(SweepError, match=message):
        plan_sweep("r.yaml", methods, seeds, "out", "s", overrides)


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_run_state_and_the_resume_command(tmp_path: Path):
    start = {"kind": "start", "total_steps": 4, "method": "turnopd", "seed": 0}
    write_metrics(tmp_path / "s-turnopd-s0", [start, {"kind": "train", "step": 2, "train_time_s": 2.0}])
    write_metrics(tmp_path / "s-turnopd-s1", [
        start, {"kind": "train", "step": 4, "train_time_s": 4.0},
        {"kind": "eval", "step": 4, "train_time_s": 4.0, "avg_at_k": 0.5}])  # the final evaluation
    incomplete, complete, new = plan_sweep("r.yaml", ["turnopd"], 3, tmp_path, "s", launcher=["distill"])
    assert [run_state(r.run_dir) for r in (new, incomplete, complete)] == ["new", "incomplete", "complete"]
    assert command_for(incomplete, "incomplete")[-2:] == ["--resume", str(tmp_path / "s-turnopd-s0")]
    assert "--resume" not in command_for(new, "new")


def test_sweep_runs_resumes_and_compares(tmp_path: Path, monkeypatch, capfd):
    fake = tmp_path / "fake_distill.py"
    fake.write_text(FAKE_DISTILL)
    recipe = tmp_path / "quick.yaml"
    recipe.write_text("trainer: {steps: 2}\ndepth: {mode: full}\nloss: {mode: trajectory}\n")
    log = tmp_path / "calls.jsonl"
    out = tmp_path / "runs"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_CRASH", "quick-vanilla_opd-s1")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    sweep = ["sweep", str(recipe), "--methods", "turnopd,vanilla_opd", "--seeds", "2", "--out-dir", str(out),
             "--launcher", f"{shlex.quote(sys.executable)} {shlex.quote(str(fake))}", "--md",
             "trainer.steps=4"]  # an override after the options

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    # first pass: one run crashes, the others go on; exit 1
    assert main(sweep) == 1
    text = capfd.readouterr().out
    assert len(calls()) == 4 and all("trainer.steps=4" in c for c in calls())
    assert "quick-vanilla_opd-s1: FAILED (exit 3, run incomplete)" in text
    assert (out / "quick-frontier.png").stat().st_size > 0

    # --print-only: the one run left, as a resume
    assert main([*sweep, "--print-only"]) == 0
    printed = capfd.readouterr()
    assert [shlex.split(line)[-2:] for line in printed.out.splitlines()] == [
        ["--resume", str(out / "quick-vanilla_opd-s1")]]
    assert printed.err.count("already complete") == 3

    # second pass: complete runs skipped, the crashed one resumed; then the frontier of all four
    monkeypatch.delenv("FAKE_CRASH")
    assert main(sweep) == 0
    text = capfd.readouterr().out
    assert len(calls()) == 5 and calls()[-1][-2:] == ["--resume", str(out / "quick-vanilla_opd-s1")]
    assert text.count("already complete, skipped") == 3
    rows = markdown_tables(text)[0]
    # vanilla_opd: finals .60 and .62 (mean .61) after 4 steps of 10 s, evaluated at 0, 20, 40 s, so its
    # seed mean first reaches .61 at 40 s; turnopd reaches the same accuracies at 0, 10, 20 s: 40/20 = 2x
    # (sample std of two values a, b: |a - b| / sqrt(2) = .02 / 1.414 = 1.4 points)
    assert rows["vanilla_opd"][3:5] == ["40.0 s", "61.0 ± 1.4"]
    assert rows["turnopd"][8] == "20.0 s"
    # resampling the two seeds of each group, a group misses the target .61 only when it draws the .60
    # seed twice (1/4), so both reach it in (3/4)^2 = 56% of resamples, each time at 2x
    speedup = re.fullmatch(r"2\.00x \[2\.00, 2\.00\] \((\d+)% of resamples reach it\)", rows["turnopd"][9])
    assert speedup and 50 <= int(speedup.group(1)) <= 63
    assert rows["turnopd"][10] == "–"  # the fake runs record no env steps: no work ratio
    # least-time = 20 s (turnopd's end): vanilla_opd is then at (.40 + .42) / 2
    assert rows["vanilla_opd"][7] == "41.0 ± 1.4"


def test_method_of_names_the_most_specific_fragment():
    from turnopd.core.methods import method_of

    turnopd = {"depth": {"mode": "adaptive", "probe_fraction": None}, "loss": {"mode": "progressive"}}
    assert method_of(turnopd) == "turnopd"
    # turnopd_continuous's keys (mode, probe_fraction, loss) all match, turnopd's too: the larger wins
    continuous = {"depth": {"mode": "adaptive", "probe_fraction": 0.125}, "loss": {"mode": "progressive"}}
    assert method_of(continuous) == "turnopd_continuous"
    assert method_of({"depth": {"mode": "fixed", "fixed_cap": 25}, "loss": {"mode": "trajectory"}}) == "fixed_cap"
    assert method_of({"depth": {"mode": "fixed", "fixed_cap": 9}, "loss": {"mode": "turn"}}) == "depth=fixed,loss=turn"
