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

#[test]
fn compiled_kernels_are_cached_by_source_hash_and_architecture() {
    use zeropp_cuda::compile::cubin_cached_in;
    let toolkit = Toolkit::find().unwrap();
    let dir = std::env::temp_dir().join(format!("zeropp-cuda-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let family = &FAMILIES[1];
    let first = cubin_cached_in(Some(&dir), &toolkit, family, Arch(90)).unwrap();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("dequantize-sm_90-") && name.ends_with(".cubin"),
        "{name}"
    );
    assert_eq!(std::fs::read(&files[0]).unwrap(), first);
    // The second call reads the cache (a planted file comes back as is).
    std::fs::write(&files[0], b"cached").unwrap();
    let again = cubin_cached_in(Some(&dir), &toolkit, family, Arch(90)).unwrap();
    assert_eq!(again, b"cached");
    // Another architecture is another entry; no cache means a fresh build.
    cubin_cached_in(Some(&dir), &toolkit, family, Arch(80)).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    let fresh = cubin_cached_in(None, &toolkit, family, Arch(90)).unwrap();
    assert_eq!(fresh, first);
    std::fs::remove_dir_all(&dir).ok();
}
