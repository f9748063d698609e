"""Target-only generation: cache correctness, decoding options, stopping, streaming."""
from __future__ import annotations

import numpy as np
import pytest

from specserve.engine import Engine, EngineConfig, GenerationOptions, KVCacheCapacityError, PromptTooLongError
from specserve.engine.errors import InvalidRequestError
from specserve.engine.kv.block_ledger import AdmissionError
from specserve.engine.speculative.sequence import TokenEvent

from .conftest import PINNED, TARGET_DIR


def uncached_greedy(engine: Engine, prompt: str, n: int) -> list[int]:
    """Reference: recompute the whole sequence from scratch (no KV past) for every token."""
    decoder = engine.target.decoder
    tokens = engine.tokenizer.encode(prompt)
    out = []
    for _ in range(n):
        ids = np.asarray(tokens)[None]
        logits = decoder.forward(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], decoder.empty_past()).logits
        out.append(int(np.argmax(logits[0, -1])))
        tokens.append(out[-1])
    return out


def test_cached_decoding_matches_uncached_recomputation(target_engine, heldout_prompts):
    for prompt in heldout_prompts[:10]:
        result = target_engine.generate(prompt, GenerationOptions(max_new_tokens=32, ignore_eos=True))
        assert result.token_ids == uncached_greedy(target_engine, prompt, 32)
    assert target_engine.drain() and target_engine.target.cache.used_blocks == 0


def test_greedy_is_deterministic_and_top_k_1_equals_greedy(target_engine, heldout_prompts):
    prompt = heldout_prompts[3]
    greedy = target_engine.generate(prompt, GenerationOptions(max_new_tokens=24))
    assert target_engine.generate(prompt, GenerationOptions(max_new_tokens=24)).token_ids == greedy.token_ids
    top1 = target_engine.generate(prompt, GenerationOptions(max_new_tokens=24, temperature=0.9, top_k=1, seed=5))
    assert top1.token_ids == greedy.token_ids


def test_sampling_with_a_seed_is_reproducible(target_engine, heldout_prompts):
    options = GenerationOptions(max_new_tokens=32, temperature=1.0, top_p=0.95, seed=1234)
    first = target_engine.generate(heldout_prompts[0], options)
    second = target_engine.generate(heldout_prompts[0], options)
    assert first.token_ids == second.token_ids and first.text == second.text
    others = {tuple(target_engine.generate(heldout_prompts[0], options.model_copy(update={"seed": s})).token_ids)
              for s in range(4)}
    assert len(others) > 1, "different seeds should give different samples"


def test_repetition_penalty_changes_greedy_output(target_engine, heldout_prompts):
    prompt = heldout_prompts[1]
    plain = target_engine.generate(prompt, GenerationOptions(max_new_tokens=48))
    penalised = target_engine.generate(prompt, GenerationOptions(max_new_tokens=48, repetition_penalty=1.5))
    assert plain.token_ids != penalised.token_ids


def test_max_new_tokens_gives_length(target_engine, heldout_prompts):
    result = target_engine.generate(heldout_prompts[2], GenerationOptions(max_new_tokens=7, ignore_eos=True))
    assert result.finish_reason == "length" and result.completion_tokens == 7


def test_stop_string_truncates_and_finishes_with_stop(target_engine, heldout_prompts):
    prompt = heldout_prompts[4]
    free = target_engine.generate(prompt, GenerationOptions(max_new_tokens=40, ignore_eos=True))
    stop = free.text[15:19]
    assert len(stop.strip()) >= 2, f"pick a better stop substring from {free.text!r}"
    stopped = target_engine.generate(prompt, GenerationOptions(max_new_tokens=40, ignore_eos=True, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stop not in stopped.text


@pytest.mark.parametrize("mode", ["none", "prompt_lookup", "draft_model", "eagle3"])
def test_stop_token_ids_end_generation_on_that_token_even_with_ignore_eos(bundle_engine, heldout_prompts, mode):
    """vLLM's stop_token_ids: the first of them generated ends the request, the token in
    token_ids but not its text (as EOS) -- also in the middle of a round's accepted drafts
    or of a call's plain rounds."""
    prompt = heldout_prompts[5]
    options = GenerationOptions(max_new_tokens=24, ignore_eos=True, speculative_mode=mode)
    free = bundle_engine.generate(prompt, options)
    stop_id = free.token_ids[9]
    first = free.token_ids.index(stop_id)
    stopped = bundle_engine.generate(prompt, options.model_copy(update={"stop_token_ids": (stop_id,)}))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.text == bundle_engine.tokenizer.decode(stopped.token_ids[:-1])
    assert free.text.startswith(stopped.text) and len(stopped.text) < len(free.text)
    assert bundle_engine.drain() and bundle_engine.target.cache.used_blocks == 0


def test_stop_token_ids_outside_the_vocabulary_are_refused(bundle_engine):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        bundle_engine.generate("x", GenerationOptions(stop_token_ids=(bundle_engine.tokenizer.vocab_size,)))
    for bad in ((-1,), "12"):  # a string is not a list of digits' ids
        with pytest.raises(ValueError, match="stop_token_ids"):
            GenerationOptions(stop_token_ids=bad)


def test_eos_token_finishes_with_stop(target_engine, heldout_prompts, monkeypatch):
    prompt = heldout_prompts[5]
    free = target_engine.generate(prompt, GenerationOptions(max_new_tokens=20, ignore_eos=True))
    fake_eos = free.token_ids[6]  # declare the 7th greedy token to be EOS for this test
    first = free.token_ids.index(fake_eos)
    monkeypatch.setattr(target_engine.factory, "eos_token_ids", (fake_eos,))  # what new requests stop on
    result = target_engine.generate(prompt, GenerationOptions(max_new_tokens=20))
    assert result.finish_reason == "stop"
    assert result.token_ids == free.token_ids[: first + 1]
    ignored = target_engine.generate(prompt, GenerationOptions(max_new_tokens=20, ignore_eos=True))
    assert ignored.token_ids == free.token_ids


def test_context_limit_finishes_with_length_and_too_long_prompt_is_rejected(heldout_prompts, make_engine):
    engine = make_engine(TARGET_DIR, EngineConfig(device="cpu", speculative=PINNED, max_context=60))
    prompt_ids = engine.tokenizer.encode(heldout_prompts[0])[:50]
    result = engine.generate(prompt_ids, GenerationOptions(max_new_tokens=100, ignore_eos=True))
    assert result.finish_reason == "length" and result.completion_tokens == 10
    with pytest.raises(PromptTooLongError, match="context limit is 60"):
        engine.generate(engine.tokenizer.encode(heldout_prompts[0])[:60])


def test_bad_prompts_are_rejected_with_the_reason(target_engine):
    with pytest.raises(ValueError, match="empty"):
        target_engine.generate("")
    with pytest.raises(ValueError, match="out of range"):
        target_engine.generate([1, 2, 999_999])


def test_logprobs_come_from_the_target_distribution(target_engine, heldout_prompts):
    result = target_engine.generate(heldout_prompts[6],
                                    GenerationOptions(max_new_tokens=8, logprobs=True, top_logprobs=3))
    assert len(result.logprobs) == 8
    for token_id, lp in zip(result.token_ids, result.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True) and len(lp.top) == 3
        assert lp.top[0].token_id == token_id and lp.top[0].logprob == pytest.approx(lp.logprob)  # greedy = argmax
    assert target_engine.generate(heldout_prompts[6], GenerationOptions(max_new_tokens=2)).logprobs is None


def test_streaming_deltas_rebuild_the_text_and_never_split_characters(target_engine):
    events: list[TokenEvent] = []
    prompt = 'message = "caf\u00e9 \u00fcber na\u00efve \u65e5\u672c\u8a9e \u2603 \U0001F600'
    result = target_engine.generate(prompt, GenerationOptions(max_new_tokens=24, temperature=1.2, seed=3),
                                    on_token=events.append)
    assert "".join(e.text for e in events) == result.text
    assert [e.token_id for e in events] == result.token_ids
    assert all("\ufffd" not in e.text for e in events)
    assert events[-1].finish_reason == result.finish_reason and all(e.finish_reason is None for e in events[:-1])


def test_a_request_that_could_never_fit_is_a_typed_error_at_once_and_leaks_no_blocks(heldout_prompts, make_engine):
    """6 blocks of 16 = 96 token slots; prompt + 64 new tokens can never fit, so admission
    refuses it at once (it does not wait out ``admission_timeout_s``)."""
    engine = make_engine(TARGET_DIR, EngineConfig(device="cpu", speculative=PINNED, kv_num_blocks=6, kv_block_size=16))
    with pytest.raises(AdmissionError, match="needs more KV than any") as info:
        engine.generate(heldout_prompts[0], GenerationOptions(max_new_tokens=64, ignore_eos=True))
    assert isinstance(info.value, KVCacheCapacityError)
    short = engine.generate("def f(x):\n", GenerationOptions(max_new_tokens=4))
    assert short.completion_tokens >= 1
    assert engine.drain()
    assert engine.target.cache.free_blocks == engine.target.cache.num_blocks == 6
    assert engine.transport.admission.usage()["free_blocks"] == 6


def test_sliding_window_generation_runs_within_the_window(heldout_prompts, make_engine):
    """With a window the cache never holds more than `window` tokens, yet decoding continues.
    The pool (6 blocks of 16 = 96 slots) is smaller than prompt + new tokens (154): admission
    reserves only what the window can ever hold (1 sink block + 4 window blocks + 1 in
    flight), so the request is admitted, and runs in exactly that reservation."""
    engine = make_engine(TARGET_DIR, EngineConfig(device="cpu", speculative=PINNED, sliding_window=64, sink_tokens=4, kv_num_blocks=6))
    assert len(engine.tokenizer.encode(heldout_prompts[0])) + 40 > 6 * 16
    seen = []
    original = engine.target.feed_batch

    def spy(requests):
        out = original(requests)
        seen.extend(engine.target.cache.length(r.seq_id) for r in requests)
        return out

    engine.target.feed_batch = spy
    result = engine.generate(heldout_prompts[0], GenerationOptions(max_new_tokens=40, ignore_eos=True))
    assert result.completion_tokens == 40 and max(seen) == 64
    assert engine.drain() and engine.target.cache.used_blocks == 0
    with pytest.raises(ValueError, match="full-attention KV cache"):
        engine.generate(heldout_prompts[0], GenerationOptions(speculative_mode="prompt_lookup"))


def test_min_tokens_stop_strings_follow_vllm_v1_per_stop_string(target_engine):
    """A stop string counts only if it ends after the first min_tokens tokens' text, each
    by its own length (not the longest stop's): measured on a forced output."""
    from specserve.engine.speculative.sequence import SequenceState

    tokenizer = target_engine.tokenizer
    pieces = tokenizer.encode(" Hello there, world")
    texts = [tokenizer.decode(pieces[: i + 1]) for i in range(len(pieces))]

    def run(stop: list[str], min_tokens: int) -> str:
        options = GenerationOptions(max_new_tokens=len(pieces), stop=stop, min_tokens=min_tokens)
        state = SequenceState([1], options, tokenizer, (), 512)
        for token in pieces:
            if state.commit(token):
                break
        return state.text

    boundary = texts[1]  # the first two tokens' text
    early = boundary[-2:]  # lies wholly within it
    assert run([early], 0) == boundary[:-2]  # without min_tokens it stops there
    assert run([early], 2) == texts[-1]  # never counts once it ends before the boundary
    assert run([early, "z" * 20], 2) == texts[-1]  # nor because another stop string is longer
    straddling = texts[2][len(boundary) - 1: len(boundary) + 1]  # begins before the boundary, ends after
    assert run([straddling], 2) == texts[2][: len(boundary) - 1]
