"""Hugging Face checkpoints in every published layout, converted by
``python -m specserve.modelbuild.convert`` and served by the engine, checked against transformers
and against independent torch forwards of each head's published semantics.

Runs in the convert venv (``bash scripts/test_convert.sh``)."""
from __future__ import annotations


import numpy as np
import pytest

from specserve.engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.heads import load_head
from specserve.engine.model.onnx_model import OnnxDecoder
from specserve.engine.speculative.proposers.base import ProposerContext, SharedKvSlice
from specserve.engine.speculative.proposers.eagle3 import Eagle3Proposer
from specserve.engine.speculative.proposers.mtp import MtpProposer
from specserve.engine.speculative.proposers.shared_kv import SharedKvProposer

from .build_tiny_bundles import SPECULATORS_AUX
from .tiny_eagle3 import eagle3_reference_chain
from .tiny_gemma4_assistant import gemma4_assistant_reference
from .tiny_llama import TINY, transformers_forward, transformers_greedy
from .tiny_qwen35_mtp import qwen3_next_mtp_reference, qwen35_mtp_reference

PROMPT = [11, 402, 77, 1234, 9, 3000, 15, 15, 88, 402, 77]
CPU = EngineConfig(device="cpu", intra_op_threads=1, speculative=SpeculativeConfig(adaptive=False))


def forward(bundle_dir, tokens):
    """The converted target on ``tokens`` at once, from an empty past."""
    decoder = OnnxDecoder(Bundle.load(bundle_dir).target_dir, "cpu", 1)
    n = len(tokens)
    return decoder.forward(np.array([tokens]), np.ones((1, n), np.int64), np.arange(n)[None], decoder.empty_past())


def run_target(bundle_dir, tokens):
    """Logits and every extra output of the whole prompt."""
    out = forward(bundle_dir, tokens)
    return out.logits[0], {name: value[0] for name, value in out.extras.items()}


def test_the_converted_target_equals_transformers_logits_and_hidden_states(tiny):
    logits, extras = run_target(tiny.full, PROMPT)
    hf_logits, hf_final, hf_hidden = transformers_forward(tiny.target, PROMPT)
    assert np.abs(logits - hf_logits).max() < 1e-4
    assert np.abs(extras["hidden_states"] - hf_final).max() < 1e-4
    # The heads read the final state through the target's LM head: the array beside it.
    lm_head = np.load(Bundle.load(tiny.full).target_dir / "lm_head.npy")
    assert np.abs(extras["hidden_states"] @ lm_head.T - hf_logits).max() < 1e-4


@pytest.mark.parametrize("which", ["full", "speculators"])
def test_aux_layer_j_is_the_stream_entering_decoder_layer_j(tiny, which):
    """vLLM's convention (HF ``hidden_states[j]``), not mobius's (output of layer j, HF
    ``hidden_states[j+1]``): the two differ, so a shifted index fails here."""
    bundle = getattr(tiny, which)
    aux = Bundle.load(bundle).manifest.models["target"].hidden_outputs.layer_indices
    n = TINY["num_hidden_layers"]
    assert list(aux) == ([2, n // 2, n - 3] if which == "full" else SPECULATORS_AUX)
    _, extras = run_target(bundle, PROMPT)
    _, _, hf_hidden = transformers_forward(tiny.target, PROMPT)
    for j in aux:
        assert np.abs(extras[f"aux_hidden.{j}"] - hf_hidden[j]).max() < 1e-4, j
        assert np.abs(extras[f"aux_hidden.{j}"] - hf_hidden[j + 1]).max() > 1e-2, j


def test_the_engine_reproduces_transformers_greedy_tokens(tiny):
    with Engine(tiny.full, CPU) as engine:
        ours = engine.generate(PROMPT, GenerationOptions(max_new_tokens=24, ignore_eos=True,
                                                         speculative_mode="none")).token_ids
    assert ours == transformers_greedy(tiny.target, PROMPT, 24)


def _context(bundle_dir, tokens, width, needs_kv_layers=None) -> ProposerContext:
    """What the coordinator hands a proposer after the target ran ``tokens[:-1]``."""
    hidden = Bundle.load(bundle_dir).manifest.models["target"].hidden_outputs
    out = forward(bundle_dir, tokens[:-1])
    layers = None
    if hidden.layer_indices:
        layers = tuple(out.extras[f"aux_hidden.{j}"][0, -1] for j in hidden.layer_indices)
    slices = None
    if needs_kv_layers:
        slices = tuple(SharedKvSlice(group, layer, *out.presents[layer]) for group, layer in needs_kv_layers.items())
    return ProposerContext(num_drafts=width - 1, context_tokens=list(tokens), options=GenerationOptions(),
                           target_hidden=out.extras["hidden_states"][0, -1], target_hidden_layers=layers,
                           shared_kv=slices)


def _head(bundle_dir, kind):
    bundle = Bundle.load(bundle_dir)
    return load_head(kind, bundle.head_dir(kind), TINY["vocab_size"], TINY["hidden_size"], "cpu", 1)


@pytest.mark.parametrize("which,layout", [("full", "eagle3_safeailab"), ("speculators", "eagle3_speculators")])
def test_eagle3_drafts_equal_the_published_forward(tiny, which, layout):
    """Both layouts, through the engine's proposer: step 0 feeds fc(low|mid|high), later
    steps the head's own pre-norm state; d2t maps draft ids to target ids."""
    bundle = getattr(tiny, which)
    head = _head(bundle, "eagle3")
    context = _context(bundle, PROMPT, width=4)
    drafted = Eagle3Proposer(head).propose(context).tokens
    embed = np.load(Bundle.load(bundle).target_dir / "embed_tokens.npy")
    fused = np.concatenate(context.target_hidden_layers)
    logits, expected = eagle3_reference_chain(tiny.head(layout), embed, PROMPT[-1], fused, steps=3,
                                              position=len(PROMPT) - 1)
    assert drafted == expected
    first = head.session.run(["draft_logits"], {
        "inputs_embeds": embed[[PROMPT[-1]]][None], "fused_hidden": fused[None, None],
        "recycled_hidden": np.zeros((1, 1, TINY["hidden_size"]), np.float32),
        "attention_mask": np.ones((1, 1), np.int64), "position_ids": np.array([[len(PROMPT) - 1]]),
        "past_key_values.0.key": np.zeros((1, 2, 0, 16), np.float32),
        "past_key_values.0.value": np.zeros((1, 2, 0, 16), np.float32)})[0]
    assert np.abs(first[0, 0] - logits[0]).max() < 1e-4
    assert len(set(expected)) > 1 or expected[0] != PROMPT[-1]  # a real chain, not a constant


@pytest.mark.parametrize("which,checkpoint", [("full", "qwen35_mtp"), ("speculators", "qwen3_next_mtp")])
def test_the_mtp_proposer_drafts_what_the_published_forward_predicts(tiny, which, checkpoint):
    """Step 0 through the engine's MTP proposer equals the published head's forward
    (Qwen3.5 dense; Qwen3-Next with its routed experts) read through the target's LM
    head; step 1 feeds the head's own ``mtp_hidden`` back."""
    bundle = getattr(tiny, which)
    head = _head(bundle, "mtp")
    context = _context(bundle, PROMPT, width=3)
    drafted = MtpProposer(head).propose(context).tokens
    embed = np.load(Bundle.load(bundle).target_dir / "embed_tokens.npy")
    lm_head = np.load(Bundle.load(bundle).target_dir / "lm_head.npy")
    reference = qwen35_mtp_reference if checkpoint == "qwen35_mtp" else qwen3_next_mtp_reference
    first = reference(tiny.head(checkpoint), embed[[PROMPT[-1]]][None], context.target_hidden[None, None],
                      np.array([[len(PROMPT) - 1]]))
    assert drafted[0] == int(np.argmax(first[0, -1] @ lm_head.T))
    assert len(drafted) == 2


def test_the_assistant_proposer_drafts_what_transformers_predicts(tiny):
    """transformers' assisted-generation feed (``draft_feed: hf_assisted``): the pending
    token with the target hidden state that predicted it, at the pending token's
    position, then each draft with the assistant's own projected state at the same
    position, reading the target KV of the bound layers."""
    bundle = Bundle.load(tiny.full)
    head = _head(tiny.full, "shared_kv")
    groups = head.config["shared_kv_groups"]
    context = _context(tiny.full, PROMPT, width=3, needs_kv_layers=groups)
    drafted = SharedKvProposer(head).propose(context).tokens
    embed = np.load(bundle.target_dir / "embed_tokens.npy")
    kv = {s.group: (s.key, s.value) for s in context.shared_kv}
    kv_len = len(PROMPT) - 1
    position, mask = np.array([[kv_len]]), np.ones((1, kv_len), np.int64)
    token, state, expected = PROMPT[-1], context.target_hidden, []
    for _ in range(2):
        step = np.concatenate([embed[token], state])[None, None]
        logits, projected = gemma4_assistant_reference(tiny.head("gemma4_assistant"), step, position, kv, mask)
        token, state = int(np.argmax(logits[0, -1])), projected[0, -1]
        expected.append(token)
    assert drafted == expected


@pytest.mark.parametrize("which,modes", [("full", ["eagle3", "mtp", "shared_kv", "prompt_lookup"]),
                                         ("speculators", ["eagle3", "mtp"])])
def test_every_converted_mode_is_greedy_identical_to_target_only(tiny, which, modes):
    bundle = getattr(tiny, which)
    prompts = [PROMPT, PROMPT[3:] + PROMPT[:3], [5, 6, 7, 5, 6, 7, 5, 6]]
    with Engine(bundle, CPU) as engine:
        assert set(modes) <= set(engine.available_modes)
        for prompt in prompts:
            base = engine.generate(prompt, GenerationOptions(max_new_tokens=20, ignore_eos=True,
                                                             speculative_mode="none")).token_ids
            for mode in modes:
                result = engine.generate(prompt, GenerationOptions(max_new_tokens=20, ignore_eos=True,
                                                                   speculative_mode=mode))
                assert result.token_ids == base, mode
                assert result.speculative.proposed_tokens > 0, mode  # speculation really ran


def test_the_manifest_records_where_each_model_came_from(tiny):
    manifest = Bundle.load(tiny.full).manifest
    assert manifest.models["target"].converted.source_format == "llama"
    formats = {kind: entry.converted.source_format for kind, entry in manifest.heads.items()}
    assert formats == {"eagle3": "eagle3-safeailab", "mtp": "qwen3.5-mtp", "shared_kv": "gemma4-assistant"}
    formats = {kind: entry.converted.source_format for kind, entry in Bundle.load(tiny.speculators).manifest.heads.items()}
    assert formats == {"eagle3": "eagle3-speculators", "mtp": "qwen3-next-mtp"}
    assert all(entry.training is None for entry in manifest.heads.values())


def test_an_aux_layer_0_is_refused_with_the_reason(tiny, tmp_path):
    from specserve.modelbuild.convert.__main__ import main

    with pytest.raises(ValueError, match="entering that decoder layer"):
        main(["--target", str(tiny.target), "--out", str(tmp_path / "b"), "--eagle3",
              str(tiny.head("eagle3_safeailab")), "--aux-layers", "0,3,5"])
    assert not (tmp_path / "b").exists()  # no half-written bundle left behind


def test_conversion_reports_each_stage_on_stderr_and_the_result_on_stdout(tiny, tmp_path, capsys):
    import json

    from specserve.modelbuild.convert.__main__ import main

    main(["--target", str(tiny.target), "--out", str(tmp_path / "b"), "--eagle3", str(tiny.head("eagle3_safeailab"))])
    out, err = capsys.readouterr()
    stages = [line for line in err.splitlines() if line.startswith("[")]
    assert "converting the target from" in stages[0] and "converting the EAGLE-3 head" in stages[1]
    assert json.loads(out.strip().splitlines()[-1])["heads"] == ["eagle3"]
