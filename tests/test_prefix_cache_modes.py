"""Prefix caching in every mode, in-process on the test fixture (whose bundle has every
proposer): outputs token-identical with a cold cache, a warm cache and no cache at all
(an engine with prefix caching off), greedy and seeded-sampled; every mode's rewinds
leave the shared blocks' bytes unchanged while they reject drafts on a sequence that
shares them (a rewind into one would be refused and fail the request); the heads start
from the same anchor on a hit; the draft model caches its own prefixes; and every block
is back at the end."""
from __future__ import annotations

import numpy as np
import pytest

from specserve.engine import Engine, GenerationOptions

from .conftest import CPU_CONFIG, MODELS, assert_everything_released

MODES = ("none", "prompt_lookup", "suffix", "draft_model", "mtp", "eagle3", "shared_kv")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def uncached_engine():
    with Engine(MODELS, CPU_CONFIG.model_copy(update={"prefix_caching": False})) as engine:
        yield engine


@pytest.fixture(scope="module")
def system(heldout_prompts) -> str:
    """A shared prefix of ~300 tokens (the fixture's context is 512)."""
    return "\n".join(heldout_prompts[:3]) + "\n"


def _named_block_bytes(cache) -> dict[int, tuple[int, bytes]]:
    """Every named block's name and KV bytes, over all layers."""
    return {block: (name, b"".join(pool[block].tobytes() for pool in cache._tables.key_pools + cache._tables.value_pools))
            for block, name in cache.block_names().items()}


def _options(mode: str, sampled: bool) -> GenerationOptions:
    if sampled:
        return GenerationOptions(max_new_tokens=NEW_TOKENS, speculative_mode=mode, temperature=0.8, top_p=0.95,
                                 seed=7, ignore_eos=True)
    return GenerationOptions(max_new_tokens=NEW_TOKENS, speculative_mode=mode, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_mode_is_token_identical_cold_warm_and_uncached(bundle_engine, uncached_engine, system,
                                                              heldout_prompts, sampled):
    questions = [system + q for q in heldout_prompts[5:8]]
    bundle_engine.reset_prefix_cache()
    for mode in MODES:
        options = _options(mode, sampled)
        uncached = [uncached_engine.generate(q, options) for q in questions]
        assert all(r.cached_tokens == 0 for r in uncached)
        bundle_engine.reset_prefix_cache()
        cold = bundle_engine.generate(questions[0], options)
        warm = [bundle_engine.generate(q, options) for q in questions]
        assert cold.cached_tokens == 0 and all(r.cached_tokens >= 256 for r in warm), mode
        assert warm[0].cached_tokens == (warm[0].prompt_tokens - 1) // 16 * 16  # all but the last token's block
        expected = [r.token_ids for r in uncached]
        assert [cold.token_ids] + [r.token_ids for r in warm] == [expected[0]] + expected, (mode, sampled)
    assert_everything_released(bundle_engine)


def test_rewinds_in_every_mode_never_touch_a_shared_block(bundle_engine, system, heldout_prompts):
    """Warm requests in every mode draft, reject drafts and rewind on sequences whose
    first blocks are shared; afterwards every block that was named before holds the same
    name and the same bytes, in the target's pool and in the draft model's own."""
    target, draft = bundle_engine.target.cache, bundle_engine.draft.cache
    bundle_engine.reset_prefix_cache()
    warmup = _options("draft_model", sampled=False)
    for question in heldout_prompts[5:7]:
        bundle_engine.generate(system + question, warmup)  # names the prefix in both pools
    assert bundle_engine.drain()
    before = {"target": _named_block_bytes(target), "draft": _named_block_bytes(draft)}
    assert len(before["target"]) >= 18 and len(before["draft"]) >= 18
    rejected = {}
    for mode in MODES:
        for sampled in (False, True):
            result = bundle_engine.generate(system + heldout_prompts[9], _options(mode, sampled))
            assert result.cached_tokens >= 256
            stats = result.speculative
            rejected[mode] = rejected.get(mode, 0) + stats.proposed_tokens - stats.accepted_tokens
    assert all(rejected[mode] > 0 for mode in MODES if mode != "none"), rejected  # rewinds really happened
    assert bundle_engine.drain()
    for name, cache in (("target", target), ("draft", draft)):
        after = _named_block_bytes(cache)
        assert {b: after[b] for b in before[name]} == before[name], name  # nothing reused: the pools are large
    assert_everything_released(bundle_engine)


def test_a_hit_hands_the_heads_the_anchor_of_the_last_prompt_position(bundle_engine, system, heldout_prompts,
                                                                    monkeypatch):
    """On a hit the prefill still feeds the prompt's last token (and the rest of its
    block), so the anchor a head starts from is that position's hidden states (and, for
    shared-KV, the whole prompt's KV slices), as after a cold prefill; the rounds that
    follow draft and accept the same."""
    worker = bundle_engine.transport.target
    anchors: list = []
    real_prefill = worker._prefill

    def recording(item):
        result = real_prefill(item)
        anchors.append(result.outcome.anchor)
        return result

    monkeypatch.setattr(worker, "_prefill", recording)
    for mode in ("eagle3", "mtp", "shared_kv"):
        bundle_engine.reset_prefix_cache()
        anchors.clear()
        prompt = system + heldout_prompts[10]
        cold = bundle_engine.generate(prompt, _options(mode, sampled=False))
        warm = bundle_engine.generate(prompt, _options(mode, sampled=False))
        assert cold.cached_tokens == 0 and warm.cached_tokens > 0 and len(anchors) == 2, mode
        a, b = anchors
        for x, y in zip([a.final, *(a.layers or ())], [b.final, *(b.layers or ())]):
            if x is not None:
                np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)
        assert len(a.shared_kv or ()) == len(b.shared_kv or ())
        for x, y in zip(a.shared_kv or (), b.shared_kv or ()):
            assert x.kv_len == y.kv_len == cold.prompt_tokens
            np.testing.assert_allclose(y.key, x.key, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(y.value, x.value, rtol=1e-4, atol=1e-4)
        assert warm.token_ids == cold.token_ids
        assert (warm.speculative.proposed_tokens, warm.speculative.accepted_tokens) == (
            cold.speculative.proposed_tokens, cold.speculative.accepted_tokens), mode


def test_the_draft_model_starts_on_its_own_cached_prefix(bundle_engine, system, heldout_prompts, monkeypatch):
    """The draft model's pool caches prefixes too: a second request's first contact
    feeds the draft only what follows the shared blocks."""
    draft = bundle_engine.draft
    fed: list[int] = []
    real_feed = draft.feed_batch

    def counting(requests):
        fed.append(sum(len(r.tokens) for r in requests))
        return real_feed(requests)

    monkeypatch.setattr(draft, "feed_batch", counting)
    bundle_engine.reset_prefix_cache()
    prompt = system + heldout_prompts[11]
    prompt_tokens = len(bundle_engine.factory.encode(prompt))
    first_contact = []
    for _ in range(2):
        fed.clear()
        bundle_engine.generate(prompt, _options("draft_model", sampled=False))
        first_contact.append(fed[0])
    assert first_contact[0] > prompt_tokens  # cold: the whole context (the prompt and the first token)
    assert first_contact[1] <= prompt_tokens - 256  # warm: only what follows its cached blocks
    assert_everything_released(bundle_engine)
