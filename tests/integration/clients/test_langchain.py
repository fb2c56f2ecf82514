"""langchain-openai's ChatOpenAI against the server: invoke, stream, batch and with_structured_output."""

from typing import Literal

from langchain_openai import ChatOpenAI
from pydantic import BaseModel


class Verdict(BaseModel):
    language: Literal["python", "c", "rust"]
    compiles: bool


async def chat(start, **options) -> ChatOpenAI:
    h = await start(api_keys=("k",))
    return ChatOpenAI(
        base_url=str(h.client.make_url("/v1")),
        api_key="k",
        model="primary",
        max_retries=0,
        **{"max_tokens": 8, "temperature": 0.0, **options},
    )


async def test_invoke_stream_and_batch(start):
    llm = await chat(start)
    message = await llm.ainvoke("Write a loop")
    assert message.content and message.response_metadata["model_name"] == "primary"
    assert message.usage_metadata["output_tokens"] == 8
    chunks = [chunk.content async for chunk in llm.astream("Write a loop")]
    assert "".join(chunks) == message.content  # greedy: the stream says what the call said
    answers = await llm.abatch(["Write a loop", "Write a class", "Write a test"])
    assert len(answers) == 3 and all(a.content for a in answers)


async def test_with_structured_output_returns_the_pydantic_model(start):
    llm = await chat(start, max_tokens=48)
    structured = llm.with_structured_output(Verdict, method="json_schema", strict=True)
    for prompt in ("Is this Python? print(1)", "Does this compile? int main() {}", "Rust?"):
        verdict = await structured.ainvoke(prompt)
        assert isinstance(verdict, Verdict), verdict


class RunTests(BaseModel):
    """Run the project's tests."""

    path: Literal["tests/", "tests/engine/", "tests/service/"]
    verbose: bool


async def test_bind_tools_with_a_named_tool_returns_its_call(start):
    llm = await chat(start, max_tokens=48)
    # strict: LangChain closes the schema (additionalProperties false), as OpenAI's strict mode asks
    message = await llm.bind_tools([RunTests], tool_choice="RunTests", strict=True).ainvoke(
        "Run the engine tests"
    )
    (call,) = message.tool_calls
    assert call["name"] == "RunTests" and RunTests(**call["args"]), message
    assert message.response_metadata["finish_reason"] == "tool_calls"
