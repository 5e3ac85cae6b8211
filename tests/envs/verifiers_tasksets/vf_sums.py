"""A verifiers taskset for the adapter's tests: one-answer sums (verifiers' SingleAgentEnv: the prompt,
one reply, scored), with two weighted rewards."""

import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "Answer with the number only."


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 20)


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 6


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f"What is {i} + {i + 3}?", system_prompt=SYSTEM_PROMPT, answer=2 * i + 3),
                        self.config.task) for i in range(self.config.num_tasks)]


__all__ = ["SumTaskset"]
