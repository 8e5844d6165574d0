//! Every decoder of the application that reads bytes from outside, fed
//! arbitrary and mutated input (proptest): the checkpoint manifest and
//! shard readers, and the safetensors path of `quant-error` (the wire's
//! frame reader is fuzzed in `zeropp-comm`'s own tests, `wire.rs`). None may panic, and none may trust a length it has not
//! checked. `PROPTEST_CASES=N` runs longer (docs/RELIABILITY.md).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use proptest::prelude::*;
use zeropp::train::checkpoint;
use zeropp_comm::fuzzing::{apply, cases, edit};
use zeropp_quant::{QuantFormat, Rounding};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zeropp-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

// ---------------------------------------------------------- checkpoints

/// One real checkpoint (2 x 2 ranks, 2 steps of a tiny model), made once.
fn checkpoint_fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = scratch("ckpt");
        let out = Command::new(env!("CARGO_BIN_EXE_zeropp"))
            .args(["train", "--steps", "2", "--width", "32", "--layers", "1"])
            .args(["--heads", "2", "--context", "16", "--batch", "2"])
            .arg("--checkpoint-dir")
            .arg(&d)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        checkpoint::resolve(&d).unwrap()
    })
}

fn copy_checkpoint(to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(checkpoint_fixture()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Reads everything a resume or `ckpt inspect` would.
fn read_all(dir: &Path) -> anyhow::Result<()> {
    let m = checkpoint::read_manifest(dir)?;
    checkpoint::verify(dir, &m)?;
    checkpoint::full_weights(dir, &m)?;
    Ok(())
}

proptest! {
    #![proptest_config(cases(300))]

    #[test]
    fn mutated_manifests_are_read_or_refused(edits in proptest::collection::vec(edit(), 1..4)) {
        let d = scratch(&format!("manifest-{:?}", std::thread::current().id()).replace(['(', ')'], ""));
        copy_checkpoint(&d);
        let p = d.join("manifest.json");
        let mut bytes = std::fs::read(&p).unwrap();
        apply(&mut bytes, &edits);
        std::fs::write(&p, &bytes).unwrap();
        let _ = read_all(&d);
    }

    #[test]
    fn arbitrary_manifests_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let d = scratch(&format!("manifest-any-{:?}", std::thread::current().id()).replace(['(', ')'], ""));
        std::fs::write(d.join("manifest.json"), &bytes).unwrap();
        prop_assert!(checkpoint::read_manifest(&d).is_err());
    }

    /// Mutations inside the compressed stream, with the manifest's size and
    /// CRC updated to match, so the shard decoder itself sees the damage.
    #[test]
    fn mutated_shards_behind_valid_checksums_are_read_or_refused(
        rank in 0usize..4,
        edits in proptest::collection::vec(edit(), 1..4),
        inside in any::<bool>(),
    ) {
        let d = scratch(&format!("shard-{:?}", std::thread::current().id()).replace(['(', ')'], ""));
        copy_checkpoint(&d);
        let file = d.join(format!("rank-{rank:05}.zst"));
        let packed = std::fs::read(&file).unwrap();
        let damaged = if inside {
            let mut raw = zstd::decode_all(&packed[..]).unwrap();
            apply(&mut raw, &edits);
            zstd::encode_all(&raw[..], 1).unwrap()
        } else {
            let mut p = packed.clone();
            apply(&mut p, &edits);
            p
        };
        std::fs::write(&file, &damaged).unwrap();
        let mp = d.join("manifest.json");
        let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mp).unwrap()).unwrap();
        m["shards"][rank]["bytes"] = (damaged.len() as u64).into();
        m["shards"][rank]["crc32"] = crc32fast::hash(&damaged).into();
        std::fs::write(&mp, serde_json::to_vec(&m).unwrap()).unwrap();
        let result = read_all(&d);
        if damaged != packed && inside {
            // Content edits either were harmless float changes or are refused.
            if let Err(e) = &result {
                prop_assert!(e.to_string().contains("rank-"), "{e}");
            }
        }
    }
}

// --------------------------------------------------- quant-error input

fn weights_fixture() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let p = scratch("weights").join("w.safetensors");
        zeropp::cli::example_weights::write(&p, 1, 16, 7).unwrap();
        std::fs::read(&p).unwrap()
    })
}

proptest! {
    #![proptest_config(cases(500))]

    #[test]
    fn mutated_safetensors_are_measured_or_refused(edits in proptest::collection::vec(edit(), 1..4)) {
        let d = scratch(&format!("st-{:?}", std::thread::current().id()).replace(['(', ')'], ""));
        let p = d.join("w.safetensors");
        let mut bytes = weights_fixture().to_vec();
        apply(&mut bytes, &edits);
        std::fs::write(&p, &bytes).unwrap();
        let f = QuantFormat::int4(32).unwrap();
        let _ = zeropp::cli::quant_error::analyze(&p, f, Rounding::NearestEven);
    }
}
