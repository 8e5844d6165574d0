//! Joining a job: rank facts from the environment → zeropp's rendezvous
//! (or torchrun's store) as the exchange of [`exchange::join`] → the
//! transport → a communicator and the standard groups (world, this node,
//! this local rank across nodes).

use std::sync::Arc;

use super::Transport;
use super::env::RankFacts;
use super::exchange;
use super::rendezvous::{self, PeerInfo};
use super::{CommError, Communicator, Group, GroupKind};

/// Which transport carries a job's messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// A full TCP mesh (framed, checksummed headers).
    Tcp,
    /// UCX tag matching (libucp loaded at run time): shared memory inside a
    /// host, TCP or RDMA between hosts.
    Ucx,
}

impl std::str::FromStr for TransportKind {
    type Err = String;

    /// `tcp` or `ucx`, as `ZEROPP_TRANSPORT` and `--transport` spell them.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tcp" => Ok(TransportKind::Tcp),
            "ucx" => Ok(TransportKind::Ucx),
            other => Err(format!("{other:?} is not a transport: use ucx or tcp")),
        }
    }
}

impl TransportKind {
    /// The transport of a rank that was not told one: UCX when libucp loads
    /// here, else TCP and why not UCX.
    pub fn default_here() -> (TransportKind, Option<String>) {
        match super::ucx::available() {
            Ok(()) => (TransportKind::Ucx, None),
            Err(why) => (TransportKind::Tcp, Some(why)),
        }
    }

    /// `ZEROPP_TRANSPORT` (`tcp` or `ucx`), else [`TransportKind::default_here`].
    pub fn from_env() -> Result<(TransportKind, Option<String>), CommError> {
        match std::env::var("ZEROPP_TRANSPORT") {
            Err(_) => Ok(Self::default_here()),
            Ok(v) => v
                .parse()
                .map(|k| (k, None))
                .map_err(|_| CommError::Setting {
                    name: "ZEROPP_TRANSPORT",
                    problem: format!("{v:?}: use ucx (the default when libucp loads) or tcp"),
                }),
        }
    }
}

/// The error of ranks that picked different transports.
pub(crate) fn mixed_transports(them: usize, theirs: &str, me: usize, mine: &str) -> CommError {
    CommError::Join(format!(
        "rank {them} uses the {theirs} transport and rank {me} {mine}: set ZEROPP_TRANSPORT \
         to the same value (ucx or tcp) for every rank (unset, each rank picks UCX when libucp \
         loads on its host)"
    ))
}

/// Which process a rank is, and where: two ranks with the same boot id and
/// PID namespace see each other's processes in /proc.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct ProcessIdentity {
    pub(crate) pid: u32,
    pub(crate) boot_id: String,
    pid_namespace: String,
}

impl ProcessIdentity {
    pub(crate) fn of_self() -> Self {
        ProcessIdentity {
            pid: std::process::id(),
            boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            pid_namespace: std::fs::read_link("/proc/self/ns/pid")
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }

    /// Whether `other` runs on this host in this PID namespace (unknown
    /// facts never match).
    pub(crate) fn same_host(&self, other: &ProcessIdentity) -> bool {
        !self.boot_id.is_empty()
            && !self.pid_namespace.is_empty()
            && self.boot_id == other.boot_id
            && self.pid_namespace == other.pid_namespace
    }
}

/// A joined job.
pub struct Job {
    pub facts: RankFacts,
    pub table: Vec<PeerInfo>,
    pub comm: Arc<Communicator>,
}

impl Job {
    /// Joins the job described by the environment over TCP.
    pub fn join_from_env(extra_facts: serde_json::Value) -> Result<Job, CommError> {
        Self::join(RankFacts::from_env()?, extra_facts)
    }

    /// Joins the job described by `facts` over TCP.
    pub fn join(facts: RankFacts, extra_facts: serde_json::Value) -> Result<Job, CommError> {
        let (transport, table) = Self::connect(&facts, extra_facts)?;
        let comm = Arc::new(Communicator::new(Arc::from(transport), facts.timeout));
        Ok(Job { facts, table, comm })
    }

    /// Rendezvous and a mesh for `facts` over the transport ZEROPP_TRANSPORT
    /// names (ucx or tcp; unset: UCX when libucp loads, else TCP with a
    /// note): the transport and everyone's published facts, for callers that
    /// build their own communicator.
    pub fn connect(
        facts: &RankFacts,
        extra_facts: serde_json::Value,
    ) -> Result<(Box<dyn Transport>, Vec<PeerInfo>), CommError> {
        let (kind, why_not_ucx) = TransportKind::from_env()?;
        if let (Some(why), 0) = (why_not_ucx, facts.rank) {
            eprintln!("note: using TCP between ranks: {why}");
        }
        Self::connect_over(kind, facts, extra_facts)
    }

    /// [`Job::connect`] over a transport chosen by the caller: zeropp's
    /// rendezvous (or torchrun's store) is the exchange through which
    /// [`exchange::join`] publishes this rank and connects the transport,
    /// the one join of every caller.
    pub fn connect_over(
        kind: TransportKind,
        facts: &RankFacts,
        extra_facts: serde_json::Value,
    ) -> Result<(Box<dyn Transport>, Vec<PeerInfo>), CommError> {
        let mut store = rendezvous::torch_store(facts)?;
        let facts = &RankFacts {
            token: rendezvous::job_token(facts, store.as_mut())?,
            ..facts.clone()
        };
        let master = rendezvous::resolve(&facts.master_addr, facts.master_port)?;
        let opts = exchange::JoinOptions {
            kind,
            rank: facts.rank,
            world_size: facts.world_size,
            token: facts.token.clone(),
            ip: rendezvous::local_ip_towards(master)?,
            timeout: facts.timeout,
            // The launcher's nodes (the rendezvous checks them against the
            // hosts).
            ranks_per_node: Some(facts.local_world_size),
            // Islands over TCP: restarted ranks of a lost island rejoin.
            rejoins: (facts.islands > 1 && kind == TransportKind::Tcp).then(|| {
                super::tcp::Rejoins {
                    island: facts.island_ranks(),
                    rejoining: facts.rejoin,
                }
            }),
        };
        let mut table = Vec::new();
        let joined = exchange::join(&opts, extra_facts, &mut |mine: Vec<u8>| {
            let published: serde_json::Value = serde_json::from_slice(&mine)
                .map_err(|e| CommError::Malformed(format!("this rank's own facts: {e}")))?;
            let facts_out = serde_json::json!({ "published": published });
            table = rendezvous::rendezvous(facts, store.as_mut(), String::new(), facts_out)?;
            table
                .iter()
                .map(|p| {
                    serde_json::to_vec(&p.facts["published"])
                        .map_err(|e| CommError::Malformed(format!("rank {}'s facts: {e}", p.rank)))
                })
                .collect()
        })?;
        tracing::debug!(
            "rank {} joined: {} ranks on {} nodes over {kind:?}",
            facts.rank,
            facts.world_size,
            facts.nodes()
        );
        // Callers see the facts each rank published.
        for (p, peer) in table.iter_mut().zip(joined.peers) {
            if p.rank != peer.rank {
                return Err(CommError::Malformed(format!(
                    "the rendezvous listed rank {} where the exchange had rank {}",
                    p.rank, peer.rank
                )));
            }
            p.facts = peer.facts;
        }
        Ok((joined.transport, table))
    }

    /// Every rank.
    pub fn world_group(&self) -> Group {
        Group::new(GroupKind::World, (0..self.facts.world_size).collect()).expect("distinct ranks")
    }

    /// The ranks on `node`, in local-rank order.
    pub fn node_group(&self, node: usize) -> Group {
        let mut ranks: Vec<&PeerInfo> = self.table.iter().filter(|p| p.node_rank == node).collect();
        ranks.sort_by_key(|p| p.local_rank);
        Group::new(
            GroupKind::Node(node),
            ranks.iter().map(|p| p.rank).collect(),
        )
        .expect("the rendezvous checked the layout")
    }

    /// The ranks with local rank `local`, one per node, in node order.
    pub fn cross_node_group(&self, local: usize) -> Group {
        let mut ranks: Vec<&PeerInfo> = self
            .table
            .iter()
            .filter(|p| p.local_rank == local)
            .collect();
        ranks.sort_by_key(|p| p.node_rank);
        Group::new(
            GroupKind::Cross(local),
            ranks.iter().map(|p| p.rank).collect(),
        )
        .expect("the rendezvous checked the layout")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_are_spelled_as_the_environment_and_flags_spell_them() {
        assert_eq!("tcp".parse(), Ok(TransportKind::Tcp));
        assert_eq!("ucx".parse(), Ok(TransportKind::Ucx));
        let e = "rdma".parse::<TransportKind>().unwrap_err();
        assert!(e.contains("use ucx or tcp"), "{e}");
        // Missing rank facts are a typed error that says how to start.
        let e = CommError::from(super::super::env::EnvError::Missing);
        assert!(
            matches!(e, CommError::Environment(_)) && e.to_string().contains("zeropp launch"),
            "{e}"
        );
    }
}
