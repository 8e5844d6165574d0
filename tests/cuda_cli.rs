//! `zeropp cuda compile-check` as a user runs it: the kernels compile and are
//! reported per kernel; without NVRTC the error says what to install.

use std::process::Command;

fn zeropp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_zeropp"))
}

#[test]
fn compile_check_reports_every_kernel() {
    let out = zeropp()
        .args(["cuda", "compile-check", "--arch", "sm_90", "--json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let kernels = doc["kernels"].as_array().unwrap();
    assert_eq!(kernels.len(), 81, "{doc}");
    assert!(doc["problems"].as_array().unwrap().is_empty(), "{doc}");
    for k in kernels {
        assert_eq!(k["arch"], "sm_90");
        assert!(k["registers"].as_u64().unwrap() > 0, "{k}");
    }
    assert!(
        kernels
            .iter()
            .any(|k| k["kernel"] == "zq_sum_requantize_sym4_rn")
    );
    assert!(
        kernels
            .iter()
            .any(|k| k["kernel"] == "zq_dequantize_acc_sym8")
    );
}

#[test]
fn without_nvrtc_the_error_says_what_to_install() {
    let empty = std::env::temp_dir().join(format!("zeropp-no-python-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = zeropp()
        .args(["cuda", "compile-check"])
        .env("PATH", &empty)
        .env_remove("CUDA_HOME")
        .env_remove("CUDA_PATH")
        .env_remove("ZEROPP_NVRTC")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("NVRTC") && stderr.contains("pip install") && stderr.contains("CUDA_HOME"),
        "{stderr}"
    );
    let out = zeropp()
        .args(["cuda", "bench", "--mib", "1"])
        .output()
        .unwrap();
    if !out.status.success() {
        // No GPU here: a clear error, not a panic.
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stderr.contains("error:"), "{stderr}");
    }
}
