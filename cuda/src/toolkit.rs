//! Finding NVRTC and the CUDA headers on a machine that may have no CUDA
//! installation: `ZEROPP_NVRTC` / `ZEROPP_CUDA_INCLUDE`, then `CUDA_HOME`,
//! `CUDA_PATH` and `/usr/local/cuda`, then the system library path, then the
//! `nvidia` wheels of the `python3` on PATH (`nvidia-cuda-nvrtc`,
//! `nvidia-cuda-runtime`, CUDA 13 or 12 layout).
//!
//! cudarc opens NVRTC by its bare library name; a library found by path is
//! opened first with `RTLD_GLOBAL`, and the dynamic loader then hands cudarc
//! the same object by its soname.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::CudaError;

/// NVRTC library names, newest first (the bindings are CUDA 13's; NVRTC 12
/// has the same entry points).
const NVRTC_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Where NVRTC and the headers were found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Toolkit {
    /// The NVRTC library file, or `None` when the system loader finds it by name.
    pub nvrtc: Option<PathBuf>,
    /// A directory holding `cuda_fp16.h` and `cuda_bf16.h`.
    pub include: PathBuf,
    /// How they were found, for messages (`CUDA_HOME`, `python3 wheels`, ...).
    pub origin: String,
}

impl Toolkit {
    /// Finds NVRTC and the headers and makes NVRTC loadable by cudarc.
    pub fn find() -> Result<Toolkit, CudaError> {
        static FOUND: OnceLock<Result<Toolkit, std::sync::Arc<CudaError>>> = OnceLock::new();
        let found = FOUND.get_or_init(|| {
            let roots = search_roots();
            let tk = locate(&roots, system_has_nvrtc)?;
            if let Some(path) = &tk.nvrtc {
                preload(path)?;
            }
            Ok(tk)
        });
        match found {
            Ok(tk) => Ok(tk.clone()),
            // The search is done once; every caller gets its error.
            Err(e) => Err(CudaError::Toolkit(e.clone())),
        }
    }

    /// NVRTC's version (major, minor).
    pub fn nvrtc_version(&self) -> Result<(i32, i32), CudaError> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: `find` made the library loadable; plain out-parameters.
        let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        if r != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(CudaError::Nvrtc {
                what: "nvrtcVersion".into(),
                status: format!("{r:?}"),
            });
        }
        Ok((major, minor))
    }
}

/// Candidate installation roots, in search order, each with the name shown
/// in messages. Each root is probed for `lib64/`, `lib/` and `include/`.
#[derive(Clone, Debug)]
pub(crate) struct Roots {
    pub explicit_lib: Option<PathBuf>,
    pub explicit_include: Option<PathBuf>,
    pub dirs: Vec<(String, PathBuf)>,
}

fn search_roots() -> Roots {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            dirs.push((var.to_string(), PathBuf::from(v)));
        }
    }
    dirs.push(("/usr/local/cuda".into(), PathBuf::from("/usr/local/cuda")));
    for d in python_nvidia_dirs() {
        // CUDA 13 wheels put everything under nvidia/cu13; CUDA 12 wheels
        // have one directory per package.
        dirs.push(("python3 wheels".into(), d.join("cu13")));
        dirs.push(("python3 wheels".into(), d.join("cuda_nvrtc")));
        dirs.push(("python3 wheels".into(), d.join("cuda_runtime")));
    }
    Roots {
        explicit_lib: std::env::var_os("ZEROPP_NVRTC").map(PathBuf::from),
        explicit_include: std::env::var_os("ZEROPP_CUDA_INCLUDE").map(PathBuf::from),
        dirs,
    }
}

/// The directories of the `nvidia` namespace package of `python3`, if any.
pub(crate) fn python_nvidia_dirs() -> Vec<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import nvidia\nfor p in nvidia.__path__: print(p)"])
        .stderr(std::process::Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| PathBuf::from(l.trim()))
            .collect(),
        _ => Vec::new(),
    }
}

fn system_has_nvrtc() -> bool {
    // SAFETY: loading NVRTC runs no initialisers with preconditions.
    NVRTC_NAMES
        .iter()
        .any(|n| unsafe { libloading::Library::new(*n) }.is_ok())
}

/// The search itself, over given roots (tests pass fake trees).
pub(crate) fn locate(roots: &Roots, system_nvrtc: impl Fn() -> bool) -> Result<Toolkit, CudaError> {
    let mut searched_lib = Vec::new();
    let mut lib: Option<(Option<PathBuf>, String)> = None;
    if let Some(p) = &roots.explicit_lib {
        searched_lib.push(format!("ZEROPP_NVRTC={}", p.display()));
        if p.is_file() {
            lib = Some((Some(p.clone()), "ZEROPP_NVRTC".into()));
        }
    }
    if lib.is_none() {
        'roots: for (origin, root) in &roots.dirs {
            for sub in ["lib64", "lib"] {
                let dir = root.join(sub);
                searched_lib.push(dir.display().to_string());
                for name in NVRTC_NAMES {
                    let f = dir.join(name);
                    if f.is_file() {
                        lib = Some((Some(f), origin.clone()));
                        break 'roots;
                    }
                }
            }
        }
    }
    if lib.is_none() {
        searched_lib.push("the system library path".into());
        if system_nvrtc() {
            lib = Some((None, "system library path".into()));
        }
    }
    let Some((nvrtc, lib_origin)) = lib else {
        return Err(CudaError::NoNvrtc {
            searched: searched_lib.join(", "),
        });
    };

    let mut searched_inc = Vec::new();
    let mut include = None;
    let candidates = roots
        .explicit_include
        .iter()
        .cloned()
        .chain(roots.dirs.iter().map(|(_, r)| r.join("include")))
        .chain([PathBuf::from("/usr/include")]);
    for dir in candidates {
        searched_inc.push(dir.display().to_string());
        if has_headers(&dir) {
            include = Some(dir);
            break;
        }
    }
    let Some(include) = include else {
        return Err(CudaError::NoHeaders {
            searched: searched_inc.join(", "),
        });
    };
    Ok(Toolkit {
        nvrtc,
        include,
        origin: lib_origin,
    })
}

fn has_headers(dir: &Path) -> bool {
    dir.join("cuda_fp16.h").is_file() && dir.join("cuda_bf16.h").is_file()
}

/// Opens NVRTC by path, globally and for good, so that cudarc's later
/// open by soname finds it.
fn preload(path: &Path) -> Result<(), CudaError> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: as in `system_has_nvrtc`.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| {
        CudaError::NvrtcLoad {
            path: path.display().to_string(),
            reason: e.to_string(),
        }
    })?;
    std::mem::forget(lib);
    // SAFETY: probing only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NvrtcLoad {
            path: path.display().to_string(),
            reason: "loaded by path, but not found again by its soname; set LD_LIBRARY_PATH to \
                     its directory"
                .into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[&str]) -> PathBuf {
        let base = std::env::temp_dir().join(format!(
            "zeropp-cuda-tk-{}-{}",
            std::process::id(),
            files.join("+").replace('/', "_")
        ));
        let _ = std::fs::remove_dir_all(&base);
        for f in files {
            let p = base.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, b"").unwrap();
        }
        base
    }

    #[test]
    fn finds_a_cuda_home_layout_before_the_wheels() {
        let home = tree(&[
            "lib64/libnvrtc.so.13",
            "include/cuda_fp16.h",
            "include/cuda_bf16.h",
        ]);
        let wheel = tree(&["cu13/lib/libnvrtc.so.13"]);
        let roots = Roots {
            explicit_lib: None,
            explicit_include: None,
            dirs: vec![
                ("CUDA_HOME".into(), home.clone()),
                ("python3 wheels".into(), wheel.join("cu13")),
            ],
        };
        let tk = locate(&roots, || false).unwrap();
        assert_eq!(tk.nvrtc, Some(home.join("lib64/libnvrtc.so.13")));
        assert_eq!(tk.include, home.join("include"));
        assert_eq!(tk.origin, "CUDA_HOME");
    }

    #[test]
    fn finds_the_cuda_13_wheel_layout() {
        let wheel = tree(&[
            "nvidia/cu13/lib/libnvrtc.so.13",
            "nvidia/cu13/include/cuda_fp16.h",
            "nvidia/cu13/include/cuda_bf16.h",
        ]);
        let roots = Roots {
            explicit_lib: None,
            explicit_include: None,
            dirs: vec![("python3 wheels".into(), wheel.join("nvidia/cu13"))],
        };
        let tk = locate(&roots, || false).unwrap();
        assert_eq!(tk.nvrtc, Some(wheel.join("nvidia/cu13/lib/libnvrtc.so.13")));
        assert_eq!(tk.origin, "python3 wheels");
    }

    #[test]
    fn nothing_found_says_what_to_install() {
        let empty = tree(&["README"]);
        let roots = Roots {
            explicit_lib: None,
            explicit_include: None,
            dirs: vec![("CUDA_HOME".into(), empty.clone())],
        };
        let msg = locate(&roots, || false).unwrap_err().to_string();
        assert!(msg.contains("nvidia-cuda-nvrtc==13"), "{msg}");
        assert!(
            msg.contains(&empty.join("lib64").display().to_string()),
            "{msg}"
        );
        // A library without headers names the header package.
        let lib_only = tree(&["lib/libnvrtc.so.12"]);
        let roots = Roots {
            explicit_lib: None,
            explicit_include: Some(lib_only.join("nowhere")),
            dirs: vec![("CUDA_HOME".into(), lib_only)],
        };
        let msg = locate(&roots, || false).unwrap_err().to_string();
        assert!(
            msg.contains("cuda_fp16.h") && msg.contains("nvidia-cuda-runtime"),
            "{msg}"
        );
    }

    #[test]
    fn the_system_loader_is_a_fallback() {
        let inc = tree(&["include/cuda_fp16.h", "include/cuda_bf16.h"]);
        let roots = Roots {
            explicit_lib: None,
            explicit_include: Some(inc.join("include")),
            dirs: vec![],
        };
        let tk = locate(&roots, || true).unwrap();
        assert_eq!(tk.nvrtc, None);
        assert_eq!(tk.origin, "system library path");
    }
}
