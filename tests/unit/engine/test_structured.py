"""Structured output's request bounds, checked like every other (StructuredOutputs, SamplingParams), and
the JSON cursor that closes a reply; compiles and constrained generation on the shipped tiny model are
tests/integration/engine/test_structured.py."""

import pytest

from engine.sampling_params import MAX_STRUCTURED_CHARS, SamplingParams, StructuredOutputs
from engine.structured.json_closer import JsonCursor

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zip"],
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        },
    },
}


def test_the_json_cursor_follows_strings_escapes_and_containers():
    cursor = JsonCursor()
    cursor.feed(b'{"a": [1, {"b": "x\\"}]')  # the string holds x \ \" and ends at none of them
    assert (cursor.in_string, cursor.escaped, cursor.stack) == (True, False, [0x7B, 0x5B, 0x7B])
    twin = cursor.copy()
    twin.feed(b'"}]')
    assert (twin.in_string, twin.stack, cursor.stack) == (False, [0x7B], [0x7B, 0x5B, 0x7B])
    cursor.feed("é\\".encode())  # a multi-byte character, then an escape pending
    assert cursor.in_string and cursor.escaped and cursor.preferences()[0] == b"n"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one"),
        ({"json": PERSON, "regex": "a"}, "exactly one"),
        ({"json": "[1, 2]"}, "an object"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "1 to 256"),
        ({"choice": ["a", ""]}, "non-empty"),
        ({"regex": ""}, "non-empty string"),
        ({"grammar": "x" * (MAX_STRUCTURED_CHARS + 1)}, "at most"),
        ({"choice": ["abc"] * 257}, "1 to 256"),
    ],
)
def test_structured_outputs_check_their_bounds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**kwargs)


def test_sampling_params_take_only_a_structured_outputs():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputs"):
        SamplingParams(structured_outputs={"json": PERSON})
