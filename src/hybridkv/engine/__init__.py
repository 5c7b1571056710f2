"""The engine: a model runner over hybridkv's paged hybrid cache, exact against transformers.

Modules, one concept each:

* :mod:`~hybridkv.engine.llm_engine`     :class:`LLMEngine`: scheduler + manager + storage + runner
* :mod:`~hybridkv.engine.metrics`        what the engine measures (:class:`EngineStats`)
* :mod:`~hybridkv.engine.verify`         finished requests checked against transformers
* :mod:`~hybridkv.engine.batch`          the step description the runner executes
* :mod:`~hybridkv.engine.runner`         :class:`ModelRunner`: one step, many requests
* :mod:`~hybridkv.engine.attention`      paged attention registered with transformers
* :mod:`~hybridkv.engine.gather`         which cache slots a step writes and reads
* :mod:`~hybridkv.engine.hf_cache`       the transformers ``Cache`` a forward pass gets
* :mod:`~hybridkv.engine.probe`          what a model really caches, measured
* :mod:`~hybridkv.engine.binding`        a memory layout checked against the model
* :mod:`~hybridkv.engine.views`          the storage seam (:class:`PagedKVViews`)
* :mod:`~hybridkv.engine.models`         tiny built-in models and checkpoint loading
* :mod:`~hybridkv.engine.layouts`        a fixed-size layout for tests and demos
* :mod:`~hybridkv.engine.manager_bridge` the cache manager's tables as a runner step
* :mod:`~hybridkv.engine.generate`       :class:`Generation`: tokens and their logits
* :mod:`~hybridkv.engine.demo`           the shared-prefix workload of ``hybridkv run``

The test suite's own helpers (a reference allocator, a scheduler-less decoding loop, the
transformers oracles) live in ``tests/support/``, not here.

Quick start (a tiny hybrid model, end to end, checked against transformers)::

    >>> from hybridkv.engine import CacheConfig, LLMEngine, reference_copy, verify_completions
    >>> from hybridkv.engine.models import load_model
    >>> model = load_model("lfm3")
    >>> ref = reference_copy(model)
    >>> engine = LLMEngine(model, cache=CacheConfig(block_size=4, state_block_size=8),
    ...                    keep_logits=True)
    >>> done = engine.generate([[1, 2, 3, 4, 5], [6, 7]], max_tokens=4)
    >>> verify_completions(ref, done).ok
    True
"""

from __future__ import annotations

from hybridkv.engine.attention import PAGED_ATTENTION, register_paged_attention
from hybridkv.engine.batch import RequestStep, SlotCopy, StateIO, StepBatch
from hybridkv.engine.errors import (
    BatchError,
    BindingError,
    EngineError,
    ModelSourceError,
    NoActiveStepError,
    PromptError,
)
from hybridkv.engine.generate import Generation
from hybridkv.engine.layouts import fixed_layout
from hybridkv.engine.llm_engine import CacheConfig, Completion, LLMEngine
from hybridkv.engine.manager_bridge import step_from_tables
from hybridkv.engine.metrics import EngineStats
from hybridkv.engine.models import DEFAULT_TINY_MODEL, TINY_MODELS, load_model, reference_copy
from hybridkv.engine.probe import ModelProbe, probe_model, probe_model_spec
from hybridkv.engine.runner import ModelRunner, StepOutput
from hybridkv.engine.verify import Mismatch, VerifyResult, verify_completions
from hybridkv.engine.views import DenseKVViews, PagedKVViews, StorageViews

__all__ = [
    "DEFAULT_TINY_MODEL",
    "PAGED_ATTENTION",
    "TINY_MODELS",
    "BatchError",
    "BindingError",
    "CacheConfig",
    "Completion",
    "DenseKVViews",
    "EngineError",
    "EngineStats",
    "Generation",
    "LLMEngine",
    "Mismatch",
    "ModelProbe",
    "ModelRunner",
    "ModelSourceError",
    "NoActiveStepError",
    "PagedKVViews",
    "PromptError",
    "RequestStep",
    "SlotCopy",
    "StateIO",
    "StepBatch",
    "StepOutput",
    "StorageViews",
    "VerifyResult",
    "fixed_layout",
    "load_model",
    "probe_model",
    "probe_model_spec",
    "reference_copy",
    "register_paged_attention",
    "step_from_tables",
    "verify_completions",
]
