//! `zeropp cuda ...`: compile-check the kernels (no GPU needed), and the GPU
//! benchmark.

use anyhow::{Result, bail};
use zeropp_cuda::kernels::kernel_names;
use zeropp_cuda::{Arch, FAMILIES, Gpu, Toolkit, compile_family};

/// Compiles every kernel family for each architecture and prints ptxas'
/// resources per kernel. Fails on any compile error or warning.
pub fn compile_check(archs: &[String], json: bool) -> Result<()> {
    let toolkit = Toolkit::find()?;
    let (major, minor) = toolkit.nvrtc_version()?;
    let archs: Vec<Arch> = archs
        .iter()
        .map(|a| Arch::parse(a))
        .collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    let mut problems = Vec::new();
    for &arch in &archs {
        for family in &FAMILIES {
            match compile_family(&toolkit, family, arch) {
                Ok(c) => {
                    for w in &c.warnings {
                        problems.push(format!("{} {arch}: {w}", family.file));
                    }
                    for name in kernel_names(family.name) {
                        if !c.resources.iter().any(|r| r.name == name) {
                            problems.push(format!("{} {arch}: kernel {name} missing", family.file));
                        }
                    }
                    for r in c.resources {
                        rows.push((arch, family.file, r));
                    }
                }
                Err(e) => problems.push(e.to_string()),
            }
        }
    }
    if json {
        let kernels: Vec<_> = rows
            .iter()
            .map(|(arch, file, r)| {
                serde_json::json!({
                    "arch": arch.to_string(), "file": file, "kernel": r.name,
                    "registers": r.registers, "shared_bytes": r.shared_bytes,
                    "stack_bytes": r.stack_bytes, "spill_stores": r.spill_stores,
                    "spill_loads": r.spill_loads,
                })
            })
            .collect();
        let doc = serde_json::json!({
            "nvrtc": format!("{major}.{minor}"),
            "nvrtc_from": toolkit.origin,
            "include": toolkit.include,
            "kernels": kernels,
            "problems": problems,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "NVRTC {major}.{minor} ({}, {}), headers {}",
            toolkit.origin,
            toolkit
                .nvrtc
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "by soname".into()),
            toolkit.include.display()
        );
        println!(
            "{:<7} {:<15} {:<34} {:>5} {:>6} {:>6} {:>13}",
            "arch", "file", "kernel", "regs", "smem", "stack", "spill st/ld"
        );
        for (arch, file, r) in &rows {
            println!(
                "{:<7} {:<15} {:<34} {:>5} {:>6} {:>6} {:>13}",
                arch.to_string(),
                file,
                r.name,
                r.registers,
                r.shared_bytes,
                r.stack_bytes,
                format!("{}/{}", r.spill_stores, r.spill_loads)
            );
        }
        let list: Vec<String> = archs.iter().map(|a| a.to_string()).collect();
        println!(
            "{} kernels compiled for {}; {} problem(s)",
            rows.len(),
            list.join(", "),
            problems.len()
        );
    }
    if !problems.is_empty() {
        bail!("compile check failed:\n{}", problems.join("\n"));
    }
    Ok(())
}

/// The GPU benchmark on device `ordinal`.
pub fn bench(ordinal: usize, mib: usize, reps: usize) -> Result<()> {
    let gpu = Gpu::open(ordinal)?;
    eprintln!(
        "benchmarking on {} ({}), {mib} MiB, {reps} runs each",
        gpu.name(),
        gpu.arch()
    );
    let rows = zeropp_cuda::bench::run(&gpu, mib, reps)?;
    print!("{}", zeropp_cuda::bench::render(&rows, mib, &gpu.name()));
    Ok(())
}
