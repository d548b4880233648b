"""MXFP8 at the layer's boundary (OCP Microscaling v1.0: E4M3 elements, one E8M0 scale per 32 consecutive
elements of a row), for callers that exchange activations or weights in that format:

    data, scales = pounce.to_mxfp8(y)           # bf16 [..., C] -> float8_e4m3fn [..., C], uint8 [..., C/32]
    x = pounce.from_mxfp8(data, scales)         # and back to bf16

Both are pounce's device converters (formats/quantize_kernel.h) on the current CUDA stream, registered as
custom ops (torch.compile, CUDA graphs). to_mxfp8 follows the MX spec's scale rule (the top binade of a
block may saturate to 448, as the spec allows); from_mxfp8 is exact for scale codes 3 to 246 and rounds
only outside them (values under bf16's subnormal step, overflow to infinity); a 0xFF scale gives NaN.
The layer itself computes in bf16: these convert at its boundary, they are not fused into its kernels.
"""

from typing import Tuple

import torch
from torch import Tensor

from . import _lib
from ._lib import Error

MX_BLOCK = 32


def _check(what: str, name: str, t: Tensor, dtypes, whole_blocks: bool) -> None:
    """Raises pounce.Error naming `name` unless t is a contiguous CUDA tensor of one of `dtypes` (and, with
    whole_blocks, rows of whole MX blocks)."""
    if t.dtype not in dtypes:
        raise Error(f"pounce.{what}: {name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if t.device.type != "cuda":
        raise Error(f"pounce.{what}: {name} is on {t.device}, expected a CUDA device")
    if not t.is_contiguous():
        raise Error(f"pounce.{what}: {name} is not contiguous (strides {t.stride()}): pass {name}.contiguous()")
    if whole_blocks and (t.dim() < 1 or t.shape[-1] % MX_BLOCK != 0):
        raise Error(f"pounce.{what}: {name} has shape {tuple(t.shape)}: its last dimension must be a multiple of "
                    f"{MX_BLOCK}")


def _rows_cols(t: Tensor) -> Tuple[int, int]:
    cols = t.shape[-1]
    return (t.numel() // cols if cols else 0), cols


@torch.library.custom_op("pounce::to_mxfp8", mutates_args=())
def to_mxfp8(x: Tensor) -> Tuple[Tensor, Tensor]:
    """bf16 x [..., C] (C a multiple of 32) -> (data float8_e4m3fn [..., C], scales uint8 [..., C / 32]),
    the E8M0 scales by the MX spec's rule."""
    _check("to_mxfp8", "x", x, (torch.bfloat16,), whole_blocks=True)
    if x.numel() > 0 and x.data_ptr() % 16 != 0:
        raise Error(f"pounce.to_mxfp8: x at {x.data_ptr():#x} is not 16-byte aligned")
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // MX_BLOCK), dtype=torch.uint8, device=x.device)
    rows, cols = _rows_cols(x)
    with torch.cuda.device(x.device):
        stream = torch.cuda.current_stream(x.device).cuda_stream
        _lib.check(_lib.library().pounce_bf16_to_mxfp8(x.data_ptr(), rows, cols, data.data_ptr(), scales.data_ptr(),
                                                       stream))
    return data, scales


@to_mxfp8.register_fake
def _(x):
    return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((*x.shape[:-1], x.shape[-1] // MX_BLOCK), dtype=torch.uint8, device=x.device))


@torch.library.custom_op("pounce::from_mxfp8", mutates_args=())
def from_mxfp8(data: Tensor, scales: Tensor) -> Tensor:
    """MXFP8 (data float8_e4m3fn or its uint8 bits [..., C], scales uint8 E8M0 [..., C / 32]) -> bf16
    [..., C]: data * 2^(scales - 127), exact for scale codes 3 to 246."""
    _check("from_mxfp8", "data", data, (torch.float8_e4m3fn, torch.uint8), whole_blocks=True)
    _check("from_mxfp8", "scales", scales, (torch.uint8,), whole_blocks=False)
    expected = (*data.shape[:-1], data.shape[-1] // MX_BLOCK)
    if tuple(scales.shape) != expected:
        raise Error(f"pounce.from_mxfp8: scales has shape {tuple(scales.shape)}, expected {list(expected)} (one per "
                    f"{MX_BLOCK} elements of data's rows)")
    if scales.device != data.device:
        raise Error(f"pounce.from_mxfp8: scales is on {scales.device}, data on {data.device}: both on one GPU")
    if data.numel() > 0 and data.data_ptr() % 8 != 0:
        raise Error(f"pounce.from_mxfp8: data at {data.data_ptr():#x} is not 8-byte aligned")
    out = torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
    rows, cols = _rows_cols(data)
    with torch.cuda.device(data.device):
        stream = torch.cuda.current_stream(data.device).cuda_stream
        _lib.check(_lib.library().pounce_mxfp8_to_bf16(data.data_ptr(), scales.data_ptr(), rows, cols, out.data_ptr(),
                                                       stream))
    return out


@from_mxfp8.register_fake
def _(data, scales):
    return torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
