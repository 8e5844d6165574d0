//! Reused receive buffers. A large allocation is a fresh `mmap`: the kernel
//! zeroes and maps each of its 4 KiB pages at the first write, so receiving
//! 16 MiB into a new buffer costs 4096 page faults on top of the copy — on
//! this host that halved every collective's bandwidth (docs/BENCHMARKS.md).
//! A transport takes a buffer of a message's length from its pool; when the
//! last `Bytes` pointing into it is dropped, wherever that happens, the
//! buffer goes back to the pool for the next message of about that size.
//!
//! Buffers are kept in size classes (a quarter of a power of two apart, so
//! at most 25% of a buffer is unused), at most [`PER_CLASS`] per class and
//! at most the pool's budget in all; what does not fit is freed. Messages
//! under [`MIN_POOLED`] bytes use ordinary allocations, which the allocator
//! already recycles without faults.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use super::CommError;

/// Smaller messages are not pooled.
pub const MIN_POOLED: usize = 64 << 10;
/// Free buffers kept per size class.
pub const PER_CLASS: usize = 8;
/// Bytes of free buffers a pool keeps unless `ZEROPP_RECV_POOL` says
/// otherwise.
pub const DEFAULT_BUDGET: usize = 256 << 20;

/// The size class a buffer for `len` bytes is allocated with: `len` rounded
/// up to a quarter of its power of two.
pub fn class_of(len: usize) -> usize {
    if len <= 4 {
        return len.max(1);
    }
    let step = 1usize << (usize::BITS - 1 - len.leading_zeros()).saturating_sub(2);
    len.div_ceil(step) * step
}

/// A size that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a size like 4K, 16M or 1G")]
pub struct NotASize(pub String);

/// Parses sizes like `4K`, `16M`, `1G`, `1000`.
pub fn parse_size(s: &str) -> Result<usize, NotASize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| NotASize(s.into()))
}

/// The pool budget a `ZEROPP_RECV_POOL` value names (`None`: unset).
fn budget_from(value: Option<&str>) -> Result<usize, CommError> {
    match value {
        None => Ok(DEFAULT_BUDGET),
        Some(v) => parse_size(v).map_err(|e| CommError::Setting {
            name: "ZEROPP_RECV_POOL",
            problem: format!(
                "{e}; give the bytes of free receive buffers a rank may keep (for example \
                     256M, the default), or 0 to turn the pool off"
            ),
        }),
    }
}

#[derive(Default)]
struct Free {
    by_class: HashMap<usize, Vec<Vec<u8>>>,
    held: usize,
}

/// A pool of receive buffers (see the module's documentation).
pub struct BufferPool {
    free: Mutex<Free>,
    budget: usize,
}

impl BufferPool {
    /// A pool that keeps up to `budget` bytes of free buffers (0: none).
    pub fn new(budget: usize) -> Arc<BufferPool> {
        Arc::new(BufferPool {
            free: Mutex::new(Free::default()),
            budget,
        })
    }

    /// A pool with the budget `ZEROPP_RECV_POOL` names (bytes, or with a
    /// K/M/G suffix; 0 disables pooling), else [`DEFAULT_BUDGET`]. A value
    /// that is not a size is an error that says what to write.
    pub fn from_env() -> Result<Arc<BufferPool>, CommError> {
        budget_from(std::env::var("ZEROPP_RECV_POOL").ok().as_deref()).map(BufferPool::new)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A buffer of exactly `len` bytes whose contents are unspecified (a
    /// reused buffer holds an earlier message): the caller overwrites all of
    /// it before reading any.
    pub fn take(self: &Arc<Self>, len: usize) -> PooledBuf {
        if len < MIN_POOLED || self.budget == 0 {
            return PooledBuf {
                buf: vec![0u8; len],
                len,
                pool: None,
            };
        }
        let class = class_of(len);
        let reused = {
            let mut free = self.lock();
            let buf = free.by_class.get_mut(&class).and_then(Vec::pop);
            if buf.is_some() {
                free.held -= class;
            }
            buf
        };
        PooledBuf {
            buf: reused.unwrap_or_else(|| vec![0u8; class]),
            len,
            pool: Some(self.clone()),
        }
    }

    /// Bytes of free buffers held now.
    pub fn held(&self) -> usize {
        self.lock().held
    }

    fn give_back(&self, buf: Vec<u8>) {
        let class = buf.len();
        if class > self.budget {
            return;
        }
        let mut evicted = Vec::new();
        let mut free = self.lock();
        if free
            .by_class
            .get(&class)
            .is_some_and(|l| l.len() >= PER_CLASS)
        {
            return; // freed when `buf` drops, after the lock
        }
        // Make room by freeing buffers of other sizes, largest first: the
        // sizes in use now matter more than those of earlier messages.
        while free.held + class > self.budget {
            let victim = free
                .by_class
                .iter()
                .filter(|(c, l)| **c != class && !l.is_empty())
                .map(|(c, _)| *c)
                .max();
            let Some(victim) = victim else { break };
            evicted.extend(free.by_class.get_mut(&victim).and_then(Vec::pop));
            free.held -= victim;
        }
        if free.held + class <= self.budget {
            free.by_class.entry(class).or_default().push(buf);
            free.held += class;
        }
        drop(free);
        drop(evicted); // freed after the lock
    }
}

/// A buffer from a [`BufferPool`]; returns to it when dropped.
pub struct PooledBuf {
    buf: Vec<u8>,
    len: usize,
    pool: Option<Arc<BufferPool>>,
}

impl PooledBuf {
    /// Wraps an ordinary buffer (freed, not pooled, when dropped).
    pub fn unpooled(buf: Vec<u8>) -> PooledBuf {
        PooledBuf {
            len: buf.len(),
            buf,
            pool: None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }

    /// Shares the buffer as `Bytes`; it returns to the pool when the last
    /// clone or slice of them is dropped.
    pub fn into_bytes(self) -> Bytes {
        let mut me = self;
        if me.pool.is_none() {
            // Allocated at exactly `len`; dropping `me` gives nothing back.
            return Bytes::from(std::mem::take(&mut me.buf));
        }
        Bytes::from_owner(me)
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give_back(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_the_length_and_waste_at_most_a_quarter() {
        for len in (1..5000).chain([MIN_POOLED, 65_537, 1 << 20, (16 << 20) + 3, 100_000_007]) {
            let c = class_of(len);
            assert!(c >= len, "{len} -> {c}");
            assert!(c as f64 <= len as f64 * 1.5 + 4.0, "{len} -> {c}");
            assert_eq!(class_of(c), c, "a class is its own class");
        }
        assert_eq!(class_of(1 << 20), 1 << 20);
        assert_eq!(class_of((1 << 20) + 1), (1 << 20) + (1 << 18));
    }

    #[test]
    fn a_dropped_buffer_is_reused_for_the_next_message_of_its_class() {
        let pool = BufferPool::new(64 << 20);
        let mut a = pool.take(1 << 20);
        a.as_mut_slice().fill(7);
        let ptr = a.as_ref().as_ptr();
        let bytes = a.into_bytes();
        let slice = bytes.slice(16..);
        drop(bytes);
        assert_eq!(pool.held(), 0, "a slice still holds it");
        assert!(slice.iter().all(|&b| b == 7));
        drop(slice);
        assert_eq!(pool.held(), 1 << 20);
        // A slightly smaller message of the same class gets the same memory.
        let b = pool.take((1 << 20) - 100);
        assert_eq!(b.as_ref().as_ptr(), ptr);
        assert_eq!(b.len(), (1 << 20) - 100);
        assert_eq!(pool.held(), 0);
    }

    #[test]
    fn the_budget_and_the_per_class_limit_bound_what_is_kept() {
        let pool = BufferPool::new(3 << 20);
        let bufs: Vec<_> = (0..5).map(|_| pool.take(1 << 20)).collect();
        drop(bufs);
        assert_eq!(pool.held(), 3 << 20, "only the budget's worth is kept");
        let pool = BufferPool::new(1 << 30);
        let bufs: Vec<_> = (0..PER_CLASS + 3).map(|_| pool.take(MIN_POOLED)).collect();
        drop(bufs);
        assert_eq!(pool.held(), PER_CLASS * MIN_POOLED);
        // A new size makes room by freeing buffers of other sizes.
        let pool = BufferPool::new(4 << 20);
        drop((0..4).map(|_| pool.take(1 << 20)).collect::<Vec<_>>());
        assert_eq!(pool.held(), 4 << 20);
        drop(pool.take(2 << 20));
        assert_eq!(pool.held(), 4 << 20, "two 1 MiB buffers gave way");
        let b = pool.take(2 << 20);
        assert_eq!(pool.held(), 2 << 20, "the 2 MiB one was kept and is reused");
        drop(b);
        let off = BufferPool::new(0);
        drop(off.take(1 << 20));
        assert_eq!(off.held(), 0);
    }

    #[test]
    fn the_budget_comes_from_zeropp_recv_pool_and_garbage_is_an_error() {
        assert_eq!(budget_from(None).unwrap(), DEFAULT_BUDGET);
        assert_eq!(budget_from(Some("64M")).unwrap(), 64 << 20);
        assert_eq!(budget_from(Some("0")).unwrap(), 0);
        let err = budget_from(Some("lots")).unwrap_err().to_string();
        assert!(
            err.contains("ZEROPP_RECV_POOL") && err.contains("256M"),
            "{err}"
        );
    }

    #[test]
    fn small_and_unpooled_buffers_are_plain_bytes_of_the_right_length() {
        let pool = BufferPool::new(1 << 30);
        let mut small = pool.take(100);
        small.as_mut_slice().copy_from_slice(&[3; 100]);
        assert_eq!(small.into_bytes(), Bytes::from(vec![3u8; 100]));
        assert_eq!(pool.held(), 0);
        assert!(pool.take(0).is_empty());
    }
}
