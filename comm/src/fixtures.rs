//! The host-identity rule on what real launchers set: each fixture in
//! `tests/data/launch-env/` holds every rank's launcher variables and host
//! identity from a real 2-host × 2-rank job (two network namespaces as the
//! hosts; `capture.sh` there re-creates them), and a single-host srun. The
//! rule: ranks on one host form a node in rank order; a launcher whose
//! variables say otherwise is an error naming both.

use std::collections::HashMap;

use super::env::RankFacts;
use super::exchange::host_layout;
use super::rendezvous::{PeerInfo, check_layout};

/// Each rank's variables, in rank order.
fn ranks(name: &str) -> Vec<HashMap<String, String>> {
    let path = format!(
        "{}/../tests/data/launch-env/{name}.env",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut out: Vec<HashMap<String, String>> = Vec::new();
    for line in text.lines() {
        if line.starts_with("# rank ") {
            out.push(HashMap::new());
        } else if let (Some(m), Some((k, v))) = (out.last_mut(), line.split_once('=')) {
            m.insert(k.to_string(), v.to_string());
        }
    }
    assert_eq!(out.len(), 4, "{path}: 4 ranks expected");
    out
}

/// The rendezvous table those ranks would publish (a token stands in for
/// the one the user exports).
fn table(name: &str) -> Vec<PeerInfo> {
    ranks(name)
        .into_iter()
        .map(|mut vars| {
            vars.entry("ZEROPP_TOKEN".into()).or_insert("t".into());
            let f = RankFacts::from_lookup(&|k| vars.get(k).cloned())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            PeerInfo {
                rank: f.rank,
                world_size: f.world_size,
                node_rank: f.node_rank,
                local_rank: f.local_rank,
                local_world_size: f.local_world_size,
                host: vars["ZEROPP_FIXTURE_HOST"].clone(),
                host_id: vars["ZEROPP_FIXTURE_HOST_ID"].clone(),
                address: String::new(),
                facts: serde_json::Value::Null,
            }
        })
        .collect()
}

fn hosts(t: &[PeerInfo]) -> Vec<(String, String)> {
    t.iter()
        .map(|p| (p.host.clone(), p.host_id.clone()))
        .collect()
}

#[test]
fn mpirun_by_slot_and_torchrun_form_two_nodes_of_two() {
    for name in ["mpirun-by-slot", "torchrun-2x2"] {
        let t = table(name);
        // The two namespaces share a hostname: the host id tells them apart.
        assert_eq!(t[0].host, t[2].host, "{name}");
        assert_ne!(t[0].host_id, t[2].host_id, "{name}");
        check_layout(&t).unwrap_or_else(|e| panic!("{name}: {e}"));
        let l = host_layout(&hosts(&t)).unwrap();
        assert_eq!((l.nodes, l.ranks_per_node), (2, 2), "{name}");
        let nodes: Vec<usize> = t.iter().map(|p| p.node_rank).collect();
        assert_eq!(nodes, [0, 0, 1, 1], "{name}");
    }
}

#[test]
fn mpirun_by_node_is_refused_naming_both_views() {
    let t = table("mpirun-by-node");
    // Round robin: ranks 0 and 2 on one host, 1 and 3 on the other.
    assert_eq!(t[0].host_id, t[2].host_id);
    assert_ne!(t[0].host_id, t[1].host_id);
    let e = check_layout(&t).unwrap_err().to_string();
    assert!(e.contains("--map-by slot"), "{e}");
    let e = host_layout(&hosts(&t)).unwrap_err().to_string();
    assert!(e.contains("rank 2") && e.contains("consecutive"), "{e}");
}

#[test]
fn srun_on_one_host_is_one_node_of_four() {
    let t = table("srun-1x4");
    check_layout(&t).unwrap();
    let l = host_layout(&hosts(&t)).unwrap();
    assert_eq!((l.nodes, l.ranks_per_node), (1, 4));
    // The rendezvous host is the step's first (only) host.
    let vars = &ranks("srun-1x4")[3];
    let mut with_token = vars.clone();
    with_token.insert("ZEROPP_TOKEN".into(), "t".into());
    let f = RankFacts::from_lookup(&|k| with_token.get(k).cloned()).unwrap();
    assert_eq!(f.master_addr, vars["SLURM_STEP_NODELIST"]);
}
