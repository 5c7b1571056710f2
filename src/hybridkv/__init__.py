"""hybridkv: KV-cache planning, management and layout for hybrid-attention LLMs.

The layers, bottom to top (nothing imports upward):

* :mod:`hybridkv.specs`   what one layer stores (no torch)
* :mod:`hybridkv.models`  per-layer specs from a Hugging Face ``config.json`` (no torch)
* :mod:`hybridkv.plan`    groups, block sizes and pool layout for a memory budget (no torch)
* :mod:`hybridkv.cache`   block pools, per-kind managers, prefix caching (no torch)
* :mod:`hybridkv.storage` backing memory and tensor views (torch)
* :mod:`hybridkv.cli`     the ``hybridkv`` command
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
