"""Multi-token prediction (MTP) modules: the extra layers a speculative decoder runs.

DeepSeek-V3, GLM-4.5, MiMo, Qwen3-Next / Qwen3.5 and Nemotron-H checkpoints ship MTP modules
after their decoder layers (``num_nextn_predict_layers``, ``num_mtp_layers`` or
``mtp_num_hidden_layers`` of them).  Each is one decoder layer whose attention has the same
shape as the target's full attention (MLA for DeepSeek), and it caches K/V for every token it
drafts from, so serving with MTP needs cache for these layers too.  Nemotron-H describes each
module as a list of sublayers (``mtp_layers_block_type``, e.g. ``["attention", "moe"]``):
attention sublayers cache like the target's attention, Mamba sublayers keep the target's
Mamba state, MLP / MoE sublayers store nothing.

:func:`mtp_layers` returns them as :class:`~hybridkv.specs.LayerSpec` s to append with
:meth:`~hybridkv.specs.ModelSpec.with_draft` (tag ``"mtp"``): grouped by spec, they join the
target's groups.  Example: DeepSeek-V3 with ``mtp=True`` has 62 MLA layers in its one group.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.errors import ConfigError
from hybridkv.models.config import ConfigView
from hybridkv.specs import CacheKind, CacheSpec, LayerSpec, NoCacheSpec

__all__ = ["MTP_COUNT_FIELDS", "MTP_DEFAULT_COUNT", "mtp_layers"]

#: Config fields that count a checkpoint's MTP modules, in the order they are read.
MTP_COUNT_FIELDS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")

#: Model types whose checkpoints ship MTP modules their config does not count (Qwen3-Next's
#: release config has no count field; its weights hold one ``mtp`` layer).
MTP_DEFAULT_COUNT = {"qwen3_next": 1}

_ATTENTION = frozenset({"attention", "full_attention", "*"})
_STATE = frozenset({"mamba", "m", "mamba2"})
_NO_CACHE = frozenset({"moe", "mlp", "e", "-"})


def _first(layers: Sequence[LayerSpec], kinds: frozenset[CacheKind]) -> CacheSpec | None:
    for layer in layers:
        for spec in layer.caches:
            if spec.kind in kinds:
                return spec
    return None


def mtp_layers(cfg: ConfigView, target: Sequence[LayerSpec]) -> list[LayerSpec]:
    """The MTP layers of the checkpoint ``cfg`` describes, after the target's ``target``
    layers (numbered from ``len(target)``, tagged ``"mtp"``).

    Raises :class:`ConfigError` naming the field when the config declares no MTP module, or
    when a module needs a cache kind the target has none of to copy its shape from.
    """
    count = cfg.first_int(*MTP_COUNT_FIELDS, minimum=0)
    if count is None:
        count = MTP_DEFAULT_COUNT.get(cfg.model_type)
    if not count:
        raise ConfigError(
            f"mtp: config of model_type {cfg.model_type!r} declares no MTP module "
            f"({' / '.join(MTP_COUNT_FIELDS)} is {count!r}); MTP layers need one of them >= 1"
        )
    attention = _first(target, frozenset({CacheKind.FULL, CacheKind.MLA}))
    state = _first(target, frozenset({CacheKind.STATE}))
    block_types = cfg.opt_str_list("mtp_layers_block_type") or ["attention"]
    out: list[LayerSpec] = []
    for _ in range(count):
        for kind in block_types:
            name = kind.lower()
            spec: CacheSpec | None
            if name in _ATTENTION:
                spec = attention
            elif name in _STATE:
                spec = state
            elif name in _NO_CACHE:
                spec = NoCacheSpec()
            else:
                raise ConfigError(
                    f"config.mtp_layers_block_type: unknown sublayer type {kind!r}; valid: "
                    f"{', '.join(sorted(_ATTENTION | _STATE | _NO_CACHE))}"
                )
            if spec is None:
                raise ConfigError(
                    f"mtp: model_type {cfg.model_type!r} has an MTP {kind!r} sublayer but no "
                    "target layer of that kind to take its cache shape from"
                )
            n = len(target) + len(out)
            out.append(LayerSpec(index=n, layer_type=f"mtp_{name}", caches=(spec,), tag="mtp"))
    return out
