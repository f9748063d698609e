"""Structured outputs and tool calls as a user meets them: the default model
(SmolLM2-135M-Instruct) behind the server, through the official ``openai`` client, in
every mode it serves. Each answer obeys its format -- a JSON schema (strict), any JSON
object, a forced and a required tool call, vLLM's choice and regex -- and is token for
token what constrained target-only decoding gives, streamed and not. (Exactness in
every mode of the test fixture, and the grammar mechanics, are in
``test_structured_outputs.py``.)"""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

from .conftest import stream_chat

MODES = ("none", *PROPOSER_MODES)  # every mode: SmolLM2 ships a draft model and a head of each kind
BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                         "year": {"type": "integer"}},
        "required": ["title", "author", "year"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"], "additionalProperties": False}}}]
# A tool as a user writes one: no additionalProperties, so it is held closed (strict by default)
CITY_WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
DATE = r"\d{4}-\d{2}-\d{2}"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# name -> (request fields, a check of the reply's message)
CASES = {
    "json_schema": (dict(messages=user("Tell me about the book 1984 by George Orwell, as JSON with its title, "
                                       "author and year."),
                         response_format={"type": "json_schema",
                                          "json_schema": {"name": "book", "schema": BOOK, "strict": True}}),
                    lambda m: jsonschema.validate(json.loads(m.content), BOOK) is None
                    and json.loads(m.content)["author"] == "George Orwell"),
    "json_object": (dict(messages=user('Return the capital of France as JSON, with the key "capital".'),
                         response_format={"type": "json_object"}),
                    lambda m: json.loads(m.content) == {"capital": "Paris"}),
    "forced_tool": (dict(messages=user("What's the weather like in Paris today?"), tools=TOOLS,
                         tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                    lambda m: [c.function.name for c in m.tool_calls] == ["get_weather"]
                    and jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), WEATHER) is None
                    and json.loads(m.tool_calls[0].function.arguments)["city"] == "Paris"),
    "required_tool": (dict(messages=user("What's the weather like in Paris today?"), tools=TOOLS,
                           tool_choice="required", parallel_tool_calls=False),
                      lambda m: len(m.tool_calls) == 1 and m.tool_calls[0].function.name in ("get_weather", "get_time")
                      and json.loads(m.tool_calls[0].function.arguments)["city"] == "Paris"),
    # tool_choice "auto" (the client's default with tools): one tool, a question it
    # answers, then one it does not
    "auto_tool_call": (dict(messages=user("What's the weather in Paris?"), tools=CITY_WEATHER),
                       lambda m: [c.function.name for c in m.tool_calls] == ["get_weather"]
                       and json.loads(m.tool_calls[0].function.arguments)["city"] == "Paris"),
    "auto_reply": (dict(messages=user("Say hello"), tools=CITY_WEATHER),
                   lambda m: m.tool_calls is None and "hello" in m.content.lower()),
    # "Which city": asked "What is the capital of Italy?" the default (fast) format picks
    # Berlin, float32 Rome: a near tie at this 135M model's first token (docs/models.md).
    "choice": (dict(messages=user("Which city is the capital of Italy? Answer with one word."),
                    extra_body={"structured_outputs": {"choice": ["Rome", "Paris", "Berlin", "Madrid"]}}),
               lambda m: m.content == "Rome"),
    "regex": (dict(messages=user("When did World War II end? Answer with a date."),
                   extra_body={"structured_outputs": {"regex": DATE}}),
              lambda m: re.fullmatch(DATE, m.content) is not None and m.content.startswith("1945")),
}


@pytest.fixture(scope="module")
def client(default_model_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_model_server}/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, mode: str, case: dict) -> dict:
    extra = {**case.get("extra_body", {}), "speculative_mode": mode, "return_token_ids": True}
    return dict(model="SmolLM2-135M-Instruct", max_tokens=48, temperature=0,
                **{k: v for k, v in case.items() if k != "extra_body"}, extra_body=extra)


@pytest.mark.parametrize("name", list(CASES))
def test_each_format_is_obeyed_and_token_identical_to_constrained_target_only_streamed_and_not(client, name):
    case, obeyed = CASES[name]
    expected = None
    for mode in MODES:  # "none" first: constrained target-only, the reference
        request = ask(client, mode, case)
        whole = client.chat.completions.create(**request).choices[0]
        if expected is None:
            expected = whole
            assert obeyed(expected.message), expected.message
            tool = expected.message.tool_calls is not None
            assert expected.finish_reason == ("tool_calls" if tool else "stop")
        content, calls, finish, ids = stream_chat(client, **request)
        assert whole.model_extra["token_ids"] == ids == expected.model_extra["token_ids"], mode
        assert whole.message.content == expected.message.content and finish == expected.finish_reason
        if tool:
            assert whole.message.content is None and content == ""
            assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
                [(c["name"], c["arguments"]) for c in calls] == \
                [(c.function.name, c.function.arguments) for c in expected.message.tool_calls]
        else:
            assert content == whole.message.content and not calls


def test_a_conversation_goes_on_after_a_tool_call(client):
    """The assistant's call sent back as the SDK dumps it, then the tool's answer: the
    model answers from it in text (tool_choice "none")."""
    case, _ = CASES["forced_tool"]
    first = client.chat.completions.create(**ask(client, "none", case)).choices[0].message
    call = first.tool_calls[0]
    messages = [*case["messages"], first.model_dump(),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=40,
                                           temperature=0, tools=TOOLS, tool_choice="none").choices[0]
    assert reply.message.tool_calls is None and reply.message.content


def test_a_tool_call_cut_by_max_tokens_is_never_returned_with_broken_arguments(client):
    """Three calls asked for, and the output cut inside the first, the second and the
    third: what comes back parses, whole and streamed, and says it was cut."""
    cut = 0
    for max_tokens in (12, 24, 40):
        request = dict(model="SmolLM2-135M-Instruct", messages=user("Weather in Paris, Rome and Oslo?"),
                       temperature=0, tools=TOOLS, tool_choice="required", max_tokens=max_tokens)
        whole = client.chat.completions.create(**request).choices[0]
        content, calls, finish, _ = stream_chat(client, **request)
        assert whole.finish_reason == finish and content == ""
        cut += finish == "length"
        returned = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert returned == [(c["name"], c["arguments"]) for c in calls]
        for _, arguments in returned:
            assert isinstance(json.loads(arguments), dict)
    assert cut >= 2


def test_bad_schemas_are_400s_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError, match="Unknown format: postcode") as refused:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=user("x"), max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "string", "format": "postcode"}}})
    assert refused.value.body["param"] == "response_format"
