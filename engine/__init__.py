"""specserve engine: Ray-free, in-process ONNX decoding (also the embedded mode).

Pure Python + numpy + onnxruntime; nothing here may import Ray. Layout:

- ``model/``        ONNX runner, providers, cached decoder, heads, tokenizer, chat template, bundle
- ``kv/``           paged KV cache, block ledger, admission
- ``speculative/``  the reference loop (read ``speculative/reference.py`` first), verification,
                    sampling, the commit path, stats, and the proposers with their kinds and registry
- ``grammar/``      structured outputs: what an output must match, compiling it (llguidance),
                    a sequence's grammar state, and drafting under a grammar
- ``sched/``        the scheduler both transports share: coordinator, sequence driver, target
                    and proposer workers, local transport, and the draft-length planner with its
                    calibration, cost tables and cost models
- ``api.py``        ``Engine``: the coordinator over the local transport

``deployments/`` runs the same scheduler across Ray Serve processes.
"""
from specserve.engine.api import Engine, GenerationResult
from specserve.engine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from specserve.engine.errors import EngineError, InvalidRequestError, ModelLoadError, PromptTooLongError
from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.kv.paged_cache import KVCacheCapacityError, PagedKVCache
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.sequence import TokenEvent
from specserve.engine.speculative.stats import SpeculativeStats

__all__ = ["CachedDecoder", "Engine", "EngineConfig", "EngineError", "GenerationOptions", "GenerationResult",
           "InvalidRequestError", "KVCacheCapacityError", "ModelLoadError", "PagedKVCache", "PromptTooLongError",
           "SchedulerConfig", "SpeculativeConfig", "SpeculativeStats", "StructuredOutput", "TokenEvent"]
