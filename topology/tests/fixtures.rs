//! Detection on sysfs trees laid out as the kernel lays them out — devices
//! under `sys/devices/pci<domain>:<bus>/<root port>/.../<function>`, reached
//! through the `sys/bus/pci/devices`, `sys/class/net` and
//! `sys/class/infiniband` symlinks — and on `nvidia-smi topo -m` texts.
//! Each test asserts the facts a plan depends on.

use std::path::{Path, PathBuf};

use zeropp_topology::detect::detect;
use zeropp_topology::plan::RoutingError;
use zeropp_topology::{LinkKind, NicKind, PciePath, Topology, smi};

struct Tree {
    root: PathBuf,
}

impl Tree {
    fn new(name: &str) -> Tree {
        let root = std::env::temp_dir().join(format!("zeropp-topo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("sys/devices/virtual/net")).unwrap();
        std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
        std::fs::create_dir_all(root.join("sys/class/net")).unwrap();
        Tree { root }
    }

    fn file(&self, rel: &str, content: &str) {
        let p = self.root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, format!("{content}\n")).unwrap();
    }

    /// A relative symlink at `rel` to `target` (relative to `sys/`).
    fn link(&self, rel: &str, target: &str) {
        let p = self.root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let depth = rel.matches('/').count() - 1; // below sys/
        let up = "../".repeat(depth);
        std::os::unix::fs::symlink(format!("{up}{target}"), p).unwrap();
    }

    fn host(&self, name: &str, numa: &[&str]) -> &Self {
        self.file("proc/sys/kernel/hostname", name);
        for (i, cpus) in numa.iter().enumerate() {
            self.file(&format!("sys/devices/system/node/node{i}/cpulist"), cpus);
        }
        self
    }

    /// A PCI function at `path` (`pci0000:00/0000:00:01.0/...`): every
    /// component along the way gets its own function files and bus link.
    fn pci(&self, path: &str, vendor: &str, class: &str, numa: i32) {
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

    fn gpu(&self, path: &str, numa: i32) -> &Self {
        self.pci(path, "0x10de", "0x030200", numa);
        self.file(
            &format!("sys/devices/{path}/current_link_speed"),
            "32.0 GT/s PCIe",
        );
        self.file(&format!("sys/devices/{path}/current_link_width"), "16");
        self
    }

    fn eth(&self, name: &str, path: &str, numa: i32, mbps: i64) -> &Self {
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

    fn virtual_net(&self, name: &str, bridge: bool) -> &Self {
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

    fn ib(&self, name: &str, path: &str, numa: i32, layer: &str, rate: &str) -> &Self {
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
    fn nvml(&self, gpus: &[(&str, &str, u64, Vec<String>)]) -> &Self {
        let facts = zeropp_topology::nvml::NvmlFacts {
            driver_version: "550.54.15".into(),
            gpus: gpus
                .iter()
                .map(|(bus, name, mib, links)| zeropp_topology::nvml::NvmlGpu {
                    pci_bus_id: bus.to_string(),
                    name: name.to_string(),
                    memory_mib: *mib,
                    nvlinks: links
                        .iter()
                        .map(|l| zeropp_topology::nvml::NvLink {
                            remote_pci_bus_id: l.clone(),
                        })
                        .collect(),
                })
                .collect(),
        };
        self.file(
            zeropp_topology::nvml::CAPTURE_PATH,
            &serde_json::to_string_pretty(&facts).unwrap(),
        );
        self
    }

    fn detect(&self) -> Topology {
        detect(&self.root).unwrap()
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn path(t: &Topology, a: usize, b: usize) -> PciePath {
    match t.link(a, b) {
        Some(LinkKind::Pcie { path }) => *path,
        other => panic!("GPU{a}-GPU{b}: {other:?}"),
    }
}

/// 8 GPUs as on an HGX H100 board: two sockets, two host bridges each, and
/// behind each host bridge one PCIe switch with two GPUs and two NDR NICs.
fn hgx(t: &Tree) {
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

#[test]
fn hgx_h100_with_ndr_infiniband() {
    let t = Tree::new("hgx");
    hgx(&t);
    let topo = t.detect();
    assert_eq!(topo.hostname, "hgx-01");
    assert_eq!(topo.numa_nodes.len(), 2);
    assert_eq!(topo.numa_nodes[0].cpu_count, 112);
    assert_eq!(topo.gpus.len(), 8);
    assert_eq!(topo.gpu_links.len(), 28);
    assert!(topo.gpu_links.iter().all(|l| l.a < l.b));
    assert_eq!(topo.gpus[0].pci_bus_id, "0000:13:00.0");
    assert_eq!(topo.gpus[4].numa_node, Some(1));
    assert_eq!(topo.gpus[0].link_width, Some(16));
    // Same switch, other host bridge on the same socket, other socket.
    assert_eq!(path(&topo, 0, 1), PciePath::PIX);
    assert_eq!(path(&topo, 0, 2), PciePath::NODE);
    assert_eq!(path(&topo, 0, 7), PciePath::SYS);
    let ib: Vec<_> = topo
        .nics
        .iter()
        .filter(|n| n.kind == NicKind::Infiniband)
        .collect();
    assert_eq!(ib.len(), 8);
    assert!(
        ib.iter()
            .all(|n| n.speed_gbps == Some(400.0) && !n.is_virtual)
    );
    assert_eq!(ib[7].numa_node, Some(1));
    assert_eq!(ib[0].state.as_deref(), Some("ACTIVE"));
    let routable = topo.routable_nics();
    assert_eq!(routable.len(), 9);
    assert_eq!(routable[0].speed_gbps, Some(400.0));
    let lo = topo.nics.iter().find(|n| n.name == "lo").unwrap();
    assert!(lo.is_virtual && lo.reason == "loopback");
    // The JSON a user attaches to a bug report.
    let j = serde_json::to_value(&topo).unwrap();
    assert_eq!(j["gpu_links"][0]["kind"], "pcie");
    assert_eq!(j["gpu_links"][0]["path"], "PIX");
    assert_eq!(j["nics"][0]["virtual"], false);
    for key in ["hostname", "numa_nodes", "gpus", "gpu_links", "nics"] {
        assert!(j.get(key).is_some());
    }
    let view = topo.render();
    assert!(view.contains("GPU0") && view.contains("PIX") && view.contains("SYS"));
}

#[test]
fn four_pcie_gpus_over_two_numa_nodes_with_two_25gbe() {
    let t = Tree::new("pcie4");
    t.host("ws", &["0-15", "16-31"]);
    // Two GPUs per socket, each behind its own root port of one host bridge.
    t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0)
        .gpu("pci0000:00/0000:00:03.0/0000:02:00.0", 0)
        .gpu("pci0000:80/0000:80:01.0/0000:81:00.0", 1)
        .gpu("pci0000:80/0000:80:03.0/0000:82:00.0", 1)
        .eth("ens1f0", "pci0000:00/0000:00:05.0/0000:03:00.0", 0, 25000)
        .eth("ens1f1", "pci0000:80/0000:80:05.0/0000:83:00.1", 1, 25000)
        .virtual_net("lo", false);
    let topo = t.detect();
    assert_eq!(topo.gpus.len(), 4);
    assert_eq!(path(&topo, 0, 1), PciePath::PHB);
    assert_eq!(path(&topo, 2, 3), PciePath::PHB);
    assert_eq!(path(&topo, 0, 2), PciePath::SYS);
    let eth: Vec<_> = topo.routable_nics();
    assert_eq!(eth.len(), 2);
    assert!(
        eth.iter()
            .all(|n| n.kind == NicKind::Ethernet && n.speed_gbps == Some(25.0))
    );
    let f1 = topo.nics.iter().find(|n| n.name == "ens1f1").unwrap();
    assert_eq!(
        (f1.numa_node, f1.pci_bus_id.as_deref()),
        (Some(1), Some("0000:83:00.1"))
    );
}

#[test]
fn a_cpu_only_host_with_10gbe_and_docker() {
    let t = Tree::new("cpu");
    t.host("laptop", &["0-7"])
        .eth("enp3s0", "pci0000:00/0000:00:1c.0/0000:03:00.0", -1, 10000)
        .virtual_net("lo", false)
        .virtual_net("docker0", true)
        .virtual_net("veth12ab", false)
        .virtual_net("br0", true);
    let topo = t.detect();
    assert!(topo.gpus.is_empty() && topo.gpu_links.is_empty());
    assert_eq!(topo.numa_nodes[0].cpu_count, 8);
    let r = topo.routable_nics();
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].name.as_str(), r[0].speed_gbps),
        ("enp3s0", Some(10.0))
    );
    assert_eq!(r[0].numa_node, None, "numa_node -1 means unknown");
    let reason = |n: &str| {
        topo.nics
            .iter()
            .find(|x| x.name == n)
            .map(|x| (x.is_virtual, x.reason.clone()))
            .unwrap()
    };
    assert_eq!(reason("docker0"), (true, "docker bridge".into()));
    assert_eq!(reason("veth12ab"), (true, "veth pair".into()));
    assert_eq!(reason("br0"), (true, "bridge".into()));
    assert!(topo.render().contains("GPUs: none"));
}

#[test]
fn not_a_sysfs_tree_is_an_error_that_says_so() {
    let d = std::env::temp_dir().join(format!("zeropp-topo-empty-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let e = detect(&d).unwrap_err().to_string();
    assert!(e.contains("no sysfs here"), "{e}");
    std::fs::remove_dir_all(d).ok();
}

fn data(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    )
    .unwrap()
}

#[test]
fn nvidia_smi_dgx_a100_matrix_with_nic_legend_and_escape_codes() {
    let t = smi::parse(&data("dgx_a100.txt")).unwrap();
    assert_eq!(t.gpus.len(), 8);
    assert_eq!(t.gpu_links.len(), 28);
    assert!(
        t.gpu_links
            .iter()
            .all(|l| l.link == LinkKind::Nvlink { count: 12 })
    );
    assert_eq!(t.gpus[5].numa_node, Some(1));
    assert_eq!(t.numa_nodes.len(), 2);
    assert_eq!(t.numa_nodes[1].cpus, "64-127,192-255");
    let names: Vec<_> = t.nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]);
}

#[test]
fn nvidia_smi_old_pcie_box_with_soc_and_named_nic_columns() {
    let t = smi::parse(&data("pcie_4gpu_old.txt")).unwrap();
    assert_eq!(t.gpus.len(), 4);
    assert_eq!(path(&t, 0, 1), PciePath::PIX);
    assert_eq!(path(&t, 2, 3), PciePath::PXB);
    assert_eq!(path(&t, 0, 3), PciePath::SYS);
    assert_eq!(t.nics[0].name, "mlx5_0");
    assert_eq!(t.numa_nodes.len(), 0, "no NUMA column in this version");
}

#[test]
fn nvidia_smi_two_gpus_on_an_nvlink_bridge_separated_by_spaces() {
    let t = smi::parse(&data("nvlink_bridge_2gpu.txt")).unwrap();
    assert_eq!(t.gpu_links.len(), 1);
    assert_eq!(t.link(0, 1), Some(&LinkKind::Nvlink { count: 4 }));
    assert_eq!(t.gpus[1].numa_node, Some(0));
    assert!(t.nics.is_empty());
}

#[test]
fn malformed_nvidia_smi_text_names_the_line() {
    let e = smi::parse(&data("bad_cell.txt")).unwrap_err().to_string();
    assert!(e.starts_with("line 2:") && e.contains("QQQ"), "{e}");
    let e = smi::parse("hello\nworld\n").unwrap_err().to_string();
    assert!(e.contains("GPU0"), "{e}");
    let e = smi::parse("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV2\t X \n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("line 3:") && e.contains("says otherwise"),
        "{e}"
    );
}

/// A capture, read back entry by entry and unpacked (by the `tar` crate,
/// and by the system's `tar` as a user would), detects as the original.
fn round_trip(root: &Path, name: &str) {
    use zeropp_topology::capture::{Entry, capture, to_tar};
    let entries = capture(root);
    let tar = to_tar(&entries).unwrap();
    assert_eq!(tar.len() % 512, 0);
    // Every entry comes back with its kind, path, bytes and link target.
    let mut archive = tar::Archive::new(&tar[..]);
    let back: Vec<Entry> = archive
        .entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let path = e.path().unwrap().into_owned();
            match e.header().entry_type() {
                tar::EntryType::Directory => Entry::Dir(path),
                tar::EntryType::Symlink => {
                    Entry::Symlink(path, e.link_name().unwrap().unwrap().into_owned())
                }
                _ => {
                    let mut bytes = Vec::new();
                    std::io::Read::read_to_end(&mut e, &mut bytes).unwrap();
                    Entry::File(path, bytes)
                }
            }
        })
        .collect();
    assert_eq!(back, entries);
    for unpack in ["crate", "system"] {
        let out = std::env::temp_dir().join(format!(
            "zeropp-capture-{name}-{unpack}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        if unpack == "crate" {
            tar::Archive::new(&tar[..]).unpack(&out).unwrap();
        } else {
            let file = out.with_extension("tar");
            std::fs::write(&file, &tar).unwrap();
            let st = std::process::Command::new("tar")
                .arg("-xf")
                .arg(&file)
                .arg("-C")
                .arg(&out)
                .status()
                .unwrap();
            assert!(st.success());
            std::fs::remove_file(&file).ok();
        }
        let (a, b) = (detect(root).unwrap(), detect(&out).unwrap());
        assert_eq!(a, b, "{unpack}");
        std::fs::remove_dir_all(&out).ok();
    }
}

#[test]
fn a_capture_holds_everything_detection_reads() {
    let t = Tree::new("capture");
    hgx(&t);
    t.virtual_net("docker0", true);
    round_trip(&t.root, "hgx");
    // And this machine's own tree.
    round_trip(Path::new("/"), "live");
}

#[test]
fn plan_for_hgx_nodes_uses_the_numa_closest_ndr_nic_per_gpu() {
    use zeropp_topology::plan::plan;
    let t = Tree::new("plan-hgx");
    hgx(&t);
    let p = plan(&t.detect(), 2, 8).unwrap();
    assert_eq!(p.hops.len(), 2);
    assert_eq!(p.hops[1].transport, "NCCL over RDMA");
    // 8 x 400 Gb/s per node = 400 GB/s, shared by 8 ranks.
    assert!((p.hops[1].gbps_per_rank - 50.0).abs() < 1e-9);
    assert_eq!(p.hpz_group, 8);
    // Without NVML the fixture's GPUs talk over PCIe, about as fast per rank
    // as the NDR NICs: int4 on both gradient hops.
    assert_eq!(p.qgz_bits, [4, 4], "{}", p.render());
    let nics: Vec<_> = p.rank_nics.iter().map(|r| r.nic.clone().unwrap()).collect();
    assert_eq!(
        nics,
        [
            "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"
        ]
    );
    let env: std::collections::HashMap<_, _> = p.env.iter().cloned().collect();
    assert_eq!(env["NCCL_IB_DISABLE"], "0");
    assert!(env["UCX_NET_DEVICES"].starts_with("mlx5_0:1,mlx5_1:1"));
    assert!(p.render().contains("hpZ group: 8 ranks"));
    // More ranks than GPUs is refused.
    let e = plan(&t.detect(), 2, 9).unwrap_err();
    assert_eq!(e, RoutingError::MoreRanksThanGpus { ranks: 9, gpus: 8 });
    assert!(e.to_string().contains("one rank per GPU"), "{e}");
}

#[test]
fn plan_for_cpu_only_nodes_on_ethernet_keeps_int8_inside_and_int4_across() {
    use zeropp_topology::plan::plan;
    let t = Tree::new("plan-cpu");
    t.host("laptop", &["0-7"])
        .eth("enp3s0", "pci0000:00/0000:00:1c.0/0000:03:00.0", -1, 10000)
        .virtual_net("lo", false)
        .virtual_net("docker0", true);
    let p = plan(&t.detect(), 4, 2).unwrap();
    assert_eq!(p.hops[0].transport, "UCX shared memory");
    assert_eq!(p.hops[1].transport, "UCX over TCP");
    assert!((p.hops[1].gbps_per_rank - 0.625).abs() < 1e-9);
    // Shared memory is 16x faster per rank than the NIC.
    assert_eq!(p.qgz_bits, [8, 4]);
    assert!(
        p.rank_nics
            .iter()
            .all(|r| r.nic.as_deref() == Some("enp3s0"))
    );
    let env: std::collections::HashMap<_, _> = p.env.iter().cloned().collect();
    assert_eq!(env["NCCL_SOCKET_IFNAME"], "enp3s0");
    assert_eq!(env["NCCL_IB_DISABLE"], "1");
    assert_eq!(env["UCX_TLS"], "tcp,sm,self");
    // One node: nothing crosses a slow link.
    let one = plan(&t.detect(), 1, 2).unwrap();
    assert_eq!((one.hops.len(), one.qgz_bits), (1, [8, 8]));
}

#[test]
fn plan_on_a_pcie_box_with_nvlink_pairs_keeps_hpz_on_the_pairs() {
    use zeropp_topology::plan::plan;
    use zeropp_topology::{GpuLink, LinkKind};
    let t = Tree::new("plan-pairs");
    t.host("ws", &["0-15", "16-31"]);
    t.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0)
        .gpu("pci0000:00/0000:00:03.0/0000:02:00.0", 0)
        .gpu("pci0000:80/0000:80:01.0/0000:81:00.0", 1)
        .gpu("pci0000:80/0000:80:03.0/0000:82:00.0", 1)
        .eth("eno1", "pci0000:00/0000:00:05.0/0000:03:00.0", 0, 1000);
    let mut topo = t.detect();
    for l in topo.gpu_links.iter_mut() {
        if (l.a, l.b) == (0, 1) || (l.a, l.b) == (2, 3) {
            *l = GpuLink {
                a: l.a,
                b: l.b,
                link: LinkKind::Nvlink { count: 4 },
            };
        }
    }
    let p = plan(&topo, 2, 4).unwrap();
    assert_eq!(p.hpz_group, 2, "{}", p.render());
    assert!(p.hpz_why.contains("NVLink islands of 2"));
    assert!(p.hops[0].why.contains("PCIe"));
    assert_eq!(p.qgz_bits, [8, 4]);
}

/// A DGX A100: 2 AMD sockets, 4 PCIe switches, each with 2 GPUs and 2 HDR
/// InfiniBand NICs; 6 NVSwitches, 12 NVLinks per GPU (2 to each switch), as
/// NVML reports them (NVML spells bus ids with an 8-digit domain).
fn dgx_a100(t: &Tree) -> Vec<String> {
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

#[test]
fn dgx_a100_nvswitch_links_from_nvml_and_hdr_infiniband() {
    use zeropp_topology::plan::plan;
    let t = Tree::new("dgx-a100");
    let buses = dgx_a100(&t);
    let topo = t.detect();
    assert_eq!(topo.gpus.len(), 8);
    assert_eq!(
        topo.gpus
            .iter()
            .map(|g| g.pci_bus_id.clone())
            .collect::<Vec<_>>(),
        buses
    );
    assert_eq!(topo.gpus[3].name.as_deref(), Some("NVIDIA A100-SXM4-80GB"));
    assert_eq!(topo.gpus[3].memory_mib, Some(81920));
    assert_eq!(topo.gpu_links.len(), 28);
    for l in &topo.gpu_links {
        assert_eq!(
            l.link,
            LinkKind::Nvlink { count: 12 },
            "GPU{}-GPU{}",
            l.a,
            l.b
        );
    }
    let ib: Vec<_> = topo
        .nics
        .iter()
        .filter(|n| n.kind == NicKind::Infiniband)
        .collect();
    assert_eq!(ib.len(), 8);
    assert!(ib.iter().all(|n| n.speed_gbps == Some(200.0)));
    assert_eq!(ib[5].numa_node, Some(1));
    let p = plan(&topo, 16, 8).unwrap();
    assert_eq!(p.hpz_group, 8, "{}", p.render());
    assert_eq!(p.hops[0].transport, "NCCL", "{}", p.render());
    // 12 NVLinks x 25 GB/s inside; 8 x 200 Gb/s = 200 GB/s per node across.
    assert!(
        (p.hops[0].gbps_per_rank - 300.0).abs() < 1e-9,
        "{}",
        p.render()
    );
    assert!(
        (p.hops[1].gbps_per_rank - 25.0).abs() < 1e-9,
        "{}",
        p.render()
    );
    assert_eq!(p.qgz_bits, [8, 4], "{}", p.render());
    let nics: Vec<_> = p.rank_nics.iter().map(|r| r.nic.clone().unwrap()).collect();
    // Each GPU takes the HDR NIC beside it on its own switch.
    assert_eq!(
        nics,
        (0..8).map(|i| format!("mlx5_{i}")).collect::<Vec<_>>()
    );
    let env: std::collections::BTreeMap<_, _> = p.env.iter().cloned().collect();
    assert_eq!(
        env.get("NCCL_IB_DISABLE").map(String::as_str),
        Some("0"),
        "{:?}",
        p.env
    );
}

#[test]
fn nvlink_bridge_workstation_with_one_gigabit_ethernet() {
    use zeropp_topology::plan::plan;
    let t = Tree::new("bridge");
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
    let topo = t.detect();
    assert_eq!(topo.gpu_links.len(), 1);
    assert_eq!(topo.gpu_links[0].link, LinkKind::Nvlink { count: 4 });
    assert_eq!(topo.gpus[1].name.as_deref(), Some("NVIDIA RTX A6000"));
    let eth: Vec<_> = topo.routable_nics();
    assert_eq!(eth.len(), 1);
    assert_eq!(
        (eth[0].name.as_str(), eth[0].speed_gbps),
        ("enp5s0", Some(1.0))
    );
    let p = plan(&topo, 2, 2).unwrap();
    assert_eq!(p.hpz_group, 2, "{}", p.render());
    assert_eq!(p.hops[1].transport, "NCCL over TCP", "{}", p.render());
    // 1 Gbit/s shared by two ranks: 62.5 MB/s each; int4 on both hops.
    assert!(
        (p.hops[1].gbps_per_rank - 0.0625).abs() < 1e-9,
        "{}",
        p.render()
    );
    assert_eq!(p.qgz_bits, [8, 4], "{}", p.render());
    let env: std::collections::BTreeMap<_, _> = p.env.iter().cloned().collect();
    assert_eq!(
        env.get("NCCL_SOCKET_IFNAME").map(String::as_str),
        Some("enp5s0")
    );
}

#[test]
fn damaged_nvml_facts_in_a_capture_are_named() {
    let t = Tree::new("bad-nvml");
    t.host("h", &["0-3"]);
    t.file(zeropp_topology::nvml::CAPTURE_PATH, "{ not json");
    let e = detect(&t.root).unwrap_err().to_string();
    assert!(
        e.contains("nvml.json") && e.contains("not NVML facts"),
        "{e}"
    );
}

#[test]
fn a_capture_carries_the_nvml_facts() {
    use zeropp_topology::capture::{Entry, capture};
    let t = Tree::new("cap-nvml");
    dgx_a100(&t);
    let entries = capture(&t.root);
    let nvml = entries.iter().find_map(|e| match e {
        Entry::File(p, bytes) if p == Path::new(zeropp_topology::nvml::CAPTURE_PATH) => Some(bytes),
        _ => None,
    });
    let facts: zeropp_topology::nvml::NvmlFacts =
        serde_json::from_slice(nvml.expect("nvml.json not captured")).unwrap();
    assert_eq!(facts.gpus.len(), 8);
    assert_eq!(facts.gpus[0].nvlinks.len(), 12);
}

#[test]
fn hgx_h100_nv18_through_four_nvswitches() {
    use zeropp_topology::plan::plan;
    let t = Tree::new("hgx-nv18");
    hgx(&t);
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
    let topo = t.detect();
    assert!(
        topo.gpu_links
            .iter()
            .all(|l| l.link == LinkKind::Nvlink { count: 18 })
    );
    let p = plan(&topo, 2, 8).unwrap();
    // 18 NVLinks x 25 GB/s inside the node.
    assert!(
        (p.hops[0].gbps_per_rank - 450.0).abs() < 1e-9,
        "{}",
        p.render()
    );
    assert_eq!(p.hpz_group, 8);
    // NVLink is 9x the NDR NICs per rank: int8 gradients inside the node
    // cost little (without NVML facts the same box plans int4 on both).
    assert_eq!(p.qgz_bits, [8, 4], "{}", p.render());
}

#[test]
fn a_cluster_of_unlike_nodes_is_planned_for_the_weakest() {
    use zeropp_topology::plan::cluster;
    let (a, b) = (Tree::new("cl-hgx"), Tree::new("cl-dgx"));
    hgx(&a);
    dgx_a100(&b);
    let (hgx_t, dgx_t) = (a.detect(), b.detect());
    // Alike: node 0's plan, no differences.
    let same = cluster(&[dgx_t.clone(), dgx_t.clone()], 8).unwrap();
    assert_eq!((same.planned_for, same.differences.len()), (0, 0));
    assert_eq!(same.plan.nodes, 2);
    // Unlike: 8 x 400 Gb/s NDR against 8 x 200 Gb/s HDR per node; the HDR
    // node decides (25 GB/s per rank across), and both shapes are listed.
    let mixed = cluster(&[hgx_t, dgx_t], 8).unwrap();
    assert_eq!(mixed.planned_for, 1);
    assert_eq!(mixed.hosts, vec!["hgx-01", "dgx-a100-07"]);
    assert!((mixed.plan.hops[1].gbps_per_rank - 25.0).abs() < 1e-9);
    assert_eq!(mixed.differences.len(), 2);
    assert!(
        mixed.differences[0].contains("8 x infiniband 400 Gb/s"),
        "{:?}",
        mixed.differences
    );
    assert!(
        mixed.differences[1].contains("NV12"),
        "{:?}",
        mixed.differences
    );
    // A node with fewer GPUs than ranks cannot be planned: named.
    let e = cluster(&[a.detect(), b.detect()], 9).unwrap_err();
    assert!(e.to_string().starts_with("node 0 (hgx-01)"), "{e}");
    assert!(matches!(e, RoutingError::Node { node: 0, .. }), "{e:?}");
}
