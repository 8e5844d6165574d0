//! `zeropp plan` as a user runs it: compute from a run's summary, the
//! quantization rate measured here, and clear errors for bad input.

use std::process::Command;

fn zeropp(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zeropp"))
        .args(args)
        .output()
        .unwrap()
}

fn step_of(out: &std::process::Output, config: &str) -> f64 {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let preds: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    preds
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["config"]["name"] == config)
        .unwrap_or_else(|| panic!("no {config} in {preds}"))["step_s"]
        .as_f64()
        .unwrap()
}

#[test]
fn plan_takes_compute_from_a_run_summary_and_measures_quantization() {
    let dir = std::env::temp_dir().join(format!("zeropp-plan-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let summary = dir.join("run.json");
    std::fs::write(
        &summary,
        r#"{"mode": "zero3", "world_size": 4, "median_step_time_s": 0.75, "final_loss": 3.1}"#,
    )
    .unwrap();
    let base = [
        "plan",
        "--params",
        "3758592",
        "--nic-gbit",
        "10",
        "--quant-gbps",
        "2",
        "--json",
    ];
    let from_file = zeropp(&[&base[..], &["--compute-from", summary.to_str().unwrap()]].concat());
    let given = zeropp(&[&base[..], &["--compute-s", "0.75"]].concat());
    // On a fast link ZeRO-3's step is its compute plus the little the
    // prefetch cannot hide: the file's 0.75 s is what the plan used.
    let (a, b) = (step_of(&from_file, "zero3"), step_of(&given, "zero3"));
    assert_eq!(a, b);
    assert!((0.75..0.85).contains(&a), "{a}");
    // Without --params the run's own size goes with its compute.
    let sized = dir.join("sized.json");
    std::fs::write(
        &sized,
        r#"{"mode": "zero3", "params": 30176, "median_step_time_s": 0.01}"#,
    )
    .unwrap();
    let o = zeropp(&[
        "plan",
        "--quant-gbps",
        "2",
        "--compute-from",
        sized.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.contains("3.018e4 parameters"),
        "{text}"
    );

    // Without --quant-gbps the rate is measured on this CPU and printed.
    let o = zeropp(&["plan", "--compute-s", "0.6"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("quantization: "))
        .unwrap_or_else(|| panic!("{text}"));
    let gbps: f64 = line["quantization: ".len()..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(gbps > 0.0 && gbps.is_finite(), "{line}");
    // Every single switch is in the table, with the flags of the best.
    for name in ["zero3", "qwz", "hpz", "qgz", "qwz+hpz", "zeropp"] {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{name} "))),
            "{name}: {text}"
        );
    }
    assert!(
        text.contains("recommended: ") && text.contains("--mode"),
        "{text}"
    );

    // Bad input: a file that is not a summary, one that is missing, both
    // compute flags, a rate that is not positive, a mistyped exponent.
    let bad = dir.join("bad.json");
    std::fs::write(&bad, r#"{"mode": "zero3"}"#).unwrap();
    for (args, want) in [
        (
            vec!["plan", "--compute-from", bad.to_str().unwrap()],
            "no median_step_time_s",
        ),
        (
            vec!["plan", "--compute-from", "/nonexistent/run.json"],
            "reading the run summary",
        ),
        (
            vec![
                "plan",
                "--compute-s",
                "1",
                "--compute-from",
                summary.to_str().unwrap(),
            ],
            "not both",
        ),
        (
            vec!["plan", "--compute-s", "1", "--quant-gbps", "0"],
            "--quant-gbps must be a positive",
        ),
        (vec!["plan"], "give the compute per step"),
        (
            vec!["plan", "--compute-s", "1", "--params", "1e30"],
            "at most 1e15 parameters",
        ),
    ] {
        let o = zeropp(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(dir).ok();
}

/// Recorded runs of bench-cluster (docs/BENCHMARKS.md, "The plan from
/// measured links"): the GPT of issue 29 on 2 emulated hosts x 2 ranks at
/// 10 Gbit/s, 1 Gbit/s and 30 Mbit/s, each run's links measured at join.
fn recorded(name: &str) -> String {
    format!(
        "{}/tests/data/bench-2x2/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn plan_from_a_runs_measured_links_predicts_that_run_within_15_percent() {
    let compute = recorded("zero3-2x2-10gbit");
    for rate in ["10gbit", "1gbit", "30mbit"] {
        let run = recorded(&format!("zeropp-2x2-{rate}"));
        let o = zeropp(&[
            "plan",
            "--measured",
            &run,
            "--compute-from",
            &compute,
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let r = &v["run"];
        let err = r["error"].as_f64().unwrap();
        assert!(
            err.abs() <= 0.15,
            "{rate}: predicted {} s, measured {} s",
            r["predicted_step_s"],
            r["measured_step_s"]
        );
        // The layout and size are the run's, not the defaults'.
        assert_eq!(v["input"]["params"], 3_758_592.0, "{v}");
        assert_eq!(v["input"]["nodes"], 2, "{v}");
        // The text form says the same, for the run it read.
        let o = zeropp(&["plan", "--measured", &run, "--compute-from", &compute]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("the measured run ("), "{text}");
    }
    // Without compute flags the run's own compute is taken.
    let o = zeropp(&[
        "plan",
        "--measured",
        &recorded("zeropp-2x2-30mbit"),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(recorded("zeropp-2x2-30mbit")).unwrap())
            .unwrap();
    assert_eq!(v["input"]["compute_s"], run["median_compute_s"], "{v}");
    // A run that measured nothing (logical nodes) is named as such.
    let o = zeropp(&["plan", "--measured", &recorded("zero3-2x2-1gbit")]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("measured nothing at join"), "{err}");
}

#[test]
fn plan_predicts_islands_and_the_h_that_hides_their_exchange() {
    // The emulated cluster at 10 Mbit/s, the 3.76M GPT: islands H = 20 and
    // 50 measured 0.210 and 0.150 s a step with an island's inner step of
    // 0.122 s (docs/TRAINING.md, "Islands").
    let base = [
        "plan",
        "--params",
        "3.76e6",
        "--nodes",
        "2",
        "--ranks-per-node",
        "2",
        "--nic-gbit",
        "0.01",
        "--compute-s",
        "0.12",
        "--quant-gbps",
        "2",
        "--islands",
        "2",
        "--sync-every",
        "20,50",
        "--json",
    ];
    let out = zeropp(&base);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let isl = v["islands"].as_array().unwrap();
    let step = |i: usize| isl[i]["step_s"].as_f64().unwrap();
    let hides = isl[0]["hiding_sync_every"].as_u64().unwrap();
    assert!((step(0) / 0.210 - 1.0).abs() < 0.15, "H=20: {}", step(0));
    assert!((step(1) / 0.150 - 1.0).abs() < 0.15, "H=50: {}", step(1));
    assert!((10..=20).contains(&hides), "{hides}");
    // The table a user reads, and islands that do not divide the nodes.
    let text = zeropp(&base[..base.len() - 1]);
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(
        text.contains("hides an exchange behind the inner steps"),
        "{text}"
    );
    let mut bad = base.to_vec();
    let at = bad.len() - 4;
    bad[at] = "3";
    let out = zeropp(&bad);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("divide the nodes"));
}
