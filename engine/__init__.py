"""specserve engine: Ray-free, in-process ONNX decoding (also the embedded mode).

Pure Python + numpy + onnxruntime. ``deployments/`` adapts these parts to Ray Serve;
nothing here may import Ray.
"""
from .cached_decoder import CachedDecoder
from .engine import Engine, GenerationResult
from .errors import EngineError, InvalidRequestError, ModelLoadError, PromptTooLongError
from .kv_cache import KVCacheCapacityError, PagedKVCache
from .options import EngineConfig, GenerationOptions, SpeculativeConfig
from .sequence import TokenEvent
from .stats import SpeculativeStats

__all__ = ["CachedDecoder", "Engine", "EngineConfig", "EngineError", "GenerationOptions", "GenerationResult",
           "InvalidRequestError", "KVCacheCapacityError", "ModelLoadError", "PagedKVCache", "PromptTooLongError",
           "SpeculativeConfig", "SpeculativeStats", "TokenEvent"]
