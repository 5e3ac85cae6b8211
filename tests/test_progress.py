"""What a person watching a run reads: a line per step in a log, and the env's failures named."""

from turnopd.core import progress
from turnopd.core.metrics import StepRecord
from turnopd.core.progress import EpisodeProgress, StepProgress
from turnopd.core.types import Trajectory


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(step: int, env_errors: dict[str, int]) -> StepRecord:
    return StepRecord(step=step, train_time_s=6.0, phases={"rollout": 1.0, "train": 1.0}, rollout_depth_cap=12,
                      alpha=0.25, success_rate=0.5, mean_kl=0.125, tokens_generated=100, tokens_trained=300,
                      wall_time_s=7.0, episodes=8, env_failures=sum(env_errors.values()), env_errors=env_errors)


def test_a_log_gets_a_line_per_step_and_each_env_failure_is_named():
    with progress.console.capture() as captured:  # not a terminal: lines instead of a redrawn bar
        clock = FakeClock()
        bar = StepProgress(total_steps=4, clock=clock)
        clock.now = 10.0
        bar.update(_record(1, {}))
        clock.now = 40.0  # 20 s a step so far: 2 steps left take 40 s
        bar.update(_record(2, {"GameLoadError: [Errno 28] No space left on device": 3}))
        bar.close()
    lines = [line for line in captured.get().splitlines() if line.startswith("step ")]
    # tokens/s = (100 + 300) / (1 + 1) = 200
    # ETA: 10 s for step 1, times the 3 steps left
    assert lines[0] == "step 1/4: cap 12, alpha 0.25, success 0.50, kl 0.125, tps 200, 7 s, ETA 30 s"
    assert lines[1].startswith("step 2/4: cap 12") and lines[1].endswith(", 7 s, ETA 40 s")
    # the [Errno 28] survives: the message is printed as text, not read as rich markup
    assert lines[2] == ("step 2: 3 of 8 episodes were ended by the env, not the agent: "
                        "GameLoadError: [Errno 28] No space left on device (x3)")
    assert len(lines) == 3


def test_a_long_step_line_stays_one_line_in_a_log():
    with progress.console.capture() as captured:
        clock = FakeClock()
        bar = StepProgress(total_steps=4800, clock=clock)
        clock.now = 700.0  # 700 s a step: 4799 steps left take 933.1 h, and the line passes 80 characters
        bar.update(_record(1, {}))
        bar.close()
    (line,) = [line for line in captured.get().splitlines() if line.startswith("step ")]
    assert len(line) > 80 and line.startswith("step 1/4800: ") and line.endswith(", 7 s, ETA 933.1 h"), line


def test_an_evaluation_in_a_log_prints_a_line_every_30_s_and_one_at_the_end():
    clock = FakeClock()
    with progress.console.capture() as captured, EpisodeProgress("eval at step 4", total=5, clock=clock) as bar:
        for t, won in ((10, True), (30, False), (45, True), (61, False), (62, True)):
            clock.now = t
            bar.episode_done(Trajectory(task_id="t", env_name="e", success=won))
    # at 30 s: 2 episodes, 4 a minute, 3 left at 1/15 per s; at 61 s: 4 in 61 s; at 62 s: the last
    assert captured.get().splitlines() == [
        "eval at step 4: 2/5 episodes, 1 won, 4.0 episodes/min, 30 s so far, ETA 45 s",
        "eval at step 4: 4/5 episodes, 2 won, 3.9 episodes/min, 61 s so far, ETA 15 s",
        "eval at step 4: 5/5 episodes, 3 won, 4.8 episodes/min, 62 s so far, ETA 0 s"]
    with progress.console.capture() as captured, EpisodeProgress("rollout", total=2, clock=clock) as bar:
        for t in (70, 75):  # a rollout shorter than 30 s: nothing beside the step's own line
            clock.now = t
            bar.episode_done(Trajectory(task_id="t", env_name="e"))
    assert captured.get() == ""


def test_a_multi_env_step_line_shows_each_env_s_cap_and_success():
    record = StepRecord(**{**vars(_record(1, {})), "per_env": {
        "alfworld": {"rollout_depth_cap": 12, "success_rate": 0.75}, "search": {"rollout_depth_cap": 3, "success_rate": 0.25}}})
    with progress.console.capture() as captured:
        clock = FakeClock()
        bar = StepProgress(total_steps=2, clock=clock)
        clock.now = 10.0
        bar.update(record)
        bar.close()
    lines = [line for line in captured.get().splitlines() if line.startswith("step ")]
    assert len(lines) == 1 and lines[0].startswith("step 1/2: cap 12/3, alpha 0.25, success 0.75/0.25, kl 0.125, ")
