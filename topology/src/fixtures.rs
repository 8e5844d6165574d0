//! Sysfs trees laid out as the kernel lays them out, built in a temporary
//! directory: for the tests of detection (this crate's) and of the plans
//! made from what it detects (`zeropp_zero::routing`'s). Devices sit under
//! `sys/devices/pci<domain>:<bus>/<root port>/.../<function>`, reached
//! through the `sys/bus/pci/devices`, `sys/class/net` and
//! `sys/class/infiniband` symlinks.

use std::path::PathBuf;

use crate::Topology;
use crate::detect::detect;

/// A sysfs tree under a fresh temporary directory (removed when dropped).
pub struct Tree {
    pub root: PathBuf,
}

impl Tree {
    pub fn new(name: &str) -> Tree {
        let root = std::env::temp_dir().join(format!("zeropp-topo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("sys/devices/virtual/net")).unwrap();
        std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
        std::fs::create_dir_all(root.join("sys/class/net")).unwrap();
        Tree { root }
    }

    pub fn file(&self, rel: &str, content: &str) {
        let p = self.root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, format!("{content}\n")).unwrap();
    }

    /// A relative symlink at `rel` to `target` (relative to `sys/`).
    pub fn link(&self, rel: &str, target: &str) {
        let p = self.root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let depth = rel.matches('/').count() - 1; // below sys/
        let up = "../".repeat(depth);
        std::os::unix::fs::symlink(format!("{up}{target}"), p).unwrap();
    }

    pub fn host(&self, name: &str, numa: &[&str]) -> &Self {
        self.file("proc/sys/kernel/hostname", name);
        for (i, cpus) in numa.iter().enumerate() {
            self.file(&format!("sys/devices/system/node/node{i}/cpulist"), cpus);
        }
        self
    }

    /// A PCI function at `path` (`pci0000:00/0000:00:01.0/...`): every
    /// component along the way gets its own function files and bus link.
    pub fn pci(&self, path: &str, vendor: &str, class: &str, numa: i32) {
        let parts: Vec<&str> = path.split('/').collect();
        for i in 1..parts.len() {
            let sub = parts[..=i].join("/");
            let dir = format!("sys/devices/{sub}");
            let last = i == parts.len() - 1;
            if !self.root.join(&dir).join("class").exists() || last {
                self.file(
                    &format!("{dir}/vendor"),
                    if last { vendor } else { "0x8086" },
                );
                self.file(
                    &format!("{dir}/class"),
                    if last { class } else { "0x060400" },
                );
                self.file(&format!("{dir}/numa_node"), &numa.to_string());
                let bus = format!("sys/bus/pci/devices/{}", parts[i]);
                if !self.root.join(&bus).exists() {
                    self.link(&bus, &format!("devices/{sub}"));
                }
            }
        }
    }

    pub fn gpu(&self, path: &str, numa: i32) -> &Self {
        self.pci(path, "0x10de", "0x030200", numa);
        self.file(
            &format!("sys/devices/{path}/current_link_speed"),
            "32.0 GT/s PCIe",
        );
        self.file(&format!("sys/devices/{path}/current_link_width"), "16");
        self
    }

    pub fn eth(&self, name: &str, path: &str, numa: i32, mbps: i64) -> &Self {
        self.pci(path, "0x15b3", "0x020000", numa);
        let d = format!("sys/devices/{path}/net/{name}");
        self.file(&format!("{d}/speed"), &mbps.to_string());
        self.file(&format!("{d}/type"), "1");
        self.file(&format!("{d}/operstate"), "up");
        self.link(
            &format!("sys/class/net/{name}"),
            &format!("devices/{path}/net/{name}"),
        );
        self
    }

    pub fn virtual_net(&self, name: &str, bridge: bool) -> &Self {
        let d = format!("sys/devices/virtual/net/{name}");
        self.file(&format!("{d}/type"), if name == "lo" { "772" } else { "1" });
        self.file(&format!("{d}/operstate"), "unknown");
        if bridge {
            self.file(&format!("{d}/bridge/forward_delay"), "1500");
        }
        self.link(
            &format!("sys/class/net/{name}"),
            &format!("devices/virtual/net/{name}"),
        );
        self
    }

    pub fn ib(&self, name: &str, path: &str, numa: i32, layer: &str, rate: &str) -> &Self {
        self.pci(path, "0x15b3", "0x020700", numa);
        let d = format!("sys/devices/{path}/infiniband/{name}");
        self.file(&format!("{d}/ports/1/link_layer"), layer);
        self.file(&format!("{d}/ports/1/rate"), rate);
        self.file(&format!("{d}/ports/1/state"), "4: ACTIVE");
        self.link(
            &format!("sys/class/infiniband/{name}"),
            &format!("devices/{path}/infiniband/{name}"),
        );
        self
    }

    /// NVML's facts as `zeropp topo capture` stores them: per GPU (bus id)
    /// its name, memory and the bus id at the other end of each NVLink.
    pub fn nvml(&self, gpus: &[(&str, &str, u64, Vec<String>)]) -> &Self {
        let facts = crate::nvml::NvmlFacts {
            driver_version: "550.54.15".into(),
            gpus: gpus
                .iter()
                .map(|(bus, name, mib, links)| crate::nvml::NvmlGpu {
                    pci_bus_id: bus.to_string(),
                    name: name.to_string(),
                    memory_mib: *mib,
                    nvlinks: links
                        .iter()
                        .map(|l| crate::nvml::NvLink {
                            remote_pci_bus_id: l.clone(),
                        })
                        .collect(),
                })
                .collect(),
        };
        self.file(
            crate::nvml::CAPTURE_PATH,
            &serde_json::to_string_pretty(&facts).unwrap(),
        );
        self
    }

    pub fn detect(&self) -> Topology {
        detect(&self.root).unwrap()
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// 8 GPUs as on an HGX H100 board: two sockets, two host bridges each, and
/// behind each host bridge one PCIe switch with two GPUs and two NDR NICs.
pub fn hgx(t: &Tree) {
    t.host("hgx-01", &["0-55,112-167", "56-111,168-223"]);
    for hb in 0..4 {
        let numa = hb / 2;
        let root = format!("pci0000:{:02x}", hb * 0x40 + 0x10);
        let rp = format!("0000:{:02x}:01.0", hb * 0x40 + 0x10);
        let up = format!("0000:{:02x}:00.0", hb * 0x40 + 0x11);
        for k in 0..4 {
            let dp = format!("0000:{:02x}:{:02x}.0", hb * 0x40 + 0x12, k);
            let ep = format!("0000:{:02x}:00.0", hb * 0x40 + 0x13 + k);
            let p = format!("{root}/{rp}/{up}/{dp}/{ep}");
            if k < 2 {
                t.gpu(&p, numa);
            } else {
                t.ib(
                    &format!("mlx5_{}", hb * 2 + k - 2),
                    &p,
                    numa,
                    "InfiniBand",
                    "400 Gb/sec (4X NDR)",
                );
            }
        }
    }
    t.eth("eno1", "pci0000:00/0000:00:1c.0/0000:02:00.0", 0, 1000)
        .virtual_net("lo", false);
}

/// A DGX A100: 2 AMD sockets, 4 PCIe switches, each with 2 GPUs and 2 HDR
/// InfiniBand NICs; 6 NVSwitches, 12 NVLinks per GPU (2 to each switch), as
/// NVML reports them (NVML spells bus ids with an 8-digit domain).
pub fn dgx_a100(t: &Tree) -> Vec<String> {
    t.host("dgx-a100-07", &["0-63,128-191", "64-127,192-255"]);
    let mut buses = Vec::new();
    for sw in 0..4 {
        let numa = sw / 2;
        let root = format!("pci0000:{:02x}", sw * 0x40);
        let rp = format!("0000:{:02x}:01.1", sw * 0x40);
        let up = format!("0000:{:02x}:00.0", sw * 0x40 + 1);
        for k in 0..4 {
            let dp = format!("0000:{:02x}:{:02x}.0", sw * 0x40 + 2, k * 4);
            let ep = format!("0000:{:02x}:00.0", sw * 0x40 + 3 + k);
            let p = format!("{root}/{rp}/{up}/{dp}/{ep}");
            if k % 2 == 0 {
                t.gpu(&p, numa);
                buses.push(ep);
            } else {
                let n = sw * 2 + k / 2;
                t.ib(
                    &format!("mlx5_{n}"),
                    &p,
                    numa,
                    "InfiniBand",
                    "200 Gb/sec (4X HDR)",
                );
            }
        }
    }
    t.eth(
        "enp226s0",
        "pci0000:e0/0000:e0:03.1/0000:e2:00.0",
        1,
        100000,
    )
    .virtual_net("lo", false)
    .virtual_net("docker0", true);
    let switches: Vec<String> = (0..6)
        .map(|s| format!("00000000:{:02x}:00.0", 0xf0 + s))
        .collect();
    let links: Vec<String> = switches
        .iter()
        .flat_map(|s| [s.clone(), s.clone()])
        .collect();
    let facts: Vec<(&str, &str, u64, Vec<String>)> = buses
        .iter()
        .map(|b| (b.as_str(), "NVIDIA A100-SXM4-80GB", 81920, links.clone()))
        .collect();
    t.nvml(&facts);
    buses
}

/// A workstation with two RTX A6000 on an NVLink bridge (4 links) and one
/// gigabit Ethernet port.
pub fn nvlink_bridge(t: &Tree) {
    t.host("ws-bridge", &["0-15"]);
    t.gpu("pci0000:00/0000:00:01.1/0000:01:00.0", 0)
        .gpu("pci0000:00/0000:00:03.1/0000:2d:00.0", 0)
        .eth("enp5s0", "pci0000:00/0000:00:02.2/0000:05:00.0", 0, 1000)
        .virtual_net("lo", false);
    let to = |b: &str| vec![b.to_string(); 4];
    t.nvml(&[
        (
            "00000000:01:00.0",
            "NVIDIA RTX A6000",
            49140,
            to("00000000:2D:00.0"),
        ),
        (
            "00000000:2D:00.0",
            "NVIDIA RTX A6000",
            49140,
            to("00000000:01:00.0"),
        ),
    ]);
}

/// The HGX H100 of [`hgx`] with NVML's facts: 18 NVLinks per GPU over 4
/// NVSwitches (5 + 4 + 4 + 5).
pub fn hgx_nv18(t: &Tree) {
    hgx(t);
    let buses: Vec<String> = t
        .detect()
        .gpus
        .iter()
        .map(|g| g.pci_bus_id.clone())
        .collect();
    // 18 links per GPU over 4 NVSwitches (5 + 4 + 4 + 5), as on HGX H100.
    let links: Vec<String> = [5, 4, 4, 5]
        .iter()
        .enumerate()
        .flat_map(|(s, n)| std::iter::repeat_n(format!("00000000:{:02x}:00.0", 0xf0 + s), *n))
        .collect();
    let facts: Vec<(&str, &str, u64, Vec<String>)> = buses
        .iter()
        .map(|b| (b.as_str(), "NVIDIA H100 80GB HBM3", 81559, links.clone()))
        .collect();
    t.nvml(&facts);
}
