"""Offline builder of specserve's bundled models (dev-only: needs torch).

Run ``python -m specserve.modelbuild`` to rebuild ``models/`` from scratch: corpus selection,
BPE tokenizer, target training, draft distillation, ONNX export and manifest.
"""
