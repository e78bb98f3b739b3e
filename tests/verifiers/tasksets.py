"""Tiny verifiers v1 tasksets, written as verifiers' own examples write theirs: a single-turn
one, and one whose task serves an MCP `Toolset` with the `multiply` tool the tiny tool model
calls (tests/rollout/tool_models.py)."""

import verifiers.v1 as vf

from tests.rollout.tool_models import MULTIPLY_PROMPT

PROMPT = MULTIPLY_PROMPT[0]["content"]


def digits(text: str) -> float:
    """The share of a reply's characters that are digits: a reward that differs between replies."""
    text = text.strip()
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


class MultiplyData(vf.TaskData):
    answer: str


class MultiplyTask(vf.Task[MultiplyData]):
    @vf.reward(weight=1.0)
    async def digits(self, trace: vf.Trace) -> float:
        return digits(trace.last_reply)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class MultiplyTaskset(vf.Taskset[MultiplyTask, vf.TasksetConfig]):
    """Single-turn: the question alone, no tools."""

    def load(self):
        return [MultiplyTask(MultiplyData(prompt=PROMPT, answer="12"), self.config.task)]


class MultiplyToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool's bare name, as the tiny model learned it

    @vf.tool
    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers."""
        return a * b


class ToolTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ToolTask(vf.Task[MultiplyData, vf.State, ToolTaskConfig]):
    @classmethod
    def toolsets(cls, config: ToolTaskConfig) -> list[vf.Toolset]:
        return [MultiplyToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)


class ToolTasksetConfig(vf.TasksetConfig):
    task: ToolTaskConfig = ToolTaskConfig()


class ToolTaskset(vf.Taskset[ToolTask, ToolTasksetConfig]):
    """The question with the multiply tool, served by a Toolset (its url: data.task_options)."""

    def load(self):
        return [ToolTask(MultiplyData(prompt=PROMPT, answer="12"), self.config.task)]
