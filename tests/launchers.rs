//! `zeropp train` started by the real launchers as users type them (issue
//! 16): Open MPI's `mpirun` (Debian `openmpi-bin`, installed by
//! scripts/deps.sh) with 4 ranks on this host, and torchrun (the torch of
//! the Python environment scripts/test.sh builds: `ZEROPP_PYTHON`), alone
//! and as two agents of a two-node job, with no ZEROPP_TOKEN and no port
//! of zeropp's own.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

const ZEROPP: &str = env!("CARGO_BIN_EXE_zeropp");

/// `zeropp train`'s arguments in every launcher test: 3 steps, each logged.
const TRAIN: [&str; 7] = [
    "train",
    "--steps",
    "3",
    "--log-every",
    "1",
    "--val-batches",
    "1",
];

/// The launcher's run trained on one node of 4 ranks to the end.
fn assert_trained_one_node_of_four(launcher: &str, out: &Output) {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{launcher} failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("1 node x 4 ranks"), "{stdout}");
    assert!(
        stdout.contains("step     3/3") && stdout.contains("done: loss"),
        "{stdout}"
    );
}

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
            "-x",
            "MASTER_PORT",
            ZEROPP,
        ])
        .args(TRAIN)
        .env("ZEROPP_TOKEN", "launcher-test")
        .env("ZEROPP_TIMEOUT_S", "60")
        // Its own port: the tests of this file run at once.
        .env(
            "MASTER_PORT",
            zeropp::launch::free_port().unwrap().to_string(),
        )
        .output()
        .expect("mpirun (Open MPI's openmpi-bin) must be installed: scripts/deps.sh installs it");
    assert_trained_one_node_of_four("mpirun", &out);
    assert!(start.elapsed() < Duration::from_secs(240));
}

fn torchrun(args: &[&str]) -> Command {
    let python = std::env::var("ZEROPP_PYTHON").expect(
        "ZEROPP_PYTHON must name a Python with torch (scripts/test.sh sets it to the venv it builds)",
    );
    let mut c = Command::new(python);
    c.args(["-m", "torch.distributed.run"])
        .args(args)
        .env_remove("ZEROPP_TOKEN")
        .env("OMP_NUM_THREADS", "1")
        .env("ZEROPP_TIMEOUT_S", "60");
    c
}

#[test]
fn torchrun_standalone_starts_a_four_rank_training_run() {
    let mut args = vec![
        "--standalone",
        "--nproc-per-node",
        "4",
        "--no-python",
        ZEROPP,
    ];
    args.extend(TRAIN);
    let out = torchrun(&args).output().unwrap();
    assert_trained_one_node_of_four("torchrun", &out);
}

#[test]
fn torchrun_with_two_agents_trains_as_two_nodes() {
    let port = zeropp::launch::free_port().unwrap().to_string();
    let agents: Vec<_> = ["0", "1"]
        .iter()
        .map(|k| {
            let mut args = vec!["--nnodes", "2", "--node-rank", k, "--nproc-per-node", "2"];
            args.extend(["--master-addr", "127.0.0.1", "--master-port", &port]);
            args.extend(["--no-python", ZEROPP]);
            args.extend(TRAIN);
            torchrun(&args)
                .env("ZEROPP_TRANSPORT", "tcp")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = agents
        .into_iter()
        .map(|a| a.wait_with_output().unwrap())
        .collect();
    for (k, out) in outs.iter().enumerate() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "agent {k} failed: {stderr}");
    }
    let lead = String::from_utf8_lossy(&outs[0].stdout);
    assert!(
        lead.contains("2 nodes x 2 ranks") && lead.contains("done: loss"),
        "{lead}"
    );
}

/// Slurm's `srun` (a single-node Slurm that scripts/slurm.sh installs and
/// starts: munged, slurmctld, slurmd), as users type it: `-O` to run more
/// tasks than this machine's cores, the token exported (srun passes the
/// environment on).
#[test]
fn srun_starts_a_four_rank_training_run() {
    let srun = std::env::var("ZEROPP_SRUN").unwrap_or_else(|_| "srun".into());
    let out = Command::new(srun)
        .args(["-n", "4", "-O", "-t", "5", ZEROPP])
        .args(TRAIN)
        .env("ZEROPP_TOKEN", "launcher-test")
        .env("ZEROPP_TIMEOUT_S", "60")
        .env(
            "MASTER_PORT",
            zeropp::launch::free_port().unwrap().to_string(),
        )
        .output()
        .expect("srun must be installed and Slurm running: bash scripts/slurm.sh (root) does both");
    assert_trained_one_node_of_four("srun", &out);
}

/// `zeropp bench collectives` prints, in the same run, the same
/// collectives through Open MPI (compiled with mpicc from
/// libopenmpi-dev, started with the real mpirun) and zeropp / Open MPI
/// per collective and size.
#[test]
fn the_collectives_bench_compares_with_open_mpi_in_the_same_run() {
    let out = Command::new(ZEROPP)
        .args(["launch", "--nodes", "1", "--ranks-per-node", "2", "--"])
        .args([ZEROPP, "bench", "collectives", "--sizes", "64K,256K"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("Open MPI on the same 2 ranks"),
        "no Open MPI comparison (scripts/deps.sh installs libopenmpi-dev): {stdout}"
    );
    // One row per size in each table, each with four ratios.
    for size in ["64K", "256K"] {
        let rows: Vec<&str> = stdout
            .lines()
            .filter(|l| {
                l.trim_start_matches("[rank 0]")
                    .trim_start()
                    .starts_with(size)
            })
            .collect();
        assert_eq!(rows.len(), 2, "{stdout}");
        // zeropp's row adds raw point-to-point / memcpy.
        assert_eq!(rows[0].matches('x').count(), 5, "{rows:?}");
        assert_eq!(rows[1].matches('x').count(), 4, "{rows:?}");
    }
}
