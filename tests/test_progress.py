"""What a person watching a run reads: a line per step in a log, and the env's failures named."""

from turnopd.core import progress
from turnopd.core.metrics import StepRecord
from turnopd.core.progress import StepProgress


def _record(step: int, env_errors: dict[str, int]) -> StepRecord:
    return StepRecord(step=step, train_time_s=6.0, phases={"rollout": 1.0, "train": 1.0}, rollout_depth_cap=12,
                      alpha=0.25, success_rate=0.5, mean_kl=0.125, tokens_generated=100, tokens_trained=300,
                      wall_time_s=7.0, episodes=8, env_failures=sum(env_errors.values()), env_errors=env_errors)


def test_a_log_gets_a_line_per_step_and_each_env_failure_is_named():
    with progress.console.capture() as captured:  # not a terminal: lines instead of a redrawn bar
        bar = StepProgress(total_steps=4)
        bar.update(_record(1, {}))
        bar.update(_record(2, {"GameLoadError: [Errno 28] No space left on device": 3}))
        bar.close()
    lines = [line for line in captured.get().splitlines() if line.startswith("step ")]
    # tokens/s = (100 + 300) / (1 + 1) = 200
    assert lines[0] == "step 1/4: cap 12, alpha 0.25, success 0.50, kl 0.125, tps 200, 7 s"
    assert lines[1].startswith("step 2/4: cap 12")
    # the [Errno 28] survives: the message is printed as text, not read as rich markup
    assert lines[2] == ("step 2: 3 of 8 episodes were ended by the env, not the agent: "
                        "GameLoadError: [Errno 28] No space left on device (x3)")
    assert len(lines) == 3
