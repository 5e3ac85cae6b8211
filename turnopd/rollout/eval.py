"""Avg@k on a held-out split: every task played k times at full depth (greedy when k = 1).

Avg@k = mean over tasks of (successes of the task's k episodes / k); reported overall and per task
type. Evaluation never applies the rollout-depth cap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from envs.base import EnvSpec
from turnopd.config import EnvConfig, PolicyConfig, PromptConfig
from turnopd.core.types import EpisodeSummary, Trajectory, describe_env_errors, env_errors
from turnopd.rollout.agent_loop import rollout
from turnopd.rollout.base import Policy, SamplingParams


@dataclass
class EvalResult:
    split: str
    k: int
    avg_at_k: float
    per_type: dict[str, float]
    num_tasks: int
    mean_turns: float
    env_errors: dict[str, int] = field(default_factory=dict)  # episodes the env ended, by error (they count as lost)
    per_task: dict[str, float] = field(default_factory=dict)  # task id -> its successes / k (for paired intervals)
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)
    per_env: dict[str, EvalResult] = field(default_factory=dict)  # a multi-env run's: each env's (see mixed)
    # invalid actions over the turns played; None in a record written before it was kept
    invalid_action_rate: float | None = None

    @property
    def env_failures(self) -> int:
        return sum(self.env_errors.values())

    def describe_env_failures(self) -> str:
        """describe_env_errors over this evaluation's num_tasks x k episodes."""
        return describe_env_errors(self.env_errors, self.num_tasks * self.k)

    def record(self) -> dict:
        record = {"split": self.split, "k": self.k, "avg_at_k": self.avg_at_k, "per_type": self.per_type,
                  "num_tasks": self.num_tasks, "mean_turns": self.mean_turns, "env_failures": self.env_failures,
                  "env_errors": self.env_errors, "per_task": self.per_task,
                  "invalid_action_rate": self.invalid_action_rate}
        if self.per_env:  # each env's tasks are in per_task already, as env/task
            record["per_env"] = {env: {k: v for k, v in result.record().items() if k != "per_task"}
                                 for env, result in self.per_env.items()}
        return record

    @classmethod
    def from_record(cls, record: dict) -> EvalResult:
        per_env = {env: cls.from_record(r) for env, r in record.get("per_env", {}).items()}
        return cls(**{k: v for k, v in record.items() if k not in ("env_failures", "per_env")}, per_env=per_env)

    @classmethod
    def mixed(cls, per_env: dict[str, EvalResult]) -> EvalResult:
        """A multi-env run's evaluation from each env's: Avg@k the mean of the envs' (each env weighs the
        same, however many held-out tasks it has, as each is one task family of the generalist), per
        type and per task keyed env/name, mean turns over all episodes, the env errors summed."""
        results = list(per_env.values())
        rates = [r.invalid_action_rate for r in results]  # over all turns: each env's weighs by its turns
        tasks = sum(r.num_tasks for r in results)
        errors: dict[str, int] = defaultdict(int)
        for result in results:
            for message, count in result.env_errors.items():
                errors[message] += count
        return cls("+".join(f"{env}:{r.split}" for env, r in per_env.items()), results[0].k,
                   sum(r.avg_at_k for r in results) / len(results),
                   {f"{env}/{t}": v for env, r in per_env.items() for t, v in r.per_type.items()}, tasks,
                   sum(r.mean_turns * r.num_tasks for r in results) / tasks, dict(errors),
                   {f"{env}/{t}": v for env, r in per_env.items() for t, v in r.per_task.items()}, per_env=per_env,
                   invalid_action_rate=None if None in rates else sum(
                       rate * r.mean_turns * r.num_tasks * r.k for rate, r in zip(rates, results, strict=True))
                   / sum(r.mean_turns * r.num_tasks * r.k for r in results))


def avg_at_k(trajectories: list[Trajectory], k: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """(overall Avg@k, per task type Avg@k, per task successes / k) from k trajectories per task."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for traj in trajectories:
        by_task[traj.task_id].append(traj)
    bad = {task: len(trajs) for task, trajs in by_task.items() if len(trajs) != k}
    if bad:
        raise ValueError(f"Avg@{k} needs {k} episodes per task; got {bad}")
    task_score = {task: sum(t.success for t in trajs) / k for task, trajs in by_task.items()}
    per_type: dict[str, list[float]] = defaultdict(list)
    for task, trajs in by_task.items():
        per_type[trajs[0].task_type].append(task_score[task])
    overall = sum(task_score.values()) / len(task_score) if task_score else 0.0
    return overall, {tt: sum(v) / len(v) for tt, v in sorted(per_type.items())}, task_score


def invalid_action_rate(episodes: Sequence[Trajectory | EpisodeSummary]) -> float:
    """Invalid actions over the turns played, all episodes pooled (a long episode weighs by its turns)."""
    return sum(e.invalid_actions for e in episodes) / max(1, sum(e.depth for e in episodes))


def eval_sampling(policy_config: PolicyConfig, k: int, temperature: float, seed: int) -> SamplingParams:
    """Greedy for Avg@1, else sampling at `temperature`; the policy's stop strings and length."""
    return SamplingParams(
        temperature=0.0 if k == 1 else temperature,
        top_p=1.0 if k == 1 else policy_config.top_p,
        max_new_tokens=policy_config.max_new_tokens,
        stop=tuple(policy_config.stop),
        seed=seed,
    )


def evaluate(spec: EnvSpec, pool, policy: Policy, tasks: list[str], *, split: str, env_config: EnvConfig,
             policy_config: PolicyConfig, k: int = 1, temperature: float = 1.0, seed: int = 0,
             ledger=None, on_episode: Callable[[Trajectory], None] | None = None,
             prompt: PromptConfig | None = None) -> EvalResult:
    """Play each task k times at full depth and score Avg@k (`on_episode`: called as each episode ends;
    `prompt`: the recipe's prompt section)."""
    if not tasks:
        raise ValueError(f"no tasks to evaluate on split {split!r}")
    sampling = eval_sampling(policy_config, k, temperature, seed)
    episodes = [task for task in tasks for _ in range(k)]
    trajectories = rollout(spec, pool, policy, episodes, env_config=env_config, sampling=sampling,
                           ledger=ledger, on_episode=on_episode, prompt=prompt)
    overall, per_type, per_task = avg_at_k(trajectories, k)
    mean_turns = sum(t.depth for t in trajectories) / len(trajectories)
    return EvalResult(split, k, overall, per_type, len(tasks), mean_turns, env_errors(trajectories), per_task,
                      trajectories, invalid_action_rate=invalid_action_rate(trajectories))
