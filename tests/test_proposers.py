"""Ports of the proposer unit tests of speculative.rs, the engine specserve reimplements (their
names in the section comments), run against the bundled heads and real caches."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from specserve.engine import GenerationOptions
from specserve.engine.model.heads import MATMUL_GRAPH, LinearLmHead, load_head
from specserve.engine.kv.paged_cache import LayerGeometry, PagedKVCache
from specserve.engine.sched.metrics import RoundMetrics
from specserve.engine.sched.messages import ProposeItem
from specserve.engine.sched.proposer_worker import ProposerWorker
from specserve.engine.speculative.proposers.base import Proposal, ProposerContext, StatelessProposer
from specserve.engine.speculative.proposers.eagle3 import Eagle3Proposer
from specserve.engine.speculative.proposers.mtp import MtpProposer
from specserve.engine.speculative.proposers.prompt_lookup import PromptLookupProposer
from specserve.engine.speculative.proposers.registry import LoadedProposer
from specserve.engine.speculative.proposers.shared_kv import SharedKvProposer, shared_kv_slices
from specserve.engine.speculative.reference import speculative_decode

from .conftest import MODELS

OPTIONS = GenerationOptions()


def context(tokens, width, **extra) -> ProposerContext:
    return ProposerContext(num_drafts=width - 1, context_tokens=tokens, options=OPTIONS, **extra)


# -- prompt lookup (Rust: ngram_proposer_*) -------------------------------------------------
def test_ngram_copies_most_recent_matching_continuation():
    assert PromptLookupProposer(2, 4).lookup([7, 8, 9, 4, 7, 8], 3) == [9, 4, 7]
    # Through the protocol, width counts the bonus token too: width 4 = 3 drafts.
    assert PromptLookupProposer(2, 4).propose(context([7, 8, 9, 4, 7, 8], 4)).tokens == [9, 4, 7]


def test_ngram_prefers_the_most_recent_occurrence():
    assert PromptLookupProposer(1, 2).lookup([5, 1, 5, 2, 5], 2) == [2, 5]


def test_ngram_validates_configuration_and_empty_matches():
    with pytest.raises(ValueError, match="^ngram must be greater than zero$"):
        PromptLookupProposer(0, 1)
    with pytest.raises(ValueError, match="^max_tokens must be greater than zero$"):
        PromptLookupProposer(1, 0)
    proposer = PromptLookupProposer(2, 4)
    assert proposer.lookup([1, 2], 4) == []
    assert proposer.lookup([1, 2, 3, 4], 4) == []
    assert proposer.name == "prompt_lookup"


def test_ngram_respects_request_and_config_widths():
    assert PromptLookupProposer(2, 2).lookup([1, 2, 3, 4, 1, 2], 8) == [3, 4]
    assert PromptLookupProposer(2, 8).lookup([1, 2, 3, 4, 1, 2], 1) == [3]


# -- shared-KV slices (Rust: shared_kv_slices_pick_per_layer_geometry) ----------------------
def test_the_lm_head_graph_is_the_one_node_matmul_onnx_writes_and_computes_the_product():
    """MTP's hidden state goes through the target's LM head in a one-node onnxruntime
    graph kept as bytes (onnx is not a runtime dependency): they must be what onnx.helper
    writes for that graph, and it must compute hidden @ W.T for one row or a batch."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["hidden", "weight"], ["logits"])], "lm_head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "hidden_size"]),
         helper.make_tensor_value_info("weight", TensorProto.FLOAT, ["hidden_size", "vocab"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "vocab"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="specserve")
    model.ir_version = 9
    assert model.SerializeToString() == MATMUL_GRAPH
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((512, 64)).astype(np.float32)
    head = LinearLmHead(weight)
    hidden = rng.standard_normal((3, 1, 64)).astype(np.float32)
    exact = hidden.astype(np.float64) @ weight.T.astype(np.float64)
    np.testing.assert_allclose(head.logits(hidden), exact, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(head.logits(hidden[1, 0]), exact[1, 0], rtol=1e-5, atol=1e-4)
    assert head.logits(hidden).shape == (3, 1, 512) and head.logits(hidden[1, 0]).shape == (512,)


def test_shared_kv_slices_pick_per_layer_geometry():
    cache = PagedKVCache([LayerGeometry(2, 8), LayerGeometry(3, 16)], num_blocks=4, block_size=4)
    cache.add_sequence("s")
    seq_len = 2
    sliding_key = np.arange(2 * seq_len * 8, dtype=np.float32).reshape(2, seq_len, 8)
    full_key = np.arange(3 * seq_len * 16, dtype=np.float32).reshape(3, seq_len, 16) + 2000
    cache.append("s", [sliding_key, full_key], [sliding_key + 1000, full_key + 1000])
    sliding, full = shared_kv_slices(cache, "s", {"sliding_attention": 0, "full_attention": 1})
    assert (sliding.group, sliding.kv_heads, sliding.head_dim, sliding.kv_len) == ("sliding_attention", 2, 8, 2)
    assert (full.group, full.kv_heads, full.head_dim, full.kv_len) == ("full_attention", 3, 16, 2)
    np.testing.assert_array_equal(sliding.key[0], sliding_key)
    np.testing.assert_array_equal(sliding.value[0], sliding_key + 1000)
    np.testing.assert_array_equal(full.key[0], full_key)
    np.testing.assert_array_equal(full.value[0], full_key + 1000)
    with pytest.raises(IndexError, match="group 'oob' references target layer 9 but only 2 layers exist"):
        shared_kv_slices(cache, "s", {"oob": 9})


# -- heads with the bundled weights ---------------------------------------------------------
def head(engine, mode):
    return engine.proposers[mode].model


def prefill_state(engine, prompt: str, seq_id: str) -> dict:
    """Hidden states and shared-KV slices the target exposes after prefilling a prompt,
    and the target's greedy continuation (the first entry is the pending token)."""
    target = engine.target
    ids = target.encode_prompt(prompt)
    eagle_inputs = head(engine, "eagle3").config["target_hidden_inputs"]["fused_hidden"]
    target.cache.add_sequence(seq_id)
    try:
        out = target.feed(seq_id, ids, 0)
        slices = shared_kv_slices(target.cache, seq_id, head(engine, "shared_kv").config["shared_kv_groups"])
    finally:
        target.cache.free(seq_id)
    greedy = engine.generate(ids, GenerationOptions(max_new_tokens=6, ignore_eos=True,
                                                    speculative_mode="none")).token_ids
    assert greedy[0] == int(np.argmax(out.logits[-1]))
    return dict(tokens=ids + greedy[:1], final=out.extras["hidden_states"][-1], greedy=greedy,
                layers=tuple(out.extras[n][-1] for n in eagle_inputs), slices=slices)


@pytest.fixture(scope="module")
def target_state(bundle_engine, heldout_prompts):
    assert bundle_engine.drain()  # the probe borrows the engine's target pool
    return prefill_state(bundle_engine, heldout_prompts[9], "probe-a")


@pytest.fixture(scope="module")
def other_state(bundle_engine, heldout_prompts):
    """A second prompt of another length, for batched proposals."""
    assert bundle_engine.drain()
    return prefill_state(bundle_engine, heldout_prompts[10], "probe-b")


def head_context(mode, state, width) -> ProposerContext:
    extra = dict(target_hidden=state["final"])
    if mode == "eagle3":
        extra["target_hidden_layers"] = state["layers"]
    if mode == "shared_kv":
        extra["shared_kv"] = state["slices"]
    return context(state["tokens"], width, **extra)


PROPOSERS = {"mtp": MtpProposer, "eagle3": Eagle3Proposer, "shared_kv": SharedKvProposer}


@pytest.mark.parametrize("mode", list(PROPOSERS))
def test_heads_draft_the_targets_own_continuation(mode, bundle_engine, target_state):
    proposer = PROPOSERS[mode](head(bundle_engine, mode))
    proposal = proposer.propose(head_context(mode, target_state, 5))
    assert proposer.name == mode and len(proposal.tokens) == 4 and proposal.probs is None
    assert all(0 <= t < bundle_engine.target.decoder.vocab_size for t in proposal.tokens)
    # The drafts follow the pending token; a working head gets the first of them right here.
    assert proposal.tokens[0] == target_state["greedy"][1], (proposal.tokens, target_state["greedy"])


@pytest.mark.parametrize("mode", list(PROPOSERS))
def test_a_batched_proposal_gives_each_sequence_its_solo_drafts(mode, bundle_engine, target_state, other_state):
    """Heads draft for a whole batch in one run per step: rows of different context
    lengths (padded, masked) and widths must each get exactly their solo drafts."""
    proposer = PROPOSERS[mode](head(bundle_engine, mode))
    assert proposer.batchable
    contexts = [head_context(mode, target_state, 5), head_context(mode, other_state, 3)]
    assert len(target_state["tokens"]) != len(other_state["tokens"])
    solo = [proposer.propose(c) for c in contexts]
    assert proposer.propose_batch(contexts) == solo
    assert [len(p.tokens) for p in solo] == [4, 2] and solo[0].tokens != solo[1].tokens


def test_a_batched_draft_model_gives_each_sequence_its_solo_drafts_in_one_run_per_step(bundle_engine,
                                                                                       heldout_prompts):
    """The draft model keeps each sequence's KV in its own instance but drafts for all of
    them with one model run per step: the alignment of every sequence (a first contact
    feeding its whole context, a later round two tokens), then one run per position for
    the sequences still drafting. Greedy drafts are each sequence's solo ones; sampled
    drafts and their q are too, the request's generator drawing in the same order."""
    from specserve.engine.model.cached_decoder import CachedDecoder
    from specserve.engine.speculative.proposers.draft_model import DraftModelProposer

    draft = CachedDecoder(MODELS / "draft", bundle_engine.target.config)
    prompts = [bundle_engine.target.encode_prompt(heldout_prompts[i]) for i in (3, 4, 5)]
    assert len({len(p) for p in prompts}) == 3
    widths = [5, 2, 4]
    sampled = GenerationOptions(temperature=0.9, top_p=0.95, seed=3)
    for options in (OPTIONS, sampled):
        solo = [DraftModelProposer(draft) for _ in prompts]
        batched = [DraftModelProposer(draft) for _ in prompts]
        try:
            def contexts(extra):
                return [ProposerContext(w - 1, p + extra, options, rng=np.random.default_rng(i))
                        for i, (w, p) in enumerate(zip(widths, prompts))]
            for extra in ([], [7, 9]):  # first contact, then a round's two new tokens
                alone = [s.propose(c) for s, c in zip(solo, contexts(extra))]
                runs = []
                original = draft.feed_batch
                draft.feed_batch = lambda requests: runs.append(len(requests)) or original(requests)
                try:
                    together = batched[0].propose_batch(contexts(extra), batched)
                finally:
                    draft.feed_batch = original
                if extra:  # every sequence aligns 2 tokens: one call, then positions 2, 3 and 4
                    assert runs == [3, 2, 2, 1]
                assert [p.tokens for p in together] == [p.tokens for p in alone]
                assert [len(p.tokens) for p in together] == [w - 1 for w in widths]
                if options is sampled:
                    for a, b in zip(alone, together):
                        np.testing.assert_allclose(b.probs, a.probs, rtol=1e-5, atol=1e-7)
                else:
                    assert all(p.probs is None for p in together)
                assert [o.kv_tokens for o in batched] == [s.kv_tokens for s in solo]
        finally:
            for proposer in solo + batched:
                proposer.close()
    assert draft.cache.used_blocks == 0
    stray = DraftModelProposer(draft)
    elsewhere = DraftModelProposer(CachedDecoder(MODELS / "draft", bundle_engine.target.config))
    try:
        with pytest.raises(ValueError, match="as many owners"):
            stray.propose_batch(contexts([]), [])
        with pytest.raises(ValueError, match="every owner must share it"):
            stray.propose_batch(contexts([])[:2], [stray, elsewhere])
    finally:
        stray.close()
        elsewhere.close()


def test_draft_alignment_runs_in_calls_of_similar_lengths():
    """Every fed row costs the draft's LM head and a call pads to its longest feed: one
    sequence catching up 32 tokens is aligned apart from fifteen aligning 2 (10.7 ms
    together against 4.2 ms apart, measured), while feeds of one size share one call."""
    from specserve.engine.speculative.proposers.draft_model import ALIGN_CALL_ROWS, align_groups

    short = {i: 2 for i in range(15)}
    assert align_groups(short) == [list(range(15))]
    assert align_groups({**short, 15: 32}) == [list(range(15)), [15]]
    assert align_groups({0: 2, 1: 3, 2: 2}) == [[0, 2, 1]]  # padding 2 -> 3 is cheaper than a call
    first_contacts = {i: 40 + i for i in range(8)}  # a wave's prompts: similar lengths, one call
    assert align_groups(first_contacts) == [list(range(8))]
    mixed = {0: 2, 1: 2, 2: 200, 3: 2}
    groups = align_groups(mixed)
    assert groups == [[0, 1, 3], [2]] and ALIGN_CALL_ROWS < 3 * (200 - 2)
    assert align_groups({}) == []


def test_heads_refuse_a_context_without_what_they_need(bundle_engine, target_state):
    with pytest.raises(ValueError, match="last hidden state"):
        MtpProposer(head(bundle_engine, "mtp")).propose(context(target_state["tokens"], 5))
    with pytest.raises(ValueError, match="exactly three target hidden states"):
        Eagle3Proposer(head(bundle_engine, "eagle3")).propose(
            context(target_state["tokens"], 4, target_hidden_layers=target_state["layers"][:2]))
    with pytest.raises(ValueError, match="shared-KV slices"):
        SharedKvProposer(head(bundle_engine, "shared_kv")).propose(
            context(target_state["tokens"], 4, target_hidden=target_state["final"]))


def test_eagle3_maps_the_reduced_draft_vocabulary_to_target_ids(bundle_engine, target_state):
    eagle = head(bundle_engine, "eagle3")
    proposal = Eagle3Proposer(eagle).propose(head_context("eagle3", target_state, 4))
    allowed = set((np.arange(eagle.config["draft_vocab_size"]) + eagle.d2t).tolist())
    assert eagle.config["draft_vocab_size"] < bundle_engine.target.decoder.vocab_size
    assert set(proposal.tokens) <= allowed


def test_heads_reject_a_target_of_another_width(bundle_engine):
    from specserve.engine.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="embed_tokens.npy has shape"):
        load_head("mtp", MODELS / "heads/mtp", bundle_engine.target.decoder.vocab_size, 999, "cpu")


# -- the protocol supports non-model sources (Rust: speculative_proposer_trait_*) -----------
class StubProposer(StatelessProposer):
    """Proposes fixed tokens; records what the round loop tells it."""

    name = "stub"

    def __init__(self, tokens):
        self.tokens, self.accepted, self.widths = tokens, [], []

    def propose(self, ctx):
        self.widths.append(ctx.width)
        return Proposal(list(self.tokens))

    def accept(self, ctx):
        self.accepted.append((ctx.accepted_prefix_len, list(ctx.committed_tokens), len(ctx.target_tokens)))


def test_round_loop_drives_any_proposer_and_reports_acceptance(bundle_engine, heldout_prompts):
    target = bundle_engine.target
    prompt = target.encode_prompt(heldout_prompts[11])
    expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=6, ignore_eos=True)).token_ids
    stub = StubProposer(expected[1:3] + [0])  # right, right, then wrong
    assert expected[3] != 0
    assert bundle_engine.drain()  # the reference loop borrows the engine's target pool
    state, stats = speculative_decode(target, prompt, GenerationOptions(max_new_tokens=6, ignore_eos=True), stub, 3)
    assert state.generated == expected
    assert stats.proposed_per_position[2] >= 1 and len(stats.accepted_per_position) == 2  # 3rd never right
    assert stub.accepted[0] == (2, expected[1:4], len(prompt) + 4)
    assert stub.widths[0] == 4 and stub.widths[-1] <= 6 - 4 + 1


def test_a_full_draft_pool_means_no_drafts_not_a_failed_request(bundle_engine, heldout_prompts):
    from specserve.engine.config import EngineConfig
    from specserve.engine.model.cached_decoder import CachedDecoder
    from specserve.engine.speculative.proposers.draft_model import DraftModelProposer

    tiny_draft = CachedDecoder(MODELS / "draft", EngineConfig(device="cpu", kv_num_blocks=2, kv_block_size=16))
    target = bundle_engine.target
    prompt = target.encode_prompt(heldout_prompts[12])
    assert len(prompt) > 32  # more than the tiny pool holds
    options = GenerationOptions(max_new_tokens=12, ignore_eos=True, speculative_mode="none")
    expected = bundle_engine.generate(prompt, options).token_ids
    assert bundle_engine.drain()
    proposer = DraftModelProposer(tiny_draft)
    try:
        state, stats = speculative_decode(target, prompt, options, proposer, 4)
    finally:
        proposer.close()
    assert state.generated == expected and stats.proposed_tokens == 0 and stats.verification_steps == 11
    assert tiny_draft.cache.used_blocks == 0


# -- the proposer worker isolates failures and says so ----------------------------------------
POISON = 13


class BatchDrafter(StatelessProposer):
    """Drafts ``last + 1`` repeatedly; a context ending in ``POISON`` makes it raise, in a
    batch and alone (a proposer that breaks on one sequence's input)."""

    name = "batch_drafter"
    batchable = True
    batches: list[int] = []

    def propose(self, ctx):
        if ctx.context_tokens[-1] == POISON:
            raise RuntimeError("cannot draft after the poison token")
        return Proposal([ctx.context_tokens[-1] + 1] * ctx.num_drafts)

    def propose_batch(self, contexts, owners=None):
        self.batches.append(len(contexts))
        return [self.propose(c) for c in contexts]


def test_a_failing_batched_proposal_is_retried_one_by_one_logged_and_counted(caplog):
    metrics = RoundMetrics()
    BatchDrafter.batches = []
    worker = ProposerWorker(LoadedProposer("batch_drafter", BatchDrafter, None), metrics)
    items = [ProposeItem(f"s{i}", 2, 0, [1, 2, last], OPTIONS) for i, last in enumerate((5, POISON, 7))]
    with caplog.at_level(logging.WARNING, logger="specserve.proposer"):
        results = worker.propose(items)
    assert BatchDrafter.batches == [3]  # one batched call for the three, which failed
    assert [r.tokens for r in results] == [[6, 6], [], [8, 8]]
    assert [r.error is not None for r in results] == [False, True, False] and results[1].resync
    assert "cannot draft after the poison token" in results[1].error
    assert metrics.faults == {"propose_batch_failed": 1}
    assert "batched proposal for 3 sequences failed" in caplog.text
    assert sorted(worker.sequences) == ["s0", "s2"]  # the failed one starts over next round
    # The next round batches the healthy sequences again, from what they already hold.
    again = worker.propose([ProposeItem("s0", 1, 3, [6], None, 1), ProposeItem("s2", 1, 3, [8], None, 1)])
    assert [r.tokens for r in again] == [[7], [9]] and BatchDrafter.batches == [3, 2]
    assert metrics.faults == {"propose_batch_failed": 1}


def test_an_mtp_head_with_a_draft_vocabulary_drafts_within_it_and_stays_lossless(bundle_engine, target_state,
                                                                               heldout_prompts, tmp_path):
    """The MTP head's config names a ``d2t`` (here the EAGLE-3 head's 1024 ids): its LM
    head keeps only those rows of the target's, its drafts are target ids inside that
    vocabulary, and greedy output is target-only's."""
    import json
    import shutil

    from specserve.engine import Engine

    bundle = tmp_path / "bundle"
    shutil.copytree(MODELS, bundle, ignore=shutil.ignore_patterns("draft", "eagle3", "shared_kv"))
    shutil.copy(MODELS / "heads/eagle3/d2t.npy", bundle / "heads/mtp/d2t.npy")
    config = json.loads((bundle / "heads/mtp/config.json").read_text())
    (bundle / "heads/mtp/config.json").write_text(json.dumps({**config, "d2t": "d2t.npy"}))
    vocab = bundle_engine.target.decoder.vocab_size
    mtp = load_head("mtp", bundle / "heads/mtp", vocab, bundle_engine.bundle.target_hidden_size, "cpu")
    allowed = set((np.arange(len(mtp.d2t)) + mtp.d2t).tolist())
    assert mtp.lm_head.vocab_size == len(mtp.d2t) < vocab
    proposal = MtpProposer(mtp).propose(head_context("mtp", target_state, 4))
    assert len(proposal.tokens) == 3 and set(proposal.tokens) <= allowed  # width 4: three drafts
    options = GenerationOptions(max_new_tokens=24, ignore_eos=True)
    with Engine(bundle, bundle_engine.config.model_copy(update={"speculative": bundle_engine.config.speculative.model_copy(
            update={"load": ("mtp",)})})) as engine:
        for prompt in heldout_prompts[:3]:
            expected = bundle_engine.generate(prompt, options.model_copy(update={"speculative_mode": "none"})).token_ids
            assert engine.generate(prompt, options.model_copy(update={"speculative_mode": "mtp"})).token_ids == expected


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_head_with_a_draft_vocabulary_drafts_under_a_grammar_only_what_both_allow(kind, bundle_engine, target_state,
                                                                                   tmp_path):
    """The grammar's mask covers the target's vocabulary and the head's argmax its own
    reduced one: each draft is a target id inside the draft vocabulary that the grammar
    allows after the drafts before it (EAGLE-3 with its own ``d2t``, MTP given it)."""
    import dataclasses
    import json
    import re
    import shutil

    from specserve.engine.grammar.compiler import grammar_compiler
    from specserve.engine.grammar.drafting import DraftGuide
    from specserve.engine.grammar.spec import StructuredOutput

    target = bundle_engine.target
    vocab = target.decoder.vocab_size
    head_dir = MODELS / "heads" / kind
    if kind == "mtp":
        head_dir = tmp_path / "mtp"
        shutil.copytree(MODELS / "heads/mtp", head_dir)
        shutil.copy(MODELS / "heads/eagle3/d2t.npy", head_dir / "d2t.npy")
        config = json.loads((head_dir / "config.json").read_text())
        (head_dir / "config.json").write_text(json.dumps({**config, "d2t": "d2t.npy", "target": str(MODELS / "target")}))
    model = load_head(kind, head_dir, vocab, bundle_engine.bundle.target_hidden_size, "cpu")
    in_draft_vocabulary = set(model.draft_vocabulary.tolist())
    pending = target_state["tokens"][-1]
    # The pending token's text, then only lower-case words: a rule the head's own argmax breaks.
    spec = StructuredOutput.regex(re.escape(target.tokenizer.token_bytes(pending).decode()) + "[a-z ]{1,40}")
    compiler = grammar_compiler(target.tokenizer, vocab, target.eos_token_ids)
    state = compiler.start(spec)
    state.advance(pending)
    guide = DraftGuide(state)
    proposer, unguided = PROPOSERS[kind](model), head_context(kind, target_state, 5)
    proposal = proposer.propose(dataclasses.replace(unguided, grammar=guide))
    assert len(proposal.tokens) == 4 and set(proposal.tokens) <= in_draft_vocabulary

    def obeyed(drafts: list[int]) -> bool:
        check = compiler.start(spec)
        check.advance(pending)
        for token in drafts:
            if not check.allowed()[token]:
                return False
            check.advance(token)
        return True

    assert obeyed(proposal.tokens) and not obeyed(proposer.propose(unguided).tokens)
    guide.rewind()
    assert state.consumed == 1  # back at the committed tokens


def test_a_worker_drops_sequences_it_has_not_drafted_for_and_resyncs_them(heldout_prompts):
    """A dead router's sequences never come back: their drafting state (here a draft
    model's KV) is dropped after the idle timeout, and a sequence that does come back
    answers ``resync`` and is drafted for again from its whole context."""
    import time

    from specserve.engine.config import EngineConfig
    from specserve.engine.model.bundle import Bundle
    from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

    bundle = Bundle.load(MODELS)
    vocab = bundle.manifest.models["target"].architecture.vocab_size
    loaded = PROPOSER_MODES["draft_model"].load(bundle, EngineConfig(device="cpu"), vocab)
    worker = ProposerWorker(loaded, idle_timeout_s=0.2)
    cache = loaded.model.cache
    free = cache.free_blocks
    prompts = [list(range(5, 45)), list(range(50, 90))]
    first = worker.propose([ProposeItem(f"s{i}", 3, 0, p, OPTIONS) for i, p in enumerate(prompts)])
    assert all(len(r.tokens) == 3 for r in first) and cache.free_blocks < free
    time.sleep(0.3)
    again = worker.propose([ProposeItem("s1", 3, 0, prompts[1], OPTIONS)])  # s1 alone comes back
    assert worker.sequences == ["s1"] and again[0].tokens == first[1].tokens
    worker.release(["s1"])
    assert cache.free_blocks == free  # s0's KV went with it
    late = worker.propose([ProposeItem("s0", 3, len(prompts[0]), [first[0].tokens[0]], None, 0)])
    assert late[0].resync and late[0].tokens == []
