//! The communication layer as real processes over TCP and UCX: every
//! collective on 2, 3 and 4 processes and their groups; a rank killed
//! mid-collective (UCX: node-local and cross-node endpoints); UCX's shared
//! memory confined to a node; a stranger with the wrong token; disagreeing
//! world sizes and transports; the launcher's handling of a failing rank.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const ZEROPP: &str = env!("CARGO_BIN_EXE_zeropp");

/// Starts `zeropp args` as rank `rank` of a one-node world of `world`.
fn rank_process(rank: usize, world: usize, port: u16, token: &str, args: &[&str]) -> Child {
    rank_command("tcp", rank, world, world, port, token, args)
        .spawn()
        .unwrap()
}

/// `zeropp args` as rank `rank` of `world`, `per_node` ranks per node.
fn rank_command(
    transport: &str,
    rank: usize,
    world: usize,
    per_node: usize,
    port: u16,
    token: &str,
    args: &[&str],
) -> Command {
    let mut c = Command::new(ZEROPP);
    c.args(args)
        .env("ZEROPP_TRANSPORT", transport)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", (rank % per_node).to_string())
        .env("LOCAL_WORLD_SIZE", per_node.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ZEROPP_TOKEN", token)
        .env("ZEROPP_TIMEOUT_S", "20")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Waits for `child` up to `limit`; kills it and fails the test if it hangs.
fn finish(mut child: Child, limit: Duration, what: &str) -> (bool, String, String) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            return (
                status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_collective_passes_on_2_3_and_4_processes() {
    every_collective_passes_over(
        "tcp",
        &[(1, 2), (1, 3), (2, 2), (4, 1)],
        "0,1,13,4099,70000",
    );
}

/// With a size of single-copy messages (node-local ones lie in the
/// sender's shared segment, comm/ucx/shm.rs): the ranks report using it.
#[test]
fn every_collective_passes_over_ucx() {
    let sizes = "0,1,13,4099,70000,4500000";
    let out = every_collective_passes_over("ucx", &[(1, 3), (2, 2)], sizes);
    let used: Vec<usize> = out
        .lines()
        .filter_map(|l| l.split("shared segment: ").nth(1))
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(used.len(), 7, "every rank reports its segment: {out}");
    assert!(
        used.iter().filter(|&&mib| mib >= 4).count() >= 3,
        "node-local messages of 4.5 MB went through the segments: {used:?}"
    );
}

/// Runs comm-check at `sizes` on each layout; returns all their output.
fn every_collective_passes_over(
    transport: &str,
    layouts: &[(usize, usize)],
    sizes: &str,
) -> String {
    let mut all = String::new();
    for &(nodes, per_node) in layouts {
        let child = Command::new(ZEROPP)
            .env("ZEROPP_TRANSPORT", transport)
            .env("RUST_LOG", "info,zeropp_comm::ucx::shm=debug")
            .args([
                "launch",
                "--nodes",
                &nodes.to_string(),
                "--ranks-per-node",
                &per_node.to_string(),
            ])
            .args([
                "--timeout",
                "30",
                "--",
                ZEROPP,
                "comm-check",
                "--sizes",
                sizes,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (ok, out, err) = finish(child, Duration::from_secs(120), "comm-check");
        assert!(ok, "{transport} {nodes}x{per_node}: {out}\n{err}");
        for r in 0..nodes * per_node {
            assert!(
                out.contains(&format!(
                    "[rank {r}] comm-check ok: rank {r} of {}",
                    nodes * per_node
                )),
                "{nodes}x{per_node} rank {r}: {out}"
            );
        }
        all.push_str(&out);
        all.push_str(&err);
    }
    all
}

#[test]
fn a_rank_killed_mid_collective_is_named_by_the_others() {
    killed_rank_is_named_over("tcp", 3);
}

/// Node-local UCX endpoints (shared memory, the dead process found by the
/// progress thread's watch) and cross-node ones (UCX's peer error handler).
#[test]
fn a_rank_killed_mid_collective_is_named_by_the_others_over_ucx() {
    killed_rank_is_named_over("ucx", 3);
    killed_rank_is_named_over("ucx", 1);
}

/// UCX may use shared memory between ranks of one node, and never between
/// ranks of different (logical) nodes: with shared memory as the only
/// transport, one node works and two nodes cannot reach each other.
#[test]
fn ucx_shares_memory_inside_a_node_only() {
    for (per_node, works) in [(2, true), (1, false)] {
        let port = zeropp::launch::free_port().unwrap();
        let args = ["comm-check", "--sizes", "0,70000"];
        let ranks: Vec<Child> = (0..2)
            .map(|r| {
                let mut c = rank_command("ucx", r, 2, per_node, port, "shm", &args);
                c.env("UCX_TLS", "posix,self");
                c.spawn().unwrap()
            })
            .collect();
        for (r, child) in ranks.into_iter().enumerate() {
            let (ok, out, err) = finish(child, Duration::from_secs(60), "a rank");
            if works {
                assert!(ok && out.contains("comm-check ok"), "rank {r}: {err}");
            } else {
                assert!(
                    !ok,
                    "rank {r} must not reach the other node over shared memory"
                );
                assert!(err.contains("UCX could not reach rank"), "rank {r}: {err}");
            }
        }
    }
}

fn killed_rank_is_named_over(transport: &str, per_node: usize) {
    let port = zeropp::launch::free_port().unwrap();
    let token = "kill-test";
    let args = ["comm-check", "--sizes", "0", "--loop-seconds", "60"];
    let mut ranks: Vec<Child> = (0..3)
        .map(|r| {
            rank_command(transport, r, 3, per_node, port, token, &args)
                .spawn()
                .unwrap()
        })
        .collect();
    // Wait until every rank is in the all-gather loop.
    let (tx, rx) = mpsc::channel();
    for (r, child) in ranks.iter_mut().enumerate() {
        let out = child.stdout.take().unwrap();
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains("comm-check ok") {
                    let _ = tx.send(r);
                }
            }
        });
    }
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(60))
            .expect("all ranks start looping");
    }
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = Instant::now();
    ranks[1].kill().unwrap();
    ranks[1].wait().unwrap();
    for (r, child) in ranks.into_iter().enumerate() {
        if r == 1 {
            continue;
        }
        let (ok, _, err) = finish(child, Duration::from_secs(30), "a surviving rank");
        assert!(!ok, "{transport}: rank {r} must fail once rank 1 is gone");
        assert!(
            err.contains("rank 1 failed"),
            "{transport}: rank {r} must name rank 1: {err}"
        );
    }
    // Well inside the 20 s timeout: a crash is seen, not waited out.
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "took {:?}",
        killed_at.elapsed()
    );
}

#[test]
fn a_stranger_with_the_wrong_token_is_refused_and_the_job_goes_on() {
    let port = zeropp::launch::free_port().unwrap();
    let args = ["comm-check", "--sizes", "0,100"];
    let rank0 = rank_process(0, 2, port, "right", &args);
    let stranger = rank_process(1, 2, port, "wrong", &args);
    let (ok, _, err) = finish(stranger, Duration::from_secs(60), "the stranger");
    assert!(!ok && err.contains("wrong job token"), "{err}");
    let rank1 = rank_process(1, 2, port, "right", &args);
    let (ok1, out1, err1) = finish(rank1, Duration::from_secs(60), "rank 1");
    let (ok0, _, err0) = finish(rank0, Duration::from_secs(60), "rank 0");
    assert!(ok0 && ok1, "{err0}\n{err1}");
    assert!(out1.contains("comm-check ok"));
    assert!(
        err0.contains("refused a connection") && err0.contains("wrong job token"),
        "{err0}"
    );
}

#[test]
fn ranks_on_different_transports_are_told_to_agree() {
    let port = zeropp::launch::free_port().unwrap();
    let args = ["comm-check", "--sizes", "0"];
    let rank0 = rank_command("tcp", 0, 2, 2, port, "t", &args)
        .spawn()
        .unwrap();
    let rank1 = rank_command("ucx", 1, 2, 2, port, "t", &args)
        .spawn()
        .unwrap();
    for (name, child) in [("rank 0", rank0), ("rank 1", rank1)] {
        let (ok, _, err) = finish(child, Duration::from_secs(60), name);
        assert!(!ok, "{name} must fail");
        assert!(
            err.contains("transport") && err.contains("ZEROPP_TRANSPORT to the same value"),
            "{name}: {err}"
        );
    }
}

#[test]
fn ranks_that_disagree_on_the_world_size_are_named() {
    let port = zeropp::launch::free_port().unwrap();
    let args = ["comm-check", "--sizes", "0"];
    let rank0 = rank_process(0, 2, port, "t", &args);
    let rank1 = rank_process(1, 3, port, "t", &args);
    for (name, child) in [("rank 0", rank0), ("rank 1", rank1)] {
        let (ok, _, err) = finish(child, Duration::from_secs(60), name);
        assert!(!ok, "{name} must fail");
        assert!(
            err.contains("rank 1") && err.contains("3 ranks") && err.contains("rank 0 says 2"),
            "{name}: {err}"
        );
    }
}

#[test]
fn the_launcher_prefixes_output_and_names_a_failing_rank() {
    let child = Command::new(ZEROPP)
        .args(["launch", "--nodes", "1", "--ranks-per-node", "3", "--grace", "1", "--"])
        .args(["sh", "-c", "echo hello from $RANK of $WORLD_SIZE on node $NODE_RANK; if [ $RANK = 2 ]; then echo 'error: no data' >&2; exit 7; fi; sleep 60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let (ok, out, err) = finish(child, Duration::from_secs(30), "the launcher");
    assert!(!ok);
    // Its last words repeated in the launcher's own error.
    assert!(
        err.contains("rank 2 failed with exit code 7 (it said: no data)"),
        "{err}"
    );
    for r in 0..3 {
        assert!(
            out.contains(&format!("[rank {r}] hello from {r} of 3 on node 0")),
            "{out}"
        );
    }
    // The sleeping ranks were stopped after the grace period, not waited for.
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_multi_host_islands_launch_keeps_the_job_s_store_up_while_another_node_runs() {
    // Two hosts' launchers (one machine), an island each: node 0's ranks
    // finish at once, node 1's rank reaches the job's store (which node
    // 0's launcher holds) 3 s later: node 0's launcher waits for node 1's
    // before it stops the store.
    let port = zeropp::launch::free_port().unwrap();
    let node = |k: usize, script: &str| {
        Command::new(ZEROPP)
            .args([
                "launch",
                "--nodes",
                "2",
                "--ranks-per-node",
                "1",
                "--islands",
                "2",
            ])
            .args(["--node-rank", &k.to_string()])
            .args([
                "--master-addr",
                &format!("127.0.0.1:{port}"),
                "--timeout",
                "20",
            ])
            .args(["--", "bash", "-c", script])
            .env("ZEROPP_TOKEN", "a-test-token")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = node(0, "echo node 0 done");
    let second = node(
        1,
        "sleep 3; exec 3<>/dev/tcp/${ZEROPP_STORE%:*}/${ZEROPP_STORE##*:} && echo store reached",
    );
    let (ok1, out1, err1) = finish(second, Duration::from_secs(30), "node 1's launcher");
    assert!(ok1 && out1.contains("store reached"), "{out1}{err1}");
    let (ok0, out0, err0) = finish(first, Duration::from_secs(10), "node 0's launcher");
    assert!(ok0 && out0.contains("node 0 done"), "{out0}{err0}");
    assert!(
        err0.contains("keeping the job's store up while node(s) [1] run"),
        "{err0}"
    );
}

#[test]
fn with_islands_the_launcher_stops_only_the_failed_island() {
    // 2 islands of 2 nodes x 1 rank: rank 3 (island 1) fails; island 1's
    // other rank is stopped after the grace, island 0's ranks finish.
    let child = Command::new(ZEROPP)
        .args([
            "launch",
            "--nodes",
            "4",
            "--ranks-per-node",
            "1",
            "--islands",
            "2",
        ])
        .args(["--grace", "1", "--"])
        .args([
            "sh",
            "-c",
            "if [ $RANK = 3 ]; then exit 5; fi; if [ $RANK = 2 ]; then sleep 60; fi; \
             sleep 2; echo rank $RANK finished",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let (ok, out, err) = finish(child, Duration::from_secs(30), "the launcher");
    assert!(ok, "island 0 finished, so the launch succeeds: {err}");
    assert!(out.contains("[rank 0] rank 0 finished"), "{out}");
    assert!(out.contains("[rank 1] rank 1 finished"), "{out}");
    assert!(!out.contains("rank 2 finished"), "{out}");
    assert!(err.contains("rank 3 failed with exit code 5"), "{err}");
    assert!(err.contains("island 1 was lost"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(20));

    // Every island failing fails the launch, naming the first rank.
    let child = Command::new(ZEROPP)
        .args([
            "launch",
            "--nodes",
            "2",
            "--ranks-per-node",
            "1",
            "--islands",
            "2",
        ])
        .args(["--grace", "1", "--", "sh", "-c", "exit 4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ok, _, err) = finish(child, Duration::from_secs(30), "the launcher");
    assert!(!ok);
    assert!(err.contains("failed with exit code 4"), "{err}");

    // Nodes that do not split into the islands are refused up front.
    let out = Command::new(ZEROPP)
        .args(["launch", "--nodes", "3", "--islands", "2", "--", "true"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("3 nodes do not split into 2 islands"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
