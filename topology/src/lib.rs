//! zeropp-topology: what a machine is made of, as zeropp needs it — NUMA
//! nodes and their CPUs, NVIDIA GPUs with their PCIe placement and the path
//! class between every pair (the `nvidia-smi topo -m` vocabulary), and the
//! network interfaces with kind, speed and locality, virtual ones marked and
//! excluded from routing with the reason.
//!
//! Detection reads a sysfs tree: the live `/sys`, or a captured copy
//! (`--sysfs-root`), so a machine can be inspected from another one. Nothing
//! needs root or a GPU.

pub mod capture;
pub mod detect;
#[cfg(feature = "fixtures")]
pub mod fixtures;
pub mod nccl;
pub mod nvml;
pub mod smi;

use serde::{Deserialize, Serialize};

/// What could not be read or parsed, with where.
#[derive(Debug, thiserror::Error)]
pub enum TopoError {
    #[error("{path}: {what}")]
    Read { path: String, what: String },
    #[error("line {line}: {what}")]
    Parse { line: usize, what: String },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NumaNode {
    pub id: u32,
    /// The kernel's CPU list, e.g. `0-15,32-47`.
    pub cpus: String,
    pub cpu_count: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Index in PCI bus order (what CUDA_DEVICE_ORDER=PCI_BUS_ID and
    /// nvidia-smi use), or as the input numbers them.
    pub index: usize,
    pub pci_bus_id: String,
    pub numa_node: Option<u32>,
    pub name: Option<String>,
    /// PCIe link of the GPU: speed as sysfs says it (e.g. `16.0 GT/s PCIe`)
    /// and width in lanes.
    pub link_speed: Option<String>,
    pub link_width: Option<u32>,
    /// Memory from NVML, when the driver (or a capture) says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
}

/// The PCIe path between two devices, in `nvidia-smi topo -m` terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PciePath {
    /// Through at most one PCIe bridge (e.g. two ports of one switch).
    PIX,
    /// Through several bridges, without the host bridge.
    PXB,
    /// Through a PCIe host bridge (same root complex).
    PHB,
    /// Between host bridges within one NUMA node.
    NODE,
    /// Across NUMA nodes (the SMP interconnect).
    SYS,
}

impl PciePath {
    pub fn parse(s: &str) -> Option<PciePath> {
        Some(match s {
            "PIX" => PciePath::PIX,
            "PXB" => PciePath::PXB,
            "PHB" => PciePath::PHB,
            "NODE" => PciePath::NODE,
            "SYS" | "SOC" => PciePath::SYS,
            _ => return None,
        })
    }
}

/// How two GPUs are connected.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum LinkKind {
    Nvlink { count: u32 },
    Pcie { path: PciePath },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuLink {
    pub a: usize,
    pub b: usize,
    #[serde(flatten)]
    pub link: LinkKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NicKind {
    Ethernet,
    Infiniband,
    Roce,
    Other,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Nic {
    pub name: String,
    pub kind: NicKind,
    /// Link speed in Gbit/s; `None` when the link is down or unknown.
    pub speed_gbps: Option<f64>,
    /// `up`, `down`, `ACTIVE`, ... as the kernel says.
    pub state: Option<String>,
    pub pci_bus_id: Option<String>,
    pub numa_node: Option<u32>,
    /// Not a physical port (loopback, veth, bridge, docker, tunnel, ...):
    /// never used for routing.
    #[serde(rename = "virtual")]
    pub is_virtual: bool,
    /// Why it is virtual (empty for a physical port).
    pub reason: String,
}

/// One machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    pub hostname: String,
    pub numa_nodes: Vec<NumaNode>,
    pub gpus: Vec<Gpu>,
    /// Every unordered GPU pair once, `a < b`.
    pub gpu_links: Vec<GpuLink>,
    pub nics: Vec<Nic>,
}

impl Topology {
    /// The NICs routing may use: physical, with the fastest first.
    pub fn routable_nics(&self) -> Vec<&Nic> {
        let mut v: Vec<&Nic> = self.nics.iter().filter(|n| !n.is_virtual).collect();
        v.sort_by(|a, b| {
            b.speed_gbps
                .unwrap_or(0.0)
                .total_cmp(&a.speed_gbps.unwrap_or(0.0))
        });
        v
    }

    /// The link between GPUs `a` and `b`.
    pub fn link(&self, a: usize, b: usize) -> Option<&LinkKind> {
        let (a, b) = (a.min(b), a.max(b));
        self.gpu_links
            .iter()
            .find(|l| l.a == a && l.b == b)
            .map(|l| &l.link)
    }

    /// The human view: NUMA nodes, the GPU matrix like `nvidia-smi topo -m`,
    /// and the NICs.
    pub fn render(&self) -> String {
        let mut s = format!("host {}\n", self.hostname);
        s += "NUMA nodes:\n";
        for n in &self.numa_nodes {
            s += &format!("  node {}: {} CPUs ({})\n", n.id, n.cpu_count, n.cpus);
        }
        if self.gpus.is_empty() {
            s += "GPUs: none\n";
        } else {
            s += "GPUs:\n";
            for g in &self.gpus {
                s += &format!(
                    "  GPU{} {} numa {} {} {}\n",
                    g.index,
                    g.pci_bus_id,
                    g.numa_node.map_or("-".into(), |n| n.to_string()),
                    g.name.as_deref().unwrap_or(""),
                    match (&g.link_speed, g.link_width) {
                        (Some(sp), Some(w)) => format!("PCIe {sp} x{w}"),
                        _ => String::new(),
                    }
                );
            }
            s += "\n      ";
            for g in &self.gpus {
                s += &format!("{:>6}", format!("GPU{}", g.index));
            }
            s += "\n";
            for a in &self.gpus {
                s += &format!("{:<6}", format!("GPU{}", a.index));
                for b in &self.gpus {
                    let cell = if a.index == b.index {
                        "X".to_string()
                    } else {
                        match self.link(a.index, b.index) {
                            Some(LinkKind::Nvlink { count }) => format!("NV{count}"),
                            Some(LinkKind::Pcie { path }) => format!("{path:?}"),
                            None => "?".into(),
                        }
                    };
                    s += &format!("{cell:>6}");
                }
                s += "\n";
            }
        }
        s += "NICs:\n";
        for n in &self.nics {
            s += &format!(
                "  {:<12} {:<10} {:>8} {:<8} numa {:<2} {}\n",
                n.name,
                format!("{:?}", n.kind).to_lowercase(),
                n.speed_gbps.map_or("-".into(), |g| format!("{g} Gb/s")),
                n.state.as_deref().unwrap_or("-"),
                n.numa_node.map_or("-".into(), |x| x.to_string()),
                if n.is_virtual {
                    format!("virtual: {} (not routed)", n.reason)
                } else {
                    n.pci_bus_id.clone().unwrap_or_default()
                }
            );
        }
        s
    }
}
