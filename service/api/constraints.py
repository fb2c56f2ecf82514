"""What constrains a request's output: OpenAI's response_format, vLLM's guided_* and structured_outputs,
and function calling (tools and tool_choice parsed into the constraint that makes the calls, the
model's constrained text turned back into `tool_calls`). The constraint's bounds are
StructuredOutputs' own; whether it compiles is the engine's check."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.sampling_params import StructuredOutputs
from service.api import protocol
from service.body import JSON
from service.errors import InvalidRequestError

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only
MAX_NUM_TOOLS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# vLLM's constraint fields -> the StructuredOutputs field each sets
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def parse_constraint(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """The one output constraint (OpenAI's response_format, vLLM's guided_* or structured_outputs)
    and the field it came from; its bounds are StructuredOutputs' own, whether it compiles the engine's."""
    found = [
        (name, value)
        for name in ("response_format", *GUIDED, "structured_outputs")
        if (value := body.get(name)) is not None and value != {"type": "text"}
    ]
    if len(found) > 1:
        raise InvalidRequestError(
            f"{found[0][0]} and {found[1][0]} both constrain the output; send one", param=found[1][0]
        )
    if not found:
        return None, None
    name, value = found[0]
    try:
        if name == "response_format":
            return _response_format(value), name
        if name == "structured_outputs":
            if not isinstance(value, dict) or not value.keys() <= set(STRUCTURED_KEYS):
                raise ValueError(f"structured_outputs must be an object with one of {list(STRUCTURED_KEYS)}")
            return StructuredOutputs(
                **{k: v for k, v in value.items() if v is not None and v is not False}
            ), name
        if name == "guided_json" and isinstance(value, str):  # vLLM takes the schema as JSON text too
            return StructuredOutputs(json=value), name
        if name == "guided_choice" and not isinstance(value, list):
            raise ValueError("guided_choice must be a list of strings")
        return StructuredOutputs(**{GUIDED[name]: value}), name
    except ValueError as exc:
        raise InvalidRequestError(_renamed(str(exc), name), param=name) from None


def _renamed(message: str, name: str) -> str:
    """StructuredOutputs' message in the words of the field the client sent."""
    if name == "structured_outputs":
        return message
    label = "response_format json_schema.schema" if name == "response_format" else name
    return re.sub(r"^structured_outputs( (json|regex|choice|grammar)\b)?", label, message)


def _response_format(value: JSON) -> StructuredOutputs:
    """{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
    a json_schema without a schema is any JSON object. strict or not, the schema is enforced."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise ValueError(
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {...}}'
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError("response_format json_schema must be an object with a name and a schema")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutputs(json_object=True)
    if not isinstance(schema, dict):
        raise ValueError("response_format json_schema.schema must be a JSON schema (an object)")
    return StructuredOutputs(json=schema)


@dataclass(frozen=True)
class ToolCalling:
    """tool_choice "required" or a named function: the output is constrained to the call(s), and
    comes back as OpenAI `tool_calls`. ("auto" needs a parser for the model's own tool-call format,
    which the shipped models have none of: it answers in text, as "none".)"""

    function: str | None  # the named function; None: "required", any of the tools

    def calls(self, text: str) -> list[dict[str, JSON]] | None:
        """The tool_calls a finished constrained text makes; None if it is not whole JSON (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            return [protocol.tool_call(self.function, text)]
        return [
            protocol.tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
            for call in value
        ]


def parse_tools(body: dict) -> tuple[list[dict[str, JSON]], ToolCalling | None, StructuredOutputs | None]:
    """tools, tool_choice, parallel_tool_calls -> the tools' definitions (for the chat template: a model
    whose template knows tools is told of them), how tool calls are made, and the constraint that
    makes them: a named function's arguments match its parameters schema; "required" is a JSON array
    of {"name", "parameters"} calls, one at most without parallel_tool_calls."""
    tools = [_tool(t, i) for i, t in enumerate(checked_list(body.get("tools"), "tools", MAX_NUM_TOOLS))]
    definitions = [{"type": "function", "function": tool} for tool in tools]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice not in (None, "none") and not tools:
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    if choice is None or choice in ("none", "auto"):
        return definitions if choice != "none" else [], None, None
    by_name = {t["name"]: t["parameters"] for t in tools}
    if choice == "required":
        calls = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "parameters"],
                "properties": {"name": {"const": name}, "parameters": schema},
            }
            for name, schema in by_name.items()
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | (
            {"maxItems": 1} if parallel is False else {}
        )
        return definitions, ToolCalling(None), _tool_constraint(array)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in by_name:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}} naming one of the tools',
            param="tool_choice",
        )
    return definitions, ToolCalling(name), _tool_constraint(by_name[name])


def _tool(tool: JSON, index: int) -> dict[str, JSON]:
    param = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise InvalidRequestError(f'{param} must be {{"type": "function", "function": {{...}}}}', param=param)
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{param}.function.name must be 1 to 64 letters, digits, _ or -", param=f"{param}.function.name"
        )
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(
            f"{param}.function.parameters must be a JSON schema (an object)",
            param=f"{param}.function.parameters",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(
            f"{param}.function.description must be a string", param=f"{param}.function.description"
        )
    return {"name": name, "parameters": parameters} | ({"description": description} if description else {})


def _tool_constraint(schema: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=schema)
    except ValueError as exc:
        raise InvalidRequestError(
            str(exc).replace("structured_outputs json", "tools"), param="tools"
        ) from None


def checked_list(value: JSON, name: str, limit: int) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError(f"{name} must be a list", param=name)
    if len(value) > limit:
        raise InvalidRequestError(f"{name} may hold at most {limit} entries, got {len(value)}", param=name)
    return value
