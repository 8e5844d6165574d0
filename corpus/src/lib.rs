//! zeropp's built-in corpus: the bytes `zeropp train` learns when no data
//! file is given, and that the PyTorch examples train on too (through
//! `zeropp._zeropp.builtin_corpus`), so both see the same text.

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

/// The built-in corpus: simple English sentences from a small grammar,
/// deterministic for a seed. Learnable structure (spelling, word order,
/// agreement) at every scale a small model can reach.
pub fn builtin_corpus(bytes: usize, seed: u64) -> Vec<u8> {
    const SUBJECTS: &[&str] = &[
        "the cat",
        "a dog",
        "the old man",
        "my sister",
        "the engineer",
        "a small bird",
        "the teacher",
        "our neighbour",
        "the captain",
        "a young girl",
        "the farmer",
        "his brother",
    ];
    const VERBS: &[&str] = &[
        "sees",
        "likes",
        "builds",
        "finds",
        "carries",
        "paints",
        "watches",
        "opens",
        "follows",
        "cleans",
        "remembers",
        "sells",
    ];
    const OBJECTS: &[&str] = &[
        "a red ball",
        "the wooden door",
        "an apple",
        "the long road",
        "a blue boat",
        "the heavy box",
        "a letter",
        "the garden wall",
        "a warm coat",
        "the river",
        "a new bicycle",
        "the map",
    ];
    const PLACES: &[&str] = &[
        "in the morning",
        "at the station",
        "near the river",
        "after dinner",
        "in the garden",
        "on the hill",
        "before the rain",
        "at night",
    ];
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(bytes + 128);
    while out.len() < bytes {
        let mut s = String::new();
        let subject = SUBJECTS[rng.random_range(0..SUBJECTS.len())];
        let verb = VERBS[rng.random_range(0..VERBS.len())];
        let object = OBJECTS[rng.random_range(0..OBJECTS.len())];
        match rng.random_range(0..4) {
            0 => s.push_str(&format!("{subject} {verb} {object}")),
            1 => s.push_str(&format!(
                "{subject} {verb} {object} {}",
                PLACES[rng.random_range(0..PLACES.len())]
            )),
            2 => s.push_str(&format!(
                "there are {} boats {}",
                rng.random_range(2..20),
                PLACES[rng.random_range(0..PLACES.len())]
            )),
            _ => s.push_str(&format!(
                "{subject} {verb} {object} and {}",
                OBJECTS[rng.random_range(0..OBJECTS.len())]
            )),
        }
        let mut chars = s.chars();
        if let Some(first) = chars.next() {
            out.extend(first.to_uppercase().to_string().bytes());
            out.extend(chars.as_str().bytes());
        }
        out.extend_from_slice(if rng.random_range(0..6) == 0 {
            b".\n"
        } else {
            b". "
        });
    }
    out.truncate(bytes);
    out
}
