//! An NCCL topology dump (`NCCL_TOPO_DUMP_FILE=topo.xml`): `<system>` holding
//! `<cpu numaid affinity>` elements, under them trees of `<pci busid class
//! link_speed link_width>` (PCIe switches and devices), `<gpu dev>` with
//! `<nvlink target count tclass>` children, and `<nic>` / `<net name speed
//! port>` for network devices. Read into the same [`Topology`] as detection.
//!
//! - GPUs keep NCCL's `dev` numbering; NUMA nodes and CPU lists come from the
//!   `cpu` elements (the `affinity` mask turned into a CPU list).
//! - NVLink: a link whose target is another GPU joins that pair; links to an
//!   NVSwitch (`tclass` 0x068000, or a target that is no GPU) join every pair
//!   of GPUs on switches, with the smaller of their switch link counts (what
//!   `nvidia-smi topo -m` shows as NV#).
//! - PCIe paths of the other pairs from the `pci` tree: both directly under
//!   one switch → PIX; a common switch further up → PXB; same CPU, no common
//!   switch → NODE (NCCL's dump does not say whether two root ports share a
//!   host bridge, which `nvidia-smi` would call PHB); different CPUs → SYS.
//! - NICs: speed is NCCL's Mbit/s; the kind comes from the PCI class of the
//!   enclosing `pci` element (0x0207 InfiniBand; an Ethernet class with an
//!   RDMA device name such as mlx5_0 → RoCE; else Ethernet).
//!
//! Malformed XML, a missing attribute or a bad number is an error with the
//! line number.

use crate::nvml::{norm_bus_id as norm_busid, nvlink_count};
use crate::{Gpu, GpuLink, LinkKind, Nic, NicKind, NumaNode, PciePath, TopoError, Topology};

fn err_at(doc: &roxmltree::Document, node: roxmltree::Node, what: impl Into<String>) -> TopoError {
    TopoError::Parse {
        line: doc.text_pos_at(node.range().start).row as usize,
        what: what.into(),
    }
}

fn attr<'a>(
    doc: &roxmltree::Document,
    node: roxmltree::Node<'a, '_>,
    name: &str,
) -> Result<&'a str, TopoError> {
    node.attribute(name).ok_or_else(|| {
        err_at(
            doc,
            node,
            format!("<{}> has no {name}= attribute", node.tag_name().name()),
        )
    })
}

fn number<T: std::str::FromStr>(
    doc: &roxmltree::Document,
    node: roxmltree::Node,
    name: &str,
    text: &str,
) -> Result<T, TopoError> {
    let t = text.trim();
    let parsed = if let Some(hex) = t.strip_prefix("0x") {
        u64::from_str_radix(hex, 16)
            .ok()
            .and_then(|v| v.to_string().parse().ok())
    } else {
        t.parse().ok()
    };
    parsed.ok_or_else(|| err_at(doc, node, format!("{name}=\"{text}\" is not a number")))
}

/// NCCL's `affinity` (comma-separated 32-bit hex words, most significant
/// first) as a kernel CPU list (`0-15,32-47`) and a count.
pub fn affinity_to_cpulist(mask: &str) -> Option<(String, usize)> {
    let mut bits = Vec::new();
    for word in mask.trim().split(',').rev() {
        let w = u32::from_str_radix(word.trim(), 16).ok()?;
        for b in 0..32 {
            bits.push(w >> b & 1 == 1);
        }
    }
    let mut ranges = Vec::new();
    let mut i = 0;
    while i < bits.len() {
        if bits[i] {
            let start = i;
            while i + 1 < bits.len() && bits[i + 1] {
                i += 1;
            }
            ranges.push(if start == i {
                start.to_string()
            } else {
                format!("{start}-{i}")
            });
        }
        i += 1;
    }
    let count = bits.iter().filter(|b| **b).count();
    Some((ranges.join(","), count))
}

struct GpuFacts {
    dev: usize,
    busid: String,
    numa: Option<u32>,
    /// busids of the enclosing `pci` elements, outermost first (the GPU's own last).
    chain: Vec<String>,
    link_speed: Option<String>,
    link_width: Option<u32>,
    /// (target busid, count, target is a switch)
    nvlinks: Vec<(String, u32, bool)>,
}

/// Parses an NCCL topology dump; `hostname` names the machine (the dump does not).
pub fn parse(text: &str, hostname: &str) -> Result<Topology, TopoError> {
    let doc = roxmltree::Document::parse(text).map_err(|e| TopoError::Parse {
        line: e.pos().row as usize,
        what: format!("not well-formed XML: {e}"),
    })?;
    let root = doc.root_element();
    if root.tag_name().name() != "system" {
        return Err(err_at(
            &doc,
            root,
            format!(
                "the root element is <{}>, expected <system> (an NCCL_TOPO_DUMP_FILE dump)",
                root.tag_name().name()
            ),
        ));
    }
    let mut numa_nodes = Vec::new();
    let mut gpus: Vec<GpuFacts> = Vec::new();
    let mut nics = Vec::new();
    for cpu in root.children().filter(|n| n.has_tag_name("cpu")) {
        let numa: Option<u32> = match cpu.attribute("numaid") {
            Some(v) if v.trim() != "-1" => Some(number(&doc, cpu, "numaid", v)?),
            _ => None,
        };
        if let Some(id) = numa {
            let (cpus, cpu_count) = match cpu.attribute("affinity") {
                Some(m) => affinity_to_cpulist(m).ok_or_else(|| {
                    err_at(&doc, cpu, format!("affinity=\"{m}\" is not a hex CPU mask"))
                })?,
                None => (String::new(), 0),
            };
            numa_nodes.push(NumaNode {
                id,
                cpus,
                cpu_count,
            });
        }
        for d in cpu.descendants() {
            // Other elements (pci, nic, nvlink, and what newer NCCL
            // versions add) are read through these two or skipped.
            match d.tag_name().name() {
                "gpu" => gpus.push(gpu_facts(&doc, d, numa)?),
                "net" => nics.push(net_facts(&doc, d, numa)?),
                _ => {}
            }
        }
    }
    if root.children().all(|n| !n.has_tag_name("cpu")) {
        return Err(err_at(&doc, root, "<system> holds no <cpu> element"));
    }
    gpus.sort_by_key(|g| g.dev);
    for w in gpus.windows(2) {
        if w[0].dev == w[1].dev {
            return Err(TopoError::Parse {
                line: 0,
                what: format!("two GPUs with dev=\"{}\"", w[0].dev),
            });
        }
    }
    let links = gpu_links(&gpus);
    Ok(Topology {
        hostname: hostname.to_string(),
        numa_nodes,
        gpus: gpus
            .iter()
            .map(|g| Gpu {
                index: g.dev,
                pci_bus_id: g.busid.clone(),
                numa_node: g.numa,
                name: None,
                link_speed: g.link_speed.clone(),
                link_width: g.link_width,
                memory_mib: None,
            })
            .collect(),
        gpu_links: links,
        nics,
    })
}

fn pci_chain<'a, 'i>(node: roxmltree::Node<'a, 'i>) -> Vec<roxmltree::Node<'a, 'i>> {
    let mut chain: Vec<_> = node.ancestors().filter(|a| a.has_tag_name("pci")).collect();
    chain.reverse();
    chain
}

fn gpu_facts(
    doc: &roxmltree::Document,
    g: roxmltree::Node,
    numa: Option<u32>,
) -> Result<GpuFacts, TopoError> {
    let dev = number(doc, g, "dev", attr(doc, g, "dev")?)?;
    let chain = pci_chain(g);
    let own = chain
        .last()
        .ok_or_else(|| err_at(doc, g, "<gpu> is not inside a <pci> element"))?;
    let busid = norm_busid(attr(doc, *own, "busid")?);
    let link_width = match own.attribute("link_width") {
        Some(w) => Some(number(doc, *own, "link_width", w)?),
        None => None,
    };
    let mut nvlinks = Vec::new();
    for l in g.children().filter(|n| n.has_tag_name("nvlink")) {
        let target = norm_busid(attr(doc, l, "target")?);
        let count = number(doc, l, "count", attr(doc, l, "count")?)?;
        let switch = l
            .attribute("tclass")
            .is_some_and(|c| c.trim().eq_ignore_ascii_case("0x068000"));
        nvlinks.push((target, count, switch));
    }
    Ok(GpuFacts {
        dev,
        busid,
        numa,
        chain: chain
            .iter()
            .map(|p| norm_busid(p.attribute("busid").unwrap_or("")))
            .collect(),
        link_speed: own.attribute("link_speed").map(str::to_string),
        link_width,
        nvlinks,
    })
}

fn net_facts(
    doc: &roxmltree::Document,
    n: roxmltree::Node,
    numa: Option<u32>,
) -> Result<Nic, TopoError> {
    let name = attr(doc, n, "name")?.to_string();
    let speed_mbps: Option<f64> = match n.attribute("speed") {
        Some(s) => Some(number::<u64>(doc, n, "speed", s)? as f64),
        None => None,
    };
    let pci = pci_chain(n).last().copied();
    let class = pci
        .and_then(|p| p.attribute("class"))
        .map(|c| c.trim().to_ascii_lowercase());
    let rdma_name = ["mlx", "ibp", "hfi", "irdma", "bnxt_re", "qedr", "efa"]
        .iter()
        .any(|p| name.starts_with(p));
    let kind = match class.as_deref() {
        Some(c) if c.starts_with("0x0207") => NicKind::Infiniband,
        Some(c) if c.starts_with("0x0200") && rdma_name => NicKind::Roce,
        _ if rdma_name => NicKind::Infiniband,
        _ => NicKind::Ethernet,
    };
    Ok(Nic {
        name,
        kind,
        speed_gbps: speed_mbps.filter(|s| *s > 0.0).map(|s| s / 1000.0),
        state: None,
        pci_bus_id: pci.and_then(|p| p.attribute("busid")).map(norm_busid),
        numa_node: numa,
        is_virtual: false,
        reason: String::new(),
    })
}

fn gpu_links(gpus: &[GpuFacts]) -> Vec<GpuLink> {
    let buses: Vec<&str> = gpus.iter().map(|g| g.busid.as_str()).collect();
    // One entry per link, as NVML lists them; switch ends under one name.
    let ends: Vec<Vec<String>> = gpus
        .iter()
        .map(|g| {
            g.nvlinks
                .iter()
                .flat_map(|(t, c, sw)| {
                    let end = if *sw {
                        "nvswitch".to_string()
                    } else {
                        t.clone()
                    };
                    std::iter::repeat_n(end, *c as usize)
                })
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    for i in 0..gpus.len() {
        for j in i + 1..gpus.len() {
            let (a, b) = (&gpus[i], &gpus[j]);
            let count = nvlink_count(&ends[i], &b.busid, &ends[j], |t| buses.contains(&t));
            let link = if count > 0 {
                LinkKind::Nvlink { count }
            } else {
                LinkKind::Pcie {
                    path: pcie_path(a, b),
                }
            };
            out.push(GpuLink {
                a: a.dev,
                b: b.dev,
                link,
            });
        }
    }
    out
}

fn pcie_path(a: &GpuFacts, b: &GpuFacts) -> PciePath {
    if a.numa != b.numa {
        return PciePath::SYS;
    }
    // Common switches above both GPUs (the GPUs' own elements excluded).
    let (ua, ub) = (&a.chain[..a.chain.len() - 1], &b.chain[..b.chain.len() - 1]);
    let common = ua.iter().zip(ub).take_while(|(x, y)| x == y).count();
    if common == 0 {
        PciePath::NODE
    } else if common == ua.len() && common == ub.len() {
        PciePath::PIX
    } else {
        PciePath::PXB
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_masks_become_cpu_lists() {
        assert_eq!(
            affinity_to_cpulist("00000000,0000ffff"),
            Some(("0-15".into(), 16))
        );
        assert_eq!(
            affinity_to_cpulist("ffff0000,ffff0000"),
            Some(("16-31,48-63".into(), 32))
        );
        assert_eq!(affinity_to_cpulist("5"), Some(("0,2".into(), 2)));
        assert_eq!(affinity_to_cpulist("zz"), None);
    }

    #[test]
    fn malformed_dumps_name_the_line() {
        let e = parse(
            "<system>\n<cpu numaid=\"0\">\n<pci busid=\"x\"\n</system>",
            "h",
        )
        .unwrap_err();
        assert!(matches!(e, TopoError::Parse { line: 3 | 4, .. }), "{e}");
        let e = parse(
            "<system version=\"1\">\n  <cpu numaid=\"zero\"/>\n</system>",
            "h",
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "line 2: numaid=\"zero\" is not a number");
        let e = parse("<graphs/>", "h").unwrap_err();
        assert!(e.to_string().contains("expected <system>"), "{e}");
        let e = parse(
            "<system>\n<cpu numaid=\"0\">\n<pci busid=\"0000:01:00.0\">\n<gpu sm=\"80\"/>\n</pci></cpu></system>",
            "h",
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "line 4: <gpu> has no dev= attribute");
    }
}
