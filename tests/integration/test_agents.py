"""An agent framework drives a real stack: the OpenAI Agents SDK runs an agent with two Python tools
through a multi-turn tool loop on the tiny random model, served with Qwen2.5's published chat
template. ``tool_choice: required`` makes every turn a valid call (a grammar: the random model
alone would never write one), and every turn after the first reads the earlier turns' KV
from storage (``cached_tokens`` > 0): the agentic workload DualPath exists for."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Annotated, Literal

import pytest
from conftest import start_stack
from pydantic import Field

agents = pytest.importorskip("agents")

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

QWEN_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "qwen2.5-instruct.jinja"
TOOL_TURNS = 3


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("agents")
    model = base / "tiny-qwen-template"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_TEMPLATE.read_text(encoding="utf-8")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = start_stack(model, base / "storage", base / "run")
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_agents_sdk_completes_a_multi_turn_tool_loop_and_later_turns_hit_the_kv_cache(stack, streamed):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
    )
    from openai import AsyncOpenAI

    calls: list[tuple[str, dict]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Lima"]) -> str:
        """The weather in a city."""
        calls.append(("get_weather", {"city": city}))
        return f"{city}: 21C, clear"

    @function_tool
    def add(a: Annotated[int, Field(ge=0, le=9)], b: Annotated[int, Field(ge=0, le=9)]) -> int:
        """Add two small numbers."""
        calls.append(("add", {"a": a, "b": b}))
        return a + b

    turns: list[int] = []

    def stop_after_three_tool_turns(_ctx, results) -> ToolsToFinalOutputResult:
        turns.append(len(results))
        if len(turns) < TOOL_TURNS:
            return ToolsToFinalOutputResult(is_final_output=False)
        return ToolsToFinalOutputResult(is_final_output=True, final_output="; ".join(str(r.output) for r in results))

    client = AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    agent = Agent(
        name="planner",
        instructions="Plan a trip: check the weather, then do the sums.",
        model=OpenAIChatCompletionsModel(model="tiny-qwen-template", openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=120, include_usage=True
        ),
        tools=[get_weather, add],
        tool_use_behavior=stop_after_three_tool_turns,
        reset_tool_choice=False,
    )
    ask = {"max_turns": TOOL_TURNS + 1, "run_config": RunConfig(tracing_disabled=True)}
    question = "Weather in Paris, and what is 2 + 3?" + (" (streamed)" if streamed else "")
    if streamed:  # tool calls arrive as OpenAI-style stream deltas, rebuilt by the SDK
        result = Runner.run_streamed(agent, question, **ask)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, question, **ask)
    await client.close()

    usage = [(r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens) for r in result.raw_responses]
    print(f"\nagent transcript (OpenAI Agents SDK, Runner.{'run_streamed' if streamed else 'run'}, tiny model, Qwen2.5 template):")
    for turn, ((prompt, cached), (name, args)) in enumerate(zip(usage, calls), 1):
        print(f"  turn {turn}: tool call {name}({json.dumps(args)})  prompt_tokens={prompt} cached_tokens={cached}")
    print(f"  final output: {result.final_output!r}")
    assert len(result.raw_responses) == TOOL_TURNS and len(calls) == TOOL_TURNS
    assert all(name in ("get_weather", "add") for name, _ in calls)
    # The first turn hits only what an earlier run left (the system prompt and tools); every
    # later turn also reads this run's earlier turns.
    assert usage[0][1] < usage[0][0]
    assert all(later[1] > 0 and later[1] > earlier[1] for earlier, later in itertools.pairwise(usage)), usage
    assert all(later[0] > earlier[0] for earlier, later in itertools.pairwise(usage)), "each turn extends the conversation"
    assert result.final_output
