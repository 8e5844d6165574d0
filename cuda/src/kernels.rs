//! The kernel sources and the names of the kernels each family defines.

use zeropp_quant::{Bits, QuantFormat, Rounding, Scheme};

/// The header every family includes.
pub const COMMON_HEADER: &str = include_str!("../kernels/common.cuh");

/// One `.cu` file: its name, source and kernels.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    pub name: &'static str,
    pub file: &'static str,
    pub source: &'static str,
}

/// Every kernel family, compiled as one NVRTC program each.
pub const FAMILIES: [Family; 3] = [
    Family {
        name: "quantize",
        file: "quantize.cu",
        source: include_str!("../kernels/quantize.cu"),
    },
    Family {
        name: "dequantize",
        file: "dequantize.cu",
        source: include_str!("../kernels/dequantize.cu"),
    },
    Family {
        name: "qgz",
        file: "qgz.cu",
        source: include_str!("../kernels/qgz.cu"),
    },
];

/// Threads per CUDA block (`zq::THREADS` in common.cuh).
pub const THREADS: u32 = 256;

/// Every element type the kernels read or write, as kernel names spell it.
pub const ELEMENTS: [&str; 3] = ["f32", "bf16", "f16"];

/// `sym8`, `asym4`, ...: the format part of a kernel name.
pub fn format_tag(bits: Bits, scheme: Scheme) -> String {
    let s = match scheme {
        Scheme::Symmetric => "sym",
        Scheme::Asymmetric => "asym",
    };
    format!("{s}{}", bits.count())
}

fn all_format_tags() -> Vec<String> {
    let mut tags = Vec::new();
    for scheme in [Scheme::Symmetric, Scheme::Asymmetric] {
        for bits in [Bits::Eight, Bits::Four, Bits::Two] {
            tags.push(format_tag(bits, scheme));
        }
    }
    tags
}

/// The kernels a family defines (the launchers call exactly these).
pub fn kernel_names(family: &str) -> Vec<String> {
    let mut names = Vec::new();
    let tags = all_format_tags();
    match family {
        "quantize" => {
            for e in ELEMENTS {
                for r in ["rn", "sr"] {
                    for t in &tags {
                        names.push(format!("zq_quantize_{e}_{t}_{r}"));
                    }
                }
            }
        }
        "dequantize" => {
            for e in ELEMENTS {
                for t in &tags {
                    names.push(format!("zq_dequantize_{t}_{e}"));
                }
            }
            for t in &tags {
                names.push(format!("zq_dequantize_acc_{t}"));
            }
            names.push("zq_div_f32".into());
            names.push("zq_axpby_f32".into());
            for e in ELEMENTS {
                names.push(format!("zq_to_f32_{e}"));
                names.push(format!("zq_from_f32_{e}"));
            }
            names.push("zq_hadamard_stage_f32".into());
        }
        "qgz" => {
            for r in ["rn", "sr"] {
                for t in &tags {
                    names.push(format!("zq_sum_requantize_{t}_{r}"));
                }
            }
        }
        _ => {}
    }
    names
}

fn rounding_tag(rounding: Rounding) -> (&'static str, u64) {
    match rounding {
        Rounding::NearestEven => ("rn", 0),
        Rounding::Stochastic { seed } => ("sr", seed),
    }
}

/// The quantize kernel for an element type (`f32`, `bf16`, `f16`), a format
/// and a rounding, and the seed to pass it.
pub fn quantize_kernel(element: &str, format: &QuantFormat, rounding: Rounding) -> (String, u64) {
    let (r, seed) = rounding_tag(rounding);
    let t = format_tag(format.bits, format.scheme);
    (format!("zq_quantize_{element}_{t}_{r}"), seed)
}

/// The dequantize kernel writing `element`, or accumulating into f32 when
/// `element` is `None`.
pub fn dequantize_kernel(format: &QuantFormat, element: Option<&str>) -> String {
    let t = format_tag(format.bits, format.scheme);
    match element {
        Some(e) => format!("zq_dequantize_{t}_{e}"),
        None => format!("zq_dequantize_acc_{t}"),
    }
}

/// The fused sum-requantize kernel for an output format and rounding, and
/// the seed to pass it.
pub fn sum_requantize_kernel(format: &QuantFormat, rounding: Rounding) -> (String, u64) {
    let (r, seed) = rounding_tag(rounding);
    let t = format_tag(format.bits, format.scheme);
    (format!("zq_sum_requantize_{t}_{r}"), seed)
}

/// Most CUDA blocks a grid-stride (dequantize) launch uses.
pub const MAX_STRIDE_GRID: u64 = 1 << 16;

/// CUDA blocks of a grid-stride launch over `n` items.
pub fn stride_grid(n: u64) -> u64 {
    n.div_ceil(u64::from(THREADS)).min(MAX_STRIDE_GRID)
}

/// The launches of a Walsh–Hadamard rotation of blocks of `block` values
/// (`zq_hadamard_stage_f32`), in order: each stage's distance and the
/// factor it multiplies by (1/√block at the last stage, 1 before), so the
/// result is `zeropp_quant::hadamard::rotate_blocks`' bit for bit.
pub fn hadamard_stages(block: usize) -> Vec<(u64, f32)> {
    let scale = 1.0 / (block as f32).sqrt();
    let mut stages = Vec::new();
    let mut h = 1;
    while h < block {
        stages.push((h as u64, if 2 * h == block { scale } else { 1.0 }));
        h *= 2;
    }
    stages
}

/// CUDA blocks for dequantizing `len` values: one thread per code byte,
/// grid-stride beyond [`MAX_STRIDE_GRID`] blocks.
pub fn dequantize_grid(format: &QuantFormat, len: usize) -> u64 {
    (format.code_bytes(len) as u64)
        .div_ceil(u64::from(THREADS))
        .min(MAX_STRIDE_GRID)
}

/// `KEY_SPAN` and `KEY_OVERFLOW` of common.cuh.
const KEY_SPAN: u64 = 131_072;
const KEY_OVERFLOW: u64 = 65_536;

/// What a quantizing kernel reported in error slot 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// A non-finite value at `offset` of quantization block `block` (counted
    /// over all chunks of the launch).
    NonFinite { block: u64, offset: u64 },
    /// An asymmetric block whose range overflows f32.
    RangeOverflow { block: u64 },
}

/// Decodes error slot 0 of a quantizing kernel (`None`: no error).
pub fn decode_fault(key: u64) -> Option<Fault> {
    if key == u64::MAX {
        return None;
    }
    let (block, what) = (key / KEY_SPAN, key % KEY_SPAN);
    Some(if what == KEY_OVERFLOW {
        Fault::RangeOverflow { block }
    } else {
        Fault::NonFinite {
            block,
            offset: what,
        }
    })
}

/// Decodes error slot 1 of the fused kernel: (input, block) with corrupt
/// parameters. The dequantize kernels store the bare block.
pub fn decode_corrupt_input(key: u64) -> Option<(usize, usize)> {
    (key != u64::MAX).then_some(((key >> 40) as usize, (key & ((1 << 40) - 1)) as usize))
}

/// The largest grid (x dimension) CUDA launches: 2^31 − 1 blocks.
pub const MAX_GRID: u64 = i32::MAX as u64;

/// A launch's grid of `blocks` CUDA blocks (of [`THREADS`] threads, within
/// CUDA's 1024 a block), checked against CUDA's limits: the device's
/// launcher and the emulator both launch through it.
pub fn launch_grid(blocks: u64, name: &str) -> Result<u32, crate::CudaError> {
    const _: () = assert!(THREADS <= 1024);
    if blocks == 0 || blocks > MAX_GRID {
        return Err(crate::CudaError::Invalid(format!(
            "{name}: {blocks} CUDA blocks is outside the grid limit (1 to {MAX_GRID}); split \
             the tensor"
        )));
    }
    Ok(blocks as u32)
}

/// Threads that share one quantization block in the quantizing kernels: one
/// per code byte, at most [`THREADS`] (`team_size` in common.cuh).
pub fn team_size(format: &QuantFormat) -> u32 {
    let groups = (format.block / format.bits.codes_per_byte()) as u32;
    groups.min(THREADS)
}

/// CUDA blocks for a quantizing launch over `blocks` quantization blocks.
pub fn quantize_grid(format: &QuantFormat, blocks: u64) -> u64 {
    blocks.div_ceil(u64::from(THREADS / team_size(format)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_kernel_is_defined_in_its_source() {
        for f in FAMILIES {
            let names = kernel_names(f.name);
            assert!(!names.is_empty(), "{}", f.name);
            for n in names {
                // The sources build names with macros: check the pieces.
                let (stem, _) = n.rsplit_once('_').unwrap();
                let head = stem.split('_').take(2).collect::<Vec<_>>().join("_");
                assert!(f.source.contains(&head), "{n} in {}", f.file);
            }
        }
        assert_eq!(kernel_names("quantize").len(), 36);
        assert_eq!(kernel_names("dequantize").len(), 33);
        assert_eq!(kernel_names("qgz").len(), 12);
    }

    #[test]
    fn teams_cover_every_block_size() {
        for bits in [Bits::Eight, Bits::Four, Bits::Two] {
            let mut block = 32;
            while block <= 65536 {
                let f = QuantFormat::new(bits, Scheme::Symmetric, block).unwrap();
                let team = team_size(&f);
                assert!(
                    team.is_power_of_two() && (8..=THREADS).contains(&team),
                    "{f}"
                );
                assert_eq!(THREADS % team, 0);
                // No thread of a team is without a code byte of a full block.
                assert!(team as usize <= f.code_bytes(block), "{f}");
                block *= 2;
            }
        }
        let f = QuantFormat::int4(32).unwrap();
        assert_eq!(team_size(&f), 16);
        assert_eq!(quantize_grid(&f, 17), 2);
        assert_eq!(quantize_grid(&f, 16), 1);
        let big = QuantFormat::int8(65536).unwrap();
        assert_eq!(team_size(&big), 256);
        assert_eq!(quantize_grid(&big, 3), 3);
    }
}
