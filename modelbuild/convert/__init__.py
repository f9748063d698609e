"""Converting a user's Hugging Face checkpoints into a specserve bundle (dev/convert
extra: mobius-onnx and torch, in their own venv). Entry point: ``python -m specserve.modelbuild.convert``."""
