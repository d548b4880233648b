"""libpounce.so through its C ABI (include/pounce/pounce_c.h), loaded with ctypes on first use.

The structs below mirror the header field for field; ABI_VERSION must equal the library's
pounce_abi_version(), which is checked at load.
"""

import ctypes
import functools
import os
import sys
from pathlib import Path

ABI_VERSION = 11
NCCL_UNIQUE_ID_BYTES = 128


class Error(RuntimeError):
    """Raised by pounce: bad input, a limit of the layer, or a failure the GPU reported. The message
    names what was wrong; errors from the C++ library keep its message word for word."""


class Config(ctypes.Structure):
    _fields_ = [
        ("ranks", ctypes.c_int32),
        ("experts", ctypes.c_int32),
        ("topk", ctypes.c_int32),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("max_tokens_per_rank", ctypes.c_int64),
        ("max_routes_per_rank", ctypes.c_int64),
    ]


class Options(ctypes.Structure):
    _fields_ = [
        ("ctas_per_rank", ctypes.c_int32),
        ("comm_ctas", ctypes.c_int32),
        ("engine_rows", ctypes.c_int32),
        ("minibatch_rows", ctypes.c_int64),
        ("ring_blocks", ctypes.c_int64),
        ("ring_bytes", ctypes.c_int64),
        ("wait_timeout_ns", ctypes.c_uint64),
        ("backward_replays", ctypes.c_int32),
        ("fused_backward", ctypes.c_int32),
        ("fp8_data_gradients", ctypes.c_int32),
        ("fp8_weight_gradients", ctypes.c_int32),
        ("fp8_forward", ctypes.c_int32),
        ("keep_x_rows", ctypes.c_int32),
    ]


class RankIO(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("topk_ids", ctypes.c_void_p),
        ("topk_weights", ctypes.c_void_p),
        ("tokens", ctypes.c_int64),
        ("y", ctypes.c_void_p),
    ]


class RankGrads(ctypes.Structure):
    _fields_ = [
        ("dy", ctypes.c_void_p),
        ("dx", ctypes.c_void_p),
        ("d_topk_weights", ctypes.c_void_p),
        ("dw13", ctypes.c_void_p),
        ("dw2", ctypes.c_void_p),
    ]


# pounce_weight_grad_output
WEIGHT_GRAD_BF16, WEIGHT_GRAD_F32, WEIGHT_GRAD_ACCUMULATE_F32 = 0, 1, 2


class Info(ctypes.Structure):
    _fields_ = [
        ("ranks_on_this_gpu", ctypes.c_int32),
        ("ctas_per_rank", ctypes.c_int32),
        ("comm_ctas", ctypes.c_int32),
        ("engine_rows", ctypes.c_int32),
        ("minibatch_rows", ctypes.c_int64),
        ("ring_blocks", ctypes.c_int64),
        ("max_m_blocks", ctypes.c_int64),
        ("device_bytes", ctypes.c_int64),
        ("in_place", ctypes.c_int32),
        ("last_backward_replayed", ctypes.c_int32),
        ("shared_bytes", ctypes.c_int64),
        ("shared_id", ctypes.c_uint64),
    ]


_P = ctypes.c_void_p
_SIGNATURES = {
    "pounce_abi_version": [],
    "pounce_default_options": [ctypes.POINTER(Options)],
    "pounce_moe_create": [ctypes.POINTER(Config), ctypes.POINTER(Options), ctypes.POINTER(_P)],
    "pounce_nccl_unique_id": [ctypes.c_char_p],
    "pounce_moe_create_nccl": [
        ctypes.POINTER(Config),
        ctypes.POINTER(Options),
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.POINTER(_P),
    ],
    "pounce_moe_set_weights": [_P, ctypes.c_int, ctypes.POINTER(_P), ctypes.POINTER(_P)],
    "pounce_moe_refresh_fp8_weights": [_P, _P],
    "pounce_moe_forward": [_P, ctypes.c_int, ctypes.POINTER(RankIO), ctypes.c_int, _P],
    "pounce_moe_backward": [_P, ctypes.c_int, ctypes.POINTER(RankIO), ctypes.POINTER(RankGrads), ctypes.c_int, _P],
    "pounce_moe_check_device_errors": [_P],
    "pounce_moe_get_info": [_P, ctypes.POINTER(Info)],
    "pounce_moe_destroy": [_P],
    "pounce_bf16_to_mxfp8": [_P, ctypes.c_int64, ctypes.c_int64, _P, _P, _P],
    "pounce_mxfp8_to_bf16": [_P, _P, ctypes.c_int64, ctypes.c_int64, _P, _P],
}


def library_path() -> Path:
    """$POUNCE_LIBRARY if set (a build tree's libpounce.so), else the one installed beside this file."""
    return Path(os.environ.get("POUNCE_LIBRARY") or Path(__file__).with_name("libpounce.so"))


def _preload_nccl():
    """PyTorch's NCCL, the nvidia-nccl wheel's libnccl.so.2, loaded globally before libpounce so that
    its libnccl.so.2 resolves to it: one NCCL per process. Without the wheel, libpounce's run path
    finds the NCCL it was built against."""
    for folder in sys.path:
        path = Path(folder or ".", "nvidia", "nccl", "lib", "libnccl.so.2")
        if path.is_file():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    import torch  # noqa: F401  (first: its CUDA runtime is the one libpounce then shares)

    path = library_path()
    try:
        _preload_nccl()
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise Error(f"cannot load {path}: {e}") from e
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.pounce_last_error.argtypes = []
    lib.pounce_last_error.restype = ctypes.c_char_p
    if lib.pounce_abi_version() != ABI_VERSION:
        raise Error(
            f"{path} has C ABI version {lib.pounce_abi_version()}, this package {ABI_VERSION}: "
            "reinstall pounce so that the library and the Python files match"
        )
    return lib


def check(status: int) -> None:
    """Raises pounce.Error with the library's message unless status is 0."""
    if status != 0:
        raise Error(library().pounce_last_error().decode(errors="replace"))


def default_options() -> Options:
    options = Options()
    check(library().pounce_default_options(ctypes.byref(options)))
    return options
