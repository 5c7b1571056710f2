"""Storage data types of cache tensors, independent of any tensor library."""

from __future__ import annotations

from enum import StrEnum

from hybridkv.errors import SpecError

__all__ = ["DType"]


class DType(StrEnum):
    """A cache element type.  The value is the torch attribute name (``torch.<value>``)."""

    FP32 = "float32"
    BF16 = "bfloat16"
    FP16 = "float16"
    FP8_E4M3 = "float8_e4m3fn"
    FP8_E5M2 = "float8_e5m2"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, text: str | DType, *, field: str = "dtype") -> DType:
        """Parse a dtype name or alias (``fp32``, ``float``, ``bf16``, ``half``, ``fp8``, ...).

        Raises :class:`SpecError` naming ``field`` and the accepted names.
        """
        if isinstance(text, DType):
            return text
        key = str(text).strip().lower().removeprefix("torch.")
        found = _ALIASES.get(key)
        if found is None:
            valid = ", ".join(sorted(_ALIASES))
            raise SpecError(f"{field}: unknown dtype {text!r}; valid: {valid}")
        return found


_ITEMSIZE: dict[DType, int] = {
    DType.FP32: 4,
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
}

_ALIASES: dict[str, DType] = {
    "fp32": DType.FP32,
    "float32": DType.FP32,
    "float": DType.FP32,
    "bf16": DType.BF16,
    "bfloat16": DType.BF16,
    "fp16": DType.FP16,
    "float16": DType.FP16,
    "half": DType.FP16,
    "fp8": DType.FP8_E4M3,
    "fp8_e4m3": DType.FP8_E4M3,
    "float8_e4m3fn": DType.FP8_E4M3,
    "fp8_e5m2": DType.FP8_E5M2,
    "float8_e5m2": DType.FP8_E5M2,
}
