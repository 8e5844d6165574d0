//! Every decoder that reads bytes from outside, fed arbitrary and mutated
//! input (proptest): the wire frame reader (also the rendezvous' framing),
//! the checkpoint manifest and shard readers, and the safetensors path of
//! `quant-error`. None may panic, and none may trust a length it has not
//! checked. `PROPTEST_CASES=N` runs longer (docs/RELIABILITY.md).

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use proptest::prelude::*;
use zeropp::comm::wire::{self, Header, Kind, ReadFrame};
use zeropp::train::checkpoint;
use zeropp_quant::{QuantFormat, Rounding};

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// A byte edit: flip, overwrite, truncate or extend.
#[derive(Clone, Debug)]
enum Edit {
    Xor(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Append(Vec<u8>),
    /// Overwrite 8 bytes with a little-endian u64 (lengths, counts).
    Word(usize, u64),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(i, b)| Edit::Xor(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Set(i, b)),
        any::<usize>().prop_map(Edit::Truncate),
        proptest::collection::vec(any::<u8>(), 1..64).prop_map(Edit::Append),
        (
            any::<usize>(),
            prop_oneof![Just(0u64), Just(u64::MAX), Just(1 << 40), any::<u64>()]
        )
            .prop_map(|(i, w)| Edit::Word(i, w)),
    ]
}

fn apply(bytes: &mut Vec<u8>, edits: &[Edit]) {
    for e in edits {
        let n = bytes.len().max(1);
        match e {
            Edit::Xor(i, b) => {
                if let Some(x) = bytes.get_mut(i % n) {
                    *x ^= b;
                }
            }
            Edit::Set(i, b) => {
                if let Some(x) = bytes.get_mut(i % n) {
                    *x = *b;
                }
            }
            Edit::Truncate(i) => bytes.truncate(i % n),
            Edit::Append(v) => bytes.extend_from_slice(v),
            Edit::Word(i, w) => {
                let at = i % n;
                if at + 8 <= bytes.len() {
                    bytes[at..at + 8].copy_from_slice(&w.to_le_bytes());
                }
            }
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("zeropp-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

// ---------------------------------------------------------------- wire

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn wire_frames_from_arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut r = Cursor::new(&bytes[..]);
        // Read frames until the end or the first error.
        for _ in 0..8 {
            match wire::read_frame(&mut r) {
                Ok(ReadFrame::Frame(h, p)) => prop_assert_eq!(p.len() as u64, h.len),
                Ok(ReadFrame::End) | Err(_) => break,
            }
        }
    }

    #[test]
    fn mutated_valid_frames_are_read_or_refused(
        tag in any::<u64>(),
        payload in proptest::collection::vec(any::<u8>(), 0..128),
        edits in proptest::collection::vec(edit(), 1..4),
    ) {
        let h = Header { kind: Kind::Data, source: 3, tag, len: payload.len() as u64 };
        let mut bytes = Vec::new();
        wire::write_frame(&mut bytes, &h, &payload).unwrap();
        apply(&mut bytes, &edits);
        match wire::read_frame(&mut Cursor::new(&bytes[..])) {
            Ok(ReadFrame::Frame(h, p)) => {
                // Anything accepted passed the header checksum and arrived whole.
                prop_assert_eq!(p.len() as u64, h.len);
                prop_assert!(h.len <= bytes.len() as u64);
            }
            Ok(ReadFrame::End) => prop_assert!(bytes.is_empty()),
            Err(_) => {}
        }
    }
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
