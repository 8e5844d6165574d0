//! A collective in flight on a device, written once for every device: the
//! call is launched in the order of the caller's stream and returns at once
//! with a [`Work`]; `is_completed` polls, `wait` makes the caller's stream
//! wait (on CUDA a stream wait: the host goes on) and raises the call's
//! error. A [`Queue`] says what differs: the CUDA queue runs a call's host
//! side where it is launched (its kernels and NCCL calls queue on the
//! stream) and records a CUDA event after it; the emulated device's queue
//! is one thread that runs the calls in order, and its event is the call's
//! own outcome (a marker the thread sets). A [`Watchdog`] per job reads
//! every call's outcome off the critical path: a call that ran past the
//! job's deadline fails the job (its communicators aborted, every pending
//! and later call raising the same error, naming the dead rank when known).

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use zeropp_cuda::CudaError;

use crate::error::ZeroError;

/// A call's result once it is known, and when the call began to run.
#[derive(Default)]
pub struct Outcome {
    state: Mutex<OutcomeState>,
    settled: Condvar,
}

#[derive(Default)]
struct OutcomeState {
    started: Option<Instant>,
    result: Option<Result<(), ZeroError>>,
    /// The result was taken by a wait (the Work raised it once).
    taken: bool,
}

impl Outcome {
    fn lock(&self) -> std::sync::MutexGuard<'_, OutcomeState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The call begins to run (its deadline counts from here).
    pub fn start(&self) {
        self.lock().started.get_or_insert_with(Instant::now);
    }

    /// The call's result; the first one settles it (a call the watchdog
    /// already failed keeps that failure).
    pub fn settle(&self, r: Result<(), ZeroError>) {
        let mut s = self.lock();
        if s.result.is_none() && !s.taken {
            s.result = Some(r);
        }
        self.settled.notify_all();
    }

    pub fn is_settled(&self) -> bool {
        let s = self.lock();
        s.result.is_some() || s.taken
    }

    /// Waits until the call is settled or `deadline`; whether it is.
    pub fn wait_until(&self, deadline: Instant) -> bool {
        let mut s = self.lock();
        while s.result.is_none() && !s.taken {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            s = self
                .settled
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// The result, once: a later call gets `Ok` (the error was raised).
    fn take(&self) -> Result<(), ZeroError> {
        let mut s = self.lock();
        s.taken = true;
        s.result.take().unwrap_or(Ok(()))
    }

    /// When the call began to run, if it has and is not settled.
    fn running_since(&self) -> Option<Instant> {
        let s = self.lock();
        match (&s.result, s.taken) {
            (None, false) => s.started,
            _ => None,
        }
    }
}

/// The order of a device's work: where a call runs and what marks its end.
pub trait Queue: Send + Sync + 'static {
    /// A point in a stream's work: complete once everything launched
    /// before it ran.
    type Event: Send + Sync + 'static;

    /// Runs `call` (which starts and settles `outcome`) in the order of
    /// the work on the caller's stream `stream`; the event after it.
    ///
    /// # Safety
    /// `stream` is a live stream of this device (the caller's current
    /// one), live until the event completes.
    unsafe fn launch(
        &self,
        stream: usize,
        outcome: &Arc<Outcome>,
        call: Box<dyn FnOnce() + Send>,
    ) -> Result<Self::Event, ZeroError>;

    /// Whether `e` completed; never blocks.
    fn query(&self, e: &Self::Event) -> Result<bool, ZeroError>;

    /// Makes the caller's `stream` wait for `e`: on CUDA a stream wait (the
    /// host goes on); the emulated device's caller is its own thread, which
    /// waits until `e` completes or `deadline` (false then).
    ///
    /// # Safety
    /// `stream` is a live stream of this device.
    unsafe fn wait_event(
        &self,
        stream: usize,
        e: &Self::Event,
        deadline: Instant,
    ) -> Result<bool, ZeroError>;
}

/// What the watchdog does to a job whose call ran past its deadline: ends
/// it (the communicators aborted, the message kept for every later call),
/// and the message that names why.
pub trait Fail: Send + Sync + 'static {
    fn fail_stuck(&self, waited: Duration) -> String;
}

/// Reads the calls' outcomes of one job off the critical path: a call
/// that has run longer than the job's deadline (plus the time a transport
/// takes to name a stuck peer) fails the job and every call still
/// pending in it.
pub struct Watchdog {
    pending: Arc<Mutex<Vec<Arc<Outcome>>>>,
    limit: Duration,
}

/// How often the watchdog looks.
const LOOK: Duration = Duration::from_millis(20);

impl Watchdog {
    /// A watchdog for calls of a job whose waits last at most `timeout`:
    /// its thread runs while `job` lives.
    pub fn start<J: Fail>(job: Weak<J>, timeout: Duration) -> Watchdog {
        let pending: Arc<Mutex<Vec<Arc<Outcome>>>> = Arc::default();
        // The transports' own deadline, then their search for the stuck
        // rank (zeropp_comm's liveness inquiry) and the naming of the dead:
        // 8 s more, less for a job whose deadline is shorter than that.
        let limit = timeout + timeout.clamp(Duration::from_secs(1), Duration::from_secs(8));
        let watched = pending.clone();
        let _ = std::thread::Builder::new()
            .name("zeropp-watchdog".into())
            .spawn(move || watch(&job, &watched, limit));
        Watchdog { pending, limit }
    }

    /// Watches `outcome` until it settles.
    pub fn watch(&self, outcome: &Arc<Outcome>) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.push(outcome.clone());
    }

    /// The longest a call may run.
    pub fn limit(&self) -> Duration {
        self.limit
    }
}

fn watch<J: Fail>(job: &Weak<J>, pending: &Mutex<Vec<Arc<Outcome>>>, limit: Duration) {
    loop {
        std::thread::sleep(LOOK);
        let Some(job) = job.upgrade() else {
            return;
        };
        let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|o| !o.is_settled());
        let stuck = p
            .iter()
            .filter_map(|o| o.running_since())
            .any(|since| since.elapsed() > limit);
        if stuck {
            let why = job.fail_stuck(limit);
            for o in p.drain(..) {
                o.settle(Err(ZeroError::Device(CudaError::Peer(why.clone()))));
            }
        }
    }
}

/// A call launched on a device's queue (module docs).
pub struct Work<Q: Queue> {
    queue: Arc<Q>,
    event: Q::Event,
    outcome: Arc<Outcome>,
    /// The longest the call may run once it started.
    limit: Duration,
}

impl<Q: Queue> Work<Q> {
    /// Launches `call` on `queue` in the order of `stream`'s work, watched
    /// by `watchdog`. `call` is the collective's whole host side; it runs
    /// here on CUDA, on the queue's thread on the emulated device.
    ///
    /// # Safety
    /// As [`Queue::launch`]; and the buffers `call` uses stay live and
    /// untouched by anything else until the Work is waited for.
    pub unsafe fn launch(
        queue: &Arc<Q>,
        stream: usize,
        watchdog: &Watchdog,
        call: impl FnOnce() -> Result<(), ZeroError> + Send + 'static,
    ) -> Result<Work<Q>, ZeroError> {
        let outcome = Arc::new(Outcome::default());
        watchdog.watch(&outcome);
        let o = outcome.clone();
        let run = Box::new(move || {
            o.start();
            o.settle(call());
        });
        // SAFETY: the caller's promise.
        let event = unsafe { queue.launch(stream, &outcome, run) }?;
        Ok(Work {
            queue: queue.clone(),
            event,
            outcome,
            limit: watchdog.limit(),
        })
    }

    /// Whether the call is done (its error, if any, is raised by `wait`).
    pub fn is_completed(&self) -> Result<bool, ZeroError> {
        Ok(self.outcome.is_settled() && self.queue.query(&self.event)?)
    }

    /// Makes the caller's `stream` wait for the call and raises its error
    /// (once; a second wait succeeds).
    ///
    /// # Safety
    /// `stream` is a live stream of this device.
    pub unsafe fn wait(&self, stream: usize) -> Result<(), ZeroError> {
        // The call may still wait behind others on its queue: the
        // watchdog bounds each once it runs, and fails every pending call
        // of a job that died; this bound is only a backstop.
        let deadline = Instant::now() + self.limit * 4;
        // SAFETY: the caller's promise.
        if !unsafe { self.queue.wait_event(stream, &self.event, deadline) }? {
            return Err(ZeroError::Device(CudaError::Peer(format!(
                "a collective did not complete within {:.0} s of being waited for; the job's \
                 watchdog did not end it either",
                (self.limit * 4).as_secs_f64()
            ))));
        }
        self.outcome.take()
    }
}
