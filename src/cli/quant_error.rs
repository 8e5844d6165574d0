//! `zeropp quant-error`: quantizes every floating tensor of a safetensors file
//! and reports what it costs in accuracy and saves in bytes, so users can pick
//! bits and block size for their own weights.

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result, bail};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde::Serialize;
use zeropp_quant::{ErrorStats, QuantFormat, QuantizedTensor, Rounding, Scheme};

/// Values converted and quantized at a time, so memory stays bounded on
/// tensors of billions of values (a multiple of every block size).
const SEGMENT: usize = 1 << 22;

pub use zeropp_quant::Figures;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TensorReport {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    #[serde(flatten)]
    pub figures: Figures,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Skipped {
    pub name: String,
    pub dtype: String,
    pub reason: String,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Report {
    pub file: String,
    pub format: String,
    pub bits: u32,
    pub block: usize,
    pub scheme: String,
    pub tensors: Vec<TensorReport>,
    pub skipped: Vec<Skipped>,
    pub total: Figures,
}

fn widen(dtype: Dtype, bytes: &[u8], out: &mut Vec<f32>) {
    out.clear();
    match dtype {
        Dtype::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
        Dtype::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        Dtype::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ),
        other => unreachable!("dtype {other:?} is filtered out before widening"),
    }
}

/// Measures the tensors of one safetensors file into `tally`.
fn measure_file(
    path: &Path,
    format: QuantFormat,
    rounding: Rounding,
    tally: &mut Tally,
) -> Result<()> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: the map is read-only and lives for this function; a file changed
    // underneath us by another process is the one hazard, as with any reader.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    let st = SafeTensors::deserialize(&map).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a valid safetensors file ({e}); it may be truncated or corrupt — \
             re-download or re-export it",
            path.display()
        )
    })?;
    let mut names: Vec<&str> = st.names();
    names.sort_unstable();

    let mut wide = Vec::new();
    for name in names {
        let view = st.tensor(name)?;
        let dtype = view.dtype();
        if !matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            let reason = if matches!(dtype, Dtype::F64) || format!("{dtype:?}").starts_with('F') {
                "floating dtype zeropp does not quantize (f32, bf16 and f16 only)"
            } else {
                "not a floating-point tensor"
            };
            tally.skipped.push(Skipped {
                name: name.to_string(),
                dtype: format!("{dtype:?}"),
                reason: reason.into(),
            });
            continue;
        }
        let width = dtype.bitsize() / 8;
        let mut stats = ErrorStats::default();
        for (s, segment) in view.data().chunks(SEGMENT * width).enumerate() {
            widen(dtype, segment, &mut wide);
            let q = QuantizedTensor::quantize(&wide, format, rounding.for_part(s)).map_err(
                |e| match e {
                    zeropp_quant::QuantError::NonFinite { index, value, .. } => anyhow::anyhow!(
                        "{}: tensor '{name}': element {} is {value}; a checkpoint with NaN or \
                         Inf weights cannot be quantized — check the run that wrote it",
                        path.display(),
                        s * SEGMENT + index
                    ),
                    other => anyhow::anyhow!("{}: tensor '{name}': {other}", path.display()),
                },
            )?;
            let back: Vec<f32> = q.dequantize()?;
            stats.merge(&ErrorStats::measure(&wide, &back));
        }
        let elements: usize = view.shape().iter().product();
        let bytes_out = format.total_bytes(elements);
        tally.stats.merge(&stats);
        tally.bytes_in += view.data().len();
        tally.bytes_out += bytes_out;
        tally.tensors.push(TensorReport {
            name: name.to_string(),
            dtype: format!("{dtype:?}"),
            shape: view.shape().to_vec(),
            figures: Figures::new(&stats, view.data().len(), bytes_out),
        });
    }
    Ok(())
}

/// What the files measured so far hold.
#[derive(Default)]
struct Tally {
    tensors: Vec<TensorReport>,
    skipped: Vec<Skipped>,
    stats: ErrorStats,
    bytes_in: usize,
    bytes_out: usize,
}

/// The safetensors files `path` names: itself, or, for a directory (a
/// sharded checkpoint, as transformers saves one), every `*.safetensors`
/// in it, in name order.
fn files_of(path: &Path) -> Result<Vec<std::path::PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<_> = std::fs::read_dir(path)
        .with_context(|| format!("cannot list {}", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() && crate::train::checkpoint::resolve(path).is_ok() {
        bail!(
            "{} is a zeropp checkpoint (sharded, compressed): export its model first with \
             `zeropp ckpt export {} model.safetensors`, then measure model.safetensors",
            path.display(),
            path.display()
        );
    }
    if files.is_empty() {
        bail!(
            "{} is a directory with no .safetensors file: pass a safetensors file, or the \
             directory of a checkpoint saved as safetensors (transformers' \
             save_pretrained(..., safe_serialization=True))",
            path.display()
        );
    }
    Ok(files)
}

/// Quantizes and measures every f32/bf16/f16 tensor of the file at `path`,
/// or of every safetensors file of the directory at `path`.
pub fn analyze(path: &Path, format: QuantFormat, rounding: Rounding) -> Result<Report> {
    let mut tally = Tally::default();
    for file in files_of(path)? {
        measure_file(&file, format, rounding, &mut tally)?;
    }
    let Tally {
        tensors,
        skipped,
        stats: total_stats,
        bytes_in: total_in,
        bytes_out: total_out,
    } = tally;
    if tensors.is_empty() {
        bail!(
            "{} holds no f32, bf16 or f16 tensor ({} skipped); nothing to measure",
            path.display(),
            skipped.len()
        );
    }
    Ok(Report {
        file: path.display().to_string(),
        format: format.to_string(),
        bits: format.bits.count(),
        block: format.block,
        scheme: match format.scheme {
            Scheme::Symmetric => "symmetric".into(),
            Scheme::Asymmetric => "asymmetric".into(),
        },
        tensors,
        skipped,
        total: Figures::new(&total_stats, total_in, total_out),
    })
}

/// The report as an aligned table for a terminal.
pub fn render_table(r: &Report) -> String {
    let mut out = format!(
        "{}: {} ({}-bit {}, block {})\n",
        r.file, r.format, r.bits, r.scheme, r.block
    );
    let width = r
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(0)
        .max(5);
    out.push_str(&format!(
        "{:<width$} {:>5} {:>10} {:>10} {:>10} {:>11} {:>9} {:>8} {:>12} {:>12}\n",
        "name",
        "dtype",
        "elements",
        "absmax",
        "rmse",
        "max_abs_err",
        "rel_l2",
        "snr_db",
        "bytes_in",
        "bytes_out"
    ));
    let row = |name: &str, dtype: &str, f: &Figures| {
        format!(
            "{:<width$} {:>5} {:>10} {:>10.4e} {:>10.3e} {:>11.3e} {:>9.3e} {:>8} {:>12} {:>12}\n",
            name,
            dtype,
            f.elements,
            f.absmax,
            f.rmse,
            f.max_abs_error,
            f.rel_l2_error,
            f.snr_db.map_or("exact".into(), |s| format!("{s:.2}")),
            f.bytes_in,
            f.bytes_out
        )
    };
    for t in &r.tensors {
        out.push_str(&row(&t.name, &t.dtype, &t.figures));
    }
    out.push_str(&row("TOTAL", "", &r.total));
    out.push_str(&format!(
        "compression {:.2}x ({} -> {} bytes, block parameters included)\n",
        r.total.bytes_in as f64 / r.total.bytes_out.max(1) as f64,
        r.total.bytes_in,
        r.total.bytes_out
    ));
    for s in &r.skipped {
        out.push_str(&format!("skipped {} ({}): {}\n", s.name, s.dtype, s.reason));
    }
    out
}
