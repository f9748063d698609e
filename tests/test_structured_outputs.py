"""Structured outputs under speculation, in-process, on the test fixture (which serves
every mode): a grammar masks the target's logits at every verified position, drafts the
grammar forbids are rejected, and greedy output is token-identical to constrained
target-only decoding in every mode. The fixture writes Python-like text, so its JSON is
valid but meaningless; the grammars below leave it room to write code, so that its
drafts are accepted often enough for the comparison to mean something. What a user sees
on the default model, through the server, is in ``test_structured_server.py``."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from pydantic import ValidationError

from specserve.engine import GenerationOptions, InvalidRequestError
from specserve.engine.grammar.compiler import grammar_compiler
from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.grammar.state import GrammarError
from specserve.engine.speculative.sampling import SequenceRules
from specserve.engine.speculative.verify import verify

from .conftest import assert_everything_released
from .test_speculative import reference_decode

MODES = ["none", "prompt_lookup", "suffix", "draft_model", "mtp", "eagle3", "shared_kv"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "body": {"type": "string"},
                                           "count": {"type": "integer"}},
          "required": ["name", "body", "count"], "additionalProperties": False}
STATEMENT = r"\n        (return|if|for) [a-z_.()\[\], ]+"
CHOICES = ["\n        return None", "\n        raise ValueError", "\n        pass"]
LARK = 'start: NL "        " STMT\nNL: "\\n"\nSTMT: /self\\.[a-z_]+ = [a-z_]+/'
GRAMMARS = {"json_schema": StructuredOutput.json_schema(SCHEMA), "json_object": StructuredOutput.json_object(),
            "regex": StructuredOutput.regex(STATEMENT), "choice": StructuredOutput.choice(CHOICES),
            "grammar": StructuredOutput.grammar(LARK)}


def obeys(kind: str, text: str, finish_reason: str) -> bool:
    """Whether a finished output matches its grammar, and a cut one could still."""
    if kind in ("json_schema", "json_object"):
        if finish_reason == "length":
            return text.startswith("{")
        value = json.loads(text)
        if kind == "json_schema":
            jsonschema.validate(value, SCHEMA)
        return isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch(STATEMENT, text) is not None or (finish_reason == "length" and text.startswith("\n"))
    if kind == "choice":
        return text in CHOICES
    return text.startswith("\n        self.") and (finish_reason == "length" or " = " in text)


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_greedy_output_is_token_identical_to_constrained_target_only_in_every_mode(
        kind, bundle_engine, heldout_prompts):
    assert bundle_engine.available_modes == MODES
    accepted = 0
    for prompt in heldout_prompts[:3]:
        options = GenerationOptions(max_new_tokens=24, structured_output=GRAMMARS[kind])
        expected = bundle_engine.generate(prompt, options.model_copy(update={"speculative_mode": "none"}))
        assert obeys(kind, expected.text, expected.finish_reason), expected.text
        for mode in MODES[1:]:
            result = bundle_engine.generate(prompt, options.model_copy(update={"speculative_mode": mode}))
            assert result.token_ids == expected.token_ids, f"{kind} {mode} diverged on {prompt[-40:]!r}"
            assert (result.text, result.finish_reason) == (expected.text, expected.finish_reason)
            accepted += result.speculative.accepted_tokens
    assert accepted > 0  # drafts were really accepted under the grammar, not only rejected
    assert_everything_released(bundle_engine)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["none", "draft_model", "eagle3"])
def test_the_engine_gives_the_reference_loops_tokens_under_a_grammar(mode, temperature, bundle_engine,
                                                                   heldout_prompts):
    """The scheduler and the one-page loop mask alike: same tokens, rounds and
    acceptances, greedy and seeded-sampled (a sampling drafter's q is unmasked, so its
    forbidden drafts are rejected by the rule that rejects any other)."""
    for n, prompt in enumerate(heldout_prompts[4:6]):
        options = GenerationOptions(max_new_tokens=24, temperature=temperature, seed=7 + n, speculative_mode=mode,
                                    num_speculative_tokens=4, structured_output=GRAMMARS["json_schema"])
        result = bundle_engine.generate(prompt, options)
        assert bundle_engine.drain()
        state, stats = reference_decode(bundle_engine, mode, prompt, options, 4)
        assert result.token_ids == state.generated and result.text == state.text
        assert (result.speculative.verification_steps, result.speculative.accepted_per_position) == \
            (stats.verification_steps, stats.accepted_per_position)


def token_id(tokenizer, text: str) -> int:
    """The id of the token whose bytes are exactly ``text``."""
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == text.encode())


def test_a_draft_the_grammar_forbids_is_rejected_and_the_masked_choice_taken(bundle_engine):
    """Straight at ``verify``, under ``ab+``: the raw logits favour "z" everywhere, which the
    grammar never allows. Draft "a" is allowed and the masked favourite, so it is accepted;
    draft "z" is forbidden, so it is rejected and the masked choice "b" taken; the grammar
    ends standing at the two committed tokens. Sampling rejects "z" every time (p = 0)."""
    target = bundle_engine.target
    vocab, tokenizer = target.decoder.vocab_size, target.tokenizer
    compiler = grammar_compiler(tokenizer, vocab, target.eos_token_ids)
    a, b, z = (token_id(tokenizer, c) for c in "abz")
    logits = np.zeros((3, vocab), np.float32)
    logits[:, z] = 40.0
    logits[0, a] = logits[1, b] = 30.0
    rules = SequenceRules.of(1, GenerationOptions(), target.eos_token_ids)
    for options, seeds in ((GenerationOptions(), [0]), (GenerationOptions(temperature=1.0), range(20))):
        for seed in seeds:
            grammar = compiler.start(StructuredOutput.regex("ab+"))
            verdict = verify(logits, [a, z], None, [0], options, np.random.default_rng(seed), rules, grammar)
            assert (verdict.accepted, verdict.next_token) == (1, b)
            assert grammar.consumed == 2 and grammar.accepting  # "ab": the committed tokens, "z" never taken
    with pytest.raises(GrammarError):
        compiler.start(StructuredOutput.regex("ab+")).advance(z)  # a forbidden token cannot be forced in


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length(bundle_engine, heldout_prompts):
    options = GenerationOptions(max_new_tokens=12, speculative_mode="eagle3",
                                structured_output=StructuredOutput.regex(r"[a-z_]{200}"))
    result = bundle_engine.generate(heldout_prompts[0], options)
    assert result.finish_reason == "length" and len(result.token_ids) == 12
    assert re.fullmatch(r"[a-z_]+", result.text)


@pytest.mark.parametrize("spec, named", [
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "frobnicate"}}}), "frobnicate"),
    (StructuredOutput.json_schema({"type": "string", "format": "madeup"}), "Unknown format: madeup"),
    (StructuredOutput.json_schema({"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
    (StructuredOutput.json_schema({"type": "array", "uniqueItems": True}), "Unimplemented keys: \\[\"uniqueItems"),
    (StructuredOutput.regex("a(b"), "unclosed group"),
    (StructuredOutput.grammar("start: undefined_rule"), "undefined_rule"),
])
def test_a_bad_grammar_is_refused_before_admission_naming_the_problem(spec, named, bundle_engine):
    with pytest.raises(InvalidRequestError, match=named) as refused:
        bundle_engine.generate("def f(x):", GenerationOptions(max_new_tokens=4, structured_output=spec))
    assert refused.value.param == "structured_output"
    assert_everything_released(bundle_engine)


def test_options_that_would_hide_the_end_of_a_grammar_are_refused():
    spec = StructuredOutput.json_object()
    with pytest.raises(ValidationError, match="ignore_eos"):
        GenerationOptions(ignore_eos=True, structured_output=spec)
    with pytest.raises(ValidationError, match="min_tokens"):
        GenerationOptions(min_tokens=3, max_new_tokens=8, structured_output=spec)
    with pytest.raises(ValidationError, match="not valid JSON"):
        StructuredOutput(kind="json_schema", value="{nope")
    with pytest.raises(ValidationError, match="non-empty list"):
        StructuredOutput.choice([])


def test_a_schema_is_compiled_once_however_many_sequences_use_it(bundle_engine, heldout_prompts):
    target = bundle_engine.target
    compiler = grammar_compiler(target.tokenizer, target.decoder.vocab_size, target.eos_token_ids)
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"once": {"type": "boolean"}},
                                         "required": ["once"], "additionalProperties": False})
    before = compiler.compilations
    for prompt in heldout_prompts[:3]:
        result = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=16, structured_output=spec))
        assert json.loads(result.text)["once"] in (True, False)
    assert compiler.compilations == before + 1  # the request check and the target worker share it


def test_a_sequence_re_prefilled_on_a_new_target_rebuilds_its_grammar_from_its_tokens(bundle_engine,
                                                                                        heldout_prompts, monkeypatch):
    """The target forgets the sequence mid-output, inside the JSON (what a replacement
    replica looks like): the re-prefill rebuilds the grammar state from the committed
    tokens, and the output is unchanged."""
    options = GenerationOptions(max_new_tokens=30, speculative_mode="mtp", structured_output=GRAMMARS["json_schema"])
    expected = bundle_engine.generate(heldout_prompts[2], options).token_ids
    worker = bundle_engine.transport.target
    resumes, committed = [], []
    real_step = worker.step

    def step(prefills=(), verifies=(), releases=()):
        resumes.extend(len(p.tokens) for p in prefills if p.resume)
        return real_step(prefills, verifies, releases)

    def forget_after_six(event):  # on the loop thread, between two target passes
        committed.append(event.token_id)
        if len(committed) >= 6 and not resumes and worker.sequences:
            worker.release(worker.sequences)

    monkeypatch.setattr(worker, "step", step)
    result = bundle_engine.generate(heldout_prompts[2], options, on_token=forget_after_six)
    assert len(resumes) == 1 and result.token_ids == expected
    assert_everything_released(bundle_engine)


@pytest.mark.parametrize("mode", ["draft_model", "mtp", "eagle3", "shared_kv"])
def test_proposers_draft_only_what_the_grammar_allows(mode, bundle_engine, heldout_prompts, monkeypatch):
    """Every draft a proposer worker returns is allowed by the grammar after the committed
    tokens and the drafts before it -- and with guidance off, some are not (the check can
    fail). Either way the output is the same."""
    target = bundle_engine.target
    compiler = grammar_compiler(target.tokenizer, target.decoder.vocab_size, target.eos_token_ids)
    spec = GRAMMARS["json_schema"]
    worker = bundle_engine.transport.proposers[mode]
    prompt = bundle_engine.factory.encode(heldout_prompts[5])
    generated: list[int] = []
    checked = {"drafts": 0, "forbidden": 0}
    real_propose = worker.propose

    def propose(items):  # on the loop thread, as are the token events: ``generated`` is what is committed
        results = real_propose(items)
        for result in results:
            state = compiler.start(spec)
            state.replay(generated)
            for token in result.tokens:
                checked["drafts"] += 1
                if not state.allowed()[token]:
                    checked["forbidden"] += 1
                    break
                state.advance(token)
        return results

    monkeypatch.setattr(worker, "propose", propose)
    options = GenerationOptions(max_new_tokens=24, speculative_mode=mode, structured_output=spec)
    outputs = {}
    for guided in (True, False):
        monkeypatch.setattr(worker, "guided", guided)
        generated.clear()
        checked.update(drafts=0, forbidden=0)
        outputs[guided] = bundle_engine.generate(prompt, options, on_token=lambda e: generated.append(e.token_id))
        assert checked["drafts"] > 0
        assert (checked["forbidden"] == 0) == guided, (guided, checked)
    assert outputs[True].token_ids == outputs[False].token_ids
    assert outputs[True].speculative.acceptance_rate > outputs[False].speculative.acceptance_rate
