//! `zeropp.quant` on the Rust side: block quantization of host buffers in
//! exactly the formats of `zeropp-quant` (the wire formats of qwZ and qgZ),
//! and the error figures of `zeropp quant-error`.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use zeropp_quant::{
    Bits, ErrorStats, QuantFormat, QuantizedRef, QuantizedTensor, Rounding, Scheme,
};

use crate::buffers::{Dtype, HostBuf, with_dtype};
use crate::{invalid, to_py};

fn format(bits: u32, block: usize, asymmetric: bool) -> PyResult<QuantFormat> {
    let b = Bits::from_u32(bits).map_err(|e| invalid(e.to_string()))?;
    let scheme = if asymmetric {
        Scheme::Asymmetric
    } else {
        Scheme::Symmetric
    };
    QuantFormat::new(b, scheme, block).map_err(|e| invalid(e.to_string()))
}

fn rounding(seed: Option<u64>) -> Rounding {
    match seed {
        Some(seed) => Rounding::Stochastic { seed },
        None => Rounding::NearestEven,
    }
}

fn quantize_buf(
    data: &HostBuf,
    dtype: Dtype,
    f: QuantFormat,
    r: Rounding,
) -> PyResult<QuantizedTensor> {
    with_dtype!(dtype, T => {
        let x: &[T] = data.typed("data").map_err(to_py)?;
        QuantizedTensor::quantize(x, f, r).map_err(|e| invalid(e.to_string()))
    })
}

/// Quantizes `data` (`dtype` values) into (codes, block maxima as f32
/// bytes, block minima as f32 bytes). `seed`: stochastic rounding.
#[pyfunction]
#[pyo3(signature = (data, dtype, bits, block, asymmetric=false, seed=None))]
#[allow(clippy::type_complexity)]
fn quantize<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    dtype: &str,
    bits: u32,
    block: usize,
    asymmetric: bool,
    seed: Option<u64>,
) -> PyResult<(
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
    Bound<'py, PyBytes>,
)> {
    let (dtype, f) = (Dtype::parse(dtype)?, format(bits, block, asymmetric)?);
    let data = HostBuf::new(data, false, "data")?;
    let q = py.detach(|| quantize_buf(&data, dtype, f, rounding(seed)))?;
    Ok((
        PyBytes::new(py, &q.codes),
        PyBytes::new(py, bytemuck::cast_slice(&q.block_max)),
        PyBytes::new(py, bytemuck::cast_slice(&q.block_min)),
    ))
}

/// Dequantizes `length` values from (codes, block maxima, block minima)
/// into `out` (`dtype` values).
#[pyfunction]
#[pyo3(signature = (codes, block_max, block_min, length, bits, block, out, dtype, asymmetric=false))]
#[allow(clippy::too_many_arguments)]
fn dequantize(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    block_max: &Bound<'_, PyAny>,
    block_min: &Bound<'_, PyAny>,
    length: usize,
    bits: u32,
    block: usize,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    asymmetric: bool,
) -> PyResult<()> {
    let (dtype, f) = (Dtype::parse(dtype)?, format(bits, block, asymmetric)?);
    let codes = HostBuf::new(codes, false, "codes")?;
    let (bmax, bmin) = (
        HostBuf::new(block_max, false, "block_max")?,
        HostBuf::new(block_min, false, "block_min")?,
    );
    let out = HostBuf::new(out, true, "out")?;
    // Scales may arrive unaligned (a slice of a bytes object): copy them.
    let to_f32 = |b: &HostBuf| -> Vec<f32> {
        b.bytes()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let (bmax, bmin) = (to_f32(&bmax), to_f32(&bmin));
    py.detach(|| {
        let q = QuantizedRef::new(f, length, codes.bytes(), &bmax, &bmin)
            .map_err(|e| invalid(e.to_string()))?;
        with_dtype!(dtype, T => {
            let o: &mut [T] = out.typed_mut("out").map_err(to_py)?;
            if o.len() != length {
                return Err(invalid(format!(
                    "out holds {} values, the quantized tensor {length}",
                    o.len()
                )));
            }
            zeropp_quant::dequantize(q, o).map_err(|e| invalid(e.to_string()))
        })
    })
}

/// What quantizing `data` would do to it, as `zeropp quant-error` reports
/// one tensor (JSON: elements, absmax, rmse, max_abs_error, rel_l2_error,
/// snr_db, bytes_in, bytes_out).
#[pyfunction]
#[pyo3(signature = (data, dtype, bits, block, asymmetric=false, seed=None))]
fn quant_error_json(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    dtype: &str,
    bits: u32,
    block: usize,
    asymmetric: bool,
    seed: Option<u64>,
) -> PyResult<String> {
    let (dtype, f) = (Dtype::parse(dtype)?, format(bits, block, asymmetric)?);
    let data = HostBuf::new(data, false, "data")?;
    let figures = py.detach(|| -> PyResult<_> {
        let q = quantize_buf(&data, dtype, f, rounding(seed))?;
        let back: Vec<f32> = q.dequantize().map_err(|e| invalid(e.to_string()))?;
        let original: Vec<f32> = with_dtype!(dtype, T => {
            let x: &[T] = data.typed("data").map_err(to_py)?;
            x.iter().map(|v| zeropp_quant::Element::to_f32(*v)).collect()
        });
        let stats = ErrorStats::measure(&original, &back);
        Ok(zeropp_quant::Figures::new(
            &stats,
            data.len(),
            f.total_bytes(original.len()),
        ))
    })?;
    serde_json::to_string(&figures).map_err(|e| invalid(e.to_string()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_error_json, m)?)?;
    Ok(())
}
