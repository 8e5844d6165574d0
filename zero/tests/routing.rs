//! The routing plan made from each node's detected facts: sysfs trees
//! built as the kernel lays them out (`zeropp_topology::fixtures`) and NCCL
//! topology dumps (zeropp-topology's tests/data).

use zeropp_topology::fixtures::{Tree, dgx_a100, hgx, hgx_nv18, nvlink_bridge};
use zeropp_topology::{Topology, nccl};
use zeropp_zero::routing::{RoutingError, cluster, plan};

fn load(name: &str) -> Topology {
    let path = format!(
        "{}/../topology/tests/data/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    nccl::parse(&text, name).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn plan_for_hgx_nodes_uses_the_numa_closest_ndr_nic_per_gpu() {
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
fn plan_for_cpu_only_nodes_on_ethernet_sends_bf16_inside_and_int4_across() {
    let t = Tree::new("plan-cpu");
    t.host("laptop", &["0-7"])
        .eth("enp3s0", "pci0000:00/0000:00:1c.0/0000:03:00.0", -1, 10000)
        .virtual_net("lo", false)
        .virtual_net("docker0", true);
    let p = plan(&t.detect(), 4, 2).unwrap();
    assert_eq!(p.hops[0].transport, "UCX shared memory");
    assert_eq!(p.hops[1].transport, "UCX over TCP");
    assert!((p.hops[1].gbps_per_rank - 0.625).abs() < 1e-9);
    // No GPUs: quantizing inside the node would cost the ranks' CPUs more
    // than the shared-memory bytes it saves.
    assert_eq!(p.qgz_bits, [16, 4], "{}", p.render());
    assert!(
        p.render().contains("qgZ bf16 inside / int4 across"),
        "{}",
        p.render()
    );
    assert!(
        p.rank_nics
            .iter()
            .all(|r| r.nic.as_deref() == Some("enp3s0"))
    );
    let env: std::collections::HashMap<_, _> = p.env.iter().cloned().collect();
    assert_eq!(env["NCCL_SOCKET_IFNAME"], "enp3s0");
    assert_eq!(env["NCCL_IB_DISABLE"], "1");
    assert_eq!(env["UCX_TLS"], "tcp,sm,self");
    // One node: bf16 inside as well, and no hop across to name.
    let one = plan(&t.detect(), 1, 2).unwrap();
    assert_eq!((one.hops.len(), one.qgz_bits[0]), (1, 16));
    assert!(
        one.render().contains("qgZ bf16 inside / no hop across"),
        "{}",
        one.render()
    );
}

#[test]
fn plan_on_a_pcie_box_with_nvlink_pairs_keeps_hpz_on_the_pairs() {
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

#[test]
fn plan_for_a_dgx_a100_dump_takes_each_ranks_numa_closest_hdr_nic() {
    let t = load("nccl_dgx_a100.xml");
    let p = plan(&t, 4, 8).unwrap();
    assert_eq!(p.hpz_group, 8, "{}", p.render());
    assert_eq!(p.hops[1].transport, "NCCL over RDMA", "{}", p.render());
    // 8 x 200 Gb/s per node = 200 GB/s shared by 8 ranks.
    assert!(
        (p.hops[1].gbps_per_rank - 25.0).abs() < 1e-9,
        "{}",
        p.render()
    );
    // Each rank takes a NIC on its own NUMA node.
    for r in &p.rank_nics {
        let nic = r.nic.as_deref().unwrap();
        let n = t.nics.iter().find(|n| n.name == nic).unwrap();
        assert_eq!(
            n.numa_node, t.gpus[r.local_rank].numa_node,
            "rank {}",
            r.local_rank
        );
    }
}

#[test]
fn plan_for_a_pcie_workstation_dump_sends_nccl_over_tcp() {
    let t = load("nccl_pcie_4gpu.xml");
    let p = plan(&t, 2, 4).unwrap();
    assert_eq!(p.hops[1].transport, "NCCL over TCP", "{}", p.render());
    let env: std::collections::BTreeMap<_, _> = p.env.iter().cloned().collect();
    assert_eq!(
        env.get("NCCL_IB_DISABLE").map(String::as_str),
        Some("1"),
        "{:?}",
        p.env
    );
}

#[test]
fn plan_for_dgx_a100_nodes_keeps_int8_on_the_nvswitches_and_each_gpus_hdr_nic() {
    let t = Tree::new("plan-dgx");
    dgx_a100(&t);
    let topo = t.detect();
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
fn plan_for_an_nvlink_bridge_workstation_on_gigabit_ethernet() {
    let t = Tree::new("plan-bridge");
    nvlink_bridge(&t);
    let topo = t.detect();
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
fn plan_for_hgx_h100_with_nv18_keeps_int8_inside() {
    let t = Tree::new("plan-nv18");
    hgx_nv18(&t);
    let topo = t.detect();
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
