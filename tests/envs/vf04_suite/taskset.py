from typing import Literal

import verifiers.v1 as vf
from vf04_suite.servers.colors import ColorTools

COLORS = ("blue", "red", "green")
AGAIN = ("again", "again")  # the multi-turn user's follow-ups


class ColorData(vf.TaskData):
    answer: str


class ColorTaskConfig(vf.TaskConfig):
    kind: Literal["single", "tool", "multi", "raises"] = "single"
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ColorTask(vf.Task[ColorData, vf.State, ColorTaskConfig]):
    @vf.reward
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def mentions_answer(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(self.data.answer in r for r in replies) / max(len(replies), 1)

    @vf.reward(weight=0.0)
    async def checked(self, trace: vf.Trace) -> float:
        if self.config.kind == "raises":
            raise ValueError("reward blew up")
        return 1.0

    @vf.metric
    async def replies(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))

    @classmethod
    def toolsets(cls, config: ColorTaskConfig) -> list[vf.Toolset]:
        return [ColorTools(config.tools)] if config.kind == "tool" else []


class ColorConfig(vf.TasksetConfig):
    task: ColorTaskConfig = ColorTaskConfig()


class ColorTaskset(vf.Taskset[ColorTask, ColorConfig]):
    def load(self) -> list[ColorTask]:
        return [
            ColorTask(ColorData(idx=i, prompt=f"say {c}", answer=c), self.config.task) for i, c in enumerate(COLORS)
        ]


class ColorEnv(vf.SingleAgentEnv):
    """The multi-turn kind's scripted user: two follow-ups after the first reply."""

    async def run(self, task, agents):
        if task.config.kind != "multi":
            await agents.agent.run(task)
            return
        async with agents.agent.interaction(task) as interaction:
            if (await interaction.turn()).terminated:  # the task's own prompt opens the exchange
                return
            for prompt in AGAIN:
                if (await interaction.turn(prompt)).terminated:
                    break
