//! `zeropp comm-check`: joins the job and runs every collective on the world,
//! node and cross-node groups, at odd sizes and zero length, against a
//! reference each rank computes on its own. Users run it to prove a cluster's
//! network before training on it; the integration tests run it too.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use bytes::Bytes;

use crate::comm::collectives::balanced_bounds;
use crate::comm::job::Job;
use crate::comm::{Communicator, Group};

/// The bytes member `rank` contributes to call `call` (any rank can compute
/// any other's).
fn pattern(rank: usize, call: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (rank.wrapping_mul(131) ^ call.wrapping_mul(17) ^ i.wrapping_mul(7)) as u8)
        .collect()
}

/// Integer-valued floats, so every summation order is exact.
fn values(rank: usize, call: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank + 1) * ((i + call) % 97)) as f32 - 40.0)
        .collect()
}

fn check_group(c: &Communicator, g: &Group, sizes: &[usize], checks: &mut usize) -> Result<()> {
    let me = g
        .ranks()
        .iter()
        .position(|&r| r == c.rank())
        .expect("member");
    let p = g.size();
    for (call, &len) in sizes.iter().enumerate() {
        // All-gather with per-member sizes.
        let blocks = c.all_gather_v(g, Bytes::from(pattern(c.rank(), call, len + me)))?;
        for (i, b) in blocks.iter().enumerate() {
            if b[..] != pattern(g.ranks()[i], call, len + i)[..] {
                bail!(
                    "all-gather of {len} bytes on group {}: member {i}'s block is wrong",
                    g.id()
                );
            }
        }
        // Reduce-scatter and all-reduce, f32 sums.
        let n = len / 4 + 1;
        let mut expect = vec![0f32; n];
        for &r in g.ranks() {
            for (e, v) in expect.iter_mut().zip(values(r, call, n)) {
                *e += v;
            }
        }
        let mine = c.reduce_scatter_f32(g, &values(c.rank(), call, n))?;
        if mine[..] != expect[balanced_bounds(n, p)[me].clone()] {
            bail!("reduce-scatter of {n} f32 on group {}: wrong sums", g.id());
        }
        if c.all_reduce_f32(g, &values(c.rank(), call, n))? != expect {
            bail!("all-reduce of {n} f32 on group {}: wrong sums", g.id());
        }
        // All-to-all with per-pair sizes.
        let to_each = (0..p)
            .map(|d| {
                Bytes::from(pattern(
                    c.rank() * 1000 + g.ranks()[d],
                    call,
                    (len + d * 3) % (len + 5),
                ))
            })
            .collect();
        let got = c.all_to_all_v(g, to_each)?;
        for (s, b) in got.iter().enumerate() {
            if b[..]
                != pattern(
                    g.ranks()[s] * 1000 + c.rank(),
                    call,
                    (len + me * 3) % (len + 5),
                )[..]
            {
                bail!(
                    "all-to-all on group {}: the buffer from member {s} is wrong",
                    g.id()
                );
            }
        }
        // Broadcast from a rotating root, then a barrier.
        let root = call % p;
        let b = c.broadcast(g, root, Bytes::from(pattern(c.rank(), call, len)))?;
        if b[..] != pattern(g.ranks()[root], call, len)[..] {
            bail!(
                "broadcast from member {root} on group {}: wrong bytes",
                g.id()
            );
        }
        c.barrier(g)?;
        *checks += 6;
    }
    Ok(())
}

/// Bytes each rank contributes to every all-gather of the loop.
const LOOP_BLOCK: usize = 5 << 20;

/// Runs the checks; with `loop_for`, then keeps all-gathering 5 MiB blocks on
/// the world until rank 0 has looped that long (for failure tests and soak;
/// large enough that node-local ones go through the shared segments).
pub fn run(sizes: &[usize], loop_for: Option<Duration>) -> Result<()> {
    let job = Job::join_from_env(serde_json::Value::Null)?;
    let c = &job.comm;
    let world = job.world_group();
    let node = job.node_group(job.facts.node_rank);
    let cross = job.cross_node_group(job.facts.local_rank);
    let mut checks = 0;
    let started = Instant::now();
    for g in [&world, &node, &cross] {
        check_group(c, g, sizes, &mut checks)?;
    }
    println!(
        "comm-check ok: rank {} of {} ({} nodes x {}), {checks} collective checks in {:.2}s",
        job.facts.rank,
        job.facts.world_size,
        job.facts.nodes(),
        job.facts.local_world_size,
        started.elapsed().as_secs_f64()
    );
    if let Some(duration) = loop_for {
        let t = Instant::now();
        let mut iterations = 0u64;
        loop {
            let gathered = c.all_gather(&world, Bytes::from(vec![c.rank() as u8; LOOP_BLOCK]))?;
            if gathered.len() != LOOP_BLOCK * c.world_size() {
                bail!("loop all-gather returned {} bytes", gathered.len());
            }
            iterations += 1;
            let go = (c.rank() == 0 && t.elapsed() < duration) as u8;
            let go = c.broadcast(&world, 0, Bytes::from(vec![go]))?;
            if go.first() != Some(&1) {
                break;
            }
        }
        println!(
            "comm-check loop done: rank {}, {iterations} all-gathers",
            c.rank()
        );
    }
    // Nobody leaves while others still talk to it.
    c.barrier(&world)?;
    Ok(())
}
