//! `zeropp train` started by the real launchers as users type them (issue
//! 16): Open MPI's `mpirun` (Debian `openmpi-bin`, installed by
//! scripts/deps.sh) with 4 ranks on this host.

use std::process::Command;
use std::time::{Duration, Instant};

const ZEROPP: &str = env!("CARGO_BIN_EXE_zeropp");

fn mpirun() -> Command {
    let path = std::env::var("ZEROPP_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let mut c = Command::new(path);
    // Root in CI; more ranks than this machine's 2 cores.
    c.args(["--allow-run-as-root", "--oversubscribe"]);
    c
}

#[test]
fn mpirun_starts_a_four_rank_training_run() {
    let start = Instant::now();
    let out = mpirun()
        .args([
            "-np",
            "4",
            "-x",
            "ZEROPP_TOKEN",
            "-x",
            "ZEROPP_TIMEOUT_S",
            ZEROPP,
        ])
        .args([
            "train",
            "--steps",
            "3",
            "--log-every",
            "1",
            "--val-batches",
            "1",
        ])
        .env("ZEROPP_TOKEN", "launcher-test")
        .env("ZEROPP_TIMEOUT_S", "60")
        .output()
        .expect("mpirun (Open MPI's openmpi-bin) must be installed: scripts/deps.sh installs it");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "mpirun failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 nodes x 4 ranks"), "{stdout}");
    assert!(
        stdout.contains("step     3/3") && stdout.contains("done: loss"),
        "{stdout}"
    );
    assert!(start.elapsed() < Duration::from_secs(240));
}
