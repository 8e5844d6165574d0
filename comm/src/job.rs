//! Joining a job: rank facts from the environment → zeropp's rendezvous
//! (or torchrun's store) as the exchange of [`exchange::join`] → the
//! transport → a communicator and the standard groups (world, this node,
//! this local rank across nodes).

use std::sync::Arc;

use super::Transport;
use super::env::RankFacts;
use super::exchange::{self, TransportKind};
use super::rendezvous::{self, PeerInfo};
use super::{CommError, Communicator, Group, GroupKind};

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
        let (kind, why) = TransportKind::choose(None, facts.islands_restart())?;
        if let (Some(why), 0) = (why, facts.rank) {
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
        // A restarted rank finds the job running once a rank joined
        // ([`rendezvous::job_is_running`]).
        if let Some(s) = store.as_mut().filter(|_| facts.islands > 1) {
            s.joined_mesh(facts.rank, facts.attempt)?;
        }
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
        let e = "rdma".parse::<TransportKind>().unwrap_err().to_string();
        assert!(e.contains("use ucx or tcp"), "{e}");
        // Missing rank facts are a typed error that says how to start.
        let e = CommError::from(super::super::env::EnvError::Missing);
        assert!(
            matches!(e, CommError::Environment(_)) && e.to_string().contains("zeropp launch"),
            "{e}"
        );
    }
}
