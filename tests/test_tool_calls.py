"""Reading tool calls out of the output as it grows: only complete calls come back,
streamed deltas add up to the whole response, an ``auto`` reply's JSON string decodes
to its text a prefix at a time, and strict schemas are closed; a chat template that
renders tools in ``<tool_call>`` tags gets that format, held by its grammar."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.deployments.openai_protocol import ChatCompletionRequest
from specserve.deployments.tool_calls import (ToolPlan, closed, decoded_prefix, render_prompt, tool_format,
                                              tool_plan)
from specserve.engine import GenerationOptions
from specserve.engine.model.chat import ChatTemplate

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


# -- the Hermes format: a chat template that renders tools and asks for <tool_call> blocks --

HERMES = ChatTemplate((Path(__file__).parent / "data/hermes_chat_template.jinja").read_text())
CHATML = ChatTemplate("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


CITIES = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}


def weather_request(parameters: dict = WEATHER["parameters"], **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}], **fields})


def test_a_template_that_renders_tools_in_tool_call_tags_gets_its_own_format():
    assert tool_format(HERMES) == "hermes"
    assert tool_format(CHATML) == "generic" and tool_format(ChatTemplate()) == "generic"


def test_the_hermes_template_shows_the_tools_and_earlier_calls_itself():
    body = weather_request(messages=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'}])
    prompt = render_prompt(HERMES, body.messages, tool_plan(body, "hermes"))
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in prompt
    assert "respond with JSON" not in prompt  # no system message of the generic format


@pytest.mark.parametrize("step", [1, 5, 200])
def test_hermes_calls_come_whole_when_their_block_closes_and_a_cut_one_never(step):
    plan = ToolPlan((WEATHER,), None, format="hermes")
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ly')
    scanner, calls, content = fed(plan, text, step)
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}'] == \
        [c["function"]["arguments"] for c in scanner.tool_calls()]
    assert content == "" and scanner.message()["content"] is None


def test_a_hermes_auto_reply_streams_as_its_text():
    scanner, calls, content = fed(ToolPlan((WEATHER,), None, auto=True, format="hermes"), "Hello <b>there</b>", 3)
    assert calls == [] and content == "Hello <b>there</b>" == scanner.message()["content"]


@pytest.mark.parametrize("choice", ["required", "auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_the_hermes_grammar_holds_the_model_to_calls_of_the_tools_named(target_engine, choice):
    """The bundled fixture (random weights, so nothing but the grammar makes it call) with
    the Hermes template: a forced call parses and satisfies its schema; "auto" gives a
    call or a reply, never both and never a broken call; a cut call is not returned."""
    body = weather_request(CITIES, tool_choice=choice, parallel_tool_calls=False)  # a city the fixture can finish
    plan = tool_plan(body, tool_format(HERMES))
    prompt = render_prompt(HERMES, body.messages, plan)
    for max_tokens, cut in ((96, False), (6, True)):
        result = target_engine.generate(prompt, GenerationOptions(max_new_tokens=max_tokens,
                                                                  structured_output=plan.structured_output()))
        scanner = plan.scanner()
        scanner.feed(result.text)
        message = scanner.message()
        if scanner.reply:
            assert choice == "auto" and not result.text.startswith("<") and message.get("tool_calls") is None
            continue
        calls = message["tool_calls"] or []
        if cut:
            assert result.finish_reason == "length" and calls == []
            continue
        assert result.finish_reason == "stop" and [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Lyon")
