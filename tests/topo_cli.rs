//! `zeropp topo` as a user runs it on this machine.

use std::process::Command;

fn zeropp(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zeropp"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn topo_describes_this_machine_captures_it_and_names_bad_input() {
    let o = zeropp(&["topo", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for key in ["hostname", "numa_nodes", "gpus", "gpu_links", "nics"] {
        assert!(j.get(key).is_some(), "no {key} in {j}");
    }
    assert!(j["numa_nodes"][0]["cpu_count"].as_u64().unwrap() >= 1);

    // The plan for 2 nodes like this one.
    let o = zeropp(&[
        "topo",
        "plan",
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(p["hpz_group"], 2);
    assert_eq!(p["hops"].as_array().unwrap().len(), 2);
    // And the switches a run here resolves from it (before measuring).
    let run = &p["run_switches"];
    assert_eq!(run["switches"]["hpz_group"], 2, "{run}");
    assert_eq!(run["switches"]["qgz"], true, "{run}");
    assert!(run["why"]["hpz_group"].is_string(), "{run}");

    let dir = std::env::temp_dir().join(format!("zeropp-topo-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("cap.tar.zst");
    let o = zeropp(&["topo", "capture", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tar = zstd::decode_all(&std::fs::read(&out).unwrap()[..]).unwrap();
    assert_eq!(&tar[257..262], b"ustar");

    let bad = dir.join("bad.txt");
    std::fs::write(&bad, "\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tZZ\t X \n").unwrap();
    let o = zeropp(&["topo", "--nvidia-smi-topo", bad.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("line 3") && err.contains("ZZ"), "{err}");
    let o = zeropp(&["topo", "--sysfs-root", dir.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no sysfs here"));
    // A file that never ends is not read whole; a plan of more ranks than
    // a machine has is refused, not listed rank by rank.
    let o = zeropp(&["topo", "--nvidia-smi-topo", "/dev/zero"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("over 16 MB"));
    let o = zeropp(&[
        "topo",
        "plan",
        "--nodes",
        "100000000",
        "--ranks-per-node",
        "2",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("at most 65536 nodes"));
    let o = zeropp(&["example-weights", "/dev/null", "--dim", "4294967295"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("at most 2^30 values"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn topo_reads_an_nccl_dump_and_plans_from_it() {
    let xml = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/topology/tests/data/nccl_dgx_a100.xml"
    );
    let o = zeropp(&["topo", "--nccl-xml", xml, "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["hostname"], "nccl_dgx_a100");
    assert_eq!(j["gpus"].as_array().unwrap().len(), 8);
    assert_eq!(j["gpu_links"][0]["kind"], "nvlink");
    assert_eq!(j["gpu_links"][0]["count"], 12);
    assert_eq!(j["nics"][0]["kind"], "infiniband");
    let o = zeropp(&[
        "topo",
        "plan",
        "--nodes",
        "2",
        "--ranks-per-node",
        "8",
        "--nccl-xml",
        xml,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("mlx5_0") && text.contains("NCCL over RDMA"),
        "{text}"
    );
    assert!(
        text.contains("switches of `zeropp train` here")
            && text.contains("hpZ: secondary shards over groups of 8 ranks"),
        "{text}"
    );

    let dir = std::env::temp_dir().join(format!("zeropp-topo-xml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.xml");
    std::fs::write(
        &bad,
        "<system>\n  <cpu numaid=\"0\">\n    <pci busid=\"0000:01:00.0\">\n",
    )
    .unwrap();
    let o = zeropp(&["topo", "--nccl-xml", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("not an NCCL topology dump") && e.contains("line "),
        "{e}"
    );
}
