//! Byte edits for fuzzing the decoders of bytes that come from outside
//! (proptest): the wire's frames here, checkpoints in the application.
//! `PROPTEST_CASES=N` runs longer (docs/RELIABILITY.md).

use proptest::prelude::*;

/// Proptest's settings with `default` cases, or `PROPTEST_CASES`.
pub fn cases(default: u32) -> ProptestConfig {
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
pub enum Edit {
    Xor(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Append(Vec<u8>),
    /// Overwrite 8 bytes with a little-endian u64 (lengths, counts).
    Word(usize, u64),
}

/// Any one [`Edit`].
pub fn edit() -> impl Strategy<Value = Edit> {
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

/// `edits` applied to `bytes` in turn (positions taken modulo its length).
pub fn apply(bytes: &mut Vec<u8>, edits: &[Edit]) {
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
