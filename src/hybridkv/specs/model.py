"""A whole model's cache needs: one :class:`LayerSpec` per decoder layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hybridkv.errors import SpecError
from hybridkv.specs.kinds import CacheSpec, NoCacheSpec, spec_from_dict

__all__ = ["CacheEntry", "LayerSpec", "ModelSpec"]


class CacheEntry(NamedTuple):
    """One cache of one layer: ``(layer index, slot within the layer, spec)``.

    Most layers carry one cache (slot 0); a layer with attention and Mamba2 in parallel
    (falcon_h1) carries two (slots 0 and 1).
    """

    layer: int
    slot: int
    spec: CacheSpec


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """What decoder layer ``index`` stores.

    ``layer_type`` is the model's own name for the layer (``"sliding_attention"``,
    ``"mamba"``, ``"hybrid"``, ...), kept for display.  ``caches`` holds one spec per cache the
    layer keeps; a layer that stores nothing holds one :class:`NoCacheSpec`.  ``tag`` marks a
    layer that is not one of the target model's decoder layers: ``"mtp"`` (a multi-token
    prediction module) or ``"draft"`` (a draft model's layer); ``""`` for the target's own.
    """

    index: int
    layer_type: str
    caches: tuple[CacheSpec, ...]
    tag: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or self.index < 0:
            raise SpecError(f"LayerSpec.index: must be an integer >= 0, got {self.index!r}")
        if not isinstance(self.tag, str) or (self.tag and not self.tag.isidentifier()):
            raise SpecError(
                f"LayerSpec.tag: layer {self.index} has tag {self.tag!r}; expected '' (a target "
                "layer) or a name such as 'mtp' or 'draft'"
            )
        caches = tuple(self.caches)
        if not caches:
            raise SpecError(
                f"LayerSpec.caches: layer {self.index} has no spec; use NoCacheSpec for a "
                "layer that stores nothing"
            )
        if len(caches) > 1 and any(c.stores_nothing for c in caches):
            raise SpecError(
                f"LayerSpec.caches: layer {self.index} mixes NoCacheSpec with real caches"
            )
        object.__setattr__(self, "caches", caches)

    @property
    def stores_nothing(self) -> bool:
        return all(c.stores_nothing for c in self.caches)

    def resident_bytes(self, seq_len: int) -> int:
        """Exact bytes this layer needs while the last token of ``seq_len`` tokens runs."""
        return sum(c.resident_bytes(seq_len) for c in self.caches)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Per-layer cache specs of one model, as one tensor-parallel rank sees them.

    ``tp_size`` records the tensor-parallel size the head counts were divided by; byte figures
    are per rank.  ``max_position_embeddings`` is the model's own context limit, if known.
    """

    name: str
    model_type: str
    layers: tuple[LayerSpec, ...]
    tp_size: int = 1
    max_position_embeddings: int | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers:
            raise SpecError(f"ModelSpec.layers: model {self.name!r} has no layers")
        for i, layer in enumerate(layers):
            if layer.index != i:
                raise SpecError(
                    f"ModelSpec.layers: layer at position {i} has index {layer.index}; "
                    "layers must be numbered 0..n-1 in order"
                )
        object.__setattr__(self, "layers", layers)
        if not isinstance(self.tp_size, int) or self.tp_size <= 0:
            raise SpecError(f"ModelSpec.tp_size: must be a positive integer, got {self.tp_size!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_target_layers(self) -> int:
        """Layers of the target model itself (those without a tag come first)."""
        return sum(1 for layer in self.layers if not layer.tag)

    def with_draft(
        self, draft: ModelSpec | tuple[LayerSpec, ...], *, tag: str = "draft"
    ) -> ModelSpec:
        """This model with ``draft``'s layers appended, renumbered after its own and tagged
        ``tag`` (MTP modules, a draft model's layers).

        Grouping puts every cache by its spec (:func:`hybridkv.plan.group_entries`): a draft
        layer whose spec equals a target group's joins that group (same block tables, one more
        member); one that matches none gets a new group after the target's, so the target's
        group ids are the same with or without the draft.  Raises :class:`SpecError` for a
        draft at another tensor-parallel size or an empty tag.
        """
        if isinstance(draft, ModelSpec):
            if draft.tp_size != self.tp_size:
                raise SpecError(
                    f"ModelSpec.with_draft: draft {draft.name!r} has tp_size {draft.tp_size}, the "
                    f"target {self.tp_size}; both must describe the same rank"
                )
            layers: tuple[LayerSpec, ...] = draft.layers
            label = f"{draft.name} ({len(layers)} layers)"
        else:
            layers = tuple(draft)
            label = f"{len(layers)} layers"
        if not tag:
            raise SpecError("ModelSpec.with_draft: tag must name the draft's role, e.g. 'mtp'")
        n = self.num_layers
        extra = tuple(
            LayerSpec(index=n + i, layer_type=layer.layer_type, caches=layer.caches, tag=tag)
            for i, layer in enumerate(layers)
        )
        return ModelSpec(
            name=self.name,
            model_type=self.model_type,
            layers=(*self.layers, *extra),
            tp_size=self.tp_size,
            max_position_embeddings=self.max_position_embeddings,
            notes=(*self.notes, f"{tag}: {label} after layer {n - 1}, grouped by spec"),
        )

    def entries(self, *, include_empty: bool = False) -> list[CacheEntry]:
        """Every cache of every layer in layer order (no-cache layers only if asked)."""
        return [
            CacheEntry(layer.index, slot, spec)
            for layer in self.layers
            for slot, spec in enumerate(layer.caches)
            if include_empty or not spec.stores_nothing
        ]

    def resident_bytes(self, seq_len: int) -> int:
        """Exact bytes one request of ``seq_len`` tokens needs at its last token, all layers."""
        return sum(layer.resident_bytes(seq_len) for layer in self.layers)

    def full_attention_equivalent_bytes_per_token(self) -> int:
        """Bytes per token if every caching layer kept every token (the naive estimate).

        State layers count as their state only; this is the "every layer is full attention"
        baseline planners are compared with.
        """
        return sum(c.bytes_per_token for _, _, c in self.entries())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model_type": self.model_type,
            "tp_size": self.tp_size,
            "max_position_embeddings": self.max_position_embeddings,
            "notes": list(self.notes),
            "layers": [
                {
                    "index": layer.index,
                    "layer_type": layer.layer_type,
                    "caches": [c.to_dict() for c in layer.caches],
                    **({"tag": layer.tag} if layer.tag else {}),
                }
                for layer in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        try:
            layers = tuple(
                LayerSpec(
                    index=int(layer["index"]),
                    layer_type=str(layer["layer_type"]),
                    caches=tuple(spec_from_dict(c) for c in layer["caches"]),
                    tag=str(layer.get("tag", "")),
                )
                for layer in data["layers"]
            )
            return cls(
                name=str(data["name"]),
                model_type=str(data["model_type"]),
                layers=layers,
                tp_size=int(data.get("tp_size", 1)),
                max_position_embeddings=data.get("max_position_embeddings"),
                notes=tuple(data.get("notes", ())),
            )
        except KeyError as exc:
            raise SpecError(f"ModelSpec: missing field {exc.args[0]!r}") from None


def no_cache_layer(index: int, layer_type: str = "mlp") -> LayerSpec:
    """A layer that stores nothing (convenience for config derivation and tests)."""
    return LayerSpec(index=index, layer_type=layer_type, caches=(NoCacheSpec(),))
