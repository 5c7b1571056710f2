"""Checking a device name before anything is loaded onto it."""

from __future__ import annotations

import torch

from hybridkv.engine.errors import DeviceError

__all__ = ["resolve_device"]

_VALID = "cpu, cuda or cuda:N"


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device` this process can use.

    Raises :class:`DeviceError` for a name torch cannot parse, a device type other than CPU
    and CUDA, a CPU index other than 0, CUDA on a torch build or machine without a CUDA
    device, or a CUDA index past the devices present.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"device: cannot parse {str(device)!r}; valid: {_VALID}") from None
    if dev.type == "cpu":
        if dev.index:  # torch takes any index and ignores it: one CPU device
            raise DeviceError(
                f"device: {str(device)!r}: the CPU is one device (cpu or cpu:0); valid: {_VALID}"
            )
        return dev
    if dev.type != "cuda":
        raise DeviceError(
            f"device: {str(device)!r} is a {dev.type} device; hybridkv's engine runs on {_VALID}"
        )
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise DeviceError(
            f"device: {str(device)!r} asked for CUDA, but this torch ({torch.__version__}, "
            f"{build}) sees no CUDA device; use cpu"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise DeviceError(
            f"device: {str(device)!r} names CUDA device {dev.index}, but this machine has "
            f"{count} (cuda:0..cuda:{count - 1})"
        )
    return dev
