"""Expert demonstrations: the env's expert plays tasks through the env pool, cached on disk.

Used to build a tiny model's tokenizer from the env's own text (turnopd.models.env_text) and to
fine-tune teachers (turnopd sft). `relabel_episodes` makes DAgger-style data instead: another
player's (a student's) episodes replayed, each state labelled with the expert's command there. Episodes are cached as JSON lines under ~/.cache/turnopd/demos,
keyed by env, split, max_turns, env options (the expert is one of them) and the env spec's
observation_version, so reruns and other prompt settings reuse them.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from envs.base import EnvSpec, PromptContext, RelabellingExpert, recent_pairs, split_tasks
from envs.pool import EnvPool
from turnopd.config import EnvConfig
from turnopd.core.progress import progress_bar

DEMOS_DIR = Path.home() / ".cache" / "turnopd" / "demos"
DEMO_FORMAT = 2  # 2: episodes keep their final observation and ending (older caches are played again)


@dataclass
class DemoStep:
    observation: str  # what the player saw before acting
    admissible: list[str] | None
    action: str  # the command played
    imitate: bool = True  # False: not trained on (an exploring expert's mistake, a state the expert cannot act from)
    label: str | None = None  # a relabelled state: the expert's command there (another player played `action`)

    @property
    def target(self) -> str:
        """The command to imitate at this state."""
        return self.action if self.label is None else self.label


@dataclass
class Demonstration:
    task_id: str
    task_type: str
    task: str  # the goal text
    won: bool
    steps: list[DemoStep]
    relabelled: bool = False  # another player's episode, every state labelled by the expert (relabel_episodes)
    final_observation: str = ""  # the env's answer to the last step (world-model transitions)
    ended: bool = False  # the env ended the episode (False: it stopped at max_turns, still playing)

    @classmethod
    def from_json(cls, line: str) -> Demonstration:
        raw = json.loads(line)
        raw["steps"] = [DemoStep(**s) for s in raw["steps"]]
        return cls(**raw)


def demo_tasks(spec: EnvSpec, split: str, n: int, seed: int = 0) -> list[str]:
    """n tasks of a split, round-robin over its task types, each type's tasks in a seeded random
    order: any prefix is a uniform sample of every type (split orders group similar tasks, e.g.
    ALFWorld's sort by object, so taking the first ones would leave whole object classes out)."""
    by_type: dict[str, list[str]] = {}
    for task in split_tasks(spec, split):
        by_type.setdefault(spec.task_type(task), []).append(task)
    rng = random.Random(seed)
    queues = []
    for _, tasks in sorted(by_type.items()):
        rng.shuffle(tasks)
        queues.append(iter(tasks))
    out: list[str] = []
    while queues and len(out) < n:
        for queue in list(queues):
            task = next(queue, None)
            if task is None:
                queues.remove(queue)
            elif len(out) < n:
                out.append(task)
    return out


def demo_cache_path(env_config: EnvConfig, split: str, observation_version: str) -> Path:
    """One JSON-lines file per (env, split, max_turns, env options, the env spec's observation_version):
    the episodes do not depend on the prompt settings, which are applied when they are rendered."""
    key = json.dumps({"split": split, "max_turns": env_config.max_turns, "options": env_config.options,
                      "observation": observation_version, "format": DEMO_FORMAT}, sort_keys=True, default=str)
    return DEMOS_DIR / env_config.name / f"{split}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsonl"


def play_experts(spec: EnvSpec, pool: Any, tasks: list[str], max_turns: int,
                 followed: list[list[str]] | None = None) -> Iterator[Demonstration]:
    """The expert of each task plays it through the pool (a batch of pool.num_workers * 4 episodes at
    a time); yields each batch's episodes when they end. Episodes the env failed are left out.

    `followed` (DAgger relabelling): per task, the commands another player took; they are played
    instead of the expert's, which only labels each state they reach (envs.base.RelabellingExpert).
    A label the env does not admit there is kept but not imitated."""
    batch = pool.num_workers * 4
    for start in range(0, len(tasks), batch):
        chunk = tasks[start:start + batch]
        outcomes = dict(enumerate(pool.reset(chunk)))
        experts = {slot: spec.expert(task) for slot, task in enumerate(chunk)}
        goals = {slot: outcome.info.get("task", "") for slot, outcome in outcomes.items()}
        steps: dict[int, list[DemoStep]] = {slot: [] for slot in outcomes}
        depth = {slot: max_turns if followed is None else min(max_turns, len(followed[start + slot]))
                 for slot in outcomes}
        live = [slot for slot, outcome in outcomes.items() if not outcome.done and depth[slot]]
        for turn in range(max_turns):
            if not live:
                break
            actions = {}
            for slot in live:
                outcome, expert = outcomes[slot], experts[slot]
                if followed is None:
                    actions[slot] = expert.act(outcome)
                    step = DemoStep(outcome.observation, outcome.admissible, actions[slot],
                                    imitate=not getattr(expert, "exploring", False))
                else:
                    label, actions[slot] = expert.label(outcome), followed[start + slot][turn]
                    expert.follow(actions[slot])
                    step = DemoStep(outcome.observation, outcome.admissible, actions[slot], label=label,
                                    imitate=outcome.admissible is None or label in outcome.admissible)
                steps[slot].append(step)
            outcomes.update(pool.step(actions))
            live = [slot for slot in live if not outcomes[slot].done and turn + 1 < depth[slot]]
        for slot, task in enumerate(chunk):
            final = outcomes[slot]
            if "env_error" not in final.info:
                yield Demonstration(task, spec.task_type(task), goals[slot], bool(final.won), steps[slot],
                                    relabelled=followed is not None, final_observation=final.observation,
                                    ended=bool(final.done))


def require_relabelling_expert(spec: EnvSpec, task: str) -> None:
    """Raise ValueError unless the env's expert (as its env options select it) can relabel states."""
    expert = spec.expert(task)
    if not isinstance(expert, RelabellingExpert):
        raise ValueError(f"the {spec.name} expert ({type(expert).__name__}) cannot act from states another player "
                         "reached (it has no label/follow), so they cannot be relabelled; ALFWorld's explorer "
                         "expert (env.options.expert: explorer) can")


def relabel_episodes(spec: EnvSpec, env_config: EnvConfig, episodes: list[tuple[str, list[str]]]) -> list[Demonstration]:
    """DAgger-style data: each (task, commands another player took) replayed in the env, every state
    it reached labelled by the env's expert (play_experts with `followed`). The env's expert must be
    a RelabellingExpert."""
    if episodes:
        require_relabelling_expert(spec, episodes[0][0])
    with EnvPool.for_config(spec, env_config) as pool:
        return list(play_experts(spec, pool, [task for task, _ in episodes], env_config.max_turns,
                                 followed=[list(commands) for _, commands in episodes]))


def collect_demonstrations(spec: EnvSpec, env_config: EnvConfig, split: str, episodes: int,
                           seed: int = 0) -> list[Demonstration]:
    """The expert episodes of `demo_tasks(spec, split, episodes, seed)`, from the cache where played before."""
    tasks = demo_tasks(spec, split, episodes, seed)
    path = demo_cache_path(env_config, split, spec.observation_version)
    cached: dict[str, Demonstration] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            demo = Demonstration.from_json(line)
            cached[demo.task_id] = demo
    missing = [task for task in tasks if task not in cached]
    if missing:
        print(f"playing the {env_config.name} expert on {len(missing)} {split} tasks "
              f"({len(tasks) - len(missing)} cached in {path})", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        progress = progress_bar("demos", "won {task.fields[won]}")
        with progress, EnvPool.for_config(spec, env_config) as pool, \
                path.open("a") as cache:
            bar = progress.add_task("demos", total=len(missing), won=0)
            won, played = 0, 0
            for demo in play_experts(spec, pool, missing, env_config.max_turns):
                cache.write(json.dumps(asdict(demo)) + "\n")
                cache.flush()
                cached[demo.task_id] = demo
                won, played = won + demo.won, played + 1
                progress.update(bar, advance=1, won=won)
                if not progress.console.is_terminal and played % max(1, len(missing) // 10) == 0:
                    progress.console.print(f"demos {played}/{len(missing)} played, {won} won")
    return [cached[task] for task in tasks if task in cached]


def demo_contexts(demo: Demonstration, env_config: EnvConfig,
                  answer_format: str | None = None) -> Iterator[tuple[PromptContext, DemoStep]]:
    """Each turn of a demonstration with the prompt context the rollout engine builds for that turn
    (turnopd.rollout.agent_loop.rollout: the last env.history_length (observation, action) pairs)."""
    history: list[tuple[str, str]] = []
    for turn, step in enumerate(demo.steps):
        yield PromptContext(task=demo.task, step=turn, observation=step.observation,
                            history=recent_pairs(history, env_config.history_length),
                            admissible=step.admissible,
                            answer_format=answer_format or env_config.answer_format), step
        history.append((step.observation, step.action))
