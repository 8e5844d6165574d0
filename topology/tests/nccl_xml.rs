//! NCCL topology dumps (NCCL_TOPO_DUMP_FILE) read into the same facts as
//! detection (the plans made from them: zeropp-zero's tests/routing.rs).

use zeropp_topology::{LinkKind, NicKind, PciePath, Topology, nccl};

fn load(name: &str) -> Topology {
    let path = format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    nccl::parse(&text, name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn link(t: &Topology, a: usize, b: usize) -> LinkKind {
    t.link(a, b)
        .cloned()
        .unwrap_or_else(|| panic!("no link {a}-{b}"))
}

#[test]
fn dgx_a100_dump_nvswitch_pairs_and_hdr_infiniband() {
    let t = load("nccl_dgx_a100.xml");
    assert_eq!(t.gpus.len(), 8);
    assert_eq!(t.gpus[0].pci_bus_id, "0000:07:00.0");
    assert_eq!(t.gpus[5].numa_node, Some(1));
    assert_eq!(t.gpus[5].link_width, Some(16));
    assert_eq!(t.numa_nodes.len(), 2);
    assert_eq!(t.numa_nodes[0].cpus, "0-15,80-95");
    assert_eq!(t.numa_nodes[0].cpu_count, 32);
    // Every pair once, a < b, all NV12 through the switches.
    assert_eq!(t.gpu_links.len(), 28);
    for l in &t.gpu_links {
        assert!(l.a < l.b);
        assert_eq!(l.link, LinkKind::Nvlink { count: 12 }, "{}-{}", l.a, l.b);
    }
    assert_eq!(t.nics.len(), 8);
    for (i, n) in t.nics.iter().enumerate() {
        assert_eq!(n.name, format!("mlx5_{i}"));
        assert_eq!(n.kind, NicKind::Infiniband);
        assert_eq!(n.speed_gbps, Some(200.0));
        assert_eq!(n.numa_node, Some(u32::from(i >= 4)));
        assert!(!n.is_virtual);
    }
}

#[test]
fn pcie_workstation_dump_paths_from_the_pci_tree() {
    let t = load("nccl_pcie_4gpu.xml");
    assert_eq!(t.gpus.len(), 4);
    assert_eq!(
        link(&t, 0, 1),
        LinkKind::Pcie {
            path: PciePath::PIX
        }
    );
    assert_eq!(
        link(&t, 2, 3),
        LinkKind::Pcie {
            path: PciePath::NODE
        }
    );
    assert_eq!(
        link(&t, 0, 2),
        LinkKind::Pcie {
            path: PciePath::SYS
        }
    );
    assert_eq!(
        link(&t, 1, 3),
        LinkKind::Pcie {
            path: PciePath::SYS
        }
    );
    assert_eq!(t.nics.len(), 2);
    assert!(
        t.nics
            .iter()
            .all(|n| n.kind == NicKind::Ethernet && n.speed_gbps == Some(25.0))
    );
    assert_eq!(t.nics[1].pci_bus_id.as_deref(), Some("0000:a1:00.0"));
}

#[test]
fn nvlink_bridge_dump_joins_the_pair_directly() {
    let t = load("nccl_nvlink_bridge.xml");
    assert_eq!(link(&t, 0, 1), LinkKind::Nvlink { count: 4 });
    assert_eq!(t.nics[0].name, "enp5s0");
    assert_eq!(t.nics[0].speed_gbps, Some(1.0));
    assert_eq!(t.nics[0].pci_bus_id, None);
    assert_eq!(t.numa_nodes[0].cpu_count, 8);
}

#[test]
fn a_damaged_dump_names_the_line() {
    let path = format!(
        "{}/tests/data/nccl_dgx_a100.xml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    // Cut the file mid-element: not well-formed.
    let cut = &text[..text.len() / 2];
    let e = nccl::parse(cut, "x").unwrap_err().to_string();
    assert!(e.starts_with("line "), "{e}");
    // A bad number on a known line.
    let bad = text.replacen("count=\"12\"", "count=\"twelve\"", 1);
    let e = nccl::parse(&bad, "x").unwrap_err().to_string();
    assert_eq!(e, "line 7: count=\"twelve\" is not a number");
}
