//! `zeropp quant-error` as a user runs it: on a generated checkpoint, on
//! a truncated one, and on one with a NaN weight.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn zeropp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeropp"))
        .args(args)
        .output()
        .expect("the zeropp binary runs")
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zeropp-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn example(dir: &Path) -> PathBuf {
    let path = dir.join("example.safetensors");
    let out = zeropp(&[
        "example-weights",
        path.to_str().unwrap(),
        "--layers",
        "2",
        "--dim",
        "64",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

fn report(path: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["quant-error", path.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = zeropp(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

#[test]
fn reports_every_tensor_and_more_bits_mean_less_error() {
    let dir = temp_dir("qe");
    let path = example(&dir);
    let r8 = report(&path, &["--bits", "8", "--block", "256"]);
    let r4 = report(&path, &["--bits", "4", "--block", "256"]);
    let tensors = r8["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 1 + 2 * 5, "embedding + 5 tensors per block");
    for t in tensors {
        for key in [
            "name",
            "elements",
            "rmse",
            "max_abs_error",
            "rel_l2_error",
            "snr_db",
            "bytes_in",
            "bytes_out",
        ] {
            assert!(t.get(key).is_some(), "missing {key} in {t}");
        }
    }
    let snr = |r: &serde_json::Value| r["total"]["snr_db"].as_f64().unwrap();
    assert!(
        snr(&r8) > snr(&r4) + 15.0,
        "int8 {} dB vs int4 {} dB",
        snr(&r8),
        snr(&r4)
    );
    // Bytes: int4 with 256-value blocks is 4.5 bits per value.
    let elements = r4["total"]["elements"].as_u64().unwrap() as f64;
    let out4 = r4["total"]["bytes_out"].as_u64().unwrap() as f64;
    assert!(
        (out4 / elements - 0.5 - 4.0 / 256.0).abs() < 0.01,
        "{out4} bytes for {elements}"
    );
    // Asymmetric blocks fit the near-constant layer-norm gains far better.
    let sym = report(&path, &["--bits", "4"]);
    let asym = report(&path, &["--bits", "4", "--asymmetric"]);
    let norm_err = |r: &serde_json::Value| {
        r["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "blocks.0.norm.weight")
            .unwrap()["rmse"]
            .as_f64()
            .unwrap()
    };
    assert!(norm_err(&asym) < norm_err(&sym) / 5.0);
    // The table view names every tensor too.
    let out = zeropp(&["quant-error", path.to_str().unwrap(), "--bits", "4"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("blocks.1.mlp.up.weight") && text.contains("TOTAL"),
        "{text}"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_truncated_file_is_a_clear_error() {
    let dir = temp_dir("trunc");
    let path = example(&dir);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [3, 100, bytes.len() / 2, bytes.len() - 1] {
        let bad = dir.join("bad.safetensors");
        std::fs::write(&bad, &bytes[..cut]).unwrap();
        let out = zeropp(&["quant-error", bad.to_str().unwrap()]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("not a valid safetensors file"),
            "cut {cut}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = zeropp(&[
        "quant-error",
        dir.join("missing.safetensors").to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot open"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_nan_weight_is_named_and_bad_flags_are_refused() {
    let dir = temp_dir("nan");
    let path = dir.join("nan.safetensors");
    let mut values = vec![0.5f32; 1000];
    values[777] = f32::NAN;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1000], &bytes).unwrap();
    safetensors::serialize_to_file(vec![("layer.weight", view)], None, &path).unwrap();
    let out = zeropp(&["quant-error", path.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nan.safetensors: tensor 'layer.weight'") && err.contains("element 777"),
        "{err}"
    );

    let good = example(&dir);
    for (flag, value) in [("--bits", "3"), ("--block", "100")] {
        let out = zeropp(&["quant-error", good.to_str().unwrap(), flag, value]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("bits") || err.contains("block size"), "{err}");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_checkpoint_directory_is_measured_shard_by_shard() {
    // transformers saves a large model as model-0000k-of-0000n.safetensors
    // shards beside its config: the directory is measured whole.
    let dir = temp_dir("qe-dir");
    let one = example(&dir);
    let shards = dir.join("checkpoint");
    std::fs::create_dir_all(&shards).unwrap();
    for k in 1..=2 {
        let name = format!("model-0000{k}-of-00002.safetensors");
        std::fs::copy(&one, shards.join(name)).unwrap();
    }
    std::fs::write(shards.join("config.json"), "{}").unwrap();
    let single = report(&one, &[]);
    let whole = report(&shards, &[]);
    let count = |r: &serde_json::Value| r["tensors"].as_array().unwrap().len();
    assert_eq!(count(&whole), 2 * count(&single));
    let bytes = |r: &serde_json::Value| r["total"]["bytes_in"].as_u64().unwrap();
    assert_eq!(bytes(&whole), 2 * bytes(&single));
    // A directory with none says what to pass.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = zeropp(&["quant-error", empty.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no .safetensors file"),
        "{err}"
    );
    // A zeropp checkpoint's step directory points to its export.
    std::fs::write(empty.join("manifest.json"), "{}").unwrap();
    let out = zeropp(&["quant-error", empty.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("zeropp ckpt export"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
