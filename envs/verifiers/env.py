"""One verifiers episode at a time, inside an env-pool worker: the verifiers Env's own `run(task,
agents)` plays it, with TurnOPD's policy in its one agent seat.

A verifiers Agent would run a harness program whose model calls its interception server answers
from the library's model client. The adapter seats a `PolicySeat` instead: its `interaction(task)`
and `run(task)` speak the Agent's surface, and each `turn(message)` hands the message to TurnOPD as
the observation and waits for TurnOPD's next action, whose text becomes the assistant message. So
no model client of the library runs and the sampled tokens stay TurnOPD's; the env's control flow
(a game engine answering each move, a single-answer task) is the library's own. The mapping:
- the first observation is the task's prompt (its messages' text), or the env's opening message for a
  task without one; each later observation is the message the env answers with;
- an action is the assistant message's text, as the verifiers env reads `segment.last_reply`;
- the episode ends when the env's `run` returns; its trace (system prompt, prompt, the exchange's
  messages) is then scored by the task's rewards (runtime-free ones: no sandbox is provisioned) and the
  env's `finalize`; reward: the trace's reward (the weighted sum, verifiers' `Trace.reward`), given at
  that last step; won: reward >= success_reward.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from itertools import islice
from types import SimpleNamespace
from typing import Any

from envs.adapters import seed_of
from envs.base import StepOutcome


def load_vf_env(raw_config: dict[str, Any]) -> Any:
    """The verifiers Env of a raw env config ({"id", "taskset": {"id", ...}, seat: {...}})."""
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    return load_environment(resolve_env_config(raw_config))


def message_text(message: Any) -> str:
    """A turn's message as text: a string as it is, typed or wire messages' contents joined."""
    from verifiers.v1.types import content_text

    if isinstance(message, str):
        return message
    return "\n\n".join(content_text(m["content"] if isinstance(m, dict) else m.content) for m in message)


class Bridge:
    """Where the verifiers coroutine and TurnOPD's synchronous reset/step meet: `ask` (in the
    coroutine) posts an observation and waits for the action; `advance` (in the worker) runs the
    event loop until the next observation is posted or the env's run returns."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.asked: asyncio.Future[str] | None = None  # made by `advance` before the coroutine runs on
        self.answer: asyncio.Future[str] | None = None

    async def ask(self, observation: str) -> str:
        self.answer = self.loop.create_future()
        self.asked.set_result(observation)
        return await self.answer

    def advance(self, run: asyncio.Task, action: str | None = None) -> str | None:
        """The next observation, or None once `run` has returned (its exception raised here)."""
        self.asked = self.loop.create_future()
        if action is not None:
            self.answer.set_result(action)
        self.loop.run_until_complete(asyncio.wait([self.asked, run], return_when=asyncio.FIRST_COMPLETED))
        if self.asked.done():
            return self.asked.result()
        run.result()
        return None


class Exchange:
    """The policy's side of one verifiers interaction: a live verifiers Trace holding the
    conversation, and `turn` as `verifiers.v1.Interaction.turn` has it."""

    def __init__(self, task: Any, seat: str, bridge: Bridge):
        import verifiers.v1 as vf

        self.vf, self.task, self.bridge = vf, task, bridge
        self.trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                                hash=task.hash),
                              agent=vf.AgentInfo(config=vf.AgentConfig(), name=seat))
        self.started = False

    def add(self, message: Any, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))

    async def turn(self, message: Any = None) -> Any:
        vf, data = self.vf, self.task.data
        if not self.started:
            self.started = True
            if data.system_prompt:
                self.add(vf.SystemMessage(content=data.system_prompt))
            if data.prompt is not None:  # a prompted task speaks first: its prompt is the observation
                if message is not None:
                    raise ValueError("verifiers: a prompted task's first turn takes no message")
                message = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else data.prompt
        if message is None:
            raise ValueError("verifiers: a turn needs the env's message")
        messages = [vf.UserMessage(content=message)] if isinstance(message, str) else message
        for m in messages:
            self.add(m)
        reply = await self.bridge.ask(message_text(messages))
        self.add(vf.AssistantMessage(content=reply), sampled=True)
        return vf.Segment(messages=[self.trace.nodes[-1].message])

    async def close(self) -> None:
        self.trace.is_completed = self.trace.ok = True
        self.trace.stop("user_closed")
        await self.task.score(self.trace)


class PolicySeat:
    """The env's one agent seat, played by TurnOPD's policy: an Agent's `interaction` and `run`,
    one exchange per episode."""

    def __init__(self, name: str, bridge: Bridge, traces: list[Any]):
        self.name, self.bridge, self.traces = name, bridge, traces
        self.trainable = True  # an env's setup() may set it, as on an Agent

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **_: Any) -> AsyncIterator[Exchange]:
        if self.traces:
            raise ValueError("verifiers: the adapter plays one exchange per episode; this env opened a second")
        exchange = Exchange(task, self.name, self.bridge)
        self.traces.append(exchange.trace)
        yield exchange
        await exchange.close()

    async def run(self, task: Any, **_: Any) -> Any:
        """One segment on the task's prompt (a single-answer task)."""
        async with self.interaction(task) as exchange:
            await exchange.turn()
        return exchange.trace


class VerifiersEnv:
    """The Env of one pool slot: the verifiers Env loaded on first reset; task "task-N" is the
    taskset's task N (its load() order)."""

    def __init__(self, raw_config: dict[str, Any], seat: str, success_reward: float):
        self.raw_config, self.seat, self.success_reward = raw_config, seat, success_reward
        self.vf_env: Any = None
        self.tasks: list[Any] = []  # the taskset's tasks read so far, in order
        self.loop = asyncio.new_event_loop()
        self.run: asyncio.Task | None = None  # the episode's coroutine while it plays
        self.bridge = Bridge(self.loop)
        self.traces: list[Any] = []  # the episode's verifiers Trace (one exchange)

    def task(self, index: int) -> Any:
        if index >= len(self.tasks):
            self.tasks.extend(islice(iter(self.vf_env.taskset), len(self.tasks), index + 1))
        return self.tasks[index]

    async def episode(self, task: Any, traces: list[Any]) -> None:
        """verifiers' Env.run_episode without its agents' machinery: setup, run, then finalize."""
        from verifiers.v1.episode import EnvInfo, Episode
        from verifiers.v1.trace import TraceTask

        agents = SimpleNamespace(**{self.seat: PolicySeat(self.seat, self.bridge, traces)})
        await self.vf_env.setup(agents)
        await self.vf_env.run(task, agents)
        episode = Episode(env=EnvInfo(id=self.vf_env.config.env_id),
                          task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                          traces=traces)
        await self.vf_env.finalize(task, episode)

    def reset(self, task_id: str) -> StepOutcome:
        self.close()
        if self.vf_env is None:
            self.vf_env = load_vf_env(self.raw_config)
        task = self.task(seed_of(task_id))
        self.traces = []
        self.bridge = Bridge(self.loop)
        self.run = self.loop.create_task(self.episode(task, self.traces))
        observation = self.bridge.advance(self.run)
        if observation is None:
            raise ValueError("verifiers: the env's run() ended before the policy's first turn")
        goal = task.data.description or task.data.name or "answer the conversation"
        return StepOutcome(observation, info={"task": goal})

    def step(self, action: str) -> StepOutcome:
        observation = self.bridge.advance(self.run, action)
        if observation is not None:
            return StepOutcome(observation)
        self.run = None
        reward = self.traces[0].reward
        return StepOutcome("", reward=reward, done=True, won=reward >= self.success_reward)

    def close(self) -> None:
        """The episode's end: an unfinished run (stopped early, e.g. at max_turns) is cancelled."""
        if self.run is not None:
            self.run.cancel()
            self.loop.run_until_complete(asyncio.gather(self.run, return_exceptions=True))
            self.run = None
