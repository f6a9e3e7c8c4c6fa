"""The OpenAI Agents SDK against /v1/responses (its default model API): `Runner.run` with a
function tool completes a tool round trip on the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from server_utils import RealServer, real_server
from test_responses_api import tool_model_dir  # noqa: F401 - a fixture

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def server(tool_model_dir: Path) -> Iterator[RealServer]:  # noqa: F811
    with real_server(tool_model_dir, response_store="memory") as live:
        yield live


class Answer(BaseModel):
    weather: Literal["sunny", "rainy"]


def test_runner_completes_a_tool_round_trip(server: RealServer) -> None:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
        # The first turn must call the tool; the SDK then resets tool_choice, so the second
        # turn answers, in JSON held to the output type's schema (so the random model ends).
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=200),
        output_type=Answer,
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == 2
