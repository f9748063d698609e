"""specserve engine: Ray-free, in-process ONNX decoding (also the embedded mode).

Pure Python + numpy + onnxruntime. ``deployments/`` adapts these parts to Ray Serve;
nothing here may import Ray.
"""
from engine.model.cached_decoder import CachedDecoder
from engine.api import Engine, GenerationResult
from engine.errors import EngineError, InvalidRequestError, ModelLoadError, PromptTooLongError
from engine.kv.paged_cache import KVCacheCapacityError, PagedKVCache
from engine.options import EngineConfig, GenerationOptions, SpeculativeConfig
from engine.spec.sequence import TokenEvent
from engine.spec.stats import SpeculativeStats

__all__ = ["CachedDecoder", "Engine", "EngineConfig", "EngineError", "GenerationOptions", "GenerationResult",
           "InvalidRequestError", "KVCacheCapacityError", "ModelLoadError", "PagedKVCache", "PromptTooLongError",
           "SpeculativeConfig", "SpeculativeStats", "TokenEvent"]
