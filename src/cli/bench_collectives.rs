//! `zeropp bench collectives`: like nccl-tests, the algorithm and bus
//! bandwidth of each collective per size, next to the transport's raw
//! point-to-point bandwidth measured in the same run with the same traffic
//! pattern as a ring (every rank sends to its successor while receiving from
//! its predecessor). Run under `zeropp launch`; rank 0 prints.

use std::time::Instant;

use anyhow::Result;
use bytes::Bytes;

use crate::comm::collectives::{
    SumF32, balanced_bounds, bytes_f32, f32_byte_bounds, f32_bytes, f32_vec_bytes,
};
use crate::comm::job::Job;
use crate::comm::{Communicator, Group};

/// Runs before the timed ones (the same in the Open MPI program): first
/// connections, allocations and first-touch page faults of buffers that are
/// reused afterwards (receive pools, shared segments) are not what a
/// training loop sees in its steady state (nccl-tests also warms up 5 times).
const WARMUP: usize = 5;

/// Seconds the slowest rank took for `iters` runs of `f`, after [`WARMUP`].
fn timed(
    c: &Communicator,
    g: &Group,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    c.barrier(g)?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    let mine = t.elapsed().as_secs_f64() / iters as f64;
    let all = c.all_gather(g, f32_bytes(&[mine as f32]))?;
    Ok(bytes_f32(&all)?.into_iter().fold(0f32, f32::max) as f64)
}

pub use crate::comm::pool::parse_size;

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// Runs the benchmark over `sizes` (bytes of one rank's full buffer).
pub fn run(sizes: &[usize], iters: usize) -> Result<()> {
    let job = Job::join_from_env(serde_json::Value::Null)?;
    let c = &job.comm;
    let g = job.world_group();
    let p = g.size();
    if c.rank() == 0 {
        print_header(p, iters, c.transport().name());
    }
    let mut raw_tag = 1u64 << 63;
    let mut rows = Vec::new();
    for &size in sizes {
        let size = size.max(4 * p) / (4 * p) * (4 * p); // whole f32 per rank
        let row = time_one_size(c, &g, size, iters, &mut raw_tag)?;
        if c.rank() == 0 {
            rows.push((size, row.print(size, p)));
        }
    }
    c.barrier(&g)?;
    if c.rank() == 0 {
        let one_host = job
            .table
            .iter()
            .all(|p| p.host == job.table[0].host && p.host_id == job.table[0].host_id);
        drop(job);
        if one_host {
            compare_with_open_mpi(p, iters, &rows);
        } else {
            println!("(no Open MPI comparison: it runs on one host, and this job spans several)");
        }
    }
    Ok(())
}

fn print_header(p: usize, iters: usize, transport: &str) {
    println!(
        "zeropp bench collectives: {p} ranks, transport {transport}, {iters} iterations per size; \
         busbw in GB/s, ratio = busbw / raw ring point-to-point bandwidth; memcpy: every rank copying \
         the same bytes at once (its ratio: raw / memcpy)"
    );
    println!(
        "{:>8} {:>10} {:>8} {:>6} | {:>9} {:>6} | {:>9} {:>6} | {:>9} {:>6} | {:>9} {:>6}",
        "size",
        "raw p2p",
        "memcpy",
        "ratio",
        "allgather",
        "ratio",
        "red-scat",
        "ratio",
        "allreduce",
        "ratio",
        "alltoall",
        "ratio"
    );
}

/// Seconds per call of each measurement on one buffer size.
struct Timed {
    raw: f64,
    copy: f64,
    all_gather: f64,
    reduce_scatter: f64,
    all_reduce: f64,
    all_to_all: f64,
}

impl Timed {
    /// Prints the row (bus bandwidths and their ratios to the raw ring's)
    /// and returns the collectives' bandwidths.
    fn print(&self, size: usize, p: usize) -> [f64; 4] {
        let moved = size as f64 * (p - 1) as f64 / p as f64;
        let gbs = |bytes: f64, t: f64| bytes / t / 1e9;
        let raw_bw = gbs(moved, self.raw);
        let copy_bw = gbs(moved, self.copy);
        let row = [
            gbs(moved, self.all_gather),
            gbs(moved, self.reduce_scatter),
            gbs(2.0 * moved, self.all_reduce),
            gbs(moved, self.all_to_all),
        ];
        print!(
            "{:>8} {:>10.3} {:>8.3} {:>5.2}x",
            human(size),
            raw_bw,
            copy_bw,
            raw_bw / copy_bw
        );
        for bw in row {
            print!(" | {:>9.3} {:>5.2}x", bw, bw / raw_bw);
        }
        println!();
        row
    }
}

/// Times the raw ring, the copy limit and each collective on `size` bytes.
fn time_one_size(
    c: &Communicator,
    g: &Group,
    size: usize,
    iters: usize,
    raw_tag: &mut u64,
) -> Result<Timed> {
    let (p, me) = (g.size(), c.rank());
    let (next, prev) = ((me + 1) % p, (me + p - 1) % p);
    let moved = size as f64 * (p - 1) as f64 / p as f64;
    // Raw: every rank streams (p-1)/p of the buffer to its successor.
    let payload = Bytes::from(vec![1u8; moved as usize]);
    let raw = timed(c, g, iters, || {
        *raw_tag += 1;
        let h = c.transport().send(next, *raw_tag, payload.clone())?;
        c.transport().recv(prev, *raw_tag, c.timeout())?;
        h.wait(next, c.timeout())?;
        Ok(())
    })?;
    // The copy limit: every rank at once copies what it would send into
    // a buffer of its own (touched before, like the pool's buffers).
    let mut copy_to = vec![0u8; moved as usize];
    let copy = timed(c, g, iters, || {
        copy_to.copy_from_slice(&payload);
        std::hint::black_box(&mut copy_to);
        Ok(())
    })?;
    let block = Bytes::from(vec![me as u8; size / p]);
    // The block form: what the engine consumes (the contiguous form
    // `all_gather` adds one copy of the result).
    let all_gather = timed(c, g, iters, || {
        c.all_gather_v(g, block.clone())
            .map(|_| ())
            .map_err(Into::into)
    })?;
    let data: Vec<f32> = (0..size / 4).map(|i| (i % 7) as f32).collect();
    // Handed over like the engine's gradients, built once like the other
    // collectives' inputs.
    let owned = f32_vec_bytes(data.clone());
    let f32_bounds = f32_byte_bounds(size / 4, p);
    let reduce_scatter = timed(c, g, iters, || {
        c.reduce_scatter_bytes(g, owned.clone(), &f32_bounds, &SumF32)
            .map(|_| ())
            .map_err(Into::into)
    })?;
    // Into a buffer kept across calls, as MPI_Allreduce's receive buffer.
    let mut reduced = vec![0f32; data.len()];
    let all_reduce = timed(c, g, iters, || {
        c.all_reduce_f32_into(g, &data, &mut reduced)
            .map_err(Into::into)
    })?;
    // Built once, like Open MPI's send buffer below (a fresh buffer per
    // call would time its page faults, not the collective).
    let to_each: Vec<Bytes> = balanced_bounds(size, p)
        .iter()
        .map(|r| Bytes::from(vec![me as u8; r.len()]))
        .collect();
    let all_to_all = timed(c, g, iters, || {
        c.all_to_all_v(g, to_each.clone())
            .map(|_| ())
            .map_err(Into::into)
    })?;
    Ok(Timed {
        raw,
        copy,
        all_gather,
        reduce_scatter,
        all_reduce,
        all_to_all,
    })
}

/// The same collectives through Open MPI on this host, after zeropp's own
/// rows (its ranks idle then): the peer program is compiled with `mpicc`
/// and started with `mpirun -np P`; prints Open MPI's bus bandwidth and
/// zeropp / Open MPI per collective and size. Without mpicc/mpirun, a note.
fn compare_with_open_mpi(p: usize, iters: usize, rows: &[(usize, [f64; 4])]) {
    match open_mpi_rows(p, iters, rows) {
        Ok(theirs) => {
            println!(
                "\nOpen MPI on the same {p} ranks of this host (busbw GB/s; ratio = zeropp / Open MPI)"
            );
            println!(
                "{:>8} | {:>9} {:>6} | {:>9} {:>6} | {:>9} {:>6} | {:>9} {:>6}",
                "size",
                "allgather",
                "ratio",
                "red-scat",
                "ratio",
                "allreduce",
                "ratio",
                "alltoall",
                "ratio"
            );
            for ((size, ours), (_, mpi)) in rows.iter().zip(&theirs) {
                print!("{:>8}", human(*size));
                for (o, m) in ours.iter().zip(mpi) {
                    print!(" | {:>9.3} {:>5.2}x", m, o / m);
                }
                println!();
            }
        }
        Err(why) => println!("(no Open MPI comparison: {why})"),
    }
}

fn open_mpi_rows(
    p: usize,
    iters: usize,
    rows: &[(usize, [f64; 4])],
) -> Result<Vec<(usize, [f64; 4])>, String> {
    use std::process::Command;
    let dir = std::env::temp_dir().join(format!("zeropp-mpi-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let src = dir.join("mpi_collectives.c");
    let bin = dir.join("mpi_collectives");
    std::fs::write(&src, include_str!("mpi_collectives.c")).map_err(|e| e.to_string())?;
    let built = Command::new("mpicc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .map_err(|e| {
            format!("mpicc not found ({e}): apt-get install libopenmpi-dev openmpi-bin")
        })?;
    if !built.status.success() {
        return Err(format!(
            "mpicc failed: {}",
            String::from_utf8_lossy(&built.stderr)
        ));
    }
    let mut run = Command::new("mpirun");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        run.arg("--allow-run-as-root");
    }
    let out = run
        .args([
            "--oversubscribe",
            "--bind-to",
            "none",
            "-np",
            &p.to_string(),
        ])
        .arg(&bin)
        .arg(iters.to_string())
        .args(rows.iter().map(|(s, _)| s.to_string()))
        .output()
        .map_err(|e| format!("mpirun not found ({e}): apt-get install openmpi-bin"))?;
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        return Err(format!(
            "mpirun failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let parsed: Vec<(usize, [f64; 4])> = text
        .lines()
        .filter_map(|l| {
            let v: Vec<f64> = l
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            (v.len() == 5).then(|| (v[0] as usize, [v[1], v[2], v[3], v[4]]))
        })
        .collect();
    if parsed.len() != rows.len() {
        return Err(format!(
            "the Open MPI peer printed {} rows for {} sizes: {text}",
            parsed.len(),
            rows.len()
        ));
    }
    Ok(parsed)
}
