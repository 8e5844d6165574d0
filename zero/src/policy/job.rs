//! What a job is once its transport is connected, built by one rule for
//! every caller (the native trainer and zeropp.torch's bindings join
//! through [`zeropp_comm::exchange::join`], each through its own store,
//! then call [`Joined::new`]): each rank publishes its machine's topology
//! ([`facts_to_publish`]); the routing plan is derived from each node's
//! first rank's; the transport is counted; the standard groups are made;
//! and the links are measurable where the nodes are hosts
//! ([`measurable`]), which [`Joined::measure`] times once.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::routing::{ClusterView, RoutingError};
use zeropp_comm::exchange::Peer;
use zeropp_comm::{Communicator, Transport};

use crate::groups::ZeroGroups;
use crate::layout::Layout;
use crate::measured::Measured;
use crate::traffic::CountingTransport;
use crate::{ZeroError, probe};

/// What this rank publishes when joining: its machine's topology (or
/// nothing where it cannot be read; the plan then says so).
pub fn facts_to_publish() -> serde_json::Value {
    match zeropp_topology::detect::detect(Path::new("/")) {
        Ok(t) => serde_json::json!({ "topology": t }),
        Err(_) => serde_json::Value::Null,
    }
}

/// The cluster view and routing plan (for the weakest node, as `zeropp topo
/// plan` for a whole job) from the topology each node's first rank
/// published (`peers` in rank order), or why there is none.
pub fn routing(peers: &[Peer], layout: Layout) -> Result<ClusterView, RoutingError> {
    let g = layout.ranks_per_node;
    let tops: Option<Vec<zeropp_topology::Topology>> = (0..layout.nodes)
        .map(|n| {
            let p = peers.get(n * g)?;
            serde_json::from_value(p.facts.get("topology")?.clone()).ok()
        })
        .collect();
    crate::routing::cluster(&tops.ok_or(RoutingError::Unpublished)?, g)
}

/// Whether the job's links are measured at join: more than one rank, the
/// probe not turned off (ZEROPP_PROBE=0), and nodes that are hosts — as
/// many distinct hosts as nodes. Logical nodes of one machine emulate a
/// cluster whose links are not this machine's: nothing is measured there
/// and the switches hold as asked.
pub fn measurable(peers: &[Peer], layout: Layout) -> bool {
    let hosts: BTreeSet<(&str, &str)> = peers
        .iter()
        .map(|p| (p.hostname.as_str(), p.host_id.as_str()))
        .collect();
    layout.world() > 1 && hosts.len() == layout.nodes && probe::enabled()
}

/// A joined job: the counted transport, this rank's place and groups, the
/// routing plan and whether the links are measurable.
pub struct Joined {
    pub layout: Layout,
    /// The transport, counted (the probe's traffic included, as `other`).
    pub counter: Arc<CountingTransport>,
    pub groups: ZeroGroups,
    pub routing: Result<ClusterView, RoutingError>,
    /// [`measurable`] for this job.
    pub measurable: bool,
    /// The deadline of every wait.
    pub timeout: Duration,
}

impl Joined {
    /// The job over `transport`, whose ranks published `peers` (rank order),
    /// laid out as `layout`.
    pub fn new(
        transport: Box<dyn Transport>,
        peers: &[Peer],
        layout: Layout,
        timeout: Duration,
    ) -> Result<Joined, ZeroError> {
        if peers.len() != layout.world() {
            return Err(ZeroError::Invalid(format!(
                "{} ranks joined a job of {} nodes x {} ranks",
                peers.len(),
                layout.nodes,
                layout.ranks_per_node
            )));
        }
        let g = layout.ranks_per_node;
        Ok(Joined {
            layout,
            counter: Arc::new(CountingTransport::new(transport, g)),
            groups: ZeroGroups::new(&layout, g)?,
            routing: routing(peers, layout),
            measurable: measurable(peers, layout),
            timeout,
        })
    }

    /// A communicator over the counted transport with the job's deadline.
    pub fn communicator(&self) -> Communicator {
        Communicator::new(self.counter.clone(), self.timeout)
    }

    /// The job's links and routes measured over `c` (this job's
    /// communicator; every rank calls it at the same point) with `wanted`'s
    /// formats, a unit of at most `largest` values (the model's largest,
    /// when known): [`probe::measure_all`] within [`probe::BUDGET`].
    pub fn measure(
        &self,
        c: &Communicator,
        wanted: &crate::plan::Switches,
        largest: Option<usize>,
    ) -> Result<Measured, ZeroError> {
        probe::measure_all(
            c,
            &self.counter,
            &self.groups,
            self.layout,
            wanted,
            probe::BUDGET,
            largest,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(rank: usize, host: &str, topology: Option<serde_json::Value>) -> Peer {
        Peer {
            rank,
            hostname: host.into(),
            host_id: format!("{host}-boot"),
            facts: match topology {
                Some(t) => serde_json::json!({ "topology": t }),
                None => serde_json::Value::Null,
            },
        }
    }

    fn layout(nodes: usize, g: usize) -> Layout {
        Layout {
            nodes,
            ranks_per_node: g,
            rank: 0,
        }
    }

    #[test]
    fn links_are_measured_only_where_the_nodes_are_hosts() {
        // 2 hosts of 2 ranks: the nodes are the hosts.
        let two_hosts: Vec<Peer> = (0..4)
            .map(|r| peer(r, if r < 2 { "a" } else { "b" }, None))
            .collect();
        // Logical nodes: 2 nodes on one host emulate links that are not
        // this machine's.
        let one_host: Vec<Peer> = (0..4).map(|r| peer(r, "a", None)).collect();
        assert_eq!(
            measurable(&two_hosts, layout(2, 2)),
            probe::enabled(),
            "nodes that are hosts are measured unless ZEROPP_PROBE=0"
        );
        assert!(!measurable(&one_host, layout(2, 2)));
        // One rank has no link to measure.
        assert!(!measurable(&one_host[..1], layout(1, 1)));
        // Same hostname, other machine (boot id, network namespace): hosts.
        let mut namespaces = one_host.clone();
        namespaces[2].host_id = "other".into();
        namespaces[3].host_id = "other".into();
        assert_eq!(measurable(&namespaces, layout(2, 2)), probe::enabled());
    }

    #[test]
    fn the_routing_plan_reads_each_nodes_first_rank_and_says_why_there_is_none() {
        let t =
            serde_json::to_value(zeropp_topology::detect::detect(Path::new("/")).unwrap()).unwrap();
        // Only the nodes' first ranks need to have published.
        let peers: Vec<Peer> = (0..4)
            .map(|r| peer(r, "a", (r % 2 == 0).then(|| t.clone())))
            .collect();
        let view = routing(&peers, layout(2, 2)).unwrap();
        assert_eq!(view.hosts.len(), 2);
        let missing: Vec<Peer> = (0..4)
            .map(|r| peer(r, "a", (r == 0).then(|| t.clone())))
            .collect();
        let e = routing(&missing, layout(2, 2)).unwrap_err();
        assert_eq!(e, RoutingError::Unpublished);
        assert!(e.to_string().contains("not every node published"), "{e}");
    }
}
