//! Detection from a sysfs tree (`/sys` or a captured copy under a root).

use std::path::Path;

use crate::{Gpu, GpuLink, LinkKind, Nic, NicKind, NumaNode, PciePath, TopoError, Topology};

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

fn numa(path: &Path) -> Option<u32> {
    read(path)?
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// A part of a kernel CPU list that is neither a CPU nor a range of them.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad CPU or CPU range {0:?}")]
pub struct BadCpus(pub String);

/// Number of CPUs in a kernel CPU list (`0-3,8,10-11`).
pub fn count_cpus(list: &str) -> Result<usize, BadCpus> {
    let mut n = 0;
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let bad = || BadCpus(part.into());
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) =
                    (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if b < a {
                    return Err(bad());
                }
                n += b - a + 1;
            }
            None => {
                part.parse::<usize>().map_err(|_| bad())?;
                n += 1;
            }
        }
    }
    Ok(n)
}

fn is_pci_address(s: &str) -> bool {
    // dddd:bb:dd.f
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// Where a sysfs link points, relative to the sysfs root
/// (`devices/pci0000:00/0000:00:01.0/...`).
fn resolve(sys: &Path, link: &Path) -> Option<Vec<String>> {
    let real = std::fs::canonicalize(link).ok()?;
    let base = std::fs::canonicalize(sys).ok()?;
    let rel = real.strip_prefix(&base).ok()?;
    Some(
        rel.components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect(),
    )
}

/// A PCI device's place: its root complex and the chain of PCI functions
/// from the root port down to the device itself.
#[derive(Clone, Debug)]
struct PciPlace {
    root: String,
    chain: Vec<String>,
    numa: Option<u32>,
}

fn pci_place(components: &[String], numa: Option<u32>) -> Option<PciPlace> {
    let i = components.iter().position(|c| c.starts_with("pci"))?;
    Some(PciPlace {
        root: components[i].clone(),
        chain: components[i + 1..]
            .iter()
            .filter(|c| is_pci_address(c))
            .cloned()
            .collect(),
        numa,
    })
}

/// The `nvidia-smi topo -m` class of the path between two PCI devices.
fn pcie_path(a: &PciPlace, b: &PciPlace) -> PciePath {
    if a.root != b.root {
        return match (a.numa, b.numa) {
            (Some(x), Some(y)) if x == y => PciePath::NODE,
            (None, None) => PciePath::NODE,
            _ => PciePath::SYS,
        };
    }
    // Bridges above each device.
    let (ba, bb) = (
        &a.chain[..a.chain.len().saturating_sub(1)],
        &b.chain[..b.chain.len().saturating_sub(1)],
    );
    let common = ba.iter().zip(bb).take_while(|(x, y)| x == y).count();
    if common == 0 {
        return PciePath::PHB;
    }
    if ba.len() - common <= 1 && bb.len() - common <= 1 {
        PciePath::PIX
    } else {
        PciePath::PXB
    }
}

fn sorted_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn numa_nodes(sys: &Path) -> Result<Vec<NumaNode>, TopoError> {
    let dir = sys.join("devices/system/node");
    let mut nodes = Vec::new();
    for name in sorted_entries(&dir) {
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let path = dir.join(&name).join("cpulist");
        let cpus = read(&path).unwrap_or_default();
        let cpu_count = count_cpus(&cpus).map_err(|e| TopoError::Read {
            path: path.display().to_string(),
            what: e.to_string(),
        })?;
        nodes.push(NumaNode {
            id,
            cpus,
            cpu_count,
        });
    }
    nodes.sort_by_key(|n| n.id);
    if nodes.is_empty() {
        // No NUMA information (some VMs and containers): one node.
        let path = sys.join("devices/system/cpu/online");
        let cpus = read(&path).unwrap_or_default();
        let cpu_count = count_cpus(&cpus).unwrap_or(0);
        nodes.push(NumaNode {
            id: 0,
            cpus,
            cpu_count,
        });
    }
    Ok(nodes)
}

fn gpus(sys: &Path) -> Vec<(Gpu, Option<PciPlace>)> {
    let dir = sys.join("bus/pci/devices");
    let mut out = Vec::new();
    for id in sorted_entries(&dir) {
        let d = dir.join(&id);
        let vendor = read(&d.join("vendor")).unwrap_or_default();
        let class = read(&d.join("class")).unwrap_or_default();
        // NVIDIA, display controller: VGA (0x0300) or 3D (0x0302).
        if vendor != "0x10de" || !(class.starts_with("0x0300") || class.starts_with("0x0302")) {
            continue;
        }
        let numa_node = numa(&d.join("numa_node"));
        let place = resolve(sys, &d).and_then(|c| pci_place(&c, numa_node));
        let gpu = Gpu {
            index: out.len(),
            pci_bus_id: id.clone(),
            numa_node,
            name: read(&d.join("label")).filter(|s| !s.is_empty()),
            link_speed: read(&d.join("current_link_speed")),
            link_width: read(&d.join("current_link_width")).and_then(|w| w.parse().ok()),
            memory_mib: None,
        };
        out.push((gpu, place));
    }
    out
}

fn virtual_reason(name: &str, dev: &Path) -> String {
    let prefixes = [
        ("veth", "veth pair"),
        ("docker", "docker bridge"),
        ("br-", "docker network bridge"),
        ("virbr", "libvirt bridge"),
        ("tun", "tunnel"),
        ("tap", "tap device"),
        ("wg", "wireguard tunnel"),
        ("ifb", "intermediate functional block"),
        ("dummy", "dummy device"),
        ("vxlan", "vxlan tunnel"),
        ("bond", "bond (its member ports are listed)"),
    ];
    if name == "lo" {
        return "loopback".into();
    }
    if dev.join("bridge").is_dir() {
        return if name.starts_with("docker") {
            "docker bridge".into()
        } else {
            "bridge".into()
        };
    }
    prefixes
        .iter()
        .find(|(p, _)| name.starts_with(p))
        .map_or("virtual device".into(), |(_, r)| r.to_string())
}

fn nics(sys: &Path) -> Vec<Nic> {
    let mut out = Vec::new();
    let net = sys.join("class/net");
    for name in sorted_entries(&net) {
        let d = net.join(&name);
        let comps = resolve(sys, &d).unwrap_or_default();
        let is_virtual = comps.iter().any(|c| c == "virtual") || comps.is_empty();
        let pci = comps.iter().rev().find(|c| is_pci_address(c)).cloned();
        let numa_node = pci
            .as_ref()
            .and_then(|p| numa(&sys.join("bus/pci/devices").join(p).join("numa_node")));
        let speed = read(&d.join("speed"))
            .and_then(|s| s.parse::<i64>().ok())
            .filter(|&mbps| mbps > 0)
            .map(|mbps| mbps as f64 / 1000.0);
        let kind = match read(&d.join("type")).as_deref() {
            Some("1") => NicKind::Ethernet,
            Some("32") => NicKind::Infiniband,
            _ => NicKind::Other,
        };
        out.push(Nic {
            reason: if is_virtual {
                virtual_reason(&name, &d)
            } else {
                String::new()
            },
            name,
            kind,
            speed_gbps: speed,
            state: read(&d.join("operstate")),
            pci_bus_id: if is_virtual { None } else { pci },
            numa_node: if is_virtual { None } else { numa_node },
            is_virtual,
        });
    }
    let ib = sys.join("class/infiniband");
    for name in sorted_entries(&ib) {
        let d = ib.join(&name);
        let comps = resolve(sys, &d).unwrap_or_default();
        let pci = comps.iter().rev().find(|c| is_pci_address(c)).cloned();
        let numa_node = pci
            .as_ref()
            .and_then(|p| numa(&sys.join("bus/pci/devices").join(p).join("numa_node")));
        for port in sorted_entries(&d.join("ports")) {
            let p = d.join("ports").join(&port);
            let kind = match read(&p.join("link_layer")).as_deref() {
                Some("InfiniBand") => NicKind::Infiniband,
                Some("Ethernet") => NicKind::Roce,
                _ => NicKind::Other,
            };
            // "400 Gb/sec (4X NDR)"
            let speed = read(&p.join("rate"))
                .and_then(|r| r.split_whitespace().next().and_then(|n| n.parse().ok()));
            // "4: ACTIVE"
            let state = read(&p.join("state"))
                .map(|s| s.split(':').next_back().unwrap_or("").trim().to_string());
            let soft = comps.iter().any(|c| c == "virtual");
            out.push(Nic {
                name: if port == "1" {
                    name.clone()
                } else {
                    format!("{name}:{port}")
                },
                kind,
                speed_gbps: speed,
                state,
                pci_bus_id: pci.clone(),
                numa_node,
                is_virtual: soft,
                reason: if soft {
                    "software RDMA device".into()
                } else {
                    String::new()
                },
            });
        }
    }
    out
}

/// Detects the machine whose root file system is at `root` (`/` for this
/// one): reads `root/sys` and `root/proc/sys/kernel/hostname`.
pub fn detect(root: &Path) -> Result<Topology, TopoError> {
    let sys = root.join("sys");
    if !sys.join("devices").is_dir() {
        return Err(TopoError::Read {
            path: sys.display().to_string(),
            what: "no sysfs here (expected sys/devices): give the root of a captured tree".into(),
        });
    }
    let hostname = read(&root.join("proc/sys/kernel/hostname")).unwrap_or_else(|| "unknown".into());
    let numa_nodes = numa_nodes(&sys)?;
    let found = gpus(&sys);
    let mut gpu_links = Vec::new();
    for i in 0..found.len() {
        for j in i + 1..found.len() {
            let path = match (&found[i].1, &found[j].1) {
                (Some(a), Some(b)) => pcie_path(a, b),
                _ => PciePath::SYS,
            };
            gpu_links.push(GpuLink {
                a: i,
                b: j,
                link: LinkKind::Pcie { path },
            });
        }
    }
    let mut topo = Topology {
        hostname,
        numa_nodes,
        gpus: found.into_iter().map(|(g, _)| g).collect(),
        gpu_links,
        nics: nics(&sys),
    };
    // The driver's facts: live on this machine, from the capture elsewhere.
    let captured = root.join(crate::nvml::CAPTURE_PATH);
    let facts = if captured.is_file() {
        let text = std::fs::read_to_string(&captured).map_err(|e| TopoError::Read {
            path: captured.display().to_string(),
            what: e.to_string(),
        })?;
        Some(serde_json::from_str(&text).map_err(|e| TopoError::Read {
            path: captured.display().to_string(),
            what: format!("not NVML facts as `zeropp topo capture` writes them: {e}"),
        })?)
    } else if root == Path::new("/") && !topo.gpus.is_empty() {
        crate::nvml::query()?
    } else {
        None
    };
    if let Some(f) = facts {
        crate::nvml::apply(&mut topo, &f);
    }
    Ok(topo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_and_pci_addresses() {
        assert_eq!(count_cpus("0-3,8,10-11").unwrap(), 7);
        assert_eq!(count_cpus("").unwrap(), 0);
        assert!(count_cpus("3-1").is_err());
        assert!(count_cpus("a").is_err());
        assert!(is_pci_address("0000:3b:00.0"));
        assert!(!is_pci_address("pci0000:00"));
        assert!(!is_pci_address("virtio2"));
    }

    #[test]
    fn this_machine_is_detected() {
        let t = detect(Path::new("/")).unwrap();
        assert!(!t.numa_nodes.is_empty());
        assert!(t.numa_nodes.iter().map(|n| n.cpu_count).sum::<usize>() >= 1);
        let lo = t.nics.iter().find(|n| n.name == "lo");
        if let Some(lo) = lo {
            assert!(lo.is_virtual && lo.reason == "loopback");
        }
    }
}
