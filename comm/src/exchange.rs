//! Joining a job, written once: every rank publishes its transport
//! address, host identity and facts through the caller's `exchange`, which
//! returns everyone's — the store of a `torch.distributed` job (the Python
//! bindings), or zeropp's own rendezvous (`Job::connect`) — then connects
//! the transport. Nodes are the hosts the ranks find themselves on, or
//! logical nodes of a given size inside them.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::PlacementError;
use super::tcp::{TcpOptions, TcpTransport};
use super::ucx::{PeerAddress, UcxTransport};
use super::{CommError, Transport};

/// Which transport carries a job's messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// A full TCP mesh (framed, checksummed headers).
    Tcp,
    /// UCX tag matching (libucp loaded at run time): shared memory inside a
    /// host, TCP or RDMA between hosts.
    Ucx,
}

/// A transport's name that names none.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a transport: use ucx or tcp")]
pub struct UnknownTransport(pub String);

impl std::str::FromStr for TransportKind {
    type Err = UnknownTransport;

    /// `tcp` or `ucx`, as `ZEROPP_TRANSPORT` and `--transport` spell them.
    fn from_str(s: &str) -> Result<Self, UnknownTransport> {
        match s {
            "tcp" => Ok(TransportKind::Tcp),
            "ucx" => Ok(TransportKind::Ucx),
            other => Err(UnknownTransport(other.into())),
        }
    }
}

impl TransportKind {
    /// The transport of a rank that was not told one: UCX when libucp loads
    /// here, else TCP and why not UCX.
    pub fn default_here() -> (TransportKind, Option<String>) {
        match super::ucx::available() {
            Ok(()) => (TransportKind::Ucx, None),
            Err(why) => (TransportKind::Tcp, Some(why.to_string())),
        }
    }

    /// `ZEROPP_TRANSPORT` (`tcp` or `ucx`), else [`TransportKind::default_here`].
    pub fn from_env() -> Result<(TransportKind, Option<String>), CommError> {
        match std::env::var("ZEROPP_TRANSPORT") {
            Err(_) => Ok(Self::default_here()),
            Ok(v) => v
                .parse()
                .map(|k| (k, None))
                .map_err(|_| CommError::Setting {
                    name: "ZEROPP_TRANSPORT",
                    problem: format!("{v:?}: use ucx (the default when libucp loads) or tcp"),
                }),
        }
    }
}

impl TransportKind {
    /// A rank's transport: `asked` (`--transport`), else `ZEROPP_TRANSPORT`,
    /// else TCP where the launcher starts a lost island again
    /// (`islands_restart`: only TCP takes its ranks back), else
    /// [`TransportKind::default_here`]; with a note for the user where the
    /// choice is not the one asked or the usual one. UCX asked for islands
    /// that restart is refused: their restarts could never rejoin.
    pub fn choose(
        asked: Option<TransportKind>,
        islands_restart: bool,
    ) -> Result<(TransportKind, Option<String>), CommError> {
        let from_env = std::env::var_os("ZEROPP_TRANSPORT").map(|_| Self::from_env());
        Self::choose_from(asked, from_env, islands_restart)
    }

    /// [`TransportKind::choose`] with `ZEROPP_TRANSPORT`'s choice, where
    /// it is set, given.
    fn choose_from(
        asked: Option<TransportKind>,
        from_env: Option<Result<(TransportKind, Option<String>), CommError>>,
        islands_restart: bool,
    ) -> Result<(TransportKind, Option<String>), CommError> {
        let (kind, note) = match (asked, from_env) {
            (Some(kind), _) => (kind, None),
            (None, Some(chosen)) => chosen?,
            (None, None) if islands_restart => (
                TransportKind::Tcp,
                Some(
                    "a lost island is started again (--restarts), and only TCP takes its \
                     ranks back"
                        .to_string(),
                ),
            ),
            (None, None) => Self::default_here(),
        };
        if islands_restart && kind == TransportKind::Ucx {
            return Err(CommError::Setting {
                name: "the transport",
                problem: "ucx, with islands the launcher restarts (--restarts): a restarted \
                          island rejoins over TCP only; use tcp (the default there), or launch \
                          without --restarts"
                    .into(),
            });
        }
        Ok((kind, note))
    }
}

/// The error of ranks that picked different transports.
pub(crate) fn mixed_transports(them: usize, theirs: &str, me: usize, mine: &str) -> CommError {
    CommError::Join(format!(
        "rank {them} uses the {theirs} transport and rank {me} {mine}: set ZEROPP_TRANSPORT \
         to the same value (ucx or tcp) for every rank (unset, each rank picks UCX when libucp \
         loads on its host)"
    ))
}

/// Which process a rank is, and where: two ranks with the same boot id and
/// PID namespace see each other's processes in /proc.
#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub(crate) struct ProcessIdentity {
    pub(crate) pid: u32,
    pub(crate) boot_id: String,
    pid_namespace: String,
}

impl ProcessIdentity {
    pub(crate) fn of_self() -> Self {
        ProcessIdentity {
            pid: std::process::id(),
            boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            pid_namespace: std::fs::read_link("/proc/self/ns/pid")
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }

    /// Whether `other` runs on this host in this PID namespace (unknown
    /// facts never match).
    pub(crate) fn same_host(&self, other: &ProcessIdentity) -> bool {
        !self.boot_id.is_empty()
            && !self.pid_namespace.is_empty()
            && self.boot_id == other.boot_id
            && self.pid_namespace == other.pid_namespace
    }
}

/// What one rank publishes.
#[derive(Serialize, Deserialize, Clone, Debug)]
struct Published {
    rank: usize,
    world_size: usize,
    hostname: String,
    process: ProcessIdentity,
    /// Boot id and network namespace ([`super::rendezvous::host_identity`]):
    /// processes in different network namespaces of one machine are
    /// different hosts to the network (containers, bench-cluster/'s nodes).
    host_id: String,
    /// `host:port` of the TCP listener (TCP), or the UCP worker address in
    /// hex (UCX).
    tcp_address: Option<String>,
    ucx_address: Option<String>,
    facts: serde_json::Value,
}

/// Another rank as the exchange delivered it.
#[derive(Clone, Debug)]
pub struct Peer {
    pub rank: usize,
    pub hostname: String,
    /// Boot id and network namespace: two ranks with equal `hostname` and
    /// `host_id` run on one host.
    pub host_id: String,
    pub facts: serde_json::Value,
}

/// How the job is laid out over hosts: `nodes` × `ranks_per_node`, ranks
/// numbered node by node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLayout {
    pub nodes: usize,
    pub ranks_per_node: usize,
}

/// A joined job.
pub struct Joined {
    pub transport: Box<dyn Transport>,
    pub peers: Vec<Peer>,
    pub hosts: HostLayout,
}

/// How to join.
pub struct JoinOptions {
    pub kind: TransportKind,
    pub rank: usize,
    pub world_size: usize,
    /// Shared secret every connection must present (TCP).
    pub token: String,
    /// The address other ranks reach this one at (TCP).
    pub ip: IpAddr,
    pub timeout: Duration,
    /// Logical nodes of this many ranks (several per host, for emulating a
    /// cluster on one machine); `None`: the hosts.
    pub ranks_per_node: Option<usize>,
    /// Islands (TCP): this rank's island, and whether it is rejoining.
    pub rejoins: Option<super::tcp::Rejoins>,
}

/// Publishes this rank through `exchange` (its bytes in, every rank's bytes
/// out in rank order), connects the transport and lays out the nodes.
pub fn join(
    opts: &JoinOptions,
    facts: serde_json::Value,
    exchange: &mut dyn FnMut(Vec<u8>) -> Result<Vec<Vec<u8>>, CommError>,
) -> Result<Joined, CommError> {
    if opts.rank >= opts.world_size {
        return Err(CommError::NoSuchRank {
            peer: opts.rank,
            world: opts.world_size,
        });
    }
    let mine = Published {
        rank: opts.rank,
        world_size: opts.world_size,
        hostname: super::rendezvous::hostname(),
        process: ProcessIdentity::of_self(),
        host_id: super::rendezvous::host_identity(),
        tcp_address: None,
        ucx_address: None,
        facts,
    };
    let mut share = |mine: &Published| -> Result<Vec<Published>, CommError> {
        let bytes = serde_json::to_vec(mine).map_err(|e| CommError::Invalid(e.to_string()))?;
        let all = exchange(bytes)?;
        decode_all(&all, opts)
    };
    let (transport, all, hosts) = match opts.kind {
        TransportKind::Tcp => join_tcp(opts, mine, &mut share)?,
        TransportKind::Ucx => join_ucx(opts, mine, &mut share)?,
    };
    let peers = all
        .into_iter()
        .map(|p| Peer {
            rank: p.rank,
            hostname: p.hostname,
            host_id: p.host_id,
            facts: p.facts,
        })
        .collect();
    Ok(Joined {
        transport,
        peers,
        hosts,
    })
}

/// What joining over one transport gives: the transport, every rank's
/// published facts and the layout of their hosts.
type JoinedOver = (Box<dyn Transport>, Vec<Published>, HostLayout);

/// Joins over TCP: a listener on this rank's address, published with
/// `share`, then connected to every rank's.
fn join_tcp(
    opts: &JoinOptions,
    mut mine: Published,
    share: &mut dyn FnMut(&Published) -> Result<Vec<Published>, CommError>,
) -> Result<JoinedOver, CommError> {
    let listener = TcpListener::bind(SocketAddr::new(opts.ip, 0)).map_err(|e| CommError::Io {
        what: format!("a transport listener on {}", opts.ip),
        source: e,
    })?;
    let address = listener.local_addr().map_err(|e| CommError::Io {
        what: "the transport listener".into(),
        source: e,
    })?;
    mine.tcp_address = Some(address.to_string());
    let all = share(&mine)?;
    let addresses = all
        .iter()
        .map(|p| {
            let a = p
                .tcp_address
                .as_deref()
                .ok_or_else(|| mixed_transports(p.rank, "ucx", opts.rank, "tcp"))?;
            a.parse::<SocketAddr>().map_err(|_| CommError::BadAddress {
                rank: p.rank,
                address: a.to_string(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let options = TcpOptions {
        token: opts.token.clone(),
        connect_timeout: opts.timeout,
        write_timeout: opts.timeout,
        rejoins: opts.rejoins.clone(),
    };
    let hosts = layout_of(&all, opts)?;
    let t = TcpTransport::connect(opts.rank, &addresses, listener, &options)?;
    Ok((Box::new(t), all, hosts))
}

/// Joins over UCX: this rank's worker address published with `share`,
/// then every rank's worker reached (through shared memory inside this
/// rank's node only: the traffic of logical nodes must cross their
/// emulated links).
fn join_ucx(
    opts: &JoinOptions,
    mut mine: Published,
    share: &mut dyn FnMut(&Published) -> Result<Vec<Published>, CommError>,
) -> Result<JoinedOver, CommError> {
    let me = mine.process.clone();
    let mut table = Vec::new();
    let mut layout = None;
    let t = UcxTransport::connect(opts.rank, opts.world_size, |address| {
        mine.ucx_address = Some(super::ucx::address_to_hex(&address));
        table = share(&mine)?;
        let hosts = layout_of(&table, opts)?;
        layout = Some(hosts);
        let g = hosts.ranks_per_node;
        table
            .iter()
            .map(|p| {
                let hex = p
                    .ucx_address
                    .as_deref()
                    .ok_or_else(|| mixed_transports(p.rank, "tcp", opts.rank, "ucx"))?;
                let worker =
                    super::ucx::address_from_hex(hex).ok_or_else(|| CommError::BadAddress {
                        rank: p.rank,
                        address: hex.to_string(),
                    })?;
                let same_node = p.rank / g == opts.rank / g;
                let local_pid = (same_node && me.same_host(&p.process)).then_some(p.process.pid);
                Ok(PeerAddress { worker, local_pid })
            })
            .collect()
    })?;
    let hosts = layout
        .ok_or_else(|| CommError::Join("UCX connected without exchanging addresses".into()))?;
    Ok((Box::new(t), table, hosts))
}

/// The nodes of the job: its hosts, or logical nodes of `ranks_per_node`
/// ranks inside them.
fn layout_of(all: &[Published], opts: &JoinOptions) -> Result<HostLayout, CommError> {
    let ids: Vec<(String, String)> = all
        .iter()
        .map(|p| (p.hostname.clone(), p.host_id.clone()))
        .collect();
    let hosts = host_layout(&ids)?;
    let Some(g) = opts.ranks_per_node else {
        return Ok(hosts);
    };
    if g == 0 || !hosts.ranks_per_node.is_multiple_of(g) {
        return Err(CommError::Join(format!(
            "ranks_per_node={g}: logical nodes must divide the {} ranks each host runs ({} \
             ranks on {} host(s))",
            hosts.ranks_per_node, opts.world_size, hosts.nodes
        )));
    }
    Ok(HostLayout {
        nodes: opts.world_size / g,
        ranks_per_node: g,
    })
}

fn decode_all(all: &[Vec<u8>], opts: &JoinOptions) -> Result<Vec<Published>, CommError> {
    if all.len() != opts.world_size {
        return Err(CommError::Join(format!(
            "the exchange returned {} ranks' facts for a world of {}",
            all.len(),
            opts.world_size
        )));
    }
    all.iter()
        .enumerate()
        .map(|(r, b)| {
            let p: Published = serde_json::from_slice(b).map_err(|e| {
                CommError::Malformed(format!(
                    "rank {r}'s published facts are unreadable ({e}): every rank must run \
                     the same zeropp version"
                ))
            })?;
            if p.rank != r || p.world_size != opts.world_size {
                return Err(CommError::Join(format!(
                    "rank {r}'s entry says rank {} of {} and this rank {} of {}: the ranks \
                     disagree on the job (mismatched world sizes?)",
                    p.rank, p.world_size, opts.rank, opts.world_size
                )));
            }
            Ok(p)
        })
        .collect()
}

/// Nodes from host identities (hostname; boot id and network namespace) in
/// rank order: the ranks
/// of one host must be consecutive, and every host must hold as many.
pub fn host_layout(hosts: &[(String, String)]) -> Result<HostLayout, PlacementError> {
    if hosts.is_empty() {
        return Err(PlacementError::NoRanks);
    }
    let mut runs: Vec<(usize, usize)> = Vec::new(); // (first rank, count)
    for (r, h) in hosts.iter().enumerate() {
        match runs.last_mut() {
            Some((first, count)) if hosts[*first] == *h => *count += 1,
            _ => {
                if let Some((first, _)) = runs.iter().find(|(f, _)| hosts[*f] == *h) {
                    return Err(PlacementError::HostNotConsecutive {
                        rank: r,
                        host: h.0.clone(),
                        first: *first,
                    });
                }
                runs.push((r, 1));
            }
        }
    }
    let g = runs[0].1;
    if let Some((first, count)) = runs.iter().find(|(_, c)| *c != g) {
        return Err(PlacementError::Uneven {
            host: hosts[*first].0.clone(),
            count: *count,
            first_host: hosts[0].0.clone(),
            g,
        });
    }
    Ok(HostLayout {
        nodes: runs.len(),
        ranks_per_node: g,
    })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    /// Islands the launcher restarts run over TCP unless asked otherwise,
    /// and UCX asked for them is refused: their ranks could never rejoin.
    #[test]
    fn islands_that_restart_take_tcp_and_refuse_ucx() {
        let (kind, note) = TransportKind::choose_from(None, None, true).unwrap();
        assert_eq!(kind, TransportKind::Tcp);
        assert!(note.unwrap().contains("only TCP takes its ranks back"));
        // ZEROPP_TRANSPORT=ucx is asked too.
        let ucx = Some(Ok((TransportKind::Ucx, None)));
        let e = TransportKind::choose_from(None, ucx, true).unwrap_err();
        assert!(e.to_string().contains("use tcp"), "{e}");
        let e = TransportKind::choose(Some(TransportKind::Ucx), true).unwrap_err();
        assert!(e.to_string().contains("use tcp"), "{e}");
        let (kind, _) = TransportKind::choose(Some(TransportKind::Ucx), false).unwrap();
        assert_eq!(kind, TransportKind::Ucx);
    }

    fn hosts(names: &[&str]) -> Vec<(String, String)> {
        names
            .iter()
            .map(|n| (n.to_string(), format!("boot-{n}")))
            .collect()
    }

    #[test]
    fn nodes_are_runs_of_ranks_on_one_host() {
        let l = host_layout(&hosts(&["a", "a", "b", "b"])).unwrap();
        assert_eq!((l.nodes, l.ranks_per_node), (2, 2));
        let l = host_layout(&hosts(&["a", "a", "a"])).unwrap();
        assert_eq!((l.nodes, l.ranks_per_node), (1, 3));
        // Same hostname, another boot: another host (a container clone).
        let mut h = hosts(&["a", "a"]);
        h[1].1 = "other".into();
        assert_eq!(host_layout(&h).unwrap().nodes, 2);
    }

    /// An in-memory store shared by threads: what torch's store is to ranks.
    struct Board {
        slots: std::sync::Mutex<Vec<Option<Vec<u8>>>>,
        filled: std::sync::Condvar,
    }

    impl Board {
        fn exchange(&self, rank: usize, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, CommError> {
            let mut slots = self.slots.lock().unwrap();
            slots[rank] = Some(mine);
            self.filled.notify_all();
            let (slots, _) = self
                .filled
                .wait_timeout_while(slots, Duration::from_secs(20), |s| {
                    s.iter().any(Option::is_none)
                })
                .unwrap();
            Ok(slots
                .iter()
                .map(|s| s.clone().unwrap_or_default())
                .collect())
        }
    }

    fn join_all(
        world: usize,
        claimed: impl Fn(usize) -> usize + Sync,
    ) -> Vec<Result<Joined, CommError>> {
        join_islands(world, claimed, |_| None)
    }

    /// [`join_all`] with each rank's part in rejoins.
    fn join_islands(
        world: usize,
        claimed: impl Fn(usize) -> usize + Sync,
        rejoins: impl Fn(usize) -> Option<super::super::tcp::Rejoins> + Sync,
    ) -> Vec<Result<Joined, CommError>> {
        let board = std::sync::Arc::new(Board {
            slots: std::sync::Mutex::new(vec![None; world]),
            filled: std::sync::Condvar::new(),
        });
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (board, claimed, rejoins) = (board.clone(), &claimed, &rejoins);
                    s.spawn(move || {
                        let opts = JoinOptions {
                            kind: TransportKind::Tcp,
                            rank,
                            world_size: claimed(rank),
                            token: "t".into(),
                            ip: IpAddr::from([127, 0, 0, 1]),
                            timeout: Duration::from_secs(20),
                            ranks_per_node: None,
                            rejoins: rejoins(rank),
                        };
                        join(&opts, serde_json::json!({ "me": rank }), &mut |m| {
                            board.exchange(rank, m)
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ranks_join_through_a_shared_store_and_talk() {
        let joined: Vec<Joined> = join_all(3, |_| 3).into_iter().map(Result::unwrap).collect();
        for (r, j) in joined.iter().enumerate() {
            assert_eq!(j.transport.rank(), r);
            assert_eq!(j.peers.len(), 3);
            assert_eq!(j.peers[2].facts["me"], 2);
            // Threads of one process: one host.
            assert_eq!((j.hosts.nodes, j.hosts.ranks_per_node), (1, 3));
        }
        let h = joined[0]
            .transport
            .send(2, 7, bytes::Bytes::from_static(b"hi"))
            .unwrap();
        let got = joined[2]
            .transport
            .recv(0, 7, Duration::from_secs(10))
            .unwrap();
        h.wait(2, Duration::from_secs(10)).unwrap();
        assert_eq!(&got[..], b"hi");
    }

    #[test]
    fn a_rank_restarted_before_the_others_met_it_is_out_of_their_collectives_until_readmitted() {
        // Two islands of one rank; island 1's rank is a restarted one that
        // rejoins while island 0's rank still builds the mesh (it met no
        // earlier start of it), and so meets it first as a restarted rank.
        let joined: Vec<Joined> = join_islands(
            2,
            |_| 2,
            |r| {
                Some(super::super::tcp::Rejoins {
                    island: r..r + 1,
                    rejoining: r == 1,
                })
            },
        )
        .into_iter()
        .map(Result::unwrap)
        .collect();
        let (live, restarted) = (&joined[0].transport, &joined[1].transport);
        // A collective's wait on it fails at once, naming it, instead of
        // at the timeout (it waits to rejoin, in no collective).
        let started = std::time::Instant::now();
        let e = live.recv(1, 7, Duration::from_secs(30)).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5), "{e}");
        assert!(
            matches!(e, CommError::PeerFailed { peer: 1, .. })
                && e.to_string().contains("restarted"),
            "{e}"
        );
        // Its request to rejoin arrives.
        let request = super::super::group::rejoin_tag(1);
        restarted
            .send(0, request, Bytes::from_static(b"back"))
            .unwrap();
        let got = live.recv(1, request, Duration::from_secs(10)).unwrap();
        assert_eq!(&got[..], b"back");
        // Taken back, its collectives' messages are waited for again; the
        // restarted rank waits on the live one as on any rank.
        live.readmit(1);
        restarted.send(0, 8, Bytes::from_static(b"y")).unwrap();
        assert_eq!(&live.recv(1, 8, Duration::from_secs(10)).unwrap()[..], b"y");
        live.send(1, 9, Bytes::from_static(b"z")).unwrap();
        assert_eq!(
            &restarted.recv(0, 9, Duration::from_secs(10)).unwrap()[..],
            b"z"
        );
    }

    #[test]
    fn ranks_that_disagree_on_the_world_size_are_told() {
        // Rank 1 thinks the job has 3 ranks, rank 0 that it has 2.
        let results = join_all(2, |r| if r == 1 { 3 } else { 2 });
        let errors: Vec<String> = results
            .into_iter()
            .filter_map(|r| r.err().map(|e| e.to_string()))
            .collect();
        assert!(!errors.is_empty());
        for e in &errors {
            assert!(
                e.contains("mismatched world sizes") || e.contains("for a world of"),
                "{e}"
            );
        }
    }

    #[test]
    fn round_robin_and_uneven_placements_are_refused_with_the_hosts_named() {
        let e = host_layout(&hosts(&["a", "b", "a", "b"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 2") && e.contains("consecutive"), "{e}");
        let e = host_layout(&hosts(&["a", "a", "a", "b"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("host b runs 1") && e.contains("host a runs 3"),
            "{e}"
        );
    }
}
