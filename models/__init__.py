"""Model bundles. Installed, this folder is ``specserve.models``: the wheel carries the default
model's committed parts (its heads, draft model weights and manifest; ``setup.py``), and
``specserve convert --default-model`` converts its target from the GGUF into the data home
(``specserve.engine.model.default_model``)."""
