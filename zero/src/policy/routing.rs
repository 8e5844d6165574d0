//! From the facts of every node to the routing plan: the hop classes with
//! an estimated bandwidth, the hpZ group, the two qgZ hops and their bits,
//! the transport per group, each rank's NIC, and the NCCL/UCX environment
//! that follows — each choice with its reason.

use serde::Serialize;

use zeropp_topology::{LinkKind, Nic, NicKind, Topology};

/// Estimated bandwidths, GB/s per direction. Rough public figures: the
/// plan needs their ratios, not their decimals.
pub const NVLINK_GBPS_PER_LINK: f64 = 25.0;
/// Shared memory between processes on a host without GPUs.
pub const SHM_GBPS: f64 = 10.0;

/// PCIe bandwidth of a GPU's link from sysfs' speed and width.
fn pcie_gbps(speed: Option<&str>, width: Option<u32>) -> f64 {
    let gts: f64 = speed
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(16.0);
    // 128b/130b encoding from 8 GT/s on; about 80% of that in practice.
    gts * width.unwrap_or(16) as f64 / 8.0 * 0.8
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hop {
    pub name: String,
    /// Ranks in one group of this hop.
    pub group_size: usize,
    pub transport: String,
    /// Estimated bandwidth one rank sees on this hop, GB/s.
    pub gbps_per_rank: f64,
    pub why: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankNic {
    pub local_rank: usize,
    pub nic: Option<String>,
    pub why: String,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoutingPlan {
    pub nodes: usize,
    pub ranks_per_node: usize,
    pub hops: Vec<Hop>,
    /// Ranks sharing an hpZ secondary shard.
    pub hpz_group: usize,
    pub hpz_why: String,
    /// qgZ's bits inside the node and across, 16 for bf16 (the weights' format is the
    /// mode's: `Switches`).
    pub qgz_bits: [u32; 2],
    pub bits_why: String,
    pub rank_nics: Vec<RankNic>,
    pub env: Vec<(String, String)>,
}

/// The size of the NVLink island GPU 0 belongs to (1 without NVLink).
fn nvlink_island(t: &Topology, g: usize) -> usize {
    let mut island = vec![0usize];
    let mut i = 0;
    while i < island.len() {
        let a = island[i];
        for b in 0..g {
            if !island.contains(&b) && matches!(t.link(a, b), Some(LinkKind::Nvlink { .. })) {
                island.push(b);
            }
        }
        i += 1;
    }
    island.len()
}

fn is_rdma(n: &Nic) -> bool {
    matches!(n.kind, NicKind::Infiniband | NicKind::Roce)
}

/// The NICs traffic across nodes uses: the RDMA ones when there are any,
/// else every routable one; fastest first.
fn nic_pool(t: &Topology) -> Vec<&Nic> {
    let nics = t.routable_nics();
    if nics.iter().any(|n| is_rdma(n)) {
        nics.into_iter().filter(|n| is_rdma(n)).collect()
    } else {
        nics
    }
}

fn nic_for(t: &Topology, local: usize) -> RankNic {
    let pool = nic_pool(t);
    if pool.is_empty() {
        return RankNic {
            local_rank: local,
            nic: None,
            why: "no physical NIC: single-node only".into(),
        };
    }
    let numa = t.gpus.get(local).and_then(|g| g.numa_node);
    let near: Vec<&Nic> = pool
        .iter()
        .copied()
        .filter(|n| numa.is_some() && n.numa_node == numa)
        .collect();
    let (choice, why) = if near.is_empty() {
        (
            pool[local % pool.len()],
            "no NIC on this rank's NUMA node: round-robin over the fastest".to_string(),
        )
    } else {
        // Spread the ranks of one NUMA node over its NICs.
        let same_numa_rank = t.gpus[..local]
            .iter()
            .filter(|g| g.numa_node == numa)
            .count();
        (
            near[same_numa_rank % near.len()],
            format!("NUMA-closest to GPU{local} (node {})", numa.unwrap_or(0)),
        )
    };
    RankNic {
        local_rank: local,
        nic: Some(choice.name.clone()),
        why,
    }
}

/// Why there is no routing plan.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RoutingError {
    #[error("{nodes} nodes x {g} ranks: nodes and ranks per node must be at least 1")]
    Shape { nodes: usize, g: usize },
    #[error("{ranks} ranks per node but this node has {gpus} GPUs: use at most one rank per GPU")]
    MoreRanksThanGpus { ranks: usize, gpus: usize },
    /// A node's first rank published no topology (it could not read its
    /// machine's), so there is nothing to plan for.
    #[error("not every node published its topology")]
    Unpublished,
    /// One node of a cluster has no plan.
    #[error("node {node} ({host}): {why}")]
    Node {
        node: usize,
        host: String,
        why: Box<RoutingError>,
    },
}

/// The plan for `nodes` nodes like `t`, `g` ranks each (one per GPU when
/// there are GPUs).
pub fn plan(t: &Topology, nodes: usize, g: usize) -> Result<RoutingPlan, RoutingError> {
    if nodes == 0 || g == 0 {
        return Err(RoutingError::Shape { nodes, g });
    }
    if !t.gpus.is_empty() && g > t.gpus.len() {
        return Err(RoutingError::MoreRanksThanGpus {
            ranks: g,
            gpus: t.gpus.len(),
        });
    }
    let gpus = !t.gpus.is_empty();
    let island = if gpus { nvlink_island(t, g) } else { 1 };
    let intra_gbps = inside_gbps(t, g, island);
    let pool = nic_pool(t);
    let rdma = pool.iter().any(|n| is_rdma(n));
    let node_gbps: f64 = pool
        .iter()
        .map(|n| n.speed_gbps.unwrap_or(0.0))
        .sum::<f64>()
        / 8.0;
    let inter_per_rank = node_gbps / g as f64;
    let mut hops = vec![Hop {
        name: "inside the node".into(),
        group_size: g,
        transport: if gpus {
            "NCCL".into()
        } else {
            "UCX shared memory".into()
        },
        gbps_per_rank: intra_gbps,
        why: if !gpus {
            "no GPUs: processes share memory".into()
        } else if island == g {
            format!("all {g} GPUs in one NVLink island")
        } else {
            format!("PCIe between GPUs ({} per NVLink island)", island)
        },
    }];
    if nodes > 1 {
        let transport = if gpus { "NCCL" } else { "UCX" };
        hops.push(Hop {
            name: "across nodes".into(),
            group_size: nodes,
            transport: format!("{transport} over {}", if rdma { "RDMA" } else { "TCP" }),
            gbps_per_rank: inter_per_rank,
            why: if node_gbps > 0.0 {
                format!(
                    "{}, {:.1} GB/s per node shared by {}",
                    zeropp_comm::count(pool.len(), "NIC"),
                    node_gbps,
                    zeropp_comm::count(g, "rank")
                )
            } else {
                format!(
                    "{} whose speed the kernel does not report (virtual NICs often do not): \
                     assumed slow",
                    zeropp_comm::count(pool.len(), "NIC")
                )
            },
        });
    }
    let (hpz_group, hpz_why) = if gpus && island > 1 && island < g {
        (
            island,
            format!(
                "NVLink islands of {island} on a PCIe box: the secondary shard stays on NVLink"
            ),
        )
    } else {
        (
            g,
            "the node: the backward gather never leaves it".to_string(),
        )
    };
    let (qgz_bits, bits_why) = gradient_bits(nodes, gpus, intra_gbps, inter_per_rank);
    let rank_nics = (0..g).map(|l| nic_for(t, l)).collect::<Vec<_>>();
    let mut names: Vec<String> = rank_nics.iter().filter_map(|r| r.nic.clone()).collect();
    names.sort();
    names.dedup();
    Ok(RoutingPlan {
        nodes,
        ranks_per_node: g,
        hops,
        hpz_group,
        hpz_why,
        qgz_bits,
        bits_why,
        rank_nics,
        env: transport_env(rdma, &names),
    })
}

/// GB/s per rank inside the node: NVLink where the `g` ranks form one
/// island, else the GPUs' PCIe link; shared memory without GPUs.
fn inside_gbps(t: &Topology, g: usize, island: usize) -> f64 {
    if t.gpus.is_empty() {
        SHM_GBPS
    } else if island == g && g > 1 {
        match t.link(0, 1) {
            Some(LinkKind::Nvlink { count }) => *count as f64 * NVLINK_GBPS_PER_LINK,
            _ => SHM_GBPS,
        }
    } else {
        let gpu = &t.gpus[0];
        pcie_gbps(gpu.link_speed.as_deref(), gpu.link_width)
    }
}

/// qgZ's bits inside the node and across (16: bf16), and why. Its first
/// hop stays inside the node and its second crosses. Without GPUs the
/// gradient is in host memory and the ranks quantize it on the CPUs they
/// compute on: quantizing the hop inside costs more CPU than the
/// shared-memory bytes it saves, so it goes in bf16 (measured:
/// docs/BENCHMARKS.md, and its loss over 8 seeds in docs/TRAINING.md).
/// On GPUs the first hop's bits cost time only when inside is not much
/// faster than across, so int8 there (16 times finer steps than int4,
/// measured to keep small models' loss within 1% of ZeRO-3's) unless it
/// would slow the step. The hop across is int4 whenever there is one.
fn gradient_bits(
    nodes: usize,
    gpus: bool,
    intra_gbps: f64,
    inter_per_rank: f64,
) -> ([u32; 2], String) {
    let ratio = if inter_per_rank > 0.0 {
        intra_gbps / inter_per_rank
    } else {
        f64::INFINITY
    };
    if !gpus {
        let across = if nodes > 1 { ", int4 across" } else { "" };
        (
            [16, 4],
            format!(
                "no GPUs: quantizing the gradient inside the node costs the ranks' CPUs more \
                 than the shared-memory bytes it saves; bf16 inside{across}"
            ),
        )
    } else if nodes > 1 && inter_per_rank == 0.0 {
        (
            [8, 4],
            "the speed across nodes is unknown: assume a slow link; int4 gradients across, int8 \
             inside where the hop is cheap next to it"
                .to_string(),
        )
    } else if nodes == 1 {
        (
            [8, 8],
            "one node: nothing crosses a slow link; int8 gradients keep quantization error low"
                .to_string(),
        )
    } else if ratio >= 4.0 {
        (
            [8, 4],
            format!(
                "the link across nodes is {ratio:.0}x slower per rank than inside: int4 gradients \
                 across, int8 inside (its bytes cost little next to the hop across)"
            ),
        )
    } else {
        (
            [4, 4],
            format!(
                "links inside and across are within {ratio:.1}x: int4 gradients on both hops (int8 inside would slow the step)"
            ),
        )
    }
}

/// The environment NCCL and UCX read to use the ranks' NICs (`names`):
/// RDMA where a NIC offers it, else sockets.
fn transport_env(rdma: bool, names: &[String]) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if rdma {
        env.push(("NCCL_IB_DISABLE".into(), "0".into()));
        env.push((
            "UCX_NET_DEVICES".into(),
            names
                .iter()
                .map(|n| format!("{n}:1"))
                .collect::<Vec<_>>()
                .join(","),
        ));
        env.push(("UCX_TLS".into(), "rc,sm,self".into()));
    } else {
        env.push(("NCCL_IB_DISABLE".into(), "1".into()));
        if !names.is_empty() {
            env.push(("NCCL_SOCKET_IFNAME".into(), names.join(",")));
            env.push(("UCX_NET_DEVICES".into(), names.join(",")));
        }
        env.push(("UCX_TLS".into(), "tcp,sm,self".into()));
    }
    env
}

impl RoutingPlan {
    pub fn render(&self) -> String {
        let mut s = format!("{}\n", zeropp_comm::shape(self.nodes, self.ranks_per_node));
        for h in &self.hops {
            // A NIC whose speed the machine does not say.
            let speed = match h.gbps_per_rank {
                g if g > 0.0 => format!("~{g:>7.1} GB/s per rank"),
                _ => "speed unknown         ".to_string(),
            };
            s += &format!(
                "  hop {:<16} groups of {:<3} {:<20} {speed}  ({})\n",
                h.name, h.group_size, h.transport, h.why
            );
        }
        s += &format!(
            "  hpZ group: {} ({})\n",
            zeropp_comm::count(self.hpz_group, "rank"),
            self.hpz_why
        );
        let name = |bits: u32| match bits {
            16 => "bf16".to_string(),
            b => format!("int{b}"),
        };
        let across = match self.nodes {
            1 => "no hop across".to_string(),
            _ => format!("{} across", name(self.qgz_bits[1])),
        };
        s += &format!(
            "  gradient bits: qgZ {} inside / {across} ({}); weights as the run's mode sends \
             them (its `switches:` line)\n",
            name(self.qgz_bits[0]),
            self.bits_why
        );
        for r in &self.rank_nics {
            s += &format!(
                "  local rank {}: NIC {} ({})\n",
                r.local_rank,
                r.nic.as_deref().unwrap_or("-"),
                r.why
            );
        }
        s += "  environment:\n";
        for (k, v) in &self.env {
            s += &format!("    {k}={v}\n");
        }
        s
    }
}

/// The cluster as the rendezvous delivers it: one topology per node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClusterView {
    /// The node every plan is made for: node 0 when all nodes look alike,
    /// else the one with the slowest hop across nodes (then inside).
    pub planned_for: usize,
    /// Host names by node.
    pub hosts: Vec<String>,
    /// How nodes differ, one line each (empty when they are alike).
    pub differences: Vec<String>,
    pub plan: RoutingPlan,
}

/// What matters to a plan about one node, in words.
fn shape(t: &Topology) -> String {
    let mut counted: std::collections::BTreeMap<String, usize> = Default::default();
    for n in t.routable_nics() {
        let what = format!(
            "{} {}",
            format!("{:?}", n.kind).to_lowercase(),
            n.speed_gbps.map_or("?".into(), |s| format!("{s} Gb/s"))
        );
        *counted.entry(what).or_default() += 1;
    }
    let nics: Vec<String> = counted
        .into_iter()
        .map(|(w, c)| format!("{c} x {w}"))
        .collect();
    let nvlink: Vec<u32> = t
        .gpu_links
        .iter()
        .filter_map(|l| match l.link {
            LinkKind::Nvlink { count } => Some(count),
            LinkKind::Pcie { .. } => None,
        })
        .collect();
    format!(
        "{} GPUs, {} NVLink pairs (min NV{}), NICs [{}]",
        t.gpus.len(),
        nvlink.len(),
        nvlink.iter().min().copied().unwrap_or(0),
        nics.join(", ")
    )
}

/// Merges the nodes' facts into one view and plans for the weakest node:
/// a plan must hold on every node, so when nodes differ, the one whose hop
/// across (then inside) is slowest decides, and the differences are listed.
pub fn cluster(nodes: &[Topology], ranks_per_node: usize) -> Result<ClusterView, RoutingError> {
    if nodes.is_empty() {
        return Err(RoutingError::Unpublished);
    }
    let n = nodes.len();
    let plans = nodes
        .iter()
        .enumerate()
        .map(|(i, t)| {
            plan(t, n, ranks_per_node).map_err(|e| RoutingError::Node {
                node: i,
                host: t.hostname.clone(),
                why: Box::new(e),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let shapes: Vec<String> = nodes.iter().map(shape).collect();
    let alike = shapes.iter().all(|s| *s == shapes[0]);
    let hop = |p: &RoutingPlan, k: usize| p.hops.get(k).map_or(f64::INFINITY, |h| h.gbps_per_rank);
    let weakest = (0..n)
        .min_by(|&a, &b| {
            let key = |i: usize| (hop(&plans[i], 1), hop(&plans[i], 0));
            key(a)
                .partial_cmp(&key(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        })
        .unwrap_or(0);
    let planned_for = if alike { 0 } else { weakest };
    let differences = if alike {
        Vec::new()
    } else {
        nodes
            .iter()
            .zip(&shapes)
            .enumerate()
            .map(|(i, (t, s))| format!("node {i} ({}): {s}", t.hostname))
            .collect()
    };
    Ok(ClusterView {
        planned_for,
        hosts: nodes.iter().map(|t| t.hostname.clone()).collect(),
        differences,
        plan: plans[planned_for].clone(),
    })
}
