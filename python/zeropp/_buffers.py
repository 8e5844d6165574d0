"""Host tensors and arrays as the byte buffers the Rust side reads and writes
in place (no copies), with their element type's name."""

import numpy as np

from ._zeropp import ZeroppError

_DTYPES = ("float32", "bfloat16", "float16")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional for zeropp.quant
        return None
    return torch


def dtype_name(x):
    """'float32', 'bfloat16' or 'float16' for a torch tensor or numpy array."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        name = str(x.dtype).removeprefix("torch.")
    elif isinstance(x, np.ndarray):
        name = x.dtype.name
    else:
        raise ZeroppError(f"expected a torch.Tensor or a numpy array, got {type(x).__name__}")
    if name not in _DTYPES:
        raise ZeroppError(
            f"zeropp moves and quantizes float32, bfloat16 and float16 values, not {name}; "
            "cast it first (or set FSDP2's mp_policy param_dtype / reduce_dtype)"
        )
    return name


def host_bytes(x, what="tensor"):
    """The bytes of a contiguous host tensor or array, as a uint8 numpy view
    sharing its memory."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ZeroppError(
                f"{what} is on {x.device}: zeropp moves CPU tensors through its host transports "
                "(UCX, TCP) and CUDA tensors through its CUDA kernels and NCCL, not others; "
                "move the tensor to the CPU first"
            )
        if not x.is_contiguous():
            raise ZeroppError(f"{what} is not contiguous; call .contiguous() first")
        return x.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ZeroppError(f"{what} is not C-contiguous; use np.ascontiguousarray")
        return x.reshape(-1).view(np.uint8)
    raise ZeroppError(f"{what}: expected a torch.Tensor or a numpy array, got {type(x).__name__}")
