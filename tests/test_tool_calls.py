"""Reading tool calls out of the output as it grows: only complete calls come back,
streamed deltas add up to the whole response, an ``auto`` reply's JSON string decodes
to its text a prefix at a time, and strict schemas are closed."""
from __future__ import annotations

import json

import pytest

from specserve.deployments.tool_calls import ToolPlan, closed, decoded_prefix

WEATHER = {"name": "get_weather", "description": None,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def fed(plan: ToolPlan, text: str, step: int = 1):
    """The scanner after ``text`` a few characters at a time, and what its deltas said."""
    scanner, calls, content = plan.scanner(), [], ""
    for i in range(0, len(text), step):
        scanner.feed(text[i: i + step])
        calls += scanner.deltas()
        content += scanner.content_delta()
    return scanner, calls, content


@pytest.mark.parametrize("step", [1, 3, 64])
def test_an_auto_reply_streams_as_its_decoded_text(step):
    reply = 'Hello \\"you\\" \\u00e9\\ud83d\\ude00 \\\\ done'
    text = f'{{"response": "{reply}"}}'
    scanner, calls, content = fed(ToolPlan((WEATHER,), None, auto=True), text, step)
    assert content == json.loads(text)["response"] == scanner.message()["content"]
    assert calls == [] and scanner.message().get("tool_calls") is None


def test_an_auto_call_is_read_from_inside_its_object():
    text = '{"tool_calls": [{"name": "get_weather", "parameters": {"city": "Paris"}}]}'
    scanner, calls, content = fed(ToolPlan((WEATHER,), None, auto=True), text)
    assert content == "" and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert scanner.message()["content"] is None and len(scanner.message()["tool_calls"]) == 1


def test_a_cut_call_is_dropped_and_the_complete_ones_kept():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_weather", "parameters": {"ci'
    scanner, calls, _ = fed(ToolPlan((WEATHER,), None), text)
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}']
    assert [c["function"]["arguments"] for c in scanner.tool_calls()] == ['{"city": "Paris"}']


def test_a_named_call_comes_whole_once_its_arguments_parse():
    plan = ToolPlan((WEATHER,), "get_weather")
    cut, _, _ = fed(plan, '{"city": "Par')
    assert cut.tool_calls() == [] and cut.deltas() == []
    whole, calls, _ = fed(plan, '{"city": "Paris"}')
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}'] == \
        [c["function"]["arguments"] for c in whole.tool_calls()]


@pytest.mark.parametrize("raw, text", [('ab\\', "ab"), ('ab\\u00', "ab"), ('x\\ud83d', "x"), ('x\\ud83d\\ude00', "x\U0001f600"),
                                       ('done" tail', "done")])
def test_a_json_string_prefix_decodes_to_a_prefix_of_its_text(raw, text):
    assert decoded_prefix(raw) == text


def test_strict_schemas_close_every_object_that_says_nothing_of_extra_keys():
    schema = {"type": "object", "properties": {"place": {"type": "object", "properties": {"city": {"type": "string"}}},
                                               "tags": {"type": "array", "items": {"type": "object"}},
                                               "extra": {"type": "object", "additionalProperties": True}}}
    shut = closed(schema)
    assert shut["additionalProperties"] is False and shut["properties"]["place"]["additionalProperties"] is False
    assert shut["properties"]["tags"]["items"]["additionalProperties"] is False
    assert shut["properties"]["extra"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the request's own schema is untouched
