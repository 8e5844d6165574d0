//! `zeropp launch`: starts the ranks of a job on this machine — all N×G of
//! them as logical nodes for development, or the G of one node of a
//! multi-host job — with the torchrun-style environment, prefixes their output
//! with the rank, and when one fails stops the others and names it.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rand::RngExt;

use crate::env::{DEFAULT_PORT, DEFAULT_TIMEOUT, WAIT_LIMIT, split_host_port, wait_limit};
use crate::torch_store::{HELD, HELD_SILENCE, StoreServer, TorchStore};

/// Why a launch did not run its ranks to success.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The launch options are wrong; the message says which and how.
    #[error("{0}")]
    Options(String),
    #[error(transparent)]
    Environment(#[from] crate::env::EnvError),
    #[error("cannot start {program:?} for rank {rank}: {source}")]
    Spawn {
        program: String,
        rank: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The launcher was asked to stop (Ctrl-C, `kill`, a scheduler's
    /// SIGTERM); its ranks were stopped.
    #[error("stopped by {}: the ranks were stopped", signal_name(*signal))]
    Interrupted { signal: i32 },
    /// The first rank that failed; the others were stopped.
    #[error("rank {rank} failed with {status}{said}; the other ranks were stopped")]
    RankFailed {
        rank: usize,
        status: String,
        /// The rank's last line on stderr where it exited with a code of
        /// its own (its error), as ` (it said: ...)`; else empty.
        said: String,
    },
}

type Result<T> = std::result::Result<T, LaunchError>;

/// A signal's name, for the few a launcher is stopped with.
fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT (Ctrl-C)",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP (the terminal closed)",
        libc::SIGPIPE => "SIGPIPE (the reader of its output went away)",
        _ => "a signal",
    }
}

/// The most ranks one launch starts on its machine.
const MAX_RANKS_HERE: usize = 1024;

/// The signal that asked this launcher to stop (0: none yet), set by
/// [`on_stop_signal`].
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    STOP_SIGNAL.store(signal, std::sync::atomic::Ordering::SeqCst);
}

/// From now on SIGINT, SIGTERM and SIGHUP ask the launcher to stop its
/// ranks (it would otherwise die at once, its ranks killed with it, and a
/// self-launch's files left behind).
fn catch_stop_signals() {
    STOP_SIGNAL.store(0, std::sync::atomic::Ordering::SeqCst);
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores into an atomic (async-signal-
        // safe); the sigaction is fully initialised.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            // The launcher's threads' reads, accepts and waits go on.
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The signals [`catch_stop_signals`] caught end the process again.
fn default_stop_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: restoring the default disposition.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
        }
    }
}

/// The signal that asked the launcher to stop, if one did.
fn stop_signal() -> Option<i32> {
    Some(STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst)).filter(|&s| s != 0)
}

/// Asked to stop: every running rank gets SIGTERM (a Python rank its
/// `finally` blocks, a `zeropp train` rank its default exit), and `grace`
/// to exit before it is killed; a second signal kills them at once.
fn stop_all(ranks: &mut [Rank], grace: Duration, signal: i32) -> LaunchError {
    for r in ranks.iter().filter(|r| r.status.is_none()) {
        // SAFETY: signalling a process group we created; ESRCH is harmless.
        unsafe {
            libc::kill(-(r.child.id() as i32), libc::SIGTERM);
        }
    }
    STOP_SIGNAL.store(0, std::sync::atomic::Ordering::SeqCst);
    let until = Instant::now() + grace;
    while Instant::now() < until && stop_signal().is_none() {
        let mut running = 0;
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            match r.child.try_wait() {
                Ok(Some(status)) => r.status = Some(status),
                _ => running += 1,
            }
        }
        if running == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in ranks.iter_mut() {
        stop(r);
    }
    LaunchError::Interrupted { signal }
}

fn options(msg: impl Into<String>) -> LaunchError {
    LaunchError::Options(msg.into())
}

/// What to start.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    pub nodes: usize,
    pub ranks_per_node: usize,
    /// `Some(k)`: start only node k's ranks (multi-host); `None`: all nodes.
    pub node_rank: Option<usize>,
    /// `HOST[:PORT]` of rank 0 (required with `node_rank`).
    pub master: Option<String>,
    /// Seconds every network wait may take (ZEROPP_TIMEOUT_S).
    pub timeout_s: Option<f64>,
    /// After a rank fails, how long the others may take to report and exit
    /// before they are killed.
    pub grace: Duration,
    /// Rank 0's stderr is our own (unprefixed), so a progress bar it draws
    /// reaches the terminal; its stdout is still prefixed.
    pub rank0_terminal: bool,
    /// Failure domains: the job's islands (consecutive whole nodes each).
    /// A failed rank stops the ranks of its island only; the others go on
    /// (`zeropp train --islands`), and the launch fails only when every
    /// island has. 1: one failure stops the job.
    pub islands: usize,
    /// With islands: how many times in all a failed island's ranks are
    /// started again (`ZEROPP_REJOIN=1`) to rejoin the running job (the
    /// job's store is the launcher's: island 0 too).
    pub restarts: usize,
    pub command: Vec<String>,
}

/// A free port for a self-launched job's rendezvous, below the kernel's
/// ephemeral range (32768 and up by default): a port the kernel hands out
/// for `bind(0)` is also what it hands the next outgoing connection of any
/// process, so between our check and rank 0's bind another job's client
/// socket could take it. Random ports in 20000..32768 that bind now; the
/// kernel's own pick if none does.
pub fn free_port() -> Result<u16> {
    for _ in 0..64 {
        let port: u16 = rand::rng().random_range(20000..32768);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    let io = |source| LaunchError::Io {
        what: "finding a free port",
        source,
    };
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    Ok(l.local_addr().map_err(io)?.port())
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => "an unknown status".into(),
    }
}

/// Copies a child's output to ours, a line at a time, with a rank prefix.
fn forward(
    rank: usize,
    stream: impl Read + Send + 'static,
    stderr_words: Option<LastWords>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let text = String::from_utf8_lossy(&line);
            if let Some(words) = &stderr_words {
                let _ = writeln!(std::io::stderr().lock(), "[rank {rank}] {text}");
                if !text.trim().is_empty() {
                    let mut words = words.lock().unwrap_or_else(|p| p.into_inner());
                    words.insert(rank, text.trim().to_string());
                }
            } else {
                let written = writeln!(std::io::stdout().lock(), "[rank {rank}] {text}");
                if written.is_err_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) {
                    // The reader of our output went away (`| head`): stop,
                    // as a process killed by SIGPIPE would, not train on
                    // unseen (the rank's output is still drained).
                    let _ = STOP_SIGNAL.compare_exchange(
                        0,
                        libc::SIGPIPE,
                        std::sync::atomic::Ordering::SeqCst,
                        std::sync::atomic::Ordering::SeqCst,
                    );
                }
            }
        }
    })
}

struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
}

/// Where this launch's ranks meet: the nodes it starts here, rank 0's
/// rendezvous address and port, the job's token, and with islands the
/// job's store (`host:port`), which node 0's launcher holds.
struct Meeting {
    local_nodes: std::ops::Range<usize>,
    master_addr: String,
    master_port: u16,
    token: String,
    store: Option<String>,
    /// Each rank's last line on stderr: the launch's own error repeats a
    /// failed rank's.
    last_words: LastWords,
}

/// Each rank's last non-empty line on stderr, as its output goes by.
type LastWords = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<usize, String>>>;

/// With islands, the job's store ([`StoreServer`]: torch's `TCPStore`
/// wire) lives in the launcher of node 0, so that it outlives every rank
/// and a lost island 0 can rejoin: on all nodes' launcher at a free local
/// port, on a multi-host job's node 0 at `--master-addr`'s port + 1 (the
/// other nodes' launchers name it there). Exported as ZEROPP_STORE; node
/// 0's launcher also gets the server, to keep it up while other nodes run.
fn job_store(
    opts: &LaunchOptions,
    meeting: &Meeting,
) -> Result<(Option<String>, Option<StoreServer>)> {
    if opts.islands <= 1 {
        return Ok((None, None));
    }
    let port = match opts.node_rank {
        None => 0,
        Some(_) => meeting.master_port.checked_add(1).ok_or_else(|| {
            options(
                "with --islands the job's store takes --master-addr's port + 1: pick a lower port",
            )
        })?,
    };
    let v6 = meeting.master_addr.contains(':');
    let host = if v6 {
        format!("[{}]", meeting.master_addr)
    } else {
        meeting.master_addr.clone()
    };
    if opts.node_rank.is_some_and(|k| k > 0) {
        return Ok((Some(format!("{host}:{port}")), None));
    }
    let bind: std::net::SocketAddr = match opts.node_rank {
        None => ([127, 0, 0, 1], 0).into(),
        Some(_) if v6 => (std::net::Ipv6Addr::UNSPECIFIED, port).into(),
        Some(_) => ([0, 0, 0, 0], port).into(),
    };
    let server = StoreServer::bind(bind).map_err(|e| options(e.to_string()))?;
    Ok((
        Some(format!("{host}:{}", server.addr().port())),
        Some(server),
    ))
}

/// This launch's keys in the job's store (under a name derived from the
/// token): node `k`'s launcher joined, and holds ([`HELD`]) a key while it
/// runs.
fn launcher_key(token: &str, k: usize, what: &str) -> String {
    format!(
        "/zeropp-launch/{:016x}/node{k}/{what}",
        crate::env::fnv1a(token.as_bytes())
    )
}

/// A multi-host islands launch, node `k` > 0: tells node 0's launcher it
/// runs, by holding a key in the job's store for as long as this process
/// lives: a thread connects (again after a drop, however long node 0's
/// launcher takes to start) and pings well within
/// [`torch_store::HELD_SILENCE`](crate::torch_store::HELD_SILENCE).
fn hold_store(store: &str, k: usize, token: &str, timeout: Duration) {
    let (store, token) = (store.to_string(), token.to_string());
    std::thread::spawn(move || {
        let mut warned = false;
        loop {
            let held = crate::rendezvous::store_addr(&store).and_then(|addr| {
                let mut s = TorchStore::connect(addr, timeout)?;
                s.set(&launcher_key(&token, k, "joined"), b"1")?;
                s.set(&launcher_key(&token, k, &HELD[1..]), b"1")?;
                Ok(s)
            });
            match held {
                Ok(mut s) => {
                    warned = false;
                    while s.ping().is_ok() {
                        std::thread::sleep(HELD_SILENCE / 6);
                    }
                }
                Err(e) if !warned => {
                    warned = true;
                    tracing::warn!(
                        "node {k} cannot tell node 0's launcher it runs ({e}); trying on: until \
                         it can, node 0's launcher may stop the job's store once its own ranks \
                         finish"
                    );
                }
                Err(_) => {}
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    });
}

/// A multi-host islands launch, node 0, its own ranks done: keeps the job's
/// store up while another node's launcher runs (islands there may still
/// train and rejoin): waits up to `timeout` for each to have joined, then
/// for as long as any holds its key.
fn keep_store_up(server: &StoreServer, nodes: usize, token: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let others = 1..nodes;
    while others
        .clone()
        .any(|k| !server.has(&launcher_key(token, k, "joined")))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut said = false;
    loop {
        let running: Vec<usize> = others
            .clone()
            .filter(|&k| server.has(&launcher_key(token, k, &HELD[1..])))
            .collect();
        if running.is_empty() {
            return;
        }
        if !said {
            tracing::info!(
                "node 0's ranks are done; keeping the job's store up while node(s) {running:?} run"
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The nodes to start and where their ranks meet: all of them around a
/// free local port (a new token unless ZEROPP_TOKEN is set), or node k of
/// a multi-host job at `--master-addr` with the job's ZEROPP_TOKEN.
fn meeting(opts: &LaunchOptions) -> Result<Meeting> {
    match opts.node_rank {
        None => {
            let port = match &opts.master {
                Some(m) => split_host_port(m)?.1.unwrap_or(free_port()?),
                None => free_port()?,
            };
            let token = std::env::var("ZEROPP_TOKEN").unwrap_or_else(|_| {
                let bytes: [u8; 16] = rand::rng().random();
                bytes.iter().map(|b| format!("{b:02x}")).collect()
            });
            Ok(Meeting {
                local_nodes: 0..opts.nodes,
                master_addr: "127.0.0.1".to_string(),
                master_port: port,
                token,
                store: None,
                last_words: LastWords::default(),
            })
        }
        Some(k) => {
            if k >= opts.nodes {
                return Err(options(format!(
                    "--node-rank {k} is outside --nodes {}",
                    opts.nodes
                )));
            }
            let Some(master) = &opts.master else {
                return Err(options(
                    "--node-rank needs --master-addr HOST[:PORT] (the host of node 0)",
                ));
            };
            let (host, port) = split_host_port(master)?;
            let Ok(token) = std::env::var("ZEROPP_TOKEN") else {
                return Err(options(
                    "a multi-host launch needs ZEROPP_TOKEN set to the same secret on every host",
                ));
            };
            Ok(Meeting {
                local_nodes: k..k + 1,
                master_addr: host,
                master_port: port.unwrap_or(DEFAULT_PORT),
                token,
                store: None,
                last_words: LastWords::default(),
            })
        }
    }
}

/// Starts rank `rank` (local rank `local` of node `node`) with the
/// torchrun-style variables, in a process group of its own that dies with
/// the launcher; its output is forwarded with the rank as prefix.
fn spawn(
    opts: &LaunchOptions,
    meeting: &Meeting,
    (node, local): (usize, usize),
    threads: Option<usize>,
    forwarders: &mut Vec<std::thread::JoinHandle<()>>,
    attempt: usize,
) -> Result<Rank> {
    let program = &opts.command[0];
    let rank = node * opts.ranks_per_node + local;
    let mut cmd = Command::new(program);
    cmd.args(&opts.command[1..])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", (opts.nodes * opts.ranks_per_node).to_string())
        .env("LOCAL_RANK", local.to_string())
        .env("LOCAL_WORLD_SIZE", opts.ranks_per_node.to_string())
        .env("NODE_RANK", node.to_string())
        .env("ZEROPP_NODE_RANK", node.to_string())
        .env("MASTER_ADDR", &meeting.master_addr)
        .env("MASTER_PORT", meeting.master_port.to_string())
        .env("ZEROPP_TOKEN", &meeting.token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(if rank == 0 && opts.rank0_terminal {
            Stdio::inherit()
        } else {
            Stdio::piped()
        });
    if let Some(t) = opts.timeout_s {
        cmd.env("ZEROPP_TIMEOUT_S", t.to_string());
    }
    if opts.islands > 1 {
        cmd.env("ZEROPP_ISLANDS", opts.islands.to_string());
        // How many times this rank was started before (its island's
        // restarts): a restarted island's ranks agree on it.
        cmd.env("ZEROPP_ATTEMPT", attempt.to_string());
        // A lost island's ranks are started again: the job's transport
        // must take them back (TCP).
        cmd.env("ZEROPP_RESTARTS", opts.restarts.to_string());
    }
    if let Some(store) = &meeting.store {
        cmd.env("ZEROPP_STORE", store);
    }
    if attempt > 0 {
        cmd.env("ZEROPP_REJOIN", "1");
    }
    if let Some(n) = threads {
        cmd.env("RAYON_NUM_THREADS", n.to_string());
    }
    // Each rank leads its own process group, so stopping it stops whatever
    // it started too; and it dies with the launcher instead of running on
    // as an orphan.
    // SAFETY: setpgid and prctl are async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
        program: program.clone(),
        rank,
        source,
    })?;
    if let Some(out) = child.stdout.take() {
        forwarders.push(forward(rank, out, None));
    }
    if let Some(err) = child.stderr.take() {
        forwarders.push(forward(rank, err, Some(meeting.last_words.clone())));
    }
    Ok(Rank {
        rank,
        child,
        status: None,
    })
}

/// A rank that failed: its island, rank and status.
#[derive(Clone, Copy, Debug)]
struct Failure {
    island: usize,
    rank: usize,
    status: ExitStatus,
    at: Instant,
}

/// The island of `rank` for islands of `per_island` ranks (`None`: the
/// job is one island).
fn island_of(rank: usize, per_island: Option<usize>) -> usize {
    per_island.map_or(0, |n| rank / n)
}

/// Waits for every rank. A failure stops its island (`per_island` ranks
/// each; `None`: the whole job): the
/// island's other ranks get `grace` to report and exit, then their
/// process groups are stopped; the other islands run on. In the end
/// every rank's process group is stopped (ranks still running, and
/// anything an exited rank left holding our output pipes). Returns each
/// island's first failure, in the order they happened.
fn supervise(
    ranks: &mut [Rank],
    grace: Duration,
    per_island: Option<usize>,
    (mut restarts, respawn): (usize, &mut dyn FnMut(usize) -> Result<Rank>),
) -> Result<Vec<Failure>> {
    // Islands failing now (their ranks stop after the grace), and those
    // lost for good.
    let mut failing: Vec<Failure> = Vec::new();
    let mut failures: Vec<Failure> = Vec::new();
    let seen = |list: &[Failure], island: usize| list.iter().any(|f| f.island == island);
    loop {
        if let Some(signal) = stop_signal() {
            return Err(stop_all(ranks, grace, signal));
        }
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            let waited = r.child.try_wait().map_err(|source| LaunchError::Io {
                what: "waiting for a rank",
                source,
            })?;
            if let Some(status) = waited {
                r.status = Some(status);
                let island = island_of(r.rank, per_island);
                if !status.success() && !seen(&failing, island) && !seen(&failures, island) {
                    tracing::error!(
                        "rank {} failed with {}; stopping the other ranks{}",
                        r.rank,
                        describe(status),
                        if per_island.is_some() {
                            format!(" of island {island} (the other islands go on)")
                        } else {
                            String::new()
                        }
                    );
                    failing.push(Failure {
                        island,
                        rank: r.rank,
                        status,
                        at: Instant::now(),
                    });
                }
            }
        }
        // The ranks of islands that failed more than `grace` ago stop;
        // then the island starts again to rejoin, or is lost.
        let due: Vec<Failure> = failing
            .iter()
            .filter(|f| f.at.elapsed() >= grace)
            .copied()
            .collect();
        for f in due {
            failing.retain(|g| g.island != f.island);
            let mine = |r: &Rank| island_of(r.rank, per_island) == f.island;
            for r in ranks.iter_mut().filter(|r| mine(r)) {
                stop(r);
            }
            // No island rejoins once another finished (the job is ending).
            // The job's store is the launcher's: island 0 rejoins too.
            let ending = ranks
                .iter()
                .any(|r| !mine(r) && r.status.is_some_and(|s| s.success()));
            let rejoinable = per_island.is_some() && !ending;
            if restarts > 0 && rejoinable {
                restarts -= 1;
                tracing::warn!(
                    "restarting the ranks of island {} to rejoin the job ({} restart(s) left)",
                    f.island,
                    restarts
                );
                for r in ranks.iter_mut().filter(|r| mine(r)) {
                    *r = respawn(r.rank)?;
                }
            } else {
                failures.push(f);
            }
        }
        if failing.is_empty() && ranks.iter().all(|r| r.status.is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in ranks.iter_mut() {
        stop(r);
    }
    Ok(failures)
}

/// Stops rank `r`'s process group and reaps it.
fn stop(r: &mut Rank) {
    // SAFETY: signalling a process group we created; ESRCH is harmless.
    unsafe {
        libc::kill(-(r.child.id() as i32), libc::SIGKILL);
    }
    if r.status.is_none() {
        r.status = r.child.wait().ok();
    }
}

/// Refuses what the launch would ignore or its ranks refuse: a timeout
/// that is none, no islands, restarts without islands, and a rank 0 host
/// for a launch that starts every node here.
fn check_islands_and_master(opts: &LaunchOptions) -> Result<()> {
    if let Some(t) = opts.timeout_s.filter(|&t| wait_limit(t).is_none()) {
        return Err(options(format!(
            "--timeout {t}: the ranks' timeout is {WAIT_LIMIT}"
        )));
    }
    if opts.islands == 0 {
        return Err(options(
            "--islands 0: the job's islands are 1 or more (1, the default: one failure stops \
             the job)",
        ));
    }
    if opts.restarts > 0 && opts.islands < 2 {
        return Err(options(format!(
            "--restarts {} starts a lost island's ranks again, and this launch has no islands: \
             add --islands N (2 or more, each of whole nodes), or drop --restarts (without \
             islands one failure stops the job)",
            opts.restarts
        )));
    }
    if let (None, Some(master)) = (opts.node_rank, &opts.master) {
        let (host, _) = split_host_port(master)
            .map_err(|_| options(format!("--master-addr {master:?}: HOST or HOST:PORT")))?;
        let here = host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback() || ip.is_unspecified());
        if !here {
            return Err(options(format!(
                "--master-addr {master} without --node-rank: this launch starts all {} nodes \
                 here, meeting on 127.0.0.1 (only the port is used); for a multi-host job run \
                 `zeropp launch --node-rank K --master-addr {master} ...` on each host K, or \
                 give --master-addr 127.0.0.1:PORT to pick the port",
                opts.nodes
            )));
        }
    }
    Ok(())
}

/// Starts the ranks and waits for them. `Err` names the first rank that
/// failed (with islands: when every island of this launch has failed).
pub fn launch(opts: &LaunchOptions) -> Result<()> {
    if opts.nodes == 0 || opts.ranks_per_node == 0 {
        return Err(options("--nodes and --ranks-per-node must be at least 1"));
    }
    if opts.command.is_empty() {
        return Err(options(
            "no command to launch: put it after `--`, e.g. `zeropp launch --nodes 2 --ranks-per-node 2 -- zeropp train`",
        ));
    }
    check_islands_and_master(opts)?;
    let islands = opts.islands;
    if !opts.nodes.is_multiple_of(islands) {
        return Err(options(format!(
            "{} nodes do not split into {islands} islands of whole nodes",
            opts.nodes
        )));
    }
    let mut meeting = meeting(opts)?;
    let here = meeting.local_nodes.len() * opts.ranks_per_node;
    if here > MAX_RANKS_HERE {
        return Err(options(format!(
            "this launch would start {here} ranks on this machine; it starts at most \
             {MAX_RANKS_HERE} (one a GPU or a few cores is the usual): lower --ranks-per-node, or \
             start each node's ranks on its own host with --node-rank"
        )));
    }
    let last_words = meeting.last_words.clone();
    let (store, server) = job_store(opts, &meeting)?;
    meeting.store = store;
    // The ranks' timeout: --timeout, else ZEROPP_TIMEOUT_S, else the
    // default.
    let timeout = opts
        .timeout_s
        .or_else(|| std::env::var("ZEROPP_TIMEOUT_S").ok()?.parse().ok())
        .and_then(wait_limit)
        .unwrap_or(DEFAULT_TIMEOUT);
    if let (Some(k), Some(store)) = (opts.node_rank.filter(|&k| k > 0), &meeting.store) {
        hold_store(store, k, &meeting.token, timeout);
    }
    // The cores are shared among the ranks this launch starts here: each
    // rank's compute threads (candle's, via RAYON_NUM_THREADS) get their
    // share unless the user set a count.
    let threads = compute_threads(meeting.local_nodes.len() * opts.ranks_per_node);
    let mut ranks = Vec::new();
    let mut forwarders = Vec::new();
    catch_stop_signals();
    // A signal while the ranks start stops those started; so does a rank
    // that cannot start.
    let started = meeting
        .local_nodes
        .clone()
        .flat_map(|node| (0..opts.ranks_per_node).map(move |local| (node, local)))
        .try_for_each(|at| match stop_signal() {
            Some(signal) => Err(LaunchError::Interrupted { signal }),
            None => {
                ranks.push(spawn(opts, &meeting, at, threads, &mut forwarders, 0)?);
                Ok(())
            }
        });
    if let Err(e) = started {
        let e = match e {
            LaunchError::Interrupted { signal } => stop_all(&mut ranks, opts.grace, signal),
            e => {
                ranks.iter_mut().for_each(stop);
                e
            }
        };
        default_stop_signals();
        return Err(e);
    }
    let per_island = (islands > 1).then_some(opts.nodes / islands * opts.ranks_per_node);
    let mut starts = std::collections::HashMap::new();
    let mut respawn = |rank: usize| {
        let node = rank / opts.ranks_per_node;
        let local = rank % opts.ranks_per_node;
        let attempt = starts.entry(rank).or_insert(0usize);
        *attempt += 1;
        spawn(
            opts,
            &meeting,
            (node, local),
            threads,
            &mut forwarders,
            *attempt,
        )
    };
    let supervised = supervise(
        &mut ranks,
        opts.grace,
        per_island,
        (opts.restarts, &mut respawn),
    );
    default_stop_signals();
    if supervised.is_err() {
        // The ranks' last lines (stopped, or the cause) reach the user.
        for f in forwarders.drain(..) {
            let _ = f.join();
        }
    }
    let failures = supervised?;
    if let (Some(0), Some(server)) = (opts.node_rank, &server) {
        keep_store_up(server, opts.nodes, &meeting.token, timeout);
    }
    for f in forwarders {
        let _ = f.join();
    }
    // Islands of this launch that another failure did not stop.
    let here: std::collections::BTreeSet<usize> = ranks
        .iter()
        .map(|r| island_of(r.rank, per_island))
        .collect();
    let Some(first) = failures.first() else {
        return Ok(());
    };
    if failures.len() >= here.len() {
        let said = match (first.status.code(), last_words.lock()) {
            (Some(_), Ok(words)) => words.get(&first.rank).map_or(String::new(), |w| {
                format!(" (it said: {})", w.strip_prefix("error: ").unwrap_or(w))
            }),
            _ => String::new(),
        };
        return Err(LaunchError::RankFailed {
            rank: first.rank,
            status: describe(first.status),
            said,
        });
    }
    for f in &failures {
        tracing::warn!(
            "island {} was lost (rank {} failed with {}); the other islands trained on",
            f.island,
            f.rank,
            describe(f.status)
        );
    }
    Ok(())
}

/// Compute threads for each of `ranks` processes sharing this machine's
/// cores: `None` when the user chose (RAYON_NUM_THREADS is set), else the
/// cores divided among the ranks, at least one. Oversubscribed cores (4
/// ranks x 2 threads on 2 cores) make every rank wait on the others'
/// threads, and the communication threads with them.
pub fn compute_threads(ranks: usize) -> Option<usize> {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some((cores / ranks.max(1)).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(islands: usize, restarts: usize, master: Option<&str>) -> LaunchOptions {
        LaunchOptions {
            nodes: 2,
            ranks_per_node: 1,
            node_rank: None,
            master: master.map(str::to_string),
            timeout_s: None,
            grace: Duration::from_secs(1),
            rank0_terminal: false,
            islands,
            restarts,
            command: vec!["true".into()],
        }
    }

    fn refused(o: LaunchOptions) -> String {
        launch(&o).unwrap_err().to_string()
    }

    #[test]
    fn what_a_launch_would_ignore_is_refused_saying_what_to_do() {
        let e = refused(LaunchOptions {
            timeout_s: Some(0.0),
            ..opts(1, 0, None)
        });
        assert!(e.contains("--timeout 0") && e.contains("positive"), "{e}");
        let e = refused(LaunchOptions {
            timeout_s: Some(1e30),
            ..opts(1, 0, None)
        });
        assert!(e.contains("at most 1e9"), "{e}");
        let e = refused(LaunchOptions {
            ranks_per_node: 5000,
            ..opts(1, 0, None)
        });
        assert!(
            e.contains("ranks on this machine") && e.contains("at most 1024"),
            "{e}"
        );
        let e = refused(opts(0, 0, None));
        assert!(e.contains("--islands 0") && e.contains("1 or more"), "{e}");
        let e = refused(opts(1, 2, None));
        assert!(
            e.contains("--restarts 2") && e.contains("add --islands N"),
            "{e}"
        );
        let e = refused(opts(1, 0, Some("10.1.2.3:29500")));
        assert!(
            e.contains("without --node-rank")
                && e.contains("--node-rank K --master-addr 10.1.2.3:29500"),
            "{e}"
        );
        // A local rendezvous port, and islands that restart, are taken.
        check_islands_and_master(&opts(1, 0, Some("127.0.0.1:29511"))).unwrap();
        check_islands_and_master(&opts(2, 1, None)).unwrap();
    }
}
