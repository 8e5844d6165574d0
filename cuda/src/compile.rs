//! NVRTC compilation of a kernel family to CUBIN for one architecture, the
//! resource report ptxas gives for each kernel, and an on-disk cache keyed by
//! a hash of everything that goes into the build.

use std::ffi::{CStr, CString, c_char};
use std::path::PathBuf;

use cudarc::nvrtc::sys;

use crate::CudaError;
use crate::kernels::{COMMON_HEADER, Family};
use crate::toolkit::Toolkit;

/// A GPU architecture, `sm_XY` as the number XY (80 = A100, 90 = H100/H200).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Arch(pub u32);

impl Arch {
    /// From a device's compute capability.
    pub fn from_capability(major: i32, minor: i32) -> Arch {
        Arch((major * 10 + minor) as u32)
    }

    /// Parses `sm_90`, `90` or `9.0`.
    pub fn parse(s: &str) -> Result<Arch, CudaError> {
        let t = s
            .trim()
            .trim_start_matches("sm_")
            .trim_start_matches("compute_");
        let n = if let Some((a, b)) = t.split_once('.') {
            a.parse::<u32>()
                .ok()
                .zip(b.parse::<u32>().ok())
                .map(|(a, b)| a * 10 + b)
        } else {
            t.parse::<u32>().ok()
        };
        match n {
            Some(n) if (50..=200).contains(&n) => Ok(Arch(n)),
            _ => Err(CudaError::Invalid(format!(
                "'{s}' is not a GPU architecture; write it as sm_80, sm_90, ..."
            ))),
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}", self.0)
    }
}

/// What ptxas reports for one kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub shared_bytes: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// A compiled family.
#[derive(Clone, Debug)]
pub struct CompiledFamily {
    pub family: &'static str,
    pub arch: Arch,
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas' resource lines included).
    pub log: String,
    /// Lines of the log that are warnings.
    pub warnings: Vec<String>,
    pub resources: Vec<KernelResources>,
    /// True when the CUBIN came from the disk cache (no log then).
    pub cached: bool,
}

/// The options every build uses. `--fmad=false` keeps every multiply and add
/// rounded on its own, as the CPU library computes.
fn options(toolkit: &Toolkit, arch: Arch, verbose: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={}", toolkit.include.display()),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--device-as-default-execution-space".into(),
    ];
    if verbose {
        o.push("--ptxas-options=-v".into());
    }
    o
}

/// Compiles one family for `arch` with ptxas' verbose resource report.
/// Warnings are returned, not fatal (`zeropp cuda compile-check` makes them so).
pub fn compile_family(
    toolkit: &Toolkit,
    family: &Family,
    arch: Arch,
) -> Result<CompiledFamily, CudaError> {
    let opts = options(toolkit, arch, true);
    let (cubin, log) = nvrtc_compile(family, &opts, arch)?;
    let warnings = log
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("warning"))
        .map(str::to_string)
        .collect();
    Ok(CompiledFamily {
        family: family.name,
        arch,
        cubin,
        resources: parse_ptxas_log(&log),
        warnings,
        log,
        cached: false,
    })
}

/// The CUBIN of a family for `arch`, from the cache when the sources, the
/// options and the NVRTC version are unchanged, else compiled and cached.
pub fn cubin_cached(toolkit: &Toolkit, family: &Family, arch: Arch) -> Result<Vec<u8>, CudaError> {
    cubin_cached_in(cache_dir().as_deref(), toolkit, family, arch)
}

/// [`cubin_cached`] with the cache in `dir` (`None`: no cache).
pub fn cubin_cached_in(
    dir: Option<&std::path::Path>,
    toolkit: &Toolkit,
    family: &Family,
    arch: Arch,
) -> Result<Vec<u8>, CudaError> {
    let (major, minor) = toolkit.nvrtc_version()?;
    let opts = options(toolkit, arch, false);
    let mut h = Fnv::new();
    for part in [COMMON_HEADER, family.source] {
        h.write(part.as_bytes());
    }
    for o in &opts {
        // The include path names where headers are, not what is compiled.
        if !o.starts_with("--include-path") {
            h.write(o.as_bytes());
        }
    }
    h.write(format!("nvrtc {major}.{minor}").as_bytes());
    let file = dir.map(|d| d.join(format!("{}-{arch}-{:016x}.cubin", family.name, h.0)));
    if let Some(f) = &file
        && let Ok(bytes) = std::fs::read(f)
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    let (cubin, _log) = nvrtc_compile(family, &opts, arch)?;
    if let Some(f) = &file {
        // A cache that cannot be written only costs a compile next time.
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        let _ = std::fs::create_dir_all(f.parent().unwrap_or(f))
            .and_then(|_| std::fs::write(&tmp, &cubin))
            .and_then(|_| std::fs::rename(&tmp, f));
    }
    Ok(cubin)
}

/// `$ZEROPP_CACHE_DIR`, else `$XDG_CACHE_HOME/zeropp/cuda`, else `~/.cache/zeropp/cuda`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("ZEROPP_CACHE_DIR") {
        return Some(PathBuf::from(d).join("cuda"));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("zeropp").join("cuda"))
}

struct Fnv(u64);
impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator, so ("ab","c") and ("a","bc") differ.
        self.0 = (self.0 ^ 0xff).wrapping_mul(0x0000_0100_0000_01b3);
    }
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<(), CudaError> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Nvrtc {
            what: what.into(),
            status: format!("{r:?}"),
        })
    }
}

/// Runs NVRTC: source + the common header → CUBIN and log.
fn nvrtc_compile(
    family: &Family,
    opts: &[String],
    arch: Arch,
) -> Result<(Vec<u8>, String), CudaError> {
    let src = CString::new(family.source).expect("kernel sources hold no NUL");
    let name = CString::new(family.file).expect("no NUL");
    let header = CString::new(COMMON_HEADER).expect("no NUL");
    let header_name = c"common.cuh";
    let headers = [header.as_ptr()];
    let header_names = [header_name.as_ptr()];
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is to a live NUL-terminated string that outlives
    // the program, which is destroyed below on every path.
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                1,
                headers.as_ptr(),
                header_names.as_ptr(),
            ),
            "program creation",
        )?;
    }
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("no NUL"))
        .collect();
    let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `prog` is live; the option strings outlive the call.
    let result = unsafe { sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
    let log = program_log(prog);
    let out = if result != sys::nvrtcResult::NVRTC_SUCCESS {
        Err(CudaError::Compile {
            file: family.file,
            arch: arch.to_string(),
            log: if log.trim().is_empty() {
                format!("{result:?}")
            } else {
                log.clone()
            },
        })
    } else {
        cubin(prog).map(|c| (c, log))
    };
    // SAFETY: destroyed once.
    unsafe {
        sys::nvrtcDestroyProgram(&mut prog);
    }
    out
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `prog` is live; the buffer has the size NVRTC asked for.
    unsafe {
        if sys::nvrtcGetProgramLogSize(prog, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        let mut buf = vec![0 as c_char; size.max(1)];
        if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr()) != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
    }
}

fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, CudaError> {
    let mut size = 0usize;
    // SAFETY: as in `program_log`.
    unsafe {
        check(sys::nvrtcGetCUBINSize(prog, &mut size), "CUBIN size")?;
        let mut buf = vec![0u8; size];
        check(sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()), "CUBIN")?;
        Ok(buf)
    }
}

/// Reads ptxas' `-v` report: per entry function its registers, shared
/// memory, stack frame and spills.
pub fn parse_ptxas_log(log: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let idx = line.find(unit)?;
        line[..idx].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelResources {
                name,
                ..Default::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            cur.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains("registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
            cur.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'zq_a' for 'sm_90'\n\
ptxas info    : Function properties for zq_a\n\
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 32 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'zq_b' for 'sm_90'\n\
ptxas info    : Function properties for zq_b\n\
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 13 registers, used 0 barriers\n";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                name: "zq_a".into(),
                registers: 40,
                shared_bytes: 32,
                stack_bytes: 8,
                spill_stores: 4,
                spill_loads: 12
            }
        );
        assert_eq!(
            (r[1].registers, r[1].shared_bytes, r[1].spill_loads),
            (13, 0, 0)
        );
    }

    #[test]
    fn architectures_parse_in_every_spelling() {
        assert_eq!(Arch::parse("sm_90").unwrap(), Arch(90));
        assert_eq!(Arch::parse("80").unwrap(), Arch(80));
        assert_eq!(Arch::parse("8.6").unwrap(), Arch(86));
        assert_eq!(Arch::from_capability(9, 0).to_string(), "sm_90");
        assert!(Arch::parse("gfx90a").is_err());
    }
}
