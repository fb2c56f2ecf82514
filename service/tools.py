"""OpenAI function calling: tools and tool_choice parsed into the constraint that makes the calls,
and the model's constrained text turned back into `tool_calls`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import StructuredOutputs
from service import protocol
from service.errors import InvalidRequestError

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only
MAX_NUM_TOOLS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolCalling:
    """tool_choice "required" or a named function: the output is constrained to the call(s), and
    comes back as OpenAI `tool_calls`. ("auto" needs a parser for the model's own tool-call format,
    which the shipped models have none of: it answers in text, as "none".)"""

    function: str | None  # the named function; None: "required", any of the tools

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The tool_calls a finished constrained text makes; None if it is not whole JSON (cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            return [protocol.tool_call(self.function, text)]
        return [protocol.tool_call(call["name"], json.dumps(call["parameters"], ensure_ascii=False))
                for call in value]


def parse_tools(body: dict) -> tuple[ToolCalling | None, StructuredOutputs | None]:
    """tools, tool_choice, parallel_tool_calls -> how tool calls are made, and the constraint that
    makes them: a named function's arguments match its parameters schema; "required" is a JSON array
    of {"name", "parameters"} calls, one at most without parallel_tool_calls."""
    tools = [_tool(t, i) for i, t in enumerate(checked_list(body.get("tools"), "tools", MAX_NUM_TOOLS))]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice not in (None, "none") and not tools:
        raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
    if choice is None or choice in ("none", "auto"):
        return None, None
    by_name = {t["name"]: t["parameters"] for t in tools}
    if choice == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": name}, "parameters": schema}} for name, schema in by_name.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({"maxItems": 1} if parallel is False
                                                                                else {})
        return ToolCalling(None), _tool_constraint(array)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in by_name:
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}} naming one of the tools', param="tool_choice")
    return ToolCalling(name), _tool_constraint(by_name[name])


def _tool(tool: Any, index: int) -> dict[str, Any]:
    param = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise InvalidRequestError(f'{param} must be {{"type": "function", "function": {{...}}}}', param=param)
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise InvalidRequestError(f"{param}.function.name must be 1 to 64 letters, digits, _ or -",
                                  param=f"{param}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{param}.function.parameters must be a JSON schema (an object)",
                                  param=f"{param}.function.parameters")
    return {"name": name, "parameters": parameters}


def _tool_constraint(schema: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=schema)
    except ValueError as exc:
        raise InvalidRequestError(str(exc).replace("structured_outputs json", "tools"), param="tools") from None


def checked_list(value: Any, name: str, limit: int) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError(f"{name} must be a list", param=name)
    if len(value) > limit:
        raise InvalidRequestError(f"{name} may hold at most {limit} entries, got {len(value)}", param=name)
    return value
