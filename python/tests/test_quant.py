"""zeropp.quant: the formats of zeropp-quant, bit for bit, on torch tensors
and numpy arrays, and the figures of `zeropp quant-error`."""

import json
import struct
import subprocess

import numpy as np
import pytest
import torch

import zeropp
from zeropp import quant


def reference_int8_symmetric(x, block):
    """Symmetric int8 blocks by hand: scale = absmax / 127, codes rounded half
    to even, stored as two's complement bytes."""
    codes, maxima = [], []
    for i in range(0, len(x), block):
        b = x[i : i + block].astype(np.float32)
        m = np.float32(np.abs(b).max())
        maxima.append(m)
        scale = m / np.float32(127) if m > 0 else np.float32(1)
        codes.append(np.clip(np.rint(b / scale), -127, 127).astype(np.int8))
    return np.concatenate(codes).view(np.uint8), np.array(maxima, dtype=np.float32)


def test_int8_codes_and_scales_are_the_documented_format():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)  # not a multiple of the block
    q = quant.quantize(x, bits=8, block=64)
    codes, maxima = reference_int8_symmetric(x, 64)
    np.testing.assert_array_equal(q.block_max, maxima)
    # Off-by-one codes only where x/scale sits on a rounding boundary.
    diff = np.abs(q.codes.view(np.int8).astype(int) - codes.view(np.int8).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    assert q.nbytes == 1000 + 4 * 16


@pytest.mark.parametrize("bits,bound", [(8, 1 / 254), (4, 1 / 14)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_half_a_step_per_block(bits, bound, dtype):
    x = torch.randn(4096, dtype=torch.float32).to(dtype)
    q = quant.quantize(x, bits=bits, block=128)
    y = quant.dequantize(q)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    xf = x.float().view(-1, 128)
    err = (y.view(-1, 128) - xf).abs().max(dim=1).values
    absmax = xf.abs().max(dim=1).values
    assert torch.all(err <= absmax * bound * 1.001 + 1e-6)


def test_numpy_arrays_round_trip_and_asymmetric_keeps_minima():
    x = np.linspace(-1, 3, 777, dtype=np.float32)
    q = quant.quantize(x, bits=4, block=32, asymmetric=True)
    assert len(q.block_min) == len(q.block_max) == 25
    y = quant.dequantize(q)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    assert np.abs(y - x).max() <= (4 / 15) / 2 * 1.001


def test_stochastic_rounding_is_seeded():
    x = torch.randn(2048)
    a = quant.quantize(x, bits=4, block=64, seed=7)
    b = quant.quantize(x, bits=4, block=64, seed=7)
    c = quant.quantize(x, bits=4, block=64, seed=8)
    assert np.array_equal(a.codes, b.codes) and not np.array_equal(a.codes, c.codes)


def test_bad_input_is_an_exception_that_says_what_to_do():
    with pytest.raises(zeropp.ZeroppError, match="float32, bfloat16 and float16"):
        quant.quantize(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(zeropp.ZeroppError, match="contiguous"):
        quant.quantize(torch.zeros(8, 8).t())
    with pytest.raises(zeropp.ZeroppError, match="bits"):
        quant.quantize(torch.zeros(64), bits=3)
    with pytest.raises(zeropp.ZeroppError, match="block"):
        quant.quantize(torch.zeros(64), block=100)
    with pytest.raises(zeropp.ZeroppError, match="NaN|finite|nan"):
        quant.quantize(torch.tensor([1.0, float("nan")] * 32))
    for empty in (torch.empty(0), np.zeros(0, dtype=np.float32)):
        with pytest.raises(zeropp.ZeroppError, match="empty"):
            quant.quantize(empty)
    with pytest.raises(zeropp.ZeroppError, match="what zeropp.quant.quantize returned"):
        quant.dequantize(b"garbage")


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        raw = a.tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(a.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.mark.parametrize("bits,block,asym", [(4, 256, False), (8, 64, True)])
def test_figures_equal_the_command_line_tools(tmp_path, zeropp_bin, bits, block, asym):
    w = np.random.default_rng(1).standard_normal((96, 80)).astype(np.float32)
    f = tmp_path / "w.safetensors"
    write_safetensors(f, {"w": w})
    cmd = [zeropp_bin, "quant-error", str(f), "--bits", str(bits), "--block", str(block), "--json"]
    if asym:
        cmd.append("--asymmetric")
    cli = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    mine = quant.error(w, bits=bits, block=block, asymmetric=asym)
    theirs = cli["tensors"][0]
    for k in ("elements", "bytes_in", "bytes_out"):
        assert mine[k] == theirs[k]
    for k in ("absmax", "rmse", "max_abs_error", "rel_l2_error", "snr_db"):
        assert mine[k] == pytest.approx(theirs[k], rel=1e-9), k
