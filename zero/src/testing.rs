//! In-process worlds for the collectives' unit tests: ranks are threads
//! over `InProcess` transports, each with its counters, groups and mover.

use std::sync::Arc;
use std::time::Duration;

use zeropp_comm::Communicator;
use zeropp_comm::inproc::InProcess;

use super::groups::ZeroGroups;
use super::host::HostMover;
use super::plan::Layout;
use super::traffic::CountingTransport;

/// Runs `f` on every rank of `nodes` × `g` (hpZ over the node); each
/// rank's result and the bytes it sent across nodes, in rank order.
pub fn on_ranks<R: Send + 'static>(
    nodes: usize,
    g: usize,
    f: impl Fn(Layout, &HostMover<'_>) -> R + Send + Sync + 'static,
) -> Vec<(R, u64)> {
    let f = Arc::new(f);
    let handles: Vec<_> = InProcess::world(nodes * g)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let f = f.clone();
            std::thread::spawn(move || {
                let counter = Arc::new(CountingTransport::new(Box::new(t), g));
                let comm = Communicator::new(counter.clone(), Duration::from_secs(30));
                let layout = Layout {
                    nodes,
                    ranks_per_node: g,
                    rank,
                };
                let groups = ZeroGroups::new(&layout, g).expect("the standard groups");
                let mover = HostMover {
                    comm: &comm,
                    counter: &counter,
                    groups: &groups,
                };
                let r = f(layout, &mover);
                (r, counter.traffic().total().inter_node)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("a rank panicked"))
        .collect()
}
