//! The text of `nvidia-smi topo -m`: the GPU×GPU matrix (X, NV#, PIX, PXB,
//! PHB, NODE, SYS, and SOC from older drivers), NIC rows and columns (as
//! `NIC0..` with a NIC legend, or as device names in older versions), the
//! CPU / NUMA affinity columns, and the legend, which is skipped. Tabs or
//! runs of spaces separate cells; terminal escape codes are ignored.

use std::collections::BTreeMap;

use crate::{Gpu, GpuLink, LinkKind, Nic, NicKind, NumaNode, PciePath, TopoError, Topology};

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ ... letter
            if chars.peek() == Some(&'[') {
                chars.next();
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Cells of a line: split on tabs when there are any, else on runs of two
/// or more spaces (single spaces occur inside "CPU Affinity").
fn cells(line: &str) -> Vec<String> {
    let parts: Vec<&str> = if line.contains('\t') {
        line.split('\t').collect()
    } else {
        line.split("  ").collect()
    };
    parts
        .into_iter()
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

fn parse_err(line: usize, what: impl Into<String>) -> TopoError {
    TopoError::Parse {
        line,
        what: what.into(),
    }
}

/// Parses the output of `nvidia-smi topo -m`.
pub fn parse(text: &str) -> Result<Topology, TopoError> {
    let lines: Vec<String> = text.lines().map(strip_ansi).collect();
    let header = Header::find(&lines)?;
    let (rows, nic_names) = device_rows(&lines, &header);
    let mut gpus = Vec::new();
    let mut links = Vec::new();
    let mut numa: BTreeMap<u32, String> = BTreeMap::new();
    for g in 0..header.ngpu {
        let name = format!("GPU{g}");
        let (ln, row) = rows
            .get(&name)
            .ok_or_else(|| parse_err(lines.len(), format!("no row for {name}")))?;
        let ndev = header.devices.len();
        if row.len() < ndev {
            return Err(parse_err(
                *ln,
                format!(
                    "{name} has {} cells, expected {ndev} device columns",
                    row.len()
                ),
            ));
        }
        gpu_links(g, *ln, &row[..header.ngpu], &mut links)?;
        let aff = &row[ndev.min(row.len())..];
        let col = |want: &str| {
            header
                .affinity
                .iter()
                .position(|c| c == want)
                .and_then(|i| aff.get(i))
        };
        let numa_node = col("NUMA Affinity").and_then(|v| v.parse::<u32>().ok());
        if let (Some(n), Some(cpus)) = (numa_node, col("CPU Affinity")) {
            numa.entry(n).or_insert_with(|| cpus.clone());
        }
        gpus.push(Gpu {
            index: g,
            pci_bus_id: String::new(),
            numa_node,
            name: None,
            link_speed: None,
            link_width: None,
            memory_mib: None,
        });
    }
    let numa_nodes = numa
        .into_iter()
        .map(|(id, cpus)| NumaNode {
            cpu_count: crate::detect::count_cpus(&cpus).unwrap_or(0),
            id,
            cpus,
        })
        .collect();
    Ok(Topology {
        hostname: "unknown (from nvidia-smi topo -m)".into(),
        numa_nodes,
        gpus,
        gpu_links: links,
        nics: nics(&header.devices[header.ngpu..], &nic_names),
    })
}

/// The matrix's header row: its line (1-based), the device columns (GPUs
/// first, then NICs) and the affinity columns after them.
struct Header {
    line: usize,
    devices: Vec<String>,
    affinity: Vec<String>,
    ngpu: usize,
}

impl Header {
    fn find(lines: &[String]) -> Result<Header, TopoError> {
        let (line, cells) = lines
            .iter()
            .enumerate()
            .find(|(_, l)| cells(l).first().is_some_and(|c| c == "GPU0"))
            .map(|(i, l)| (i + 1, cells(l)))
            .ok_or_else(|| {
                parse_err(
                    1,
                    "no header row starting with GPU0: expected the output of `nvidia-smi topo -m`",
                )
            })?;
        // Device columns come first, then affinity columns.
        let ndev = cells
            .iter()
            .position(|c| c.contains("Affinity") || c.contains("NUMA"))
            .unwrap_or(cells.len());
        let devices: Vec<String> = cells[..ndev].to_vec();
        let ngpu = devices.iter().take_while(|d| d.starts_with("GPU")).count();
        if ngpu == 0 {
            return Err(parse_err(line, "the header names no GPU columns"));
        }
        for (i, d) in devices[..ngpu].iter().enumerate() {
            if *d != format!("GPU{i}") {
                return Err(parse_err(
                    line,
                    format!("column {} is {d:?}, expected GPU{i}", i + 1),
                ));
            }
        }
        Ok(Header {
            line,
            affinity: cells[ndev..].to_vec(),
            devices,
            ngpu,
        })
    }
}

/// Each device's row after the header (its line, its cells after the
/// name), and the NIC legend's names ("NIC0: mlx5_0").
type DeviceRows = BTreeMap<String, (usize, Vec<String>)>;

fn device_rows(lines: &[String], header: &Header) -> (DeviceRows, BTreeMap<String, String>) {
    let mut rows = BTreeMap::new();
    let mut nic_names = BTreeMap::new();
    for (i, l) in lines.iter().enumerate().skip(header.line) {
        let c = cells(l);
        let Some(first) = c.first() else { continue };
        let t = first.trim();
        if t.starts_with("Legend") {
            // NIC legend lines follow later: "NIC0: mlx5_0".
            continue;
        }
        if let Some((k, v)) = t.split_once(':')
            && k.starts_with("NIC")
            && c.len() == 1
        {
            nic_names.insert(k.trim().to_string(), v.trim().to_string());
            continue;
        }
        if header.devices.iter().any(|d| d == t) {
            rows.insert(t.to_string(), (i + 1, c[1..].to_vec()));
        }
    }
    (rows, nic_names)
}

/// GPU `g`'s links to the other GPUs (`cells`, on line `ln`): pushed to
/// `links` for the GPUs after it, checked against what the earlier ones
/// said (the matrix is symmetric).
fn gpu_links(
    g: usize,
    ln: usize,
    cells: &[String],
    links: &mut Vec<GpuLink>,
) -> Result<(), TopoError> {
    let name = format!("GPU{g}");
    for (h, cell) in cells.iter().enumerate() {
        if h == g {
            if cell != "X" {
                return Err(parse_err(
                    ln,
                    format!("{name} with itself is {cell:?}, expected X"),
                ));
            }
            continue;
        }
        let link = link_kind(cell).ok_or_else(|| {
            parse_err(
                ln,
                format!(
                    "{cell:?} between {name} and GPU{h}: expected X, NV<count>, PIX, PXB, PHB, \
                     NODE or SYS"
                ),
            )
        })?;
        if g < h {
            links.push(GpuLink { a: g, b: h, link });
        } else {
            let mine = links.iter().find(|l| l.a == h && l.b == g).map(|l| &l.link);
            if mine != Some(&link) {
                return Err(parse_err(
                    ln,
                    format!("{name}–GPU{h} is {cell:?}, but GPU{h}–{name} says otherwise"),
                ));
            }
        }
    }
    Ok(())
}

/// A cell of the matrix between two GPUs: NV<count> or a PCIe path.
fn link_kind(cell: &str) -> Option<LinkKind> {
    match cell.strip_prefix("NV") {
        Some(n) => Some(LinkKind::Nvlink {
            count: n.parse().ok()?,
        }),
        None => Some(LinkKind::Pcie {
            path: PciePath::parse(cell)?,
        }),
    }
}

/// The NIC columns, named from the legend where it names them.
fn nics(columns: &[String], legend: &BTreeMap<String, String>) -> Vec<Nic> {
    columns
        .iter()
        .map(|d| {
            let name = legend.get(d).cloned().unwrap_or_else(|| d.clone());
            Nic {
                kind: if name.starts_with("mlx") || name.starts_with("ib") {
                    NicKind::Infiniband
                } else {
                    NicKind::Other
                },
                name,
                speed_gbps: None,
                state: None,
                pci_bus_id: None,
                numa_node: None,
                is_virtual: false,
                reason: String::new(),
            }
        })
        .collect()
}
