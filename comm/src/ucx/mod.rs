//! The UCX transport: one UCP worker per rank, driven by a progress thread
//! that owns it (UCX's single-thread mode: every UCX call happens on that
//! thread). Messages are tag-matched UCP sends of `[header | payload]` (an
//! iov, no copy): the 16-byte header carries the kind, the source rank and
//! zeropp's tag; the progress thread probes for any message, receives it into
//! a buffer of its exact size and files it in the mailbox, so receives behave
//! exactly as over TCP. UCX picks shared memory inside a host and TCP or RDMA
//! across hosts by itself (`UCX_TLS`, `UCX_NET_DEVICES` override it).
//!
//! Dead peers: UCX's shared-memory transports cannot report a peer's failure,
//! so UCX refuses them for endpoints in peer error mode and would carry even
//! node-local traffic over TCP. Endpoints to ranks of this node whose process
//! this rank can see (same boot, same PID namespace) are therefore created
//! without error handling, which lets UCX use shared memory, and the progress
//! thread watches those processes itself (`/proc/PID/stat`, every 100 ms);
//! endpoints to every other rank use peer error mode and UCX's error handler.
//! Either way a dead peer fails every wait naming it. Ranks of other logical
//! nodes never share memory, so an emulated cluster's traffic crosses its
//! emulated links.

pub mod shm;
pub mod sys;

use std::collections::VecDeque;
use std::ffi::{CString, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{OnceLock, mpsc};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::mailbox::Mailbox;
use super::pool::{BufferPool, PooledBuf};
use super::{CommError, SendFailed, SendHandle, Tag, Transport};
use shm::{Holder, PeerSegment, Segment, SegmentBuf, ShmView};
use sys::*;

const KIND_DATA: u32 = 0;
const KIND_GOODBYE: u32 = 2;
/// "My segment is descriptor N of my process, S bytes": payload fd u32, size u64.
const KIND_SHM_HELLO: u32 = 3;
/// "I mapped your segment": single-copy messages to the sender may start.
const KIND_SHM_READY: u32 = 4;
/// A message lying in the sender's segment: payload offset u64, length u64,
/// and the offset u64 of the placed range it lies in (what its release names).
const KIND_SHM_DATA: u32 = 5;
/// "I dropped the message at this offset of your segment": payload u64.
const KIND_SHM_FREE: u32 = 6;
const HEADER: usize = 16;
/// UCX settings zeropp changes from UCX's defaults unless the environment
/// sets them: (environment variable, `ucp_config_modify` key, value). TCP
/// segments of 64 KiB instead of 8 KiB carry large messages between hosts
/// faster (docs/BENCHMARKS.md has the figures). The key carries no transport prefix:
/// UCX matches cached keys against each transport's own option names.
///
/// No rendezvous: every message is sent eagerly, its fragments streamed as
/// the transport takes them. Rendezvous first sends a request and waits for
/// the receiver's answer; on a slow link whose queue is full of bulk data
/// each such round trip waits behind that queue (up to 200 ms, the emulated
/// cluster's shaper queue), and ZeRO++'s many mid-sized messages paid it
/// every time: 1.67–1.70 s a step at 30 Mbit/s against 1.32 s eager
/// (docs/BENCHMARKS.md). The progress thread takes every message into the
/// mailbox as it arrives (probe, then receive), so eager adds no buffering
/// the mailbox did not already do; shared memory was as fast or faster
/// eager in the collectives benchmark.
const TUNED_DEFAULTS: &[(&str, &str, &str)] = &[
    ("UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "64k"),
    ("UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "64k"),
    ("UCX_RNDV_THRESH", "RNDV_THRESH", "inf"),
];

/// Idle rounds the progress thread spins before it sleeps.
const SPIN: u32 = 64;
/// Without UCX's event fd (a transport without wakeup): its nap while
/// traffic is recent, and how many before the long nap.
const NAP: Duration = Duration::from_micros(50);
const NAP_ROUNDS: u32 = 2000;
const LONG_NAP: Duration = Duration::from_millis(1);
/// The longest the progress thread sleeps on the event fds.
const SLEEP: Duration = Duration::from_millis(100);

/// How often node-local peers' processes are checked.
const WATCH_EVERY: Duration = Duration::from_millis(100);

enum Command {
    Send {
        peer: usize,
        kind: u32,
        tag: Tag,
        data: Bytes,
        done: SendHandle,
    },
    /// A view of `peer`'s segment at `off` was dropped.
    Release {
        peer: usize,
        off: u64,
    },
    Shutdown,
}

/// Single-copy state the sending threads and the progress thread share.
struct Local {
    /// This rank's segment; `None` when turned off or the host refused it.
    segment: Option<Arc<Segment>>,
    /// Per peer: it mapped the segment, so messages to it may lie there.
    ready: Vec<AtomicBool>,
}

/// What the error handler needs to name a dead peer.
struct ErrContext {
    peer: usize,
    mailbox: Arc<Mailbox>,
    ucp: *const Ucp,
}

unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: `arg` is the ErrContext the progress thread keeps alive for as
    // long as the endpoint exists; called on that thread.
    let ctx = unsafe { &*(arg as *const ErrContext) };
    let what = unsafe { &*ctx.ucp }.describe(status);
    ctx.mailbox.peer_died(
        ctx.peer,
        format!("UCX reported its endpoint failed ({what}): the process died or the link broke"),
    );
}

/// How to reach one rank.
pub struct PeerAddress {
    /// Its UCP worker address.
    pub worker: Vec<u8>,
    /// Its process id when it runs on this rank's node and this rank can
    /// watch its process (same boot, same PID namespace): the endpoint may
    /// then use shared memory. `None`: network transports only.
    pub local_pid: Option<u32>,
}

/// A node-local peer's process as seen at connect time.
struct Watched {
    peer: usize,
    pid: u32,
    /// Start time (clock ticks after boot, /proc/PID/stat field 22), so a
    /// recycled PID is not mistaken for the peer.
    start: u64,
    /// Seen gone once; declared dead at the next check unless its goodbye
    /// arrived in between (shared memory may still hold it).
    suspect: bool,
}

/// State and start time of a process, from `/proc/PID/stat`; `None` when it
/// does not exist.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ..." — comm may hold spaces and parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// One rank's end of a UCX world.
pub struct UcxTransport {
    rank: usize,
    world_size: usize,
    mailbox: Arc<Mailbox>,
    local: Arc<Local>,
    commands: mpsc::Sender<Command>,
    wake: Arc<Wake>,
    thread: Option<JoinHandle<()>>,
}

/// How the idle progress thread sleeps and how a sender wakes it. Idle, it
/// blocks in `poll` on UCX's event fd (an arriving message) and on an
/// eventfd of its own (a command: a send, a release), as gloo's threads
/// block in the kernel: ranks that share cores with their compute threads
/// (4 ranks on 2 cores; 8 ranks per GPU node's CPU) lose no time to a
/// thread polling for messages that are not there (docs/BENCHMARKS.md,
/// zeropp.torch on one node). Without UCX's event fd it naps instead.
struct Wake {
    /// Set while the progress thread may sleep: commands then signal.
    sleeping: AtomicBool,
    /// The eventfd a command writes; `None` where the kernel gave none.
    fd: Option<OwnedFd>,
    /// The progress thread, for the naps' unpark.
    thread: OnceLock<Thread>,
    /// Times the idle thread slept or napped (what being idle costs).
    rounds: std::sync::atomic::AtomicU64,
}

impl Wake {
    fn new() -> Wake {
        // SAFETY: eventfd(2) with valid flags; a non-negative result is a
        // fresh fd owned from here on.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        Wake {
            sleeping: AtomicBool::new(false),
            fd: (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw) }),
            thread: OnceLock::new(),
            rounds: Default::default(),
        }
    }

    /// Called after a command is queued: wakes the thread if it may sleep.
    fn wake(&self) {
        // Pairs with the fence in `progress_loop`: either the thread sees
        // the command, or this sees `sleeping` and signals.
        fence(Ordering::SeqCst);
        if !self.sleeping.load(Ordering::Relaxed) {
            return;
        }
        if let Some(fd) = &self.fd {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to our eventfd; a
            // full counter (EAGAIN) still leaves it readable.
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Empties the eventfd after a wakeup.
    fn drain(&self) {
        if let Some(fd) = &self.fd {
            let mut buf = [0u8; 8];
            // SAFETY: reads at most 8 bytes into a live buffer; non-blocking.
            unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
        }
    }
}

fn fail(what: &str, ucp: &Ucp, s: ucs_status_t) -> CommError {
    CommError::Ucx {
        what: format!("{what} failed"),
        status: ucp.describe(s),
    }
}

/// Everything the progress thread owns.
struct Worker {
    ucp: Box<Ucp>,
    context: ucp_context_h,
    worker: ucp_worker_h,
    eps: Vec<ucp_ep_h>,
    // Boxed: UCX holds a pointer to each context, which must not move when
    // the vector grows.
    #[allow(clippy::vec_box)]
    err_contexts: Vec<Box<ErrContext>>,
    /// Node-local peers reached without error handling, watched by PID.
    watched: Vec<Watched>,
    /// Watched peers found dead: their endpoints are closed by force.
    dead: Vec<usize>,
    /// UCX's event fd (the worker has the wakeup feature), if it gave one.
    efd: Option<i32>,
}

enum Op {
    Send {
        peer: usize,
        done: SendHandle,
        _iov: Box<[ucp_dt_iov_t; 2]>,
        _header: Box<[u8; HEADER]>,
        _data: Bytes,
    },
}

/// A message being received: done once `req` is null (`failed` says how).
struct Receiving {
    req: *mut c_void,
    failed: bool,
    buf: RecvBuf,
}

/// Where a message is received: a pooled buffer, or (large ones, when a
/// node-local peer may be sent them on) this rank's shared segment.
enum RecvBuf {
    Pool(PooledBuf),
    Segment(SegmentBuf),
}

impl RecvBuf {
    fn len(&self) -> usize {
        match self {
            RecvBuf::Pool(b) => b.len(),
            RecvBuf::Segment(b) => b.len(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            RecvBuf::Pool(b) => b.as_mut_slice(),
            RecvBuf::Segment(b) => b.as_mut_slice(),
        }
    }

    fn into_bytes(self) -> Bytes {
        match self {
            RecvBuf::Pool(b) => b.into_bytes(),
            RecvBuf::Segment(b) => b.into_bytes(),
        }
    }
}

impl AsRef<[u8]> for RecvBuf {
    fn as_ref(&self) -> &[u8] {
        match self {
            RecvBuf::Pool(b) => b.as_ref(),
            RecvBuf::Segment(b) => b.as_ref(),
        }
    }
}

impl Worker {
    fn create() -> Result<Worker, CommError> {
        let ucp = Box::new(Ucp::load().map_err(|e| CommError::Ucx {
            what: "library".into(),
            status: e.to_string(),
        })?);
        let mut config = ptr::null_mut();
        // SAFETY: prototypes from ucp.h; out-pointers are valid locals.
        unsafe {
            let s = (ucp.config_read)(ptr::null(), ptr::null(), &mut config);
            if s != UCS_OK {
                return Err(fail("config_read", &ucp, s));
            }
            for (var, name, value) in TUNED_DEFAULTS {
                if std::env::var_os(var).is_some() {
                    continue; // the user's setting wins
                }
                let (n, v) = (CString::new(*name), CString::new(*value));
                let (Ok(n), Ok(v)) = (n, v) else { continue };
                let s = (ucp.config_modify)(config, n.as_ptr(), v.as_ptr());
                if s != UCS_OK {
                    tracing::debug!("UCX ignored {name}={value}: {}", ucp.describe(s));
                }
            }
            // With wakeup if this UCX offers it; without, the thread naps.
            let mut context = ptr::null_mut();
            let mut s = UCS_OK;
            for features in [UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP, UCP_FEATURE_TAG] {
                let mut params = Params::new();
                params.put_u64(PARAMS_FIELD_MASK, UCP_PARAM_FIELD_FEATURES);
                params.put_u64(PARAMS_FEATURES, features);
                s = (ucp.init_version)(
                    UCP_API_MAJOR,
                    UCP_API_MINOR,
                    params.as_ptr(),
                    config,
                    &mut context,
                );
                if s == UCS_OK {
                    break;
                }
            }
            (ucp.config_release)(config);
            if s != UCS_OK {
                return Err(fail("init", &ucp, s));
            }
            let mut wp = Params::new();
            wp.put_u64(WORKER_FIELD_MASK, UCP_WORKER_PARAM_FIELD_THREAD_MODE);
            wp.put_u32(WORKER_THREAD_MODE, UCS_THREAD_MODE_SINGLE);
            let mut worker = ptr::null_mut();
            let s = (ucp.worker_create)(context, wp.as_ptr(), &mut worker);
            if s != UCS_OK {
                (ucp.cleanup)(context);
                return Err(fail("worker_create", &ucp, s));
            }
            let mut efd = -1;
            let efd = ((ucp.worker_get_efd)(worker, &mut efd) == UCS_OK && efd >= 0).then_some(efd);
            Ok(Worker {
                ucp,
                context,
                worker,
                eps: Vec::new(),
                err_contexts: Vec::new(),
                watched: Vec::new(),
                dead: Vec::new(),
                efd,
            })
        }
    }

    fn address(&self) -> Result<Vec<u8>, CommError> {
        let (mut addr, mut len) = (ptr::null_mut(), 0usize);
        // SAFETY: valid worker; the address is copied out, then released.
        unsafe {
            let s = (self.ucp.worker_get_address)(self.worker, &mut addr, &mut len);
            if s != UCS_OK {
                return Err(fail("worker_get_address", &self.ucp, s));
            }
            let bytes = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
            (self.ucp.worker_release_address)(self.worker, addr);
            Ok(bytes)
        }
    }

    fn connect(
        &mut self,
        rank: usize,
        peers: &[PeerAddress],
        mailbox: &Arc<Mailbox>,
    ) -> Result<(), CommError> {
        for (peer, address) in peers.iter().enumerate() {
            let ctx = Box::new(ErrContext {
                peer,
                mailbox: mailbox.clone(),
                ucp: &*self.ucp,
            });
            // A node-local peer whose process is visible goes without error
            // handling (shared memory allowed) and is watched by PID.
            let watch = match address.local_pid {
                Some(pid) if peer != rank => proc_stat(pid).map(|(_, start)| Watched {
                    peer,
                    pid,
                    start,
                    suspect: false,
                }),
                _ => None,
            };
            let unguarded = peer == rank || watch.is_some();
            let mut p = Params::new();
            p.put_u64(EP_ADDRESS, address.worker.as_ptr() as u64);
            if unguarded {
                p.put_u64(EP_FIELD_MASK, UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
            } else {
                p.put_u64(
                    EP_FIELD_MASK,
                    UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                        | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                        | UCP_EP_PARAM_FIELD_ERR_HANDLER,
                );
                p.put_u32(EP_ERR_MODE, UCP_ERR_HANDLING_MODE_PEER);
                p.put_u64(EP_ERR_HANDLER_CB, on_endpoint_error as *const () as u64);
                p.put_u64(EP_ERR_HANDLER_ARG, &*ctx as *const ErrContext as u64);
            }
            let mut ep = ptr::null_mut();
            // SAFETY: the address bytes outlive the call (UCX copies them).
            let s = unsafe { (self.ucp.ep_create)(self.worker, p.as_ptr(), &mut ep) };
            if s != UCS_OK {
                return Err(CommError::Ucx {
                    what: format!("could not reach rank {peer} from rank {rank}"),
                    status: self.ucp.describe(s),
                });
            }
            self.eps.push(ep);
            self.err_contexts.push(ctx);
            self.watched.extend(watch);
        }
        Ok(())
    }

    /// Checks the watched node-local processes; a peer seen gone twice in a
    /// row (its goodbye did not arrive in between) is reported dead and
    /// returned.
    fn check_watched(&mut self, inbox: &Mailbox) -> Vec<usize> {
        let mut died = Vec::new();
        for w in &mut self.watched {
            let alive = matches!(proc_stat(w.pid), Some((state, start))
                if start == w.start && state != 'Z' && state != 'X');
            if alive {
                w.suspect = false;
            } else if !w.suspect {
                w.suspect = true;
            } else {
                inbox.peer_died(
                    w.peer,
                    format!(
                        "its process (pid {}) is gone: it was killed or crashed",
                        w.pid
                    ),
                );
                died.push(w.peer);
            }
        }
        self.dead.extend(&died);
        // A peer reported dead (or gone after its goodbye) needs no more checks.
        self.watched
            .retain(|w| !w.suspect || !inbox.is_gone(w.peer));
        died
    }

    fn progress(&self) -> bool {
        // SAFETY: valid worker, on its owning thread.
        unsafe { (self.ucp.worker_progress)(self.worker) > 0 }
    }

    /// Sleeps until UCX has an event, `wake` is signalled or `timeout`
    /// passes; `false` (at once) when this worker cannot sleep on its
    /// event fd, and the caller naps instead.
    fn sleep(&self, wake: &Wake, timeout: Duration) -> bool {
        let (Some(efd), Some(own)) = (self.efd, wake.fd.as_ref()) else {
            return false;
        };
        // SAFETY: valid worker, on its owning thread.
        match unsafe { (self.ucp.worker_arm)(self.worker) } {
            UCS_OK => {}
            UCS_ERR_BUSY => return true, // events to progress: no sleep
            _ => return false,
        }
        let mut fds = [
            libc::pollfd {
                fd: efd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: own.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: two valid pollfd entries; both fds live for the call.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        wake.drain();
        true
    }

    /// Posts a tagged send of header + payload; `None` if it completed at once.
    fn post_send(
        &self,
        peer: usize,
        kind: u32,
        source: usize,
        tag: Tag,
        data: Bytes,
        done: SendHandle,
    ) -> Result<Option<(*mut c_void, Op)>, SendFailed> {
        let mut header = Box::new([0u8; HEADER]);
        header[0..4].copy_from_slice(&kind.to_le_bytes());
        header[4..8].copy_from_slice(&(source as u32).to_le_bytes());
        header[8..16].copy_from_slice(&tag.to_le_bytes());
        let iov = Box::new([
            ucp_dt_iov_t {
                buffer: header.as_ptr().cast(),
                length: HEADER,
            },
            ucp_dt_iov_t {
                buffer: data.as_ptr().cast(),
                length: data.len(),
            },
        ]);
        let mut p = Params::new();
        p.put_u32(REQ_OP_ATTR_MASK, UCP_OP_ATTR_FIELD_DATATYPE);
        p.put_u64(REQ_DATATYPE, UCP_DATATYPE_IOV);
        // SAFETY: the iov, header and data stay alive (in `Op::Send`) until
        // the request completes.
        let r = unsafe {
            // The UCX tag is the source rank: the receiver knows at probe
            // time whose message it is, and keeps each source's in order.
            let ucx_tag = source as u64;
            (self.ucp.tag_send_nbx)(self.eps[peer], iov.as_ptr().cast(), 2, ucx_tag, p.as_ptr())
        };
        if r.is_null() {
            drop(data);
            done.complete(Ok(()));
            return Ok(None);
        }
        if ptr_is_err(r) {
            return Err(SendFailed(self.ucp.describe(ptr_status(r))));
        }
        Ok(Some((
            r,
            Op::Send {
                peer,
                done,
                _iov: iov,
                _header: header,
                _data: data,
            },
        )))
    }

    fn free(&self, req: *mut c_void) {
        // SAFETY: a request UCX handed us and that has completed.
        unsafe { (self.ucp.request_free)(req) }
    }

    fn status(&self, req: *mut c_void) -> ucs_status_t {
        // SAFETY: a live request.
        unsafe { (self.ucp.request_check_status)(req) }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: on the owning thread. Endpoints are closed in flush mode,
        // so what was sent (the goodbyes included) reaches live peers, and by
        // force to peers known dead; a dead peer UCX does not know of cannot
        // flush, so after 2 s the close requests are released
        // and UCX finishes them in the background. Then the worker and the
        // context go.
        unsafe {
            let flush = Params::new();
            let mut force = Params::new();
            force.put_u32(REQ_OP_ATTR_MASK, UCP_OP_ATTR_FIELD_FLAGS);
            force.put_u32(REQ_FLAGS, UCP_EP_CLOSE_FLAG_FORCE);
            let mut closing = Vec::new();
            for (peer, &ep) in self.eps.iter().enumerate() {
                let p = if self.dead.contains(&peer) {
                    &force
                } else {
                    &flush
                };
                let r = (self.ucp.ep_close_nbx)(ep, p.as_ptr());
                if !r.is_null() && !ptr_is_err(r) {
                    closing.push(r);
                }
            }
            let until = Instant::now() + Duration::from_secs(2);
            while Instant::now() < until
                && closing
                    .iter()
                    .any(|&r| (self.ucp.request_check_status)(r) == UCS_INPROGRESS)
            {
                (self.ucp.worker_progress)(self.worker);
            }
            for r in closing {
                (self.ucp.request_free)(r);
            }
            (self.ucp.worker_destroy)(self.worker);
            (self.ucp.cleanup)(self.context);
        }
    }
}

/// Whether libucp can be loaded here.
/// A worker address as it travels in rendezvous facts: lowercase hex.
pub fn address_to_hex(address: &[u8]) -> String {
    address.iter().map(|b| format!("{b:02x}")).collect()
}

/// The inverse of [`address_to_hex`]; `None` for anything that is not a
/// non-empty, even-length hex string.
pub fn address_from_hex(hex: &str) -> Option<Vec<u8>> {
    let b = hex.as_bytes();
    if b.is_empty() || !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks_exact(2)
        .map(|pair| {
            let digit = |c: u8| (c as char).to_digit(16);
            Some((digit(pair[0])? * 16 + digit(pair[1])?) as u8)
        })
        .collect()
}

/// Whether libucp loads here; why not, with what to do.
pub fn available() -> Result<(), NotLoaded> {
    Ucp::load().map(|_| ())
}

impl UcxTransport {
    /// Creates this rank's worker, publishes its address through `exchange`
    /// (which must return how to reach every rank, in rank order), and
    /// connects.
    pub fn connect(
        rank: usize,
        world_size: usize,
        exchange: impl FnOnce(Vec<u8>) -> Result<Vec<PeerAddress>, CommError>,
    ) -> Result<UcxTransport, CommError> {
        let segment_size =
            shm::segment_size_from(std::env::var("ZEROPP_SHM_SEGMENT").ok().as_deref())?;
        Self::connect_with(rank, world_size, segment_size, exchange)
    }

    /// [`UcxTransport::connect`] with a shared segment of `segment_size`
    /// bytes (0: none) whatever the environment says.
    fn connect_with(
        rank: usize,
        world_size: usize,
        segment_size: usize,
        exchange: impl FnOnce(Vec<u8>) -> Result<Vec<PeerAddress>, CommError>,
    ) -> Result<UcxTransport, CommError> {
        let pool = BufferPool::from_env()?;
        let segment = match segment_size {
            0 => None,
            size => Segment::create(size, world_size)
                .map(Arc::new)
                .map_err(|e| {
                    tracing::warn!(
                        "no single-copy shared memory ({e}): node-local messages go through \
                         UCX alone"
                    )
                })
                .ok(),
        };
        let local = Arc::new(Local {
            segment,
            ready: (0..world_size).map(|_| AtomicBool::new(false)).collect(),
        });
        let mailbox = Arc::new(Mailbox::default());
        let (addr_tx, addr_rx) = mpsc::channel::<Result<Vec<u8>, CommError>>();
        let (table_tx, table_rx) = mpsc::channel::<Vec<PeerAddress>>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), CommError>>();
        let (commands, command_rx) = mpsc::channel::<Command>();
        let inbox = mailbox.clone();
        let shared = local.clone();
        let releases = commands.clone();
        let wake = Arc::new(Wake::new());
        let waker = wake.clone();
        let thread = std::thread::Builder::new()
            .name("zeropp-ucx".into())
            .spawn(move || {
                let mut worker = match Worker::create().and_then(|w| w.address().map(|a| (w, a))) {
                    Ok((w, a)) => {
                        let _ = addr_tx.send(Ok(a));
                        w
                    }
                    Err(e) => {
                        let _ = addr_tx.send(Err(e));
                        return;
                    }
                };
                let Ok(table) = table_rx.recv() else { return };
                let connected = worker.connect(rank, &table, &inbox);
                let ok = connected.is_ok();
                let _ = ready_tx.send(connected);
                if ok {
                    let ends = Ends {
                        rank,
                        world: world_size,
                        inbox: &inbox,
                        pool: &pool,
                        local: &shared,
                        releases,
                        wake: waker,
                    };
                    progress_loop(&mut worker, &ends, command_rx);
                }
                inbox.close();
            })
            .map_err(super::io_err("the UCX progress thread"))?;
        let address = addr_rx.recv().map_err(|_| CommError::Closed)??;
        let table = exchange(address)?;
        if table.len() != world_size {
            return Err(CommError::Join(format!(
                "{} UCX addresses for {world_size} ranks",
                table.len()
            )));
        }
        let _ = table_tx.send(table);
        ready_rx.recv().map_err(|_| CommError::Closed)??;
        Ok(UcxTransport {
            rank,
            world_size,
            mailbox,
            local,
            commands,
            wake,
            thread: Some(thread),
        })
    }
}

/// What the progress thread works with besides the worker.
struct Ends<'a> {
    rank: usize,
    world: usize,
    inbox: &'a Mailbox,
    pool: &'a Arc<BufferPool>,
    local: &'a Arc<Local>,
    /// Where dropped views of peers' segments report (`Command::Release`).
    releases: mpsc::Sender<Command>,
    /// Wakes this thread when a release is queued.
    wake: Arc<Wake>,
}

/// What an arrived message asks of the progress thread.
enum Arrival {
    /// Filed in the mailbox (or dropped with a warning).
    Done,
    Goodbye,
    /// A peer offers its segment.
    Hello {
        peer: usize,
        fd: i32,
        size: usize,
    },
    /// A peer mapped this rank's segment.
    Ready {
        peer: usize,
    },
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Runs on the progress thread until shutdown: posts sends, progresses the
/// worker, receives every arriving message into the mailbox.
fn progress_loop(w: &mut Worker, ends: &Ends, commands: mpsc::Receiver<Command>) {
    let _ = ends.wake.thread.set(std::thread::current());
    let mut p = Progress::new(ends);
    p.offer_segment(w);
    loop {
        let mut busy = p.take_commands(w, &commands);
        busy |= w.progress();
        busy |= p.post_receives(w);
        busy |= p.complete_sends(w);
        let (received, arrived) = p.complete_receives(w);
        busy |= received;
        for buf in arrived {
            p.handle(w, buf);
        }
        p.watch_the_dead(w);
        if p.finished_shutdown(w) {
            return;
        }
        p.rest(w, busy);
    }
}

/// The progress thread's state between rounds.
struct Progress<'e, 'a> {
    ends: &'e Ends<'a>,
    /// Sends under way.
    pending: Vec<(*mut c_void, Op)>,
    /// Receives per source in the order UCX matched them (messages from a
    /// stray source last): a large message probed at its first fragment
    /// completes after a small one probed behind it, and is delivered first.
    receiving: Vec<VecDeque<Receiving>>,
    /// Rounds without work.
    idle: u32,
    goodbyes: usize,
    shutting_down: Option<Instant>,
    next_watch: Instant,
    /// Peers' segments, mapped when they offer them.
    segments: Vec<Option<Arc<PeerSegment>>>,
}

impl<'e, 'a> Progress<'e, 'a> {
    fn new(ends: &'e Ends<'a>) -> Self {
        let world = ends.world;
        Progress {
            ends,
            pending: Vec::new(),
            receiving: (0..=world).map(|_| VecDeque::new()).collect(),
            idle: 0,
            goodbyes: 0,
            shutting_down: None,
            next_watch: Instant::now() + WATCH_EVERY,
            segments: (0..world).map(|_| None).collect(),
        }
    }

    /// Posts a send; a send that cannot be posted fails its peer.
    fn post(
        &mut self,
        w: &Worker,
        peer: usize,
        kind: u32,
        tag: Tag,
        data: Bytes,
        done: SendHandle,
    ) {
        match w.post_send(peer, kind, self.ends.rank, tag, data, done.clone()) {
            Ok(Some(p)) => self.pending.push(p),
            Ok(None) => {}
            Err(reason) => {
                self.ends
                    .inbox
                    .peer_died(peer, format!("sending to it failed: {reason}"));
                done.complete(Err(reason));
            }
        }
    }

    /// Offers this rank's segment to the peers that can map it.
    fn offer_segment(&mut self, w: &Worker) {
        let Some(seg) = &self.ends.local.segment else {
            return;
        };
        let mut hello = Vec::with_capacity(12);
        hello.extend_from_slice(&(seg.fd() as u32).to_le_bytes());
        hello.extend_from_slice(&(seg.size() as u64).to_le_bytes());
        let hello = Bytes::from(hello);
        for peer in w.watched.iter().map(|x| x.peer).collect::<Vec<_>>() {
            let done = SendHandle::default();
            self.post(w, peer, KIND_SHM_HELLO, 0, hello.clone(), done);
        }
    }

    /// New sends, releases of peers' segments, and shutdown (goodbyes to
    /// every peer); whether there were any.
    fn take_commands(&mut self, w: &Worker, commands: &mpsc::Receiver<Command>) -> bool {
        let mut busy = false;
        while self.shutting_down.is_none() {
            match commands.try_recv() {
                Ok(Command::Send {
                    peer,
                    kind,
                    tag,
                    data,
                    done,
                }) => {
                    busy = true;
                    self.post(w, peer, kind, tag, data, done);
                }
                Ok(Command::Release { peer, off }) => {
                    busy = true;
                    let data = Bytes::copy_from_slice(&off.to_le_bytes());
                    self.post(w, peer, KIND_SHM_FREE, 0, data, SendHandle::default());
                }
                Ok(Command::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                    let (rank, world) = (self.ends.rank, self.ends.world);
                    for peer in (0..world).filter(|&p| p != rank) {
                        let bye = Bytes::new();
                        if let Ok(Some(p)) =
                            w.post_send(peer, KIND_GOODBYE, rank, 0, bye, SendHandle::default())
                        {
                            self.pending.push(p);
                        }
                    }
                    self.shutting_down = Some(Instant::now());
                }
                Err(mpsc::TryRecvError::Empty) => break,
            }
        }
        busy
    }

    /// Posts a receive for every message that has arrived; whether any
    /// had.
    fn post_receives(&mut self, w: &Worker) -> bool {
        let (ends, world) = (self.ends, self.ends.world);
        let mut busy = false;
        loop {
            let mut info = ucp_tag_recv_info_t::default();
            // SAFETY: valid worker; `info` is a valid out-pointer.
            let msg = unsafe { (w.ucp.tag_probe_nb)(w.worker, 0, 0, 1, &mut info) };
            if msg.is_null() {
                return busy;
            }
            busy = true;
            // A reused buffer when one of about this size came back: no
            // page faults (comm/pool.rs); UCX overwrites all of it.
            let forwardable = info.length >= HEADER + shm::MIN_SHM
                && ends.local.ready.iter().any(|r| r.load(Ordering::Relaxed));
            let mut buf = match &ends.local.segment {
                Some(seg) if forwardable => seg.receive_buffer(info.length).map(RecvBuf::Segment),
                _ => None,
            }
            .unwrap_or_else(|| RecvBuf::Pool(ends.pool.take(info.length)));
            let p = Params::new();
            let from = (info.sender_tag as usize).min(world);
            // SAFETY: `buf` has exactly the message's length and is kept in
            // `receiving` until the request completes.
            let r = unsafe {
                (w.ucp.tag_msg_recv_nbx)(
                    w.worker,
                    buf.as_mut_slice().as_mut_ptr().cast(),
                    buf.len(),
                    msg,
                    p.as_ptr(),
                )
            };
            if ptr_is_err(r) {
                tracing::warn!("UCX receive failed: {}", w.ucp.describe(ptr_status(r)));
                continue;
            }
            self.receiving[from].push_back(Receiving {
                req: r,
                failed: false,
                buf,
            });
        }
    }

    /// Completes the sends UCX finished; whether any.
    fn complete_sends(&mut self, w: &Worker) -> bool {
        let mut busy = false;
        let mut i = 0;
        while i < self.pending.len() {
            let s = w.status(self.pending[i].0);
            if s == UCS_INPROGRESS {
                i += 1;
                continue;
            }
            busy = true;
            let (req, op) = self.pending.swap_remove(i);
            w.free(req);
            // The bytes let go before the send completes: a reused buffer
            // is back in its pool when the sender's wait ends.
            let Op::Send { done, _data, .. } = op;
            drop(_data);
            match s == UCS_OK {
                true => done.complete(Ok(())),
                false => done.complete(Err(SendFailed(w.ucp.describe(s)))),
            }
        }
        busy
    }

    /// The receives UCX finished, each source's in the order they were
    /// matched: whether any, and the buffers to deliver.
    fn complete_receives(&mut self, w: &Worker) -> (bool, Vec<RecvBuf>) {
        let mut busy = false;
        let mut arrived = Vec::new();
        for queue in &mut self.receiving {
            for r in queue.iter_mut().filter(|r| !r.req.is_null()) {
                let s = w.status(r.req);
                if s != UCS_INPROGRESS {
                    busy = true;
                    w.free(r.req);
                    r.req = ptr::null_mut();
                    if s != UCS_OK {
                        tracing::warn!("UCX receive failed: {}", w.ucp.describe(s));
                        r.failed = true;
                    }
                }
            }
            while queue.front().is_some_and(|r| r.req.is_null()) {
                let r = queue.pop_front().expect("checked");
                if !r.failed {
                    arrived.push(r.buf);
                }
            }
        }
        (busy, arrived)
    }

    /// Delivers one received message and does what it asks.
    fn handle(&mut self, w: &Worker, buf: RecvBuf) {
        let rank = self.ends.rank;
        match deliver(self.ends, &self.segments, buf) {
            Arrival::Done => {}
            Arrival::Goodbye => self.goodbyes += 1,
            Arrival::Hello { peer, fd, size } => {
                if self.segments[peer].is_some() {
                    // Offered once: a second mapping would be a second
                    // producer on this rank's ring.
                    tracing::warn!("rank {peer} offered its segment twice; kept the first");
                    return;
                }
                let Some(pid) = w.watched.iter().find(|x| x.peer == peer).map(|x| x.pid) else {
                    return; // not a peer whose process this rank sees
                };
                match PeerSegment::open(pid, fd, size, rank, self.ends.world) {
                    Ok(seg) => {
                        self.segments[peer] = Some(Arc::new(seg));
                        let done = SendHandle::default();
                        self.post(w, peer, KIND_SHM_READY, 0, Bytes::new(), done);
                    }
                    Err(e) => tracing::warn!(
                        "rank {rank} cannot map rank {peer}'s shared segment ({e}): \
                         messages from it go through UCX alone"
                    ),
                }
            }
            Arrival::Ready { peer } => self.ends.local.ready[peer].store(true, Ordering::Release),
        }
    }

    /// Shared memory never fails a send to a dead process: every
    /// `WATCH_EVERY`, fails the waits on the peers whose process is gone
    /// (the buffers stay with the request until shutdown).
    fn watch_the_dead(&mut self, w: &mut Worker) {
        if w.watched.is_empty() || Instant::now() < self.next_watch {
            return;
        }
        for dead in w.check_watched(self.ends.inbox) {
            self.ends.local.ready[dead].store(false, Ordering::Release);
            if let Some(seg) = &self.ends.local.segment {
                seg.forget(dead);
            }
            for (_, op) in &self.pending {
                if let Op::Send { peer, done, .. } = op
                    && *peer == dead
                {
                    done.complete(Err(SendFailed(format!("rank {dead}'s process is gone"))));
                }
            }
        }
        self.next_watch = Instant::now() + WATCH_EVERY;
    }

    /// Shutting down: whether to leave now — once our goodbyes are flushed
    /// and every peer's has arrived (so none is left unmatched in UCX), a
    /// dead peer counting as both, or after 2 s; the requests freed then.
    fn finished_shutdown(&mut self, w: &Worker) -> bool {
        let Some(since) = self.shutting_down else {
            return false;
        };
        let flushed = self.pending.iter().all(|(_, op)| match op {
            Op::Send { peer, .. } => w.dead.contains(peer),
        });
        let all_said = self.goodbyes + 1 + w.dead.len() >= self.ends.world;
        if !(flushed && all_said) && since.elapsed() <= Duration::from_secs(2) {
            return false;
        }
        for (req, _) in self.pending.drain(..) {
            w.free(req);
        }
        for r in self.receiving.iter_mut().flat_map(|q| q.drain(..)) {
            if !r.req.is_null() {
                w.free(r.req);
            }
        }
        true
    }

    /// After a round: go on at once if it was `busy`, else spin briefly,
    /// then yield the core (ranks often share cores).
    fn rest(&mut self, w: &Worker, busy: bool) {
        let wake = &self.ends.wake;
        if busy {
            self.idle = 0;
            wake.sleeping.store(false, Ordering::Relaxed);
            return;
        }
        self.idle = self.idle.saturating_add(1);
        // From here commands signal (`Wake::wake`); one more round reads
        // the queue after the fence, so none is missed.
        if self.idle == SPIN {
            wake.sleeping.store(true, Ordering::Relaxed);
            fence(Ordering::SeqCst);
        } else if self.idle > SPIN {
            wake.rounds.fetch_add(1, Ordering::Relaxed);
            // Sleep in the kernel until a message or a command arrives,
            // waking for the dead-peer watch and shutdown.
            let timeout = match self.shutting_down {
                Some(_) => Duration::from_millis(10),
                None if w.watched.is_empty() => SLEEP,
                None => self
                    .next_watch
                    .saturating_duration_since(Instant::now())
                    .min(SLEEP),
            };
            if !w.sleep(wake, timeout) {
                // No event fd: nap, and after a long quiet spell (no
                // traffic for ~100 ms: evaluation, a one-rank job) wake
                // less often.
                if self.idle > SPIN + NAP_ROUNDS {
                    std::thread::park_timeout(LONG_NAP);
                } else {
                    std::thread::park_timeout(NAP);
                }
            }
        }
    }
}

/// Handles a received `[header | payload]`: data is filed in the mailbox
/// (a single-copy message as a view of the sender's segment), a freed range
/// goes back to this rank's segment, and what needs the worker is returned.
fn deliver(ends: &Ends, segments: &[Option<Arc<PeerSegment>>], buf: RecvBuf) -> Arrival {
    let (inbox, world) = (ends.inbox, ends.world);
    if buf.len() < HEADER {
        tracing::warn!(
            "dropped a {}-byte UCX message: shorter than the header",
            buf.len()
        );
        return Arrival::Done;
    }
    let head = &buf.as_ref()[..HEADER];
    let kind = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let source = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
    let tag = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
    if source >= world {
        tracing::warn!("dropped a UCX message claiming to come from rank {source} of {world}");
        return Arrival::Done;
    }
    let body = &buf.as_ref()[HEADER..];
    match kind {
        KIND_DATA => inbox.deliver(source, tag, buf.into_bytes().slice(HEADER..)),
        KIND_GOODBYE => {
            inbox.peer_left(
                source,
                "it closed its connections (it finished or shut down)".into(),
            );
            return Arrival::Goodbye;
        }
        KIND_SHM_DATA => {
            let place = u64_at(body, 0).zip(u64_at(body, 8)).zip(u64_at(body, 16));
            let seg = segments[source].as_ref();
            match (place, seg) {
                (Some(((off, len), range)), Some(seg))
                    if range <= off && seg.holds(off as usize, len as usize) =>
                {
                    let releases = ends.releases.clone();
                    let wake = ends.wake.clone();
                    let ring = seg.clone();
                    let release = Box::new(move || {
                        if !ring.release(range)
                            && releases
                                .send(Command::Release {
                                    peer: source,
                                    off: range,
                                })
                                .is_ok()
                        {
                            wake.wake();
                        }
                    });
                    let view = ShmView::new(seg.clone(), off as usize, len as usize, release);
                    inbox.deliver(source, tag, Bytes::from_owner(view));
                }
                _ => inbox.peer_died(
                    source,
                    format!(
                        "it sent a shared-memory message ({place:?}) outside the segment it \
                         offered: a bug or a corrupted message"
                    ),
                ),
            }
        }
        KIND_SHM_FREE => {
            let freed = ends.local.segment.as_ref().zip(u64_at(body, 0));
            if !freed.is_some_and(|(seg, off)| seg.release(off as usize, Holder::Peer(source))) {
                tracing::warn!(
                    "rank {source} returned a range of this rank's segment it was not given"
                );
            }
        }
        KIND_SHM_HELLO => {
            let fd = body
                .get(0..4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4")));
            if let (Some(fd), Some(size)) = (fd, u64_at(body, 4)) {
                return Arrival::Hello {
                    peer: source,
                    fd: fd as i32,
                    size: size as usize,
                };
            }
            tracing::warn!("dropped a malformed segment offer from rank {source}");
        }
        KIND_SHM_READY => return Arrival::Ready { peer: source },
        other => tracing::warn!("dropped a UCX message of unknown kind {other} from rank {source}"),
    }
    Arrival::Done
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.mailbox.close();
    }
}

impl Transport for UcxTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn send(&self, peer: usize, tag: Tag, data: Bytes) -> Result<SendHandle, CommError> {
        if peer >= self.world_size {
            return Err(CommError::NoSuchRank {
                peer,
                world: self.world_size,
            });
        }
        // Large messages to a peer that mapped this rank's segment are
        // copied there (here, on the caller's thread) and travel as a place.
        // Bytes already there (staged) are shared, not copied.
        let mut kind = KIND_DATA;
        let mut data = data;
        if self.local.ready[peer].load(Ordering::Acquire)
            && let Some(seg) = &self.local.segment
        {
            let placed = seg.share(&data, peer).or_else(|| {
                (data.len() >= shm::MIN_SHM)
                    .then(|| seg.place(&data, Holder::Peer(peer)))
                    .flatten()
                    .map(|off| (off, off))
            });
            if let Some((range, off)) = placed {
                let mut place = Vec::with_capacity(24);
                place.extend_from_slice(&(off as u64).to_le_bytes());
                place.extend_from_slice(&(data.len() as u64).to_le_bytes());
                place.extend_from_slice(&(range as u64).to_le_bytes());
                kind = KIND_SHM_DATA;
                data = Bytes::from(place);
            }
        }
        let done = SendHandle::default();
        self.commands
            .send(Command::Send {
                peer,
                kind,
                tag,
                data,
                done: done.clone(),
            })
            .map_err(|_| CommError::Closed)?;
        self.wake.wake();
        Ok(done)
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Bytes, CommError> {
        if peer >= self.world_size {
            return Err(CommError::NoSuchRank {
                peer,
                world: self.world_size,
            });
        }
        self.mailbox.take(peer, tag, timeout)
    }

    fn probe(&self, peer: usize, tag: Tag) -> bool {
        self.mailbox.has(peer, tag)
    }

    fn stage(&self, peer: usize, data: Bytes) -> Bytes {
        let shared = peer < self.world_size && self.local.ready[peer].load(Ordering::Acquire);
        match &self.local.segment {
            Some(seg) if shared && data.len() >= shm::MIN_SHM && !seg.contains(&data) => {
                seg.stage(&data).unwrap_or(data)
            }
            _ => data,
        }
    }

    fn first_death(&self) -> Option<(usize, String)> {
        self.mailbox.first_death()
    }

    fn contain_deaths(&self, fatal: std::ops::Range<usize>) {
        self.mailbox.contain(fatal)
    }

    fn declare_dead(&self, peer: usize, reason: String) {
        self.mailbox.peer_died(peer, reason)
    }

    fn waiting_from(&self, tag: Tag) -> Vec<usize> {
        self.mailbox.sources_with(tag)
    }

    fn name(&self) -> &'static str {
        "ucx"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks of one process, connected as node-local peers, with
    /// shared segments of `segment` bytes (0: none).
    fn local_pair(segment: usize) -> (UcxTransport, UcxTransport) {
        let board = Arc::new((
            std::sync::Mutex::new(vec![None; 2]),
            std::sync::Condvar::new(),
        ));
        let join = |rank: usize| {
            let board = board.clone();
            std::thread::spawn(move || {
                UcxTransport::connect_with(rank, 2, segment, move |address| {
                    let (m, c) = &*board;
                    let mut slots = m.lock().unwrap();
                    slots[rank] = Some(address);
                    c.notify_all();
                    let slots = c
                        .wait_while(slots, |s| s.iter().any(Option::is_none))
                        .unwrap();
                    Ok(slots
                        .iter()
                        .map(|a| PeerAddress {
                            worker: a.clone().unwrap(),
                            local_pid: Some(std::process::id()),
                        })
                        .collect())
                })
                .unwrap()
            })
        };
        let (a, b) = (join(0), join(1));
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        // With segments, wait until each mapped the other's (the handshake
        // runs in the background), so single-copy sends start at once.
        let until = Instant::now() + Duration::from_secs(20);
        for (t, peer) in [(&a, 1), (&b, 0)] {
            while segment > 0 && !t.local.ready[peer].load(Ordering::Acquire) {
                assert!(
                    Instant::now() < until,
                    "rank {peer} never mapped the segment"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        (a, b)
    }

    fn placed(t: &UcxTransport) -> usize {
        t.local.segment.as_ref().map_or(0, |s| s.bytes_placed())
    }

    #[test]
    fn large_node_local_messages_arrive_in_place_and_free_their_range_when_dropped() {
        let (a, b) = local_pair(shm::DEFAULT_SEGMENT);
        let timeout = Duration::from_secs(20);
        let big: Vec<u8> = (0..shm::MIN_SHM + 12_345)
            .map(|i| (i % 253) as u8)
            .collect();
        let small = vec![7u8; 1000];
        // Same tag: order kept across the two paths.
        for msg in [&big, &small, &big] {
            a.send(1, 9, Bytes::from(msg.clone()))
                .unwrap()
                .wait(1, timeout)
                .unwrap();
        }
        let first = b.recv(0, 9, timeout).unwrap();
        assert_eq!(&first[..], &big[..]);
        assert_eq!(&b.recv(0, 9, timeout).unwrap()[..], &small[..]);
        let third = b.recv(0, 9, timeout).unwrap();
        assert_eq!(&third[..], &big[..]);
        let range = big.len().next_multiple_of(4096);
        assert_eq!(placed(&a), 2 * range, "both large ones lie in a's segment");
        let part = first.slice(100..200);
        drop(first);
        drop(third);
        assert_eq!(placed(&a), range, "a slice keeps its range");
        assert_eq!(&part[..], &big[100..200]);
        drop(part);
        assert_eq!(placed(&a), 0, "released through the ring");
        // Staged once, sent twice: one range, free when all three let go.
        let staged = a.stage(1, Bytes::from(big.clone()));
        assert_eq!(placed(&a), range);
        for _ in 0..2 {
            a.send(1, 11, staged.clone()).unwrap();
        }
        let (x, y) = (
            b.recv(0, 11, timeout).unwrap(),
            b.recv(0, 11, timeout).unwrap(),
        );
        assert_eq!((&x[..], &y[..]), (&big[..], &big[..]));
        assert_eq!(placed(&a), range, "shared, not copied");
        drop(staged);
        drop(x);
        assert_eq!(placed(&a), range);
        drop(y);
        assert_eq!(placed(&a), 0);
        // The other way too.
        b.send(0, 3, Bytes::from(big.clone())).unwrap();
        assert_eq!(&a.recv(1, 3, timeout).unwrap()[..], &big[..]);
    }

    /// A large eager message is matched at its first fragment and completes
    /// after small ones matched behind it; each source's messages are still
    /// delivered in the order they were sent (here under one tag, without
    /// waiting between sends; with a segment too small for the large ones,
    /// so they fall back to eager between single-copy ones).
    #[test]
    fn an_idle_progress_thread_sleeps_in_the_kernel_and_a_send_wakes_it() {
        let (a, b) = local_pair(0);
        let timeout = Duration::from_secs(30);
        let round_trip = |n: u8| {
            a.send(1, 9, Bytes::from(vec![n; 100])).unwrap();
            assert_eq!(b.recv(0, 9, timeout).unwrap()[0], n);
            b.send(0, 9, Bytes::from(vec![n; 100])).unwrap();
            assert_eq!(a.recv(1, 9, timeout).unwrap()[0], n);
        };
        round_trip(1);
        std::thread::sleep(Duration::from_millis(100));
        let before = [&a, &b].map(|t| t.wake.rounds.load(Ordering::Relaxed));
        std::thread::sleep(Duration::from_millis(400));
        let after = [&a, &b].map(|t| t.wake.rounds.load(Ordering::Relaxed));
        // Napping 50 µs at a time would be thousands of naps; asleep on the
        // event fds, a few sleeps (the 100 ms timeout, the peer watch).
        for (x, y) in before.iter().zip(after) {
            assert!(
                y - x < 100,
                "{} sleeps of an idle progress thread in 400 ms",
                y - x
            );
        }
        // Asleep, both threads still wake for a send and a message.
        round_trip(2);
    }

    #[test]
    fn messages_under_one_tag_arrive_in_order_whatever_their_path_and_size() {
        for segment in [0, 12 << 20] {
            let (a, b) = local_pair(segment);
            let timeout = Duration::from_secs(30);
            let sizes = [8 << 20, 10, 5 << 20, 3000, 8 << 20, 0, 6 << 20, 70_000];
            let sent: Vec<Bytes> = (0..4)
                .flat_map(|round| sizes.iter().map(move |&n| (round, n)))
                .enumerate()
                .map(|(i, (_, n))| Bytes::from(vec![i as u8; n]))
                .collect();
            let handles: Vec<_> = sent
                .iter()
                .map(|m| a.send(1, 5, m.clone()).unwrap())
                .collect();
            for (i, m) in sent.iter().enumerate() {
                let got = b.recv(0, 5, timeout).unwrap();
                assert_eq!(got.len(), m.len(), "message {i} (segment {segment})");
                assert!(
                    got.iter().all(|&x| x == i as u8),
                    "message {i} (segment {segment})"
                );
            }
            for h in handles {
                h.wait(1, timeout).unwrap();
            }
        }
    }

    #[test]
    fn a_message_outside_the_offered_segment_fails_the_sender_by_name() {
        let inbox = Mailbox::default();
        let (releases, _rx) = mpsc::channel();
        let local = Arc::new(Local {
            segment: None,
            ready: vec![AtomicBool::new(false), AtomicBool::new(false)],
        });
        let ends = Ends {
            rank: 0,
            world: 2,
            inbox: &inbox,
            pool: &BufferPool::new(0),
            local: &local,
            releases,
            wake: Arc::new(Wake::new()),
        };
        let mut msg = vec![0u8; HEADER + 24];
        msg[0..4].copy_from_slice(&KIND_SHM_DATA.to_le_bytes());
        msg[4..8].copy_from_slice(&1u32.to_le_bytes());
        msg[HEADER + 8..HEADER + 16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let arrival = deliver(
            &ends,
            &[None, None],
            RecvBuf::Pool(PooledBuf::unpooled(msg)),
        );
        assert!(matches!(arrival, Arrival::Done));
        let (peer, reason) = inbox.first_death().expect("rank 1 is failed");
        assert_eq!(peer, 1);
        assert!(reason.contains("outside the segment"), "{reason}");
        let err = inbox.take(1, 0, Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("rank 1 failed"), "{err}");
    }

    #[test]
    fn worker_addresses_round_trip_and_garbage_is_refused_without_a_panic() {
        let a = vec![0u8, 1, 0xab, 0xff];
        assert_eq!(address_to_hex(&a), "0001abff");
        assert_eq!(address_from_hex("0001abff"), Some(a));
        for bad in ["", "0", "zz", "0g", "é1", "ab\u{1F600}"] {
            assert_eq!(address_from_hex(bad), None, "{bad:?}");
        }
    }
}
