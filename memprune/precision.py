"""Numeric precision of the encoder's passes: autocast to bf16 or fp16 over fp32 weights, or plain fp32.

`auto` is bf16 on a CUDA device that supports it (most of a modern GPU's throughput is in its
16-bit tensor cores) and fp32 elsewhere (CPU autocast is rarely faster and changes the numbers).
Weights stay fp32 in every mode: checkpoints, optimizer state and the training master weights
are unchanged, only the matrix products of the forward (and backward) pass run in 16 bits.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

from pydantic import Field

Precision = Literal["auto", "fp32", "bf16", "fp16"]  # a request
Resolved = Literal["fp32", "bf16", "fp16"]  # what runs on a device
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
DEFAULT_PRECISION: Precision = "auto"


def precision_field(of: str) -> Any:
    """The `precision` field of a config (its one default and description); `of`: which passes it sets."""
    return Field(DEFAULT_PRECISION, description=f"{of}: fp32, bf16 or fp16 autocast over fp32 weights; "
                 "auto = bf16 on CUDA devices that support it, else fp32")


def resolve_precision(precision: str, device: Any) -> Resolved:
    """The concrete precision for `device` (a torch device or its name): `auto` becomes bf16 or fp32."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    kind = torch.device(device).type
    if precision == "auto":
        return "bf16" if kind == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp16" and kind not in ("cuda", "cpu"):
        raise ValueError(f"fp16 autocast is not supported on {kind}")
    return precision  # type: ignore[return-value]


def autocast(precision: str, device: Any) -> AbstractContextManager[Any]:
    """A context in which the forward pass runs at `precision` on `device` (fp32: no autocast)."""
    import torch

    chosen = resolve_precision(precision, device)
    if chosen == "fp32":
        return nullcontext()
    dtype = torch.bfloat16 if chosen == "bf16" else torch.float16
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def grad_scaler(precision: str, device: Any) -> Any:
    """A loss scaler for fp16 training (its small exponent range underflows gradients), else None."""
    import torch

    if resolve_precision(precision, device) != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(device).type)
