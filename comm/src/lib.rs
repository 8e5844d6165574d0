//! Communication: transports move tagged byte buffers between two ranks;
//! collectives are written once on top of any transport, for any group.

pub mod collectives;
pub mod env;
pub mod exchange;
#[cfg(test)]
mod fixtures;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod group;
pub mod hostlist;
pub mod inproc;
pub mod job;
pub mod launch;
mod liveness;
pub mod mailbox;
pub mod pool;
pub mod rendezvous;
pub mod scratch;
pub mod tcp;
pub mod torch_store;
pub mod ucx;
pub mod wire;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bytes::Bytes;

pub use collectives::Communicator;

/// `n` `noun`s in words: "1 rank", "4 ranks".
pub fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// A job's shape in words: "1 node x 4 ranks", "2 nodes x 1 rank".
pub fn shape(nodes: usize, ranks_per_node: usize) -> String {
    format!(
        "{} x {}",
        count(nodes, "node"),
        count(ranks_per_node, "rank")
    )
}
pub use group::{Group, GroupKind};

/// Identifies a message between two ranks; collectives derive tags from the
/// group and the call's sequence number so concurrent operations never mix.
pub type Tag = u64;

/// What can go wrong moving bytes.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error(
        "rank {peer} failed: {reason}; the job cannot continue without it — \
         check that rank's own log for the cause"
    )]
    PeerFailed { peer: usize, reason: String },
    #[error(
        "timed out after {waited:?} waiting for rank {peer} (message tag {tag:#x}); \
         the rank is hung, overloaded or unreachable — raise the timeout \
         (ZEROPP_TIMEOUT_S) only if it is just slow"
    )]
    Timeout {
        peer: usize,
        tag: Tag,
        waited: Duration,
    },
    #[error("the transport was shut down")]
    Closed,
    /// Rank `by` gave up the call this rank waited on it in, for a reason
    /// that names no rank of the job (its own error, or its island broke):
    /// the call cannot finish.
    #[error(
        "rank {by} gave up this collective: {reason}; the job cannot continue — check that \
         rank's own log for the cause"
    )]
    GaveUp { by: usize, reason: String },
    /// A call named a rank outside the job.
    #[error("rank {peer} does not exist in a world of {world}")]
    NoSuchRank { peer: usize, world: usize },
    /// A rank's published address (rendezvous, torch store) does not parse.
    #[error("rank {rank} published a bad address {address:?}")]
    BadAddress { rank: usize, address: String },
    /// This rank called a collective of a group it is not in.
    #[error("rank {rank} is not a member of group {group} ({ranks:?})")]
    NotInGroup {
        rank: usize,
        group: u32,
        ranks: Vec<usize>,
    },
    /// An environment setting (`ZEROPP_…`) that does not parse: its name,
    /// what is wrong and what to give instead.
    #[error("{name}: {problem}")]
    Setting { name: &'static str, problem: String },
    /// Joining the job failed: the ranks disagree on it, one did not
    /// arrive in time, or the store or rendezvous that meets them failed.
    /// The message says what to check.
    #[error("joining the job: {0}")]
    Join(String),
    /// The ranks' places make no job zeropp runs (not node by node, a
    /// node over several hosts, uneven hosts).
    #[error("joining the job: {0}")]
    Placement(PlacementError),
    /// A UCX call failed (`what` failed; its status as UCX describes it).
    #[error("UCX {what}: {status}")]
    Ucx { what: String, status: String },
    /// A group zeropp cannot form (its ranks, its size, its id).
    #[error("invalid group: {0}")]
    Group(String),
    /// A call's arguments do not fit together (sizes, ranges, a root).
    #[error("invalid call: {0}")]
    Invalid(String),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("network error talking to {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The rank facts in the environment are missing or wrong.
    #[error(transparent)]
    Environment(#[from] env::EnvError),
}

/// Why the ranks' places do not make a job zeropp can run: the launcher's
/// nodes, or the hosts the ranks run on, are not laid out node by node.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PlacementError {
    #[error("rank {rank} says {says} ranks per node, rank 0 says {first}")]
    RanksPerNode {
        rank: usize,
        says: usize,
        first: usize,
    },
    #[error("rank {rank} is local rank {local} of node {node}, outside {nodes} nodes x {g} ranks")]
    Outside {
        rank: usize,
        local: usize,
        node: usize,
        nodes: usize,
        g: usize,
    },
    #[error(
        "rank {rank} is local rank {local} of node {node} by the launcher's variables; zeropp \
         numbers ranks node by node (rank = node x {g} + local rank): place ranks by node \
         (srun --distribution=block, mpirun --map-by slot, torchrun's default)"
    )]
    NotNodeByNode {
        rank: usize,
        local: usize,
        node: usize,
        g: usize,
    },
    #[error("ranks {other} and {rank} both claim local rank {local} of node {node}")]
    Claimed {
        other: usize,
        rank: usize,
        local: usize,
        node: usize,
    },
    #[error(
        "the launcher puts ranks {first} and {rank} on node {node}, but rank {first} runs on \
         host {first_host} and rank {rank} on host {host}: the ranks of a node must share a \
         host (round-robin placement such as mpirun --map-by node is not supported; use \
         --map-by slot)"
    )]
    NodeOnHosts {
        first: usize,
        rank: usize,
        node: usize,
        first_host: String,
        host: String,
    },
    #[error("no ranks")]
    NoRanks,
    #[error(
        "rank {rank} runs on host {host} like rank {first}, but ranks in between run \
         elsewhere: zeropp needs the ranks of a host to be consecutive (place ranks by node, \
         e.g. mpirun --map-by slot, torchrun's default)"
    )]
    HostNotConsecutive {
        rank: usize,
        host: String,
        first: usize,
    },
    #[error(
        "host {host} runs {count} ranks and host {first_host} runs {g}: zeropp needs the same \
         number of ranks on every node"
    )]
    Uneven {
        host: String,
        count: usize,
        first_host: String,
        g: usize,
    },
}

impl CommError {
    /// Whether another rank's death, hang or disappearance caused it: the
    /// job cannot go on.
    pub fn is_peer_failure(&self) -> bool {
        matches!(
            self,
            CommError::PeerFailed { .. }
                | CommError::Timeout { .. }
                | CommError::Closed
                | CommError::GaveUp { .. }
        )
    }

    /// What happened to the rank that caused it, in a few words (for a
    /// job that goes on without it: islands).
    pub fn what_happened(&self) -> String {
        match self {
            CommError::PeerFailed { peer, reason } => format!("rank {peer}: {reason}"),
            CommError::Timeout { peer, waited, .. } => {
                format!(
                    "rank {peer} did not answer within {:.0} s",
                    waited.as_secs_f64()
                )
            }
            other => other.to_string(),
        }
    }

    /// The rank that died or did not answer, when another rank caused it.
    pub fn failed_peer(&self) -> Option<usize> {
        match self {
            CommError::PeerFailed { peer, .. } | CommError::Timeout { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

// By hand, not `#[from]`: the placement error is the message itself, not a
// cause to print again under it (`{e:#}` prints an error's sources).
impl From<PlacementError> for CommError {
    fn from(e: PlacementError) -> CommError {
        CommError::Placement(e)
    }
}

/// `map_err` for an I/O failure while doing `what`.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CommError {
    let what = what.into();
    move |source| CommError::Io { what, source }
}

/// Why a posted send failed, as its transport says it (a socket's error, a
/// UCX status, the peer's process gone).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SendFailed(pub String);

/// How a send ended: `Err` holds the reason it failed.
type SendOutcome = Option<Result<(), SendFailed>>;

/// Completion of a posted send.
#[derive(Clone, Default)]
pub struct SendHandle {
    cell: Arc<(Mutex<SendOutcome>, Condvar)>,
}

impl SendHandle {
    /// A send that is already complete.
    pub fn done() -> Self {
        let h = SendHandle::default();
        h.complete(Ok(()));
        h
    }

    /// Marks the send finished (by the transport).
    pub fn complete(&self, result: Result<(), SendFailed>) {
        let (m, c) = &*self.cell;
        *m.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        c.notify_all();
    }

    /// Whether the send has finished (successfully or not).
    pub fn test(&self) -> bool {
        self.cell
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Waits until the bytes are handed to the network (or the send failed).
    pub fn wait(&self, peer: usize, timeout: Duration) -> Result<(), CommError> {
        let (m, c) = &*self.cell;
        let guard = m.lock().unwrap_or_else(|e| e.into_inner());
        let (guard, _) = c
            .wait_timeout_while(guard, timeout, |r| r.is_none())
            .unwrap_or_else(|e| e.into_inner());
        match &*guard {
            Some(Ok(())) => Ok(()),
            Some(Err(reason)) => Err(CommError::PeerFailed {
                peer,
                reason: reason.to_string(),
            }),
            None => Err(CommError::Timeout {
                peer,
                tag: 0,
                waited: timeout,
            }),
        }
    }
}

/// Moves tagged byte buffers between this rank and the others. Sends are
/// posted and complete in the background (the transport keeps a reference to
/// the buffer); receives wait up to a timeout, and messages that arrive before
/// their receive is called are kept. Messages with the same (peer, tag) arrive
/// in the order they were sent.
pub trait Transport: Send + Sync {
    /// This rank's number, `0..world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the job.
    fn world_size(&self) -> usize;
    /// Posts `data` to `peer` under `tag`.
    fn send(&self, peer: usize, tag: Tag, data: Bytes) -> Result<SendHandle, CommError>;
    /// Waits up to `timeout` for the next message from `peer` under `tag`.
    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Bytes, CommError>;
    /// Whether a message from `peer` under `tag` has arrived (a receive
    /// would not wait).
    fn probe(&self, peer: usize, tag: Tag) -> bool;
    /// The peers with a message under `tag` waiting (a receive from each
    /// would not wait).
    fn waiting_from(&self, tag: Tag) -> Vec<usize> {
        (0..self.world_size())
            .filter(|&p| p != self.rank() && self.probe(p, tag))
            .collect()
    }
    /// The same bytes, placed where a send to `peer` need not copy them,
    /// for a buffer the caller both sends and keeps (UCX: in this rank's
    /// shared segment, for a node-local peer); otherwise `data` itself.
    fn stage(&self, peer: usize, data: Bytes) -> Bytes {
        let _ = peer;
        data
    }
    /// A short name for logs and benchmarks ("inproc", "tcp", "ucx").
    fn name(&self) -> &'static str;
    /// The first peer this rank saw die (not leave), and why: the root cause
    /// to report when some later operation fails because of it.
    fn first_death(&self) -> Option<(usize, String)> {
        None
    }
    /// Islands: from now on only the death of a rank in `fatal` (this
    /// rank's island) breaks every wait; another rank's death fails the
    /// waits on it alone. Transports without a mailbox ignore it.
    fn contain_deaths(&self, fatal: std::ops::Range<usize>) {
        let _ = fatal;
    }
    /// Takes `peer` for dead (this rank found it stuck): every wait fails
    /// naming it from now on, as when its connection breaks. Transports
    /// without a mailbox ignore it.
    fn declare_dead(&self, peer: usize, reason: String) {
        let _ = (peer, reason);
    }
    /// Islands: the islands took restarted rank `peer` back (its island
    /// rejoined); until then a wait on it in a collective fails at once.
    /// Transports without rejoins ignore it.
    fn readmit(&self, peer: usize) {
        let _ = peer;
    }
}

/// A shared transport is one: what a probe used at join, handed on to the
/// engine.
impl<T: Transport + ?Sized> Transport for Arc<T> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn world_size(&self) -> usize {
        (**self).world_size()
    }
    fn send(&self, peer: usize, tag: Tag, data: Bytes) -> Result<SendHandle, CommError> {
        (**self).send(peer, tag, data)
    }
    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Bytes, CommError> {
        (**self).recv(peer, tag, timeout)
    }
    fn probe(&self, peer: usize, tag: Tag) -> bool {
        (**self).probe(peer, tag)
    }
    fn waiting_from(&self, tag: Tag) -> Vec<usize> {
        (**self).waiting_from(tag)
    }
    fn stage(&self, peer: usize, data: Bytes) -> Bytes {
        (**self).stage(peer, data)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn first_death(&self) -> Option<(usize, String)> {
        (**self).first_death()
    }
    fn contain_deaths(&self, fatal: std::ops::Range<usize>) {
        (**self).contain_deaths(fatal)
    }
    fn declare_dead(&self, peer: usize, reason: String) {
        (**self).declare_dead(peer, reason)
    }

    fn readmit(&self, peer: usize) {
        (**self).readmit(peer)
    }
}
