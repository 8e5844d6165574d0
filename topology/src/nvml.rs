//! What only the driver knows: GPU names, memory and NVLink links per peer,
//! through NVML (`libnvidia-ml.so.1`, loaded at run time by nvml-wrapper).
//! No driver is not an error: detection then has the sysfs facts only.
//!
//! Captures carry these facts as `zeropp/nvml.json`, so a tree captured on a
//! GPU machine shows its NVLinks when inspected elsewhere.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{LinkKind, Topology};

/// Where a capture keeps the NVML facts, relative to its root.
pub const CAPTURE_PATH: &str = "zeropp/nvml.json";

/// One active NVLink of a GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NvLink {
    /// The PCI bus id of the other end (a GPU, or an NVSwitch).
    pub remote_pci_bus_id: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NvmlGpu {
    pub pci_bus_id: String,
    pub name: String,
    pub memory_mib: u64,
    pub nvlinks: Vec<NvLink>,
}

/// The driver's view of this machine's GPUs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NvmlFacts {
    pub driver_version: String,
    pub gpus: Vec<NvmlGpu>,
}

/// A PCI bus id as sysfs spells it: lower case, 4-digit domain (NVML says
/// `00000000:07:00.0`).
pub fn norm_bus_id(b: &str) -> String {
    let b = b.trim().to_ascii_lowercase();
    match b.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => b,
    }
}

/// Asks the live driver; `Ok(None)` when there is no NVML (no driver, no
/// GPU), an error only when NVML is there and fails.
pub fn query() -> Result<Option<NvmlFacts>, crate::TopoError> {
    use nvml_wrapper::Nvml;
    use nvml_wrapper::error::NvmlError;
    let failed = |what: String| crate::TopoError::Read {
        path: "NVML (libnvidia-ml.so.1)".into(),
        what,
    };
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(
            NvmlError::LibloadingError(_) | NvmlError::DriverNotLoaded | NvmlError::NoPermission,
        ) => {
            return Ok(None);
        }
        Err(e) => return Err(failed(format!("NVML: {e}"))),
    };
    let count = nvml
        .device_count()
        .map_err(|e| failed(format!("NVML device count: {e}")))?;
    let mut gpus = Vec::new();
    for i in 0..count {
        let d = nvml
            .device_by_index(i)
            .map_err(|e| failed(format!("NVML device {i}: {e}")))?;
        let pci = d
            .pci_info()
            .map_err(|e| failed(format!("NVML device {i} PCI info: {e}")))?;
        let mut nvlinks = Vec::new();
        // NVML_NVLINK_MAX_LINKS is 18; links past a GPU's own count fail.
        for link in 0..18 {
            let l = d.link_wrapper_for(link);
            if l.is_active().unwrap_or(false)
                && let Ok(remote) = l.remote_pci_info()
            {
                nvlinks.push(NvLink {
                    remote_pci_bus_id: norm_bus_id(&remote.bus_id),
                });
            }
        }
        gpus.push(NvmlGpu {
            pci_bus_id: norm_bus_id(&pci.bus_id),
            name: d.name().unwrap_or_default(),
            memory_mib: d.memory_info().map(|m| m.total >> 20).unwrap_or(0),
            nvlinks,
        });
    }
    Ok(Some(NvmlFacts {
        driver_version: nvml.sys_driver_version().unwrap_or_default(),
        gpus,
    }))
}

/// NVLinks between two GPUs: direct links plus, when both reach switches
/// (any peer that is not a GPU), the smaller of their switch link counts —
/// what `nvidia-smi topo -m` shows as NV#.
pub fn nvlink_count(
    a_links: &[String],
    b_bus: &str,
    b_links: &[String],
    is_gpu: impl Fn(&str) -> bool,
) -> u32 {
    let direct = a_links.iter().filter(|t| *t == b_bus).count() as u32;
    let switched = |links: &[String]| links.iter().filter(|t| !is_gpu(t)).count() as u32;
    direct + switched(a_links).min(switched(b_links))
}

/// Adds names, memory and NVLinks to the GPUs sysfs found (matched by bus id).
pub fn apply(topo: &mut Topology, facts: &NvmlFacts) {
    let by_bus: BTreeMap<String, &NvmlGpu> = facts
        .gpus
        .iter()
        .map(|g| (norm_bus_id(&g.pci_bus_id), g))
        .collect();
    for g in &mut topo.gpus {
        if let Some(n) = by_bus.get(&norm_bus_id(&g.pci_bus_id)) {
            g.name = Some(n.name.clone());
            g.memory_mib = Some(n.memory_mib);
        }
    }
    let bus_of: BTreeMap<usize, String> = topo
        .gpus
        .iter()
        .map(|g| (g.index, norm_bus_id(&g.pci_bus_id)))
        .collect();
    let links_of = |bus: &str| -> Vec<String> {
        by_bus
            .get(bus)
            .map(|g| {
                g.nvlinks
                    .iter()
                    .map(|l| norm_bus_id(&l.remote_pci_bus_id))
                    .collect()
            })
            .unwrap_or_default()
    };
    let is_gpu = |b: &str| by_bus.contains_key(b);
    for l in &mut topo.gpu_links {
        let (Some(a), Some(b)) = (bus_of.get(&l.a), bus_of.get(&l.b)) else {
            continue;
        };
        let n = nvlink_count(&links_of(a), b, &links_of(b), is_gpu);
        if n > 0 {
            l.link = LinkKind::Nvlink { count: n };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_normalised() {
        assert_eq!(norm_bus_id("00000000:07:00.0"), "0000:07:00.0");
        assert_eq!(norm_bus_id("0000:B7:00.0"), "0000:b7:00.0");
    }

    #[test]
    fn links_count_direct_and_through_switches() {
        let gpus = ["0000:01:00.0", "0000:02:00.0"];
        let is_gpu = |b: &str| gpus.contains(&b);
        let sw = |n: usize| vec!["0000:ff:00.0".to_string(); n];
        assert_eq!(nvlink_count(&sw(12), gpus[1], &sw(12), is_gpu), 12);
        assert_eq!(nvlink_count(&sw(12), gpus[1], &sw(6), is_gpu), 6);
        let bridge = vec![gpus[1].to_string(); 4];
        assert_eq!(nvlink_count(&bridge, gpus[1], &[], is_gpu), 4);
        assert_eq!(nvlink_count(&[], gpus[1], &sw(12), is_gpu), 0);
    }

    #[test]
    fn no_driver_here_is_not_an_error() {
        // On a machine with a driver this returns its facts; without, None.
        let r = query();
        assert!(r.is_ok(), "{r:?}");
    }
}
