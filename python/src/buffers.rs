//! Host buffers from Python (anything exporting a C-contiguous byte buffer:
//! a numpy `uint8` array, `torch.Tensor.view(torch.uint8).numpy()`), seen
//! as typed slices without a copy, and the element types zeropp moves.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use zeropp_comm::scratch;

use zeropp_zero::ZeroError;

use crate::invalid;

/// The element types of tensors zeropp quantizes and moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn parse(s: &str) -> PyResult<Dtype> {
        match s {
            "float32" | "f32" => Ok(Dtype::F32),
            "bfloat16" | "bf16" => Ok(Dtype::Bf16),
            "float16" | "f16" => Ok(Dtype::F16),
            other => Err(invalid(format!(
                "zeropp moves and quantizes float32, bfloat16 and float16 tensors, not {other}; \
                 cast the tensor (or set FSDP2's mp_policy) to one of them"
            ))),
        }
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

/// Runs `$body` with `$T` the Rust type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::buffers::Dtype::F32 => {
                type $T = f32;
                $body
            }
            $crate::buffers::Dtype::Bf16 => {
                type $T = half::bf16;
                $body
            }
            $crate::buffers::Dtype::F16 => {
                type $T = half::f16;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;

/// A C-contiguous host buffer held for as long as this lives.
pub struct HostBuf {
    buf: PyBuffer<u8>,
    writable: bool,
}

impl HostBuf {
    /// `obj`'s buffer; `writable` buffers are refused when read-only.
    pub fn new(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<HostBuf> {
        let buf = PyBuffer::<u8>::get(obj).map_err(|e| {
            invalid(format!(
                "{what}: expected a byte buffer (a uint8 numpy array or memoryview): {e}"
            ))
        })?;
        if !buf.is_c_contiguous() {
            return Err(invalid(format!("{what}: the buffer is not contiguous")));
        }
        if writable && buf.readonly() {
            return Err(invalid(format!("{what}: the buffer is read-only")));
        }
        Ok(HostBuf { buf, writable })
    }

    pub fn len(&self) -> usize {
        self.buf.len_bytes()
    }

    /// Where the buffer starts.
    pub fn address(&self) -> u64 {
        self.buf.buf_ptr() as u64
    }

    /// Whether the two buffers share memory (FSDP2's in-place gather: its
    /// input is this rank's run of the output).
    pub fn overlaps(&self, other: &HostBuf) -> bool {
        let (a, b) = (self.address(), other.address());
        self.len() > 0 && other.len() > 0 && a < b + other.len() as u64 && b < a + self.len() as u64
    }

    pub fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: the buffer is C-contiguous, `len_bytes` long, and kept
        // alive (and its exporter pinned) by `self.buf`.
        unsafe { std::slice::from_raw_parts(self.buf.buf_ptr() as *const u8, self.len()) }
    }

    /// The bytes, to write into. The caller holds the only writer: Python
    /// hands each output buffer to one collective and waits for it.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self) -> &mut [u8] {
        assert!(self.writable, "bytes_mut on a buffer taken read-only");
        if self.len() == 0 {
            return &mut [];
        }
        // SAFETY: as in `bytes`, and the buffer was checked writable.
        unsafe { std::slice::from_raw_parts_mut(self.buf.buf_ptr() as *mut u8, self.len()) }
    }

    /// The buffer as values of `T` (it must be aligned and whole values).
    pub fn typed<T: bytemuck::Pod>(&self, what: &str) -> Result<&[T], ZeroError> {
        let b = self.bytes();
        bytemuck::try_cast_slice(b).map_err(|_| misaligned::<T>(what, b.len()))
    }

    #[allow(clippy::mut_from_ref)]
    pub fn typed_mut<T: bytemuck::Pod>(&self, what: &str) -> Result<&mut [T], ZeroError> {
        let b = self.bytes_mut();
        let len = b.len();
        bytemuck::try_cast_slice_mut(b).map_err(|_| misaligned::<T>(what, len))
    }
}

fn misaligned<T>(what: &str, len: usize) -> ZeroError {
    ZeroError::Invalid(format!(
        "{what}: {len} bytes at an address that is not whole, aligned {}-byte values",
        std::mem::size_of::<T>()
    ))
}

// SAFETY: a `PyBuffer` may be sent between threads (pyo3 releases it under
// the GIL); the slices handed out follow the single-writer rule above.
unsafe impl Send for HostBuf {}
unsafe impl Sync for HostBuf {}

/// A copy of a caller's values in a reused buffer (`zeropp_comm::scratch`):
/// what an in-place call reads while it writes the same memory. Back to
/// the pool when dropped.
pub enum ScratchCopy {
    Two(scratch::Returned<u16>),
    Four(scratch::Returned<u32>),
}

impl ScratchCopy {
    /// A copy of `x` (2- or 4-byte elements: the dtypes zeropp moves).
    pub fn of<T: bytemuck::Pod>(x: &[T]) -> ScratchCopy {
        match size_of::<T>() {
            2 => ScratchCopy::Two(scratch::copied(bytemuck::cast_slice(x))),
            _ => ScratchCopy::Four(scratch::copied(bytemuck::cast_slice(x))),
        }
    }

    /// The copied values.
    pub fn values<T: bytemuck::Pod>(&self) -> &[T] {
        match self {
            ScratchCopy::Two(c) => bytemuck::cast_slice(&c.0),
            ScratchCopy::Four(c) => bytemuck::cast_slice(&c.0),
        }
    }
}
