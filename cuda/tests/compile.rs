//! Every kernel compiles with NVRTC for sm_80 and sm_90, with no warning,
//! defines every kernel the launchers call, and keeps its registers in
//! check: the streaming dequantize kernels spill nothing; the quantizing ones
//! may keep a few words on the stack around IEEE division's slow path (a
//! call), never more than 64 bytes. Needs NVRTC and the CUDA headers: `scripts/test.sh` installs them
//! from PyPI (no GPU needed).

use zeropp_cuda::kernels::kernel_names;
use zeropp_cuda::{Arch, FAMILIES, Toolkit, compile_family};

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_warnings_or_spills() {
    let toolkit = Toolkit::find().unwrap_or_else(|e| {
        panic!("{e}\n(scripts/test.sh installs NVRTC and the headers from PyPI)")
    });
    for arch in [Arch(80), Arch(90)] {
        for family in &FAMILIES {
            let c = compile_family(&toolkit, family, arch)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", family.file));
            assert!(
                c.warnings.is_empty(),
                "{} {arch}: {:#?}",
                family.file,
                c.warnings
            );
            assert!(c.cubin.len() > 1000, "{} {arch}: empty CUBIN", family.file);
            let expected = kernel_names(family.name);
            for name in &expected {
                let r = c
                    .resources
                    .iter()
                    .find(|r| &r.name == name)
                    .unwrap_or_else(|| panic!("{name} missing from {} for {arch}", family.file));
                let limit = if family.name == "dequantize" { 0 } else { 64 };
                assert!(
                    r.spill_stores <= limit && r.spill_loads <= limit && r.stack_bytes <= limit,
                    "{name} {arch} spills {}/{} bytes, stack {} (limit {limit})",
                    r.spill_stores,
                    r.spill_loads,
                    r.stack_bytes
                );
                assert!(
                    r.registers > 0 && r.registers <= 128,
                    "{name} {arch}: {} registers",
                    r.registers
                );
            }
            assert_eq!(
                c.resources.len(),
                expected.len(),
                "{} {arch}: extra kernels",
                family.file
            );
        }
    }
}
