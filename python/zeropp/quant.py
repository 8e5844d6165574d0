"""Block quantization of your own tensors, in exactly the formats zeropp puts
on the wire (``zeropp-quant``: symmetric or asymmetric blocks, int8 / int4 /
int2 codes, one f32 scale per block, round-to-nearest-even or seeded
stochastic rounding), and the error figures of ``zeropp quant-error``.

Works on torch tensors (CPU) and numpy arrays of float32, bfloat16 or
float16::

    import torch, zeropp
    w = torch.randn(4096, 4096)
    q = zeropp.quant.quantize(w, bits=4, block=256)
    w2 = zeropp.quant.dequantize(q)            # a float32 tensor like w
    zeropp.quant.error(w, bits=4, block=256)   # {'rmse': ..., 'snr_db': ..., ...}
"""

import json
from dataclasses import dataclass

import numpy as np

from . import _zeropp
from ._buffers import _torch, dtype_name, host_bytes
from ._zeropp import ZeroppError

__all__ = ["Quantized", "dequantize", "error", "quantize"]


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor: packed codes, one f32 maximum per block, and one
    f32 minimum per block for the asymmetric scheme (empty otherwise)."""

    codes: np.ndarray
    block_max: np.ndarray
    block_min: np.ndarray
    shape: tuple
    bits: int
    block: int
    asymmetric: bool
    dtype: str
    is_torch: bool

    @property
    def numel(self):
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self):
        """Bytes of the quantized form: codes plus scales."""
        return self.codes.nbytes + self.block_max.nbytes + self.block_min.nbytes


def quantize(x, bits=8, block=256, asymmetric=False, seed=None):
    """Quantizes ``x`` in blocks of ``block`` values to ``bits`` (8, 4 or 2).
    ``seed``: stochastic rounding with that seed (default: round to nearest
    even, bit-exact with zeropp's CUDA kernels)."""
    name = dtype_name(x)
    if (x.numel() if callable(getattr(x, "numel", None)) else np.size(x)) == 0:
        raise ZeroppError("quantize got an empty tensor: there is nothing to quantize")
    codes, bmax, bmin = _zeropp.quantize(host_bytes(x, "x"), name, bits, block, asymmetric, seed)
    torch = _torch()
    return Quantized(
        codes=np.frombuffer(codes, dtype=np.uint8),
        block_max=np.frombuffer(bmax, dtype=np.float32),
        block_min=np.frombuffer(bmin, dtype=np.float32),
        shape=tuple(x.shape),
        bits=bits,
        block=block,
        asymmetric=asymmetric,
        dtype=name,
        is_torch=torch is not None and isinstance(x, torch.Tensor),
    )


def dequantize(q, dtype="float32"):
    """The values of ``q``, as a tensor (when ``q`` came from one) or a numpy
    array of ``dtype`` ('float32', 'bfloat16' or 'float16') and ``q``'s shape."""
    if not isinstance(q, Quantized):
        raise ZeroppError(
            f"dequantize takes what zeropp.quant.quantize returned (a Quantized), not "
            f"{type(q).__name__}"
        )
    torch = _torch()
    if q.is_torch:
        out = torch.empty(q.shape, dtype=getattr(torch, dtype))
    else:
        if dtype == "bfloat16":
            import ml_dtypes  # numpy has no bfloat16 of its own

            out = np.empty(q.shape, dtype=ml_dtypes.bfloat16)
        else:
            out = np.empty(q.shape, dtype=dtype)
    _zeropp.dequantize(
        q.codes,
        q.block_max.view(np.uint8),
        q.block_min.view(np.uint8),
        q.numel,
        q.bits,
        q.block,
        host_bytes(out, "out"),
        dtype_name(out),
        q.asymmetric,
    )
    return out


def error(x, bits=8, block=256, asymmetric=False, seed=None):
    """What quantizing ``x`` would do to it, as ``zeropp quant-error`` reports a
    tensor: elements, absmax, rmse, max_abs_error, rel_l2_error, snr_db (None
    when exact), bytes_in, bytes_out."""
    return json.loads(
        _zeropp.quant_error_json(host_bytes(x, "x"), dtype_name(x), bits, block, asymmetric, seed)
    )
