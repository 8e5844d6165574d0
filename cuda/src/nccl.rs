//! NCCL for device buffers: communicators made from an id that the caller
//! exchanges (zeropp's rendezvous carries it), NCCL's all-gather,
//! reduce-scatter, all-reduce and broadcast, and all-to-all as grouped
//! send/recv.
//!
//! Our own small FFI over `libnccl.so.2`, loaded at run time: cudarc's NCCL
//! bindings look for `libnccl.so` (or `.so.<CUDA major>`), which neither
//! Debian's `libnccl2` nor the `nvidia-nccl-cu13` wheel provides. The library
//! is found in `ZEROPP_NCCL`, `CUDA_HOME`/`/usr/local/cuda`, the system
//! loader path, or the `nvidia` wheels of python3; missing → an error naming
//! the packages.
//!
//! Every wait has a deadline: communicators are created non-blocking and
//! polled; each collective is followed by polling its completion and NCCL's
//! asynchronous error, and on timeout the communicator is aborted and the
//! error says so (a dead peer never hangs a rank).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use libloading::Library;

use crate::device::{Gpu, NcclElement};
use crate::{CudaError, NcclNotLoaded};

type NcclResult = c_int;
type Comm = *mut c_void;
const SUCCESS: NcclResult = 0;
const IN_PROGRESS: NcclResult = 7;
/// `ncclRemoteError`: a peer exited or the network failed.
const REMOTE_ERROR: NcclResult = 6;
/// `ncclSystemError`: a system call failed (a peer's socket closing, too).
const SYSTEM_ERROR: NcclResult = 2;
const UINT8: c_int = 1;
const FLOAT32: c_int = <f32 as NcclElement>::TYPE;
const SUM: c_int = 0;
/// `ncclAvg` (NCCL ≥ 2.10): the sum divided by the communicator's size.
const AVG: c_int = 4;

/// `ncclUniqueId`: 128 opaque bytes, made on one rank and given to all.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// `ncclConfig_t` as of NCCL 2.17 (newer libraries accept older versions:
/// they read `size` and `version` and default the rest).
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}
const _: () = assert!(std::mem::size_of::<Config>() == 48);
const UNDEF_INT: c_int = i32::MIN;

struct Api {
    _lib: Library,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    init_rank_config:
        unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> NcclResult,
    get_async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    abort: unsafe extern "C" fn(Comm) -> NcclResult,
    destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        Comm,
        *mut c_void,
    ) -> NcclResult,
    reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> NcclResult,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> NcclResult,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

// SAFETY: the table holds function pointers into a library that stays loaded.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

impl Api {
    fn describe(&self, r: NcclResult) -> String {
        // SAFETY: NCCL returns a static string for any result code.
        let s = unsafe { (self.error_string)(r) };
        if s.is_null() {
            format!("NCCL error {r}")
        } else {
            // SAFETY: non-null, NUL-terminated, static.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        }
    }
}

/// Where libnccl.so.2 may be, in search order.
fn candidates() -> Vec<PathBuf> {
    let mut c = Vec::new();
    if let Some(p) = std::env::var_os("ZEROPP_NCCL") {
        c.push(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            c.push(PathBuf::from(v).join("lib64/libnccl.so.2"));
        }
    }
    c.push(PathBuf::from("/usr/local/cuda/lib64/libnccl.so.2"));
    // The system loader path, by name.
    c.push(PathBuf::from("libnccl.so.2"));
    for d in crate::toolkit::python_nvidia_dirs() {
        c.push(d.join("nccl/lib/libnccl.so.2"));
        c.push(d.join("cu13/lib/libnccl.so.2"));
    }
    c
}

fn api() -> Result<&'static Api, CudaError> {
    static API: OnceLock<Result<Api, NcclNotLoaded>> = OnceLock::new();
    Ok(API.get_or_init(load).as_ref().map_err(Clone::clone)?)
}

/// The NCCL this process already loaded (PyTorch's), if any: one NCCL per
/// process, whatever else is installed.
fn already_loaded() -> Option<Library> {
    use libloading::os::unix::{Library as Unix, RTLD_LAZY};
    const RTLD_NOLOAD: std::ffi::c_int = 4;
    // SAFETY: RTLD_NOLOAD only returns a library that is already loaded
    // (and initialised); it loads nothing.
    unsafe { Unix::open(Some("libnccl.so.2"), RTLD_LAZY | RTLD_NOLOAD) }
        .ok()
        .map(Library::from)
}

fn load() -> Result<Api, NcclNotLoaded> {
    let mut tried = Vec::new();
    let mut lib = already_loaded();
    if lib.is_none() {
        tried = candidates();
        // SAFETY: loading NCCL runs its initialisers, as linking it would.
        lib = tried.iter().find_map(|p| unsafe { Library::new(p) }.ok());
    }
    let lib = lib.ok_or_else(|| NcclNotLoaded::Missing {
        tried: tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's type is its prototype in nccl.h (2.x).
            *unsafe { lib.get($name) }.map_err(|e| NcclNotLoaded::Old {
                symbol: String::from_utf8_lossy($name).into_owned(),
                why: e.to_string(),
            })?
        };
    }
    Ok(Api {
        get_version: sym!(b"ncclGetVersion"),
        get_unique_id: sym!(b"ncclGetUniqueId"),
        init_rank_config: sym!(b"ncclCommInitRankConfig"),
        get_async_error: sym!(b"ncclCommGetAsyncError"),
        abort: sym!(b"ncclCommAbort"),
        destroy: sym!(b"ncclCommDestroy"),
        error_string: sym!(b"ncclGetErrorString"),
        all_gather: sym!(b"ncclAllGather"),
        reduce_scatter: sym!(b"ncclReduceScatter"),
        all_reduce: sym!(b"ncclAllReduce"),
        broadcast: sym!(b"ncclBroadcast"),
        send: sym!(b"ncclSend"),
        recv: sym!(b"ncclRecv"),
        group_start: sym!(b"ncclGroupStart"),
        group_end: sym!(b"ncclGroupEnd"),
        _lib: lib,
    })
}

/// NCCL's version as `major.minor.patch`, or why NCCL cannot be used.
pub fn version() -> Result<String, CudaError> {
    let a = api()?;
    let mut v: c_int = 0;
    // SAFETY: plain out-parameter.
    let r = unsafe { (a.get_version)(&mut v) };
    if r != SUCCESS {
        return Err(CudaError::Nccl {
            what: "ncclGetVersion".into(),
            detail: a.describe(r),
        });
    }
    Ok(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
}

/// The id that makes ranks into one communicator: made on one rank, sent
/// to the others (as bytes), passed to [`NcclComm::init`] everywhere.
#[derive(Clone, Copy)]
pub struct NcclId(UniqueId);

impl NcclId {
    pub fn new() -> Result<NcclId, CudaError> {
        let a = api()?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: `id` is a valid out-parameter of the right size.
        let r = unsafe { (a.get_unique_id)(&mut id) };
        if r != SUCCESS {
            return Err(CudaError::Nccl {
                what: "ncclGetUniqueId".into(),
                detail: a.describe(r),
            });
        }
        Ok(NcclId(id))
    }

    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId, CudaError> {
        let b: [u8; 128] = bytes.try_into().map_err(|_| {
            CudaError::Invalid(format!(
                "an NCCL id is 128 bytes, this one has {}: it was damaged on the way",
                bytes.len()
            ))
        })?;
        Ok(NcclId(UniqueId {
            internal: b.map(|c| c as c_char),
        }))
    }
}

/// One NCCL communicator on one GPU's stream.
pub struct NcclComm {
    api: &'static Api,
    comm: Comm,
    rank: usize,
    size: usize,
    stream: Mutex<Arc<CudaStream>>,
    timeout: Duration,
    aborted: AtomicBool,
    /// Held through each collective: NCCL takes one call at a time.
    busy: Mutex<()>,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time; every collective holds `busy`, so calls on one never overlap.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `size` on `gpu`'s stream, waiting
    /// at most `timeout` for the others.
    pub fn init(
        gpu: &Gpu,
        id: &NcclId,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<NcclComm, CudaError> {
        if rank >= size {
            return Err(CudaError::Invalid(format!(
                "rank {rank} of a {size}-rank NCCL communicator does not exist"
            )));
        }
        let api = api()?;
        gpu.context()
            .bind_to_thread()
            .map_err(|e| CudaError::Nccl {
                what: "binding the CUDA context".into(),
                detail: e.to_string(),
            })?;
        let mut config = Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 21700,
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
        };
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; the id is passed by value.
        let r = unsafe {
            (api.init_rank_config)(&mut comm, size as c_int, id.0, rank as c_int, &mut config)
        };
        if r != SUCCESS && r != IN_PROGRESS {
            return Err(CudaError::Nccl {
                what: format!("creating the NCCL communicator (rank {rank} of {size})"),
                detail: api.describe(r),
            });
        }
        let c = NcclComm {
            api,
            comm,
            rank,
            size,
            stream: Mutex::new(gpu.stream().clone()),
            timeout,
            aborted: AtomicBool::new(false),
            busy: Mutex::new(()),
        };
        c.settle("creating the communicator", Instant::now() + timeout)?;
        Ok(c)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Queues this communicator's collectives on `stream` from now on (the
    /// stream the caller's GPU work is on: [`Gpu::use_stream`]).
    pub fn use_stream(&self, stream: &Arc<CudaStream>) {
        *self.stream.lock().unwrap_or_else(|e| e.into_inner()) = stream.clone();
    }

    fn stream(&self) -> Arc<CudaStream> {
        self.stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// One collective at a time on this communicator, never one on an
    /// aborted communicator.
    fn one_call(&self, what: &str) -> Result<std::sync::MutexGuard<'_, ()>, CudaError> {
        let guard = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        self.alive(what)?;
        Ok(guard)
    }

    /// Polls the communicator until NCCL is done with the last call, or
    /// aborts it at `deadline`.
    fn settle(&self, what: &str, deadline: Instant) -> Result<(), CudaError> {
        loop {
            let mut state: NcclResult = SUCCESS;
            // SAFETY: live communicator; plain out-parameter.
            let r = unsafe { (self.api.get_async_error)(self.comm, &mut state) };
            let failed = match (r, state) {
                (SUCCESS, SUCCESS) => return Ok(()),
                (SUCCESS, IN_PROGRESS) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(50));
                    continue;
                }
                (SUCCESS, IN_PROGRESS) => return Err(self.timed_out(what)),
                (SUCCESS, other) => other,
                (r, _) => r,
            };
            // NCCL's rule: a communicator with an asynchronous error is
            // aborted (its kernels stop holding the stream).
            let e = self.fail(what, failed);
            self.abort();
            return Err(e);
        }
    }

    fn fail(&self, what: &str, r: NcclResult) -> CudaError {
        let what = format!("NCCL {what} failed on rank {} of {}", self.rank, self.size);
        let detail = self.api.describe(r);
        if r == REMOTE_ERROR || r == SYSTEM_ERROR {
            CudaError::Peer(format!("{what}: {detail}"))
        } else {
            CudaError::Nccl { what, detail }
        }
    }

    /// Aborts the communicator (once): NCCL's way out of a stuck or failed
    /// one. Later calls on it fail at once; dropping it destroys nothing.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::Relaxed) {
            // SAFETY: live communicator, aborted once.
            unsafe { (self.api.abort)(self.comm) };
        }
    }

    /// Fails when the communicator was aborted: it must not be used again.
    fn alive(&self, what: &str) -> Result<(), CudaError> {
        if self.aborted.load(Ordering::Relaxed) {
            return Err(CudaError::Peer(format!(
                "NCCL {what}: the communicator (rank {} of {}) was aborted after an earlier \
                 failure; the job cannot continue",
                self.rank, self.size
            )));
        }
        Ok(())
    }

    fn timed_out(&self, what: &str) -> CudaError {
        self.abort();
        CudaError::Peer(format!(
            "NCCL {what} did not finish within {:?} on rank {} of {}: a peer is gone or stuck; \
             the communicator was aborted",
            self.timeout, self.rank, self.size
        ))
    }

    /// Checks a call's result, then waits for the stream (and NCCL) with
    /// the deadline.
    fn finish(&self, what: &str, r: NcclResult) -> Result<(), CudaError> {
        if r != SUCCESS && r != IN_PROGRESS {
            return Err(self.fail(what, r));
        }
        let deadline = Instant::now() + self.timeout;
        self.settle(what, deadline)?;
        let event = self
            .stream()
            .record_event(None)
            .map_err(|e| CudaError::Nccl {
                what: format!("NCCL {what}: recording an event"),
                detail: e.to_string(),
            })?;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) if Instant::now() < deadline => {
                    // A peer's failure shows here while the kernel waits.
                    self.settle(what, deadline)?;
                    std::thread::sleep(Duration::from_micros(50));
                }
                Ok(false) => return Err(self.timed_out(what)),
                Err(e) => {
                    return Err(CudaError::Nccl {
                        what: format!("NCCL {what}"),
                        detail: e.to_string(),
                    });
                }
            }
        }
    }

    fn raw_stream(&self) -> *mut c_void {
        self.stream().cu_stream() as *mut c_void
    }

    /// Every rank's `send` (equal lengths), in rank order, into `recv`.
    pub fn all_gather_bytes(
        &self,
        send: &CudaView<'_, u8>,
        recv: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), CudaError> {
        self.check_len("all-gather output", send.len() * self.size, recv.len())?;
        let _one = self.one_call("all-gather")?;
        let stream = self.stream();
        let (s, _a) = send.device_ptr(&stream);
        let (d, _b) = recv.device_ptr_mut(&stream);
        // SAFETY: device pointers of the sizes checked above, on our stream.
        let r = unsafe {
            (self.api.all_gather)(
                s as *const c_void,
                d as *mut c_void,
                send.len(),
                UINT8,
                self.comm,
                self.raw_stream(),
            )
        };
        self.finish("all-gather", r)
    }

    /// The sum over ranks of `send` (f32, bf16 or f16, summed in that
    /// type by NCCL), this rank's 1/size part into `recv`.
    pub fn reduce_scatter_sum<T: NcclElement>(
        &self,
        send: &CudaView<'_, T>,
        recv: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        self.reduce_scatter(send, recv, false)
    }

    /// [`NcclComm::reduce_scatter_sum`], or with `mean` the mean over
    /// ranks (NCCL's average: the sum divided by the size in NCCL's
    /// reduction, so no kernel of ours or PyTorch's divides afterwards).
    pub fn reduce_scatter<T: NcclElement>(
        &self,
        send: &CudaView<'_, T>,
        recv: &mut CudaViewMut<'_, T>,
        mean: bool,
    ) -> Result<(), CudaError> {
        let n = recv.len();
        self.check_len("reduce-scatter input", n * self.size, send.len())?;
        let _one = self.one_call("reduce-scatter")?;
        let stream = self.stream();
        let (s, _a) = send.device_ptr(&stream);
        let (d, _b) = recv.device_ptr_mut(&stream);
        // SAFETY: as in `all_gather_bytes`.
        let r = unsafe {
            (self.api.reduce_scatter)(
                s as *const c_void,
                d as *mut c_void,
                n,
                T::TYPE,
                if mean { AVG } else { SUM },
                self.comm,
                self.raw_stream(),
            )
        };
        self.finish("reduce-scatter", r)
    }

    /// The f32 sum over ranks, in place.
    pub fn all_reduce_sum(&self, buf: &mut CudaViewMut<'_, f32>) -> Result<(), CudaError> {
        let n = buf.len();
        let _one = self.one_call("all-reduce")?;
        let stream = self.stream();
        let (d, _b) = buf.device_ptr_mut(&stream);
        // SAFETY: in-place all-reduce on one device buffer of `n` values.
        let r = unsafe {
            (self.api.all_reduce)(
                d as *const c_void,
                d as *mut c_void,
                n,
                FLOAT32,
                SUM,
                self.comm,
                self.raw_stream(),
            )
        };
        self.finish("all-reduce", r)
    }

    /// `root`'s bytes to every rank, in place.
    pub fn broadcast_bytes(
        &self,
        root: usize,
        buf: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), CudaError> {
        if root >= self.size {
            return Err(CudaError::Invalid(format!(
                "broadcast root {root} is not a rank of this {}-rank communicator",
                self.size
            )));
        }
        let n = buf.len();
        let _one = self.one_call("broadcast")?;
        let stream = self.stream();
        let (d, _b) = buf.device_ptr_mut(&stream);
        // SAFETY: in-place broadcast on one device buffer of `n` bytes.
        let r = unsafe {
            (self.api.broadcast)(
                d as *const c_void,
                d as *mut c_void,
                n,
                UINT8,
                root as c_int,
                self.comm,
                self.raw_stream(),
            )
        };
        self.finish("broadcast", r)
    }

    /// Pairwise all-to-all of equal chunks: chunk p of `send` goes to rank
    /// p, and rank p's chunk for us lands at chunk p of `recv` (NCCL grouped
    /// send/recv).
    pub fn all_to_all_bytes(
        &self,
        send: &CudaView<'_, u8>,
        recv: &mut CudaViewMut<'_, u8>,
    ) -> Result<(), CudaError> {
        self.check_len("all-to-all output", send.len(), recv.len())?;
        if !send.len().is_multiple_of(self.size) {
            return Err(CudaError::Invalid(format!(
                "all-to-all of {} bytes over {} ranks: not equal chunks",
                send.len(),
                self.size
            )));
        }
        let chunk = send.len() / self.size;
        let _one = self.one_call("all-to-all")?;
        let stream = self.stream();
        let (s, _a) = send.device_ptr(&stream);
        let (d, _b) = recv.device_ptr_mut(&stream);
        let raw = self.raw_stream();
        // SAFETY: group calls around sends/recvs of in-bounds chunks.
        let mut r = unsafe { (self.api.group_start)() };
        if r == SUCCESS {
            for p in 0..self.size {
                let off = (p * chunk) as u64;
                // SAFETY: chunk p lies inside both checked buffers.
                unsafe {
                    let a = (self.api.send)(
                        (s + off) as *const c_void,
                        chunk,
                        UINT8,
                        p as c_int,
                        self.comm,
                        raw,
                    );
                    let b = (self.api.recv)(
                        (d + off) as *mut c_void,
                        chunk,
                        UINT8,
                        p as c_int,
                        self.comm,
                        raw,
                    );
                    if r == SUCCESS {
                        r = if a != SUCCESS && a != IN_PROGRESS {
                            a
                        } else {
                            b
                        };
                        if r == IN_PROGRESS {
                            r = SUCCESS;
                        }
                    }
                }
            }
            // SAFETY: closes the group opened above, whatever happened in it.
            let end = unsafe { (self.api.group_end)() };
            if r == SUCCESS {
                r = end;
            }
        }
        self.finish("all-to-all", r)
    }

    fn check_len(&self, what: &str, expected: usize, found: usize) -> Result<(), CudaError> {
        if expected == found {
            Ok(())
        } else {
            Err(CudaError::Invalid(format!(
                "NCCL {what}: {found} values where {expected} are needed (rank {} of {})",
                self.rank, self.size
            )))
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::Relaxed) {
            // SAFETY: live communicator, destroyed once.
            unsafe { (self.api.destroy)(self.comm) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_damaged_ids_are_refused() {
        let mut raw = [0u8; 128];
        raw[0] = 7;
        raw[127] = 200;
        let id = NcclId::from_bytes(&raw).unwrap();
        assert_eq!(id.to_bytes(), raw);
        let e = NcclId::from_bytes(&raw[..100]).err().unwrap().to_string();
        assert!(e.contains("128 bytes") && e.contains("100"), "{e}");
    }

    #[test]
    fn without_nccl_the_error_names_the_packages() {
        match version() {
            // Where NCCL is installed this reports its version.
            Ok(v) => assert!(v.starts_with("2."), "{v}"),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("nvidia-nccl-cu13") && e.contains("libnccl2"),
                    "{e}"
                );
            }
        }
    }
}
