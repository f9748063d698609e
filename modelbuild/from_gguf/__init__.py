"""Llama GGUF files (llama.cpp's format) converted to specserve bundles without torch."""
