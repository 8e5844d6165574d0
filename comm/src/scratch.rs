//! Reused host buffers for the collectives' temporaries: the f32 values a
//! gather or a reduce-scatter works in, its quantized chunks, the bytes it
//! sends and the ring's partial sums. A collective takes them here and
//! gives them back when it is done, so after the first steps of a job no
//! gather or reduce-scatter allocates a buffer: the same lengths recur
//! every step. (A fresh buffer of 2 MiB or more is a new `mmap` whose pages
//! fault at the first write; comm's receive pool does the same for what
//! arrives.)
//!
//! What it costs: the free buffers are held between uses, so they add to a
//! rank's peak memory (docs/BENCHMARKS.md measures both sides).
//! `ZEROPP_SCRATCH_POOL` bounds the bytes held ([`BUDGET`] by default; 0
//! frees every buffer when it is given back, as before the pools).
//!
//! Free buffers are kept by exact length, at most [`PER_LENGTH`] of each;
//! a full pool frees buffers of other lengths (largest first) to keep one
//! of the length given back. Buffers under [`MIN_POOLED`] bytes are
//! ordinary allocations (the
//! allocator recycles those without faults). [`held_bytes`] says what is
//! held now, [`stats`] what was taken and how much of it was reused
//! (zeropp.torch's `scratch_stats()`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::CommError;
use super::pool::parse_size;

/// Smaller buffers are not pooled.
pub const MIN_POOLED: usize = 1024;
/// Free buffers kept per length.
pub const PER_LENGTH: usize = 64;
/// Bytes of free buffers kept unless `ZEROPP_SCRATCH_POOL` says otherwise.
pub const BUDGET: usize = 256 << 20;

static LIMIT: AtomicUsize = AtomicUsize::new(BUDGET);
static HELD: AtomicUsize = AtomicUsize::new(0);
static TAKEN: AtomicU64 = AtomicU64::new(0);
static REUSED: AtomicU64 = AtomicU64::new(0);

/// Sets the bytes of free buffers the pools may hold (0: none, every
/// buffer is freed when given back).
pub fn set_budget(bytes: usize) {
    LIMIT.store(bytes, Ordering::Relaxed);
}

/// The budget `ZEROPP_SCRATCH_POOL` names (bytes, or with a K/M/G
/// suffix), set for the process; unset: [`BUDGET`]. A value that is not a
/// size is an error that says what to write.
pub fn budget_from_env() -> Result<usize, CommError> {
    let bytes = match std::env::var("ZEROPP_SCRATCH_POOL") {
        Err(_) => BUDGET,
        Ok(v) => parse_size(&v).map_err(|e| CommError::Setting {
            name: "ZEROPP_SCRATCH_POOL",
            problem: format!(
                "{e}; give the bytes of free buffers the collectives may keep for their next \
                 call (for example 256M, the default), or 0 to free every buffer after use"
            ),
        })?,
    };
    set_budget(bytes);
    Ok(bytes)
}

/// The free buffers of one element type, by length.
pub struct Pool<T> {
    free: Mutex<Option<HashMap<usize, Vec<Vec<T>>>>>,
}

impl<T> Pool<T> {
    const fn new() -> Self {
        Pool {
            free: Mutex::new(None),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<HashMap<usize, Vec<Vec<T>>>>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An element type with a pool of its own.
pub trait Pooled: Copy + Default + 'static {
    fn pool() -> &'static Pool<Self>;
}

macro_rules! pooled {
    ($($t:ty => $name:ident),*) => {$(
        static $name: Pool<$t> = Pool::new();
        impl Pooled for $t {
            fn pool() -> &'static Pool<$t> {
                &$name
            }
        }
    )*};
}

pooled!(f32 => F32, u8 => U8, u16 => U16, u32 => U32);

/// Bytes of free buffers the pools hold now.
pub fn held_bytes() -> u64 {
    HELD.load(Ordering::Relaxed) as u64
}

/// What the pools handed out since the process started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Buffers of [`MIN_POOLED`] bytes or more taken.
    pub taken: u64,
    /// Of those, taken from a free buffer (the rest were allocated).
    pub reused: u64,
}

impl Stats {
    /// Buffers allocated: taken and not reused.
    pub fn allocated(&self) -> u64 {
        self.taken - self.reused
    }
}

/// The counts so far.
pub fn stats() -> Stats {
    Stats {
        taken: TAKEN.load(Ordering::Relaxed),
        reused: REUSED.load(Ordering::Relaxed),
    }
}

fn pooled<T>(len: usize) -> bool {
    len * size_of::<T>() >= MIN_POOLED
}

/// `len` values whose contents are unspecified (an earlier user's): the
/// caller overwrites every one before reading any.
pub fn take_for_overwrite<T: Pooled>(len: usize) -> Vec<T> {
    if !pooled::<T>(len) {
        return vec![T::default(); len];
    }
    TAKEN.fetch_add(1, Ordering::Relaxed);
    let reused = T::pool()
        .lock()
        .as_mut()
        .and_then(|m| m.get_mut(&len))
        .and_then(Vec::pop);
    match reused {
        Some(v) => {
            HELD.fetch_sub(len * size_of::<T>(), Ordering::Relaxed);
            REUSED.fetch_add(1, Ordering::Relaxed);
            v
        }
        None => vec![T::default(); len],
    }
}

/// `len` zeros.
pub fn take<T: Pooled>(len: usize) -> Vec<T> {
    let mut v = take_for_overwrite(len);
    v.fill(T::default());
    v
}

/// Gives `v` back for a later [`take`] of its length (or frees it where
/// the pools hold their budget already).
pub fn give<T: Pooled>(v: Vec<T>) {
    let len = v.len();
    let bytes = len * size_of::<T>();
    if !pooled::<T>(len) || v.capacity() != len {
        return;
    }
    let limit = LIMIT.load(Ordering::Relaxed);
    if bytes > limit {
        return;
    }
    let mut evicted = Vec::new();
    let mut free = T::pool().lock();
    let by_len = free.get_or_insert_with(HashMap::new);
    if by_len.get(&len).is_some_and(|l| l.len() >= PER_LENGTH) {
        return; // freed when `v` drops, after the lock
    }
    let over = (HELD.load(Ordering::Relaxed) + bytes).saturating_sub(limit);
    if over > 0 {
        let freed;
        (freed, evicted) = make_room(by_len, len, over);
        HELD.fetch_sub(freed, Ordering::Relaxed);
    }
    if HELD.load(Ordering::Relaxed) + bytes <= limit {
        by_len.entry(len).or_default().push(v);
        HELD.fetch_add(bytes, Ordering::Relaxed);
    }
    drop(free);
    drop(evicted); // freed after the lock
}

/// Takes free buffers of lengths other than `keep` out of `by_len`,
/// largest first, until at least `need` bytes are out (or none is left):
/// the lengths in use now matter more than those of earlier calls (a probe
/// at join, a checkpoint). Returns the bytes taken out and the buffers, to
/// free after the lock.
fn make_room<T>(
    by_len: &mut HashMap<usize, Vec<Vec<T>>>,
    keep: usize,
    need: usize,
) -> (usize, Vec<Vec<T>>) {
    let (mut freed, mut evicted) = (0, Vec::new());
    while freed < need {
        let victim = by_len
            .iter()
            .filter(|(l, free)| **l != keep && !free.is_empty())
            .map(|(l, _)| *l)
            .max();
        let Some(victim) = victim else { break };
        evicted.extend(by_len.get_mut(&victim).and_then(Vec::pop));
        freed += victim * size_of::<T>();
    }
    (freed, evicted)
}

/// A pooled buffer that goes back to its pool when dropped: the owner of
/// a message's bytes while the transport sends it, or of a copy.
pub struct Returned<T: Pooled>(pub Vec<T>);

/// A copy of `x` in a reused buffer.
pub fn copied<T: Pooled>(x: &[T]) -> Returned<T> {
    let mut v = take_for_overwrite(x.len());
    v.copy_from_slice(x);
    Returned(v)
}

impl<T: Pooled> Drop for Returned<T> {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

impl<T: Pooled + bytemuck::Pod> AsRef<[u8]> for Returned<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_given_back_is_taken_again_zeroed() {
        // Lengths no other test of this crate uses.
        let len = 4099;
        let mut v = take::<f32>(len);
        v[7] = 3.0;
        let at = v.as_ptr();
        give(v);
        let before = stats();
        let again = take::<f32>(len);
        assert_eq!(again.as_ptr(), at, "the free buffer was not reused");
        assert!(again.iter().all(|&x| x == 0.0));
        let after = stats();
        assert!(after.taken > before.taken && after.reused > before.reused);
        // Small buffers are not pooled, nor are they counted.
        let small = take::<u8>(MIN_POOLED - 1);
        assert_eq!(small.len(), MIN_POOLED - 1);
    }

    #[test]
    fn a_full_pool_makes_room_for_the_length_in_use() {
        // Free buffers of lengths 10, 20 (two) and 30 (f32): room for 90
        // bytes beside length 20 frees the one of 30 (120 bytes) alone;
        // room for 200 frees 30's and 10's and never 20's.
        let pool = || {
            HashMap::from([
                (10usize, vec![vec![0f32; 10]]),
                (20, vec![vec![0f32; 20], vec![0f32; 20]]),
                (30, vec![vec![0f32; 30]]),
            ])
        };
        let mut p = pool();
        let (freed, out) = make_room(&mut p, 20, 90);
        assert_eq!((freed, out.len()), (120, 1));
        assert!(p[&30].is_empty() && p[&10].len() == 1);
        let mut p = pool();
        let (freed, _) = make_room(&mut p, 20, 200);
        assert_eq!(freed, 160);
        assert_eq!(p[&20].len(), 2);
    }

    #[test]
    fn sent_bytes_return_to_the_pool_when_the_last_holder_drops_them() {
        let len = 5003;
        let at = {
            let mut v = take_for_overwrite::<u8>(len);
            v.fill(9);
            let at = v.as_ptr();
            let b = bytes::Bytes::from_owner(Returned(v));
            let held = b.clone();
            drop(b);
            assert_eq!(held[len - 1], 9);
            at
        };
        let again = take_for_overwrite::<u8>(len);
        assert_eq!(again.as_ptr(), at);
    }
}
