//! In-process worlds for the collectives' unit tests: ranks are threads
//! over `InProcess` transports, each with its counters, groups and mover.

use std::sync::Arc;
use std::time::Duration;

use zeropp_comm::Communicator;
use zeropp_comm::inproc::InProcess;

use crate::groups::ZeroGroups;
use crate::host::HostMover;
use crate::layout::Layout;
use crate::traffic::CountingTransport;

/// Rank `rank`'s test values (a full gradient, or with another seed a
/// shard): `len` small, distinct values.
pub fn gradient(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + rank * 3) as f32 * 0.37).sin() * 0.01)
        .collect()
}

pub fn bf16s(x: &[f32]) -> Vec<half::bf16> {
    x.iter().map(|&v| half::bf16::from_f32(v)).collect()
}

/// One rank of an in-process world.
pub struct Rank {
    pub layout: Layout,
    pub comm: Arc<Communicator>,
    pub counter: Arc<CountingTransport>,
    /// The standard groups, hpZ over the node.
    pub groups: ZeroGroups,
}

impl Rank {
    /// The host byte mover over the standard groups.
    pub fn mover(&self) -> HostMover<'_> {
        HostMover {
            comm: &self.comm,
            counter: &self.counter,
            groups: self.groups.clone(),
        }
    }
}

/// Runs `f` on every rank of `nodes` × `g` with `timeout` as the
/// transports' deadline; each rank's result, in rank order.
pub fn on_world<R: Send + 'static>(
    nodes: usize,
    g: usize,
    timeout: Duration,
    f: impl Fn(Rank) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let handles: Vec<_> = InProcess::world(nodes * g)
        .into_iter()
        .enumerate()
        .map(|(rank, t)| {
            let f = f.clone();
            std::thread::spawn(move || {
                let counter = Arc::new(CountingTransport::new(Box::new(t), g));
                let layout = Layout {
                    nodes,
                    ranks_per_node: g,
                    rank,
                };
                f(Rank {
                    layout,
                    comm: Arc::new(Communicator::new(counter.clone(), timeout)),
                    counter,
                    groups: ZeroGroups::new(&layout, g).expect("the standard groups"),
                })
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("a rank panicked"))
        .collect()
}

/// Runs `f` on every rank of `nodes` × `g` (hpZ over the node); each
/// rank's result and the bytes it sent across nodes, in rank order.
pub fn on_ranks<R: Send + 'static>(
    nodes: usize,
    g: usize,
    f: impl Fn(Layout, &HostMover<'_>) -> R + Send + Sync + 'static,
) -> Vec<(R, u64)> {
    on_world(nodes, g, Duration::from_secs(30), move |r| {
        let out = f(r.layout, &r.mover());
        (out, r.counter.traffic().total().inter_node)
    })
}

/// A gather's three kinds of wire, as a plan makes them: plain (bf16), qwZ
/// in int`bits` blocks of `block`, and weight differences in that format
/// (refreshed every 4 forward gathers, bf16 inside the node, no hpZ).
pub fn every_weight_wire(bits: u32, block: usize) -> [crate::fsdp::WeightWire; 3] {
    use crate::fsdp::WeightWire;
    use crate::plan::weight_format;
    let format = weight_format(bits, block).expect("a weight format");
    [
        WeightWire::Bf16,
        WeightWire::Quantized(format),
        WeightWire::Delta(crate::delta::DeltaWire {
            delta: format,
            refresh_every: 4,
            fp32: false,
            hpz: false,
            bf16_references: false,
            int8_references: None,
        }),
    ]
}
