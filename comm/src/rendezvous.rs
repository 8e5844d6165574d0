//! The rendezvous: rank 0 runs a small TCP store; every rank (rank 0 too)
//! connects, presents the job token and its facts (transport address, node,
//! local rank, free-form facts such as topology or NCCL ids), and receives
//! everyone's once all have arrived. A caller without the token is refused
//! and logged; inconsistent facts (two ranks with one id, world sizes that
//! disagree, uneven nodes) fail the whole job with the ranks named.

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::env::RankFacts;
use super::torch_store::TorchStore;
use super::wire::{self, Header, HelloError, Kind, ReadFrame};
use super::{CommError, PlacementError};

/// What one rank tells the others.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PeerInfo {
    pub rank: usize,
    pub world_size: usize,
    pub node_rank: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub host: String,
    /// Which machine this is beyond its name: boot id and network namespace
    /// ([`host_identity`]); two ranks with equal `host` and `host_id` run
    /// on one host.
    #[serde(default)]
    pub host_id: String,
    /// Where this rank's transport listens.
    pub address: String,
    /// Anything else to share (topology, NCCL ids, UCX worker address).
    pub facts: serde_json::Value,
}

#[derive(Serialize, Deserialize)]
struct Hello {
    token: String,
    peer: PeerInfo,
}

const REPLY_TABLE: u64 = 0;
const REPLY_ERROR: u64 = 1;
/// A hello larger than this is refused (facts are small).
const MAX_HELLO: u64 = 1 << 20;

fn failure(msg: String) -> CommError {
    CommError::Join(format!("rendezvous failed: {msg}"))
}

/// This host's name, for logs and the rendezvous table.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".into())
}

/// This host's identity beyond its name: the boot id (another machine, or
/// the same one rebooted, differs) and the network namespace (containers
/// and the emulated nodes of bench-cluster/ are hosts of their own to the
/// network).
pub fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let net = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{boot}/{net}")
}

/// Resolves `host:port`.
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr, CommError> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            failure(format!(
                "cannot resolve the host {host:?} ({e}): check the name (MASTER_ADDR or \
                 --master-addr, ZEROPP_STORE for the launcher's store) and this host's DNS"
            ))
        })?
        .next()
        .ok_or_else(|| failure(format!("{host} resolves to no address")))
}

/// The local IP this host uses to reach `master` (no packet is sent): the
/// address other ranks can reach this one at.
pub fn local_ip_towards(master: SocketAddr) -> Result<std::net::IpAddr, CommError> {
    let any: SocketAddr = if master.is_ipv4() {
        "0.0.0.0:0".parse().expect("literal")
    } else {
        "[::]:0".parse().expect("literal")
    };
    let probe = UdpSocket::bind(any).map_err(|e| CommError::Io {
        what: "a UDP probe socket".into(),
        source: e,
    })?;
    probe.connect(master).map_err(|e| CommError::Io {
        what: format!("routing towards {master}"),
        source: e,
    })?;
    probe
        .local_addr()
        .map(|a| a.ip())
        .map_err(|e| CommError::Io {
            what: "a UDP probe socket".into(),
            source: e,
        })
}

fn reply(stream: &mut TcpStream, kind: u64, payload: &[u8]) {
    let h = Header {
        kind: Kind::Data,
        source: 0,
        tag: kind,
        len: payload.len() as u64,
    };
    if let Err(e) = wire::write_frame(stream, &h, payload) {
        tracing::debug!("rendezvous reply failed: {e}");
    }
}

fn read_hello(stream: &mut TcpStream, timeout: Duration) -> Result<Hello, HelloError> {
    stream.set_read_timeout(Some(timeout))?;
    let mut limited = std::io::Read::take(&mut *stream, wire::HEADER_LEN as u64 + MAX_HELLO);
    match wire::read_frame(&mut limited)? {
        ReadFrame::Frame(h, payload) if h.kind == Kind::Hello && h.len <= MAX_HELLO => {
            Ok(serde_json::from_slice(&payload)?)
        }
        ReadFrame::Frame(..) => Err(HelloError::NotHello),
        ReadFrame::End => Err(HelloError::Closed),
    }
}

/// A caller's hello when it carries the job's token; otherwise `None`,
/// the refusal logged (and told to a caller with the wrong token).
fn hello_of_the_job(
    stream: &mut TcpStream,
    token: &str,
    wait: Duration,
    what: &str,
) -> Option<Hello> {
    let from = stream
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    match read_hello(stream, wait) {
        Ok(h) if h.token == token => Some(h),
        Ok(_) => {
            tracing::warn!("rendezvous: refused {what} from {from}: wrong job token");
            reply(
                stream,
                REPLY_ERROR,
                b"wrong job token: set ZEROPP_TOKEN to the job's secret",
            );
            None
        }
        Err(reason) => {
            tracing::warn!("rendezvous: refused {what} from {from}: {reason}");
            None
        }
    }
}

/// Runs the store on rank 0 until every rank has arrived (or it fails).
/// Returns the table it sent.
pub fn serve(
    listener: &TcpListener,
    token: &str,
    world_size: usize,
    timeout: Duration,
) -> Result<Vec<PeerInfo>, CommError> {
    let deadline = Instant::now() + timeout;
    listener.set_nonblocking(true).map_err(|e| CommError::Io {
        what: "the rendezvous listener".into(),
        source: e,
    })?;
    let mut arrived: Vec<Option<(PeerInfo, TcpStream, SocketAddr)>> =
        (0..world_size).map(|_| None).collect();
    let fail_all = |arrived: &mut Vec<Option<(PeerInfo, TcpStream, SocketAddr)>>, msg: String| {
        for (_, stream, _) in arrived.iter_mut().flatten() {
            reply(stream, REPLY_ERROR, msg.as_bytes());
        }
        failure(msg)
    };
    let mut count = 0;
    while count < world_size {
        let (mut stream, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> =
                        (0..world_size).filter(|&r| arrived[r].is_none()).collect();
                    return Err(fail_all(
                        &mut arrived,
                        format!(
                            "ranks {missing:?} did not arrive within {timeout:?}; they failed to \
                             start, or cannot reach the master address"
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => {
                return Err(CommError::Io {
                    what: "the rendezvous listener".into(),
                    source: e,
                });
            }
        };
        let _ = stream.set_nonblocking(false);
        let wait = Duration::from_secs(10).min(timeout);
        let Some(hello) = hello_of_the_job(&mut stream, token, wait, "a connection") else {
            continue;
        };
        let peer = hello.peer;
        if peer.world_size != world_size {
            let msg = format!(
                "rank {} (from {from}) says the world has {} ranks, rank 0 says {world_size}",
                peer.rank, peer.world_size
            );
            reply(&mut stream, REPLY_ERROR, msg.as_bytes());
            return Err(fail_all(&mut arrived, msg));
        }
        if peer.rank >= world_size {
            let msg = format!(
                "a process at {from} claims rank {} in a world of {world_size}",
                peer.rank
            );
            reply(&mut stream, REPLY_ERROR, msg.as_bytes());
            return Err(fail_all(&mut arrived, msg));
        }
        if let Some((_, _, first)) = &arrived[peer.rank] {
            let msg = format!(
                "two processes claim rank {}: one at {first}, one at {from}",
                peer.rank
            );
            reply(&mut stream, REPLY_ERROR, msg.as_bytes());
            return Err(fail_all(&mut arrived, msg));
        }
        let rank = peer.rank;
        arrived[rank] = Some((peer, stream, from));
        count += 1;
    }

    let table: Vec<PeerInfo> = arrived
        .iter()
        .flatten()
        .map(|(p, _, _)| p.clone())
        .collect();
    if let Err(e) = check_layout(&table) {
        return Err(fail_all(&mut arrived, e.to_string()));
    }
    let payload = serde_json::to_vec(&table).map_err(|e| failure(e.to_string()))?;
    for (_, stream, _) in arrived.iter_mut().flatten() {
        reply(stream, REPLY_TABLE, &payload);
    }
    Ok(table)
}

/// Every node must hold the same number of ranks, each (node, local rank)
/// exactly once.
pub(crate) fn check_layout(table: &[PeerInfo]) -> Result<(), PlacementError> {
    let g = table[0].local_world_size;
    let nodes = table.len() / g.max(1);
    let mut seen = vec![None; table.len()];
    for p in table {
        let (rank, local, node) = (p.rank, p.local_rank, p.node_rank);
        if p.local_world_size != g {
            return Err(PlacementError::RanksPerNode {
                rank,
                says: p.local_world_size,
                first: g,
            });
        }
        if node >= nodes || local >= g {
            return Err(PlacementError::Outside {
                rank,
                local,
                node,
                nodes,
                g,
            });
        }
        let slot = node * g + local;
        if rank != slot {
            return Err(PlacementError::NotNodeByNode {
                rank,
                local,
                node,
                g,
            });
        }
        if let Some(other) = seen[slot].replace(rank) {
            return Err(PlacementError::Claimed {
                other,
                rank,
                local,
                node,
            });
        }
    }
    check_hosts(table)
}

/// The launcher's nodes against the hosts the ranks found themselves on:
/// the ranks of one node run on one host (a host may hold several logical
/// nodes of `zeropp launch`).
fn check_hosts(table: &[PeerInfo]) -> Result<(), PlacementError> {
    let g = table[0].local_world_size;
    for p in table {
        let first = &table[p.node_rank * g];
        let unknown = p.host_id.is_empty() || first.host_id.is_empty();
        if !unknown && (p.host != first.host || p.host_id != first.host_id) {
            return Err(PlacementError::NodeOnHosts {
                first: first.rank,
                rank: p.rank,
                node: p.node_rank,
                first_host: first.host.clone(),
                host: p.host.clone(),
            });
        }
    }
    Ok(())
}

/// Presents `me` to the store at `master` and returns everyone's facts, in
/// rank order.
pub fn join(
    master: SocketAddr,
    token: &str,
    me: &PeerInfo,
    timeout: Duration,
) -> Result<Vec<PeerInfo>, CommError> {
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        match TcpStream::connect_timeout(&master, Duration::from_secs(5)) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("rendezvous at {master} not reachable yet: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(failure(format!(
                    "cannot reach rank 0's store at {master} within {timeout:?}: {e}; check \
                     MASTER_ADDR/MASTER_PORT and that rank 0 started"
                )));
            }
        }
    };
    let payload = serde_json::to_vec(&Hello {
        token: token.into(),
        peer: me.clone(),
    })
    .map_err(|e| failure(e.to_string()))?;
    let h = Header {
        kind: Kind::Hello,
        source: me.rank as u32,
        tag: 0,
        len: payload.len() as u64,
    };
    wire::write_frame(&mut stream, &h, &payload).map_err(|e| CommError::Io {
        what: format!("the rendezvous store at {master}"),
        source: e,
    })?;
    let remaining = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    stream
        .set_read_timeout(Some(remaining))
        .map_err(|e| CommError::Io {
            what: "a socket".into(),
            source: e,
        })?;
    let frame = wire::read_frame(&mut stream).map_err(|e| match e {
        CommError::Io { source, .. } if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            failure(format!("no answer from the store at {master} within {timeout:?}: other ranks did not arrive"))
        }
        other => failure(format!("the store at {master} sent a bad answer: {other}")),
    })?;
    match frame {
        ReadFrame::Frame(h, payload) if h.tag == REPLY_TABLE => {
            let table: Vec<PeerInfo> = serde_json::from_slice(&payload)
                .map_err(|e| failure(format!("unreadable table: {e}")))?;
            if table.len() != me.world_size || table.iter().enumerate().any(|(i, p)| p.rank != i) {
                return Err(failure(
                    "the store's table does not list every rank once".into(),
                ));
            }
            Ok(table)
        }
        ReadFrame::Frame(_, payload) => {
            Err(failure(String::from_utf8_lossy(&payload).into_owned()))
        }
        ReadFrame::End => Err(failure(format!(
            "the store at {master} closed the connection: wrong token, or another job owns that port"
        ))),
    }
}

/// torchrun's store and this run's keys in it: one connection, opened
/// once, serves the job token and the rendezvous.
pub struct TorchrunStore {
    store: TorchStore,
    prefix: String,
}

impl TorchrunStore {
    /// Whether a rank outside `island` (of a job of `world` ranks) joined
    /// the job's mesh already ([`TorchrunStore::joined_mesh`]).
    pub fn others_joined(
        &mut self,
        island: std::ops::Range<usize>,
        world: usize,
    ) -> Result<bool, CommError> {
        for r in (0..world).filter(|r| !island.contains(r)) {
            let key = store_key(&self.prefix, &format!("built/{r}"));
            if self.store.check(&[key])? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Records that `rank` (its `attempt`-th start) joined the mesh.
    pub fn joined_mesh(&mut self, rank: usize, attempt: usize) -> Result<(), CommError> {
        self.store.set(
            &store_key(&self.prefix, &format!("built/{rank}")),
            attempt.to_string().as_bytes(),
        )
    }
}

/// Whether a restarted rank of a lost island (`facts.rejoin`) finds a
/// running job to rejoin: a rank of another island joined the mesh. Where
/// none did, nobody has trained yet (the ranks join before their first
/// step), and it starts with the others, as if its first start had not
/// failed. Without a store (no rejoin runs there): true.
pub fn job_is_running(facts: &RankFacts) -> Result<bool, CommError> {
    match torch_store(facts)? {
        Some(mut s) => s.others_joined(facts.island_ranks(), facts.world_size),
        None => Ok(true),
    }
}

/// Where the job's store of `zeropp launch --islands` is (ZEROPP_STORE's
/// `host:port`).
pub fn store_addr(store: &str) -> Result<SocketAddr, CommError> {
    match super::env::split_host_port(store) {
        Ok((host, Some(port))) => resolve(&host, port),
        _ => Err(failure(format!(
            "ZEROPP_STORE={store:?}: the job's store is host:port"
        ))),
    }
}

/// torchrun's store when this rank was started by torchrun, the job's
/// store of `zeropp launch --islands` (ZEROPP_STORE), else `None`.
pub fn torch_store(facts: &RankFacts) -> Result<Option<TorchrunStore>, CommError> {
    let Some(prefix) = &facts.torch_store else {
        return Ok(None);
    };
    let master = match &facts.store {
        Some(s) => store_addr(s)?,
        None => resolve(&facts.master_addr, facts.master_port)?,
    };
    Ok(Some(TorchrunStore {
        store: TorchStore::connect(master, facts.timeout)?,
        prefix: prefix.clone(),
    }))
}

/// Rendezvous from rank facts: rank 0 also serves, or, under torchrun,
/// through `store` ([`torch_store`]). `address` is where this rank's
/// transport listens; `facts` anything else to share.
pub fn rendezvous(
    facts: &RankFacts,
    store: Option<&mut TorchrunStore>,
    address: String,
    extra: serde_json::Value,
) -> Result<Vec<PeerInfo>, CommError> {
    let me = PeerInfo {
        rank: facts.rank,
        world_size: facts.world_size,
        node_rank: facts.node_rank,
        local_rank: facts.local_rank,
        local_world_size: facts.local_world_size,
        host: hostname(),
        host_id: host_identity(),
        address,
        facts: extra,
    };
    if let Some(store) = store {
        return through_torch_store(facts, store, &me);
    }
    let master = resolve(&facts.master_addr, facts.master_port)?;
    if facts.rejoin {
        return Err(failure(
            "a restarted rank rejoins through the job's store that `zeropp launch --islands N \
             --restarts K` holds (ZEROPP_STORE): launch the job with it, or restart the whole \
             job from its last checkpoint (--resume)"
                .into(),
        ));
    }
    let server = if facts.rank == 0 {
        let bind: SocketAddr = if master.is_ipv4() {
            SocketAddr::from(([0, 0, 0, 0], facts.master_port))
        } else {
            SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, facts.master_port))
        };
        let listener = TcpListener::bind(bind).map_err(|e| {
            failure(format!(
                "rank 0 cannot listen on port {}: {e}; pick a free port (MASTER_PORT, or \
                 --master-addr HOST:PORT)",
                facts.master_port
            ))
        })?;
        let token = facts.token.clone();
        let (world, timeout) = (facts.world_size, facts.timeout);
        Some(std::thread::spawn(move || {
            serve(&listener, &token, world, timeout)
        }))
    } else {
        None
    };
    let joined = join(master, &facts.token, &me, facts.timeout);
    if let Some(server) = server {
        let served = server
            .join()
            .map_err(|_| failure("the store thread panicked".into()))?;
        // The server's own error is the more precise one.
        served?;
    }
    joined
}

/// The keys of this run in torchrun's store.
fn store_key(prefix: &str, what: &str) -> String {
    format!("/zeropp/{prefix}/{what}")
}

/// The rendezvous through a store (torchrun's agent's, or the one
/// `zeropp launch --islands` holds): every rank sets its facts under its
/// attempt and reads everyone's — its island's of the same attempt, the
/// other islands' latest (a restarted island finds the running ones);
/// every rank checks the table the same way.
fn through_torch_store(
    facts: &RankFacts,
    TorchrunStore { store, prefix }: &mut TorchrunStore,
    me: &PeerInfo,
) -> Result<Vec<PeerInfo>, CommError> {
    let mine = serde_json::to_vec(me).map_err(|e| failure(e.to_string()))?;
    let entry = |r: usize, attempt: usize| store_key(prefix, &format!("rank/{r}/{attempt}"));
    store.set(&entry(me.rank, facts.attempt), &mine)?;
    store.set(
        &store_key(prefix, &format!("latest/{}", me.rank)),
        facts.attempt.to_string().as_bytes(),
    )?;
    let island = facts.island_ranks();
    let mut keys = Vec::with_capacity(facts.world_size);
    for r in 0..facts.world_size {
        let attempt = if island.contains(&r) {
            facts.attempt
        } else {
            let latest = store.get(&store_key(prefix, &format!("latest/{r}")), facts.timeout)?;
            std::str::from_utf8(&latest)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| {
                    failure(format!("rank {r}'s start count in the store is unreadable"))
                })?
        };
        keys.push(entry(r, attempt));
    }
    store.wait(&keys, facts.timeout)?;
    let table = keys
        .iter()
        .enumerate()
        .map(|(r, k)| {
            let b = store.get(k, facts.timeout)?;
            let p: PeerInfo = serde_json::from_slice(&b).map_err(|e| {
                failure(format!(
                    "rank {r}'s facts in the job's store are unreadable: {e}"
                ))
            })?;
            if p.rank != r || p.world_size != facts.world_size {
                return Err(failure(format!(
                    "rank {r}'s entry says rank {} of {}, this rank {} of {}: the ranks \
                     disagree on the job",
                    p.rank, p.world_size, facts.rank, facts.world_size
                )));
            }
            Ok(p)
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_layout(&table).map_err(|e| failure(e.to_string()))?;
    Ok(table)
}

/// The job's token under torchrun: ZEROPP_TOKEN when set, else drawn by
/// rank 0 and shared through torchrun's `store` ([`torch_store`]), which
/// only the job's processes reach. Other launchers: the facts' own.
pub fn job_token(
    facts: &RankFacts,
    store: Option<&mut TorchrunStore>,
) -> Result<String, CommError> {
    let Some(TorchrunStore { store, prefix }) = store.filter(|_| facts.token.is_empty()) else {
        return Ok(facts.token.clone());
    };
    let key = store_key(prefix, "token");
    // A restarted rank 0 reads the running job's.
    if facts.rank == 0 && facts.attempt == 0 {
        let mut raw = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut raw))
            .map_err(|e| CommError::Io {
                what: "/dev/urandom (the job token)".into(),
                source: e,
            })?;
        let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        store.set(&key, token.as_bytes())?;
    }
    let token = store.get(&key, facts.timeout)?;
    String::from_utf8(token)
        .map_err(|_| failure("the token in torchrun's store is not text".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rendezvous table as the ranks of a real job publish it: per rank
    /// (hostname, the launcher's node and local rank).
    fn table(ranks: &[(&str, usize, usize)], g: usize) -> Vec<PeerInfo> {
        ranks
            .iter()
            .enumerate()
            .map(|(rank, &(host, node_rank, local_rank))| PeerInfo {
                rank,
                world_size: ranks.len(),
                node_rank,
                local_rank,
                local_world_size: g,
                host: host.into(),
                host_id: format!("boot-{host}/net:[1]"),
                address: String::new(),
                facts: serde_json::Value::Null,
            })
            .collect()
    }

    #[test]
    fn block_placements_of_every_launcher_pass() {
        // torchrun --nnodes 2 --nproc-per-node 2; srun -N 2 -n 4; mpirun
        // --map-by slot: ranks 0,1 on a, 2,3 on b.
        let t = table(&[("a", 0, 0), ("a", 0, 1), ("b", 1, 0), ("b", 1, 1)], 2);
        assert_eq!(check_layout(&t), Ok(()));
        // zeropp launch --nodes 2 on one machine: two logical nodes, one host.
        let t = table(&[("a", 0, 0), ("a", 0, 1), ("a", 1, 0), ("a", 1, 1)], 2);
        assert_eq!(check_layout(&t), Ok(()));
    }

    #[test]
    fn round_robin_placement_is_refused_with_the_fix() {
        // mpirun --map-by node on 2 hosts: OMPI local ranks 0,0,1,1; zeropp
        // derives node = rank / 2.
        let t = table(&[("a", 0, 0), ("b", 0, 0), ("a", 1, 1), ("b", 1, 1)], 2);
        let e = check_layout(&t).unwrap_err().to_string();
        assert!(
            e.contains("rank 1 is local rank 0 of node 0") && e.contains("--map-by slot"),
            "{e}"
        );
        // Slurm --distribution=cyclic: the node ids are right, the numbering is not.
        let t = table(&[("a", 0, 0), ("b", 1, 0), ("a", 0, 1), ("b", 1, 1)], 2);
        let e = check_layout(&t).unwrap_err().to_string();
        assert!(e.contains("node by node"), "{e}");
    }

    #[test]
    fn a_node_that_spans_two_hosts_is_named_with_both() {
        // A launcher that claims 2 ranks per node where the hosts run 1 each
        // (LOCAL_WORLD_SIZE set by hand on two machines).
        let t = table(&[("a", 0, 0), ("b", 0, 1)], 2);
        let e = check_layout(&t).unwrap_err().to_string();
        assert!(
            e.contains("rank 0 runs on host a") && e.contains("rank 1 on host b"),
            "{e}"
        );
        // Same name, another machine (cloned images): still two hosts.
        let mut t = table(&[("a", 0, 0), ("a", 0, 1)], 2);
        t[1].host_id = "boot-other/net:[1]".into();
        assert!(check_layout(&t).is_err());
    }
}
