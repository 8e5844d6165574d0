//! Detection on sysfs trees laid out as the kernel lays them out — devices
//! under `sys/devices/pci<domain>:<bus>/<root port>/.../<function>`, reached
//! through the `sys/bus/pci/devices`, `sys/class/net` and
//! `sys/class/infiniband` symlinks — and on `nvidia-smi topo -m` texts.
//! Each test asserts the facts a plan depends on.

use std::path::Path;

use zeropp_topology::detect::detect;
use zeropp_topology::fixtures::{Tree, dgx_a100, hgx, hgx_nv18, nvlink_bridge};
use zeropp_topology::{LinkKind, NicKind, PciePath, Topology, smi};

fn path(t: &Topology, a: usize, b: usize) -> PciePath {
    match t.link(a, b) {
        Some(LinkKind::Pcie { path }) => *path,
        other => panic!("GPU{a}-GPU{b}: {other:?}"),
    }
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
fn dgx_a100_nvswitch_links_from_nvml_and_hdr_infiniband() {
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
}

#[test]
fn nvlink_bridge_workstation_with_one_gigabit_ethernet() {
    let t = Tree::new("bridge");
    nvlink_bridge(&t);
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
    let t = Tree::new("hgx-nv18");
    hgx_nv18(&t);
    let topo = t.detect();
    assert!(
        topo.gpu_links
            .iter()
            .all(|l| l.link == LinkKind::Nvlink { count: 18 })
    );
}
