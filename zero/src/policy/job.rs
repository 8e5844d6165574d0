//! What a job is once its transport is connected, built by one rule for
//! every caller (the native trainer and zeropp.torch's bindings join
//! through [`zeropp_comm::exchange::join`], each through its own store —
//! zeropp's rendezvous or torch.distributed's — then call
//! [`Joined::new`]): each rank publishes its machine's topology
//! ([`facts_to_publish`]); the routing plan is derived from each node's
//! first rank's; the transport is counted; the standard groups are made;
//! one communication thread runs the job's collectives in order; and the
//! links are measured where the nodes are hosts ([`measurable`]), for a
//! run of zeroPP's switches, once ([`Joined::measures`],
//! [`Joined::measured`]). The native engine runs on the joined job
//! (its counter and thread); the bindings' `Job` holds one.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::routing::{ClusterView, RoutingError};
use zeropp_comm::collectives::CommThread;
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
/// routing plan, its communication thread and what its links measured.
pub struct Joined {
    pub layout: Layout,
    /// The transport, counted (the probe's traffic included, as `other`).
    pub counter: Arc<CountingTransport>,
    pub groups: ZeroGroups,
    pub routing: Result<ClusterView, RoutingError>,
    /// [`measurable`] for this job (and this rank not rejoining it).
    pub measurable: bool,
    /// The deadline of every wait.
    pub timeout: Duration,
    /// The job's collectives, in the order submitted (the probe's, the
    /// engine's, the bindings' host calls and the emulated device's
    /// stream).
    pub thread: Arc<CommThread>,
    /// What [`Joined::measured`] measured, kept for later callers.
    measured: Mutex<Option<Measured>>,
}

impl Joined {
    /// The job over `transport`, whose ranks published `peers` (rank order),
    /// laid out as `layout`. A `rejoining` rank (restarted into a running
    /// job) measures nothing: the others are training.
    pub fn new(
        transport: Box<dyn Transport>,
        peers: &[Peer],
        layout: Layout,
        timeout: Duration,
        rejoining: bool,
    ) -> Result<Joined, ZeroError> {
        if peers.len() != layout.world() {
            return Err(ZeroError::Invalid(format!(
                "{} ranks joined a job of {} nodes x {} ranks",
                peers.len(),
                layout.nodes,
                layout.ranks_per_node
            )));
        }
        let mut job = Joined::unpublished(transport, layout, timeout)?;
        job.routing = routing(peers, layout);
        job.measurable = measurable(peers, layout) && !rejoining;
        Ok(job)
    }

    /// A job over `transport` whose ranks published nothing (tests and
    /// benches that connect ranks themselves): no routing plan, nothing
    /// measured.
    pub fn unpublished(
        transport: Box<dyn Transport>,
        layout: Layout,
        timeout: Duration,
    ) -> Result<Joined, ZeroError> {
        let g = layout.ranks_per_node;
        let counter = Arc::new(CountingTransport::new(transport, g));
        let comm = Arc::new(Communicator::new(counter.clone(), timeout));
        Ok(Joined {
            layout,
            groups: ZeroGroups::new(&layout, g)?,
            routing: Err(RoutingError::Unpublished),
            measurable: false,
            timeout,
            thread: Arc::new(CommThread::new(comm)),
            counter,
            measured: Mutex::new(None),
        })
    }

    /// A communicator over the counted transport with the job's deadline.
    pub fn communicator(&self) -> Communicator {
        Communicator::new(self.counter.clone(), self.timeout)
    }

    /// Whether a run of zeroPP's switches (`zeropp`; ZeRO-3's plain rings
    /// choose nothing by the links) trained as `islands` islands measures
    /// the links: where they are [`measurable`], and not for islands of
    /// one node each (nothing inside them crosses a node, and the probe's
    /// bytes would cross the slow link).
    pub fn measures(&self, zeropp: bool, islands: usize) -> bool {
        zeropp && self.measurable && !self.layout.islands_of_one_node(islands)
    }

    /// The job's links and routes, measured on the job's thread the first
    /// time a caller [`Joined::measures`] (every rank calls this at the
    /// same point), with `wanted`'s formats and a unit of at most `largest`
    /// values (the model's largest, when known), within
    /// [`probe::BUDGET`]; later calls get what was measured. None where
    /// nothing is measured.
    pub fn measured(
        &self,
        (zeropp, islands): (bool, usize),
        wanted: &crate::plan::Switches,
        largest: Option<usize>,
    ) -> Result<Option<Measured>, ZeroError> {
        if !self.measures(zeropp, islands) {
            return Ok(None);
        }
        let mut kept = self
            .measured
            .lock()
            .map_err(|_| ZeroError::Poisoned("record of the measured links"))?;
        if kept.is_none() {
            let (counter, groups) = (self.counter.clone(), self.groups.clone());
            let (layout, wanted) = (self.layout, wanted.clone());
            let m = self
                .thread
                .submit(move |c: &Communicator| {
                    probe::measure_all(
                        c,
                        &counter,
                        &groups,
                        layout,
                        &wanted,
                        probe::BUDGET,
                        largest,
                    )
                })
                .wait()?;
            *kept = Some(m);
        }
        Ok(kept.clone())
    }

    /// What [`Joined::measured`] measured so far (None before it ran, or
    /// where nothing is measured).
    pub fn measured_so_far(&self) -> Option<Measured> {
        self.measured.lock().map(|m| m.clone()).unwrap_or(None)
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

    /// The joined jobs of `nodes` × `g` ranks over in-process transports,
    /// as if their nodes were hosts (measurable), one thread each.
    fn on_joined<R: Send + 'static>(
        nodes: usize,
        g: usize,
        f: impl Fn(Joined) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let f = Arc::new(f);
        let handles: Vec<_> = zeropp_comm::inproc::InProcess::world(nodes * g)
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let l = Layout {
                        rank,
                        ..layout(nodes, g)
                    };
                    let timeout = Duration::from_secs(30);
                    let mut job = Joined::unpublished(Box::new(t), l, timeout).unwrap();
                    job.measurable = true;
                    f(job)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn one_rule_says_who_measures_and_the_links_are_measured_once() {
        // zeroPP's switches measure; ZeRO-3's plain rings do not; islands
        // of one node each measure nothing (nothing inside them crosses a
        // node), islands of two nodes do.
        let rules = on_joined(4, 1, |job| {
            let cases = [(true, 1), (false, 1), (true, 4), (true, 2)];
            cases.map(|(zeropp, islands)| job.measures(zeropp, islands))
        });
        assert_eq!(rules[0], [true, false, false, true]);
        // Measured on the job's thread at the first call, then kept: the
        // second call sends nothing.
        let zpp = crate::plan::Switches::zeropp(256);
        let got = on_joined(2, 1, move |job| {
            assert!(job.measured((false, 1), &zpp, None).unwrap().is_none());
            assert_eq!(job.counter.traffic().total().inter_node, 0);
            assert!(job.measured_so_far().is_none());
            let first = job.measured((true, 1), &zpp, Some(4096)).unwrap().unwrap();
            let sent = job.counter.traffic().total().inter_node;
            let again = job.measured((true, 1), &zpp, Some(4096)).unwrap().unwrap();
            let after = job.counter.traffic().total().inter_node;
            let kept = job.measured_so_far().unwrap();
            let json = |m: &Measured| serde_json::to_string(m).unwrap();
            (
                sent,
                after,
                json(&first) == json(&again),
                json(&kept) == json(&first),
            )
        });
        for (sent, after, same, kept) in got {
            assert!(sent > 0, "the probe crossed the nodes");
            assert_eq!(sent, after, "measured once");
            assert!(same && kept);
        }
        // A rank restarted into a running job measures nothing.
        let hosts: Vec<Peer> = (0..2).map(|r| peer(r, ["a", "b"][r], None)).collect();
        for rejoining in [false, true] {
            let t = zeropp_comm::inproc::InProcess::world(2).remove(0);
            let l = layout(2, 1);
            let job =
                Joined::new(Box::new(t), &hosts, l, Duration::from_secs(1), rejoining).unwrap();
            assert_eq!(job.measurable, probe::enabled() && !rejoining);
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
