//! Rank facts from the environment a launcher set: torchrun style (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NODEID`) or Open MPI (`OMPI_COMM_WORLD_*`); plus `ZEROPP_TOKEN`,
//! the job's shared secret, and `ZEROPP_TIMEOUT_S`.

use std::time::Duration;

/// The default rendezvous port, as torchrun's.
pub const DEFAULT_PORT: u16 = 29500;
/// The default timeout of every network wait.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Who this process is in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFacts {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// The node (host, or logical node of `zeropp launch`) this rank is on.
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub token: String,
    pub timeout: Duration,
    /// Which launcher's variables these came from.
    pub launcher: &'static str,
    /// Under torchrun: the key prefix of this run in torchrun's own store
    /// (`TORCHELASTIC_RUN_ID`/`TORCHELASTIC_RESTART_COUNT`), which the
    /// rendezvous uses instead of a port of its own.
    pub torch_store: Option<String>,
    /// Islands of consecutive whole nodes (`ZEROPP_ISLANDS`, or the
    /// trainer's `--islands`): every rank's listener takes restarted
    /// ranks of a lost island, which rejoin through the launcher's
    /// store ([`RankFacts::store`]). 1: none.
    pub islands: usize,
    /// This is a restarted rank of a lost island joining the running job
    /// (`ZEROPP_REJOIN=1`, set by `zeropp launch --restarts`).
    pub rejoin: bool,
    /// The job's store that `zeropp launch --islands` holds (`host:port`,
    /// `ZEROPP_STORE`; torch's `TCPStore` wire): the rendezvous goes
    /// through it, so no rank holds it and island 0 rejoins too.
    pub store: Option<String>,
    /// How many times this rank's island was started before
    /// (`ZEROPP_ATTEMPT`; a rejoining rank without it: 1).
    pub attempt: usize,
    /// How many times the launcher starts a lost island again
    /// (`ZEROPP_RESTARTS`, `zeropp launch --restarts`; 0: never).
    pub restarts: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EnvError {
    #[error(
        "no rank facts in the environment: start this command with `zeropp launch`, \
         torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, \
         MASTER_ADDR, MASTER_PORT), srun or mpirun"
    )]
    Missing,
    #[error("{name}={value:?} is not a valid {what}")]
    Invalid {
        name: String,
        value: String,
        what: &'static str,
    },
    #[error("{0}")]
    Inconsistent(String),
}

fn parse<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
    what: &'static str,
) -> Result<Option<T>, EnvError> {
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|_| EnvError::Invalid {
            name: name.into(),
            value: v,
            what,
        }),
    }
}

fn need<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
    what: &'static str,
    launcher: &str,
) -> Result<T, EnvError> {
    parse(get, name, what)?.ok_or_else(|| {
        EnvError::Inconsistent(format!(
            "{launcher} variables are set but {name} is missing"
        ))
    })
}

/// Slurm's `SLURM_TASKS_PER_NODE` looks like `4(x2),3`: the first count.
fn slurm_tasks_per_node(v: &str) -> Option<usize> {
    v.split([',', '(']).next()?.trim().parse().ok()
}

/// Where the launcher put this rank, from its variables.
struct Placement {
    launcher: &'static str,
    rank: usize,
    world: usize,
    local_rank: usize,
    local_world: usize,
    /// The node's index where the launcher says it.
    node: Option<usize>,
}

impl Placement {
    fn from_launcher(get: &dyn Fn(&str) -> Option<String>) -> Result<Placement, EnvError> {
        if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let l = "torchrun-style";
            let rank = need(get, "RANK", "rank", l)?;
            let world: usize = need(get, "WORLD_SIZE", "world size", l)?;
            let local_rank = parse(get, "LOCAL_RANK", "local rank")?.unwrap_or(rank);
            let local_world = parse(get, "LOCAL_WORLD_SIZE", "local world size")?.unwrap_or(world);
            let node = match parse(get, "NODE_RANK", "node rank")? {
                Some(n) => Some(n),
                None => parse(get, "GROUP_RANK", "node rank")?,
            };
            Ok(Placement::new(
                l,
                rank,
                world,
                local_rank,
                local_world,
                node,
            ))
        } else if get("SLURM_PROCID").is_some() {
            let l = "Slurm";
            let rank = need(get, "SLURM_PROCID", "rank", l)?;
            let world = need(get, "SLURM_NTASKS", "task count", l)?;
            let local_rank = need(get, "SLURM_LOCALID", "local rank", l)?;
            let local_world = match parse(get, "SLURM_NTASKS_PER_NODE", "tasks per node")? {
                Some(n) => n,
                None => get("SLURM_TASKS_PER_NODE")
                    .as_deref()
                    .and_then(slurm_tasks_per_node)
                    .unwrap_or(world),
            };
            let node = parse(get, "SLURM_NODEID", "node id")?;
            Ok(Placement::new(
                l,
                rank,
                world,
                local_rank,
                local_world,
                node,
            ))
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            let l = "Open MPI";
            let rank = need(get, "OMPI_COMM_WORLD_RANK", "rank", l)?;
            let world = need(get, "OMPI_COMM_WORLD_SIZE", "world size", l)?;
            let local_rank = need(get, "OMPI_COMM_WORLD_LOCAL_RANK", "local rank", l)?;
            let local_world = need(get, "OMPI_COMM_WORLD_LOCAL_SIZE", "local size", l)?;
            // OMPI_COMM_WORLD_NODE_RANK is the rank on the node, not the
            // node's index: the node follows from the rank (placement by
            // slot), and the rendezvous checks it against the hosts.
            Ok(Placement::new(
                l,
                rank,
                world,
                local_rank,
                local_world,
                None,
            ))
        } else {
            Err(EnvError::Missing)
        }
    }

    fn new(
        launcher: &'static str,
        rank: usize,
        world: usize,
        local_rank: usize,
        local_world: usize,
        node: Option<usize>,
    ) -> Placement {
        Placement {
            launcher,
            rank,
            world,
            local_rank,
            local_world,
            node,
        }
    }

    /// Checks the placement holds together; the node's index
    /// (`ZEROPP_NODE_RANK` first, else the launcher's, else from the rank).
    fn check(&self, get: &dyn Fn(&str) -> Option<String>) -> Result<usize, EnvError> {
        let (launcher, rank, world_size) = (self.launcher, self.rank, self.world);
        let (local_rank, local_world_size) = (self.local_rank, self.local_world);
        if world_size == 0 || rank >= world_size {
            return Err(EnvError::Inconsistent(format!(
                "rank {rank} is outside the world size {world_size} ({launcher} variables)"
            )));
        }
        if local_world_size == 0 || local_rank >= local_world_size {
            return Err(EnvError::Inconsistent(format!(
                "local rank {local_rank} is outside the local world size {local_world_size} \
                 ({launcher} variables)"
            )));
        }
        if !world_size.is_multiple_of(local_world_size) {
            return Err(EnvError::Inconsistent(format!(
                "world size {world_size} is not a multiple of {local_world_size} ranks per node; \
                 zeropp needs the same number of ranks on every node"
            )));
        }
        let node_rank = match parse(get, "ZEROPP_NODE_RANK", "node rank")? {
            Some(n) => n,
            None => self.node.unwrap_or(rank / local_world_size),
        };
        if node_rank >= world_size / local_world_size {
            return Err(EnvError::Inconsistent(format!(
                "node rank {node_rank} is outside the {} nodes of {world_size} ranks / \
                 {local_world_size} per node",
                world_size / local_world_size
            )));
        }
        Ok(node_rank)
    }
}

/// Rank 0's address and port: `MASTER_ADDR` (and `MASTER_PORT`), under
/// Slurm the first host of the step (or the job); required where the job
/// spans `nodes` > 1 otherwise.
fn master(
    get: &dyn Fn(&str) -> Option<String>,
    launcher: &str,
    nodes: usize,
) -> Result<(String, u16), EnvError> {
    let slurm_first_host = match get("SLURM_STEP_NODELIST").or_else(|| get("SLURM_JOB_NODELIST")) {
        Some(list) if launcher == "Slurm" => Some(
            super::hostlist::expand(&list)
                .map_err(|e| EnvError::Inconsistent(e.to_string()))?
                .swap_remove(0),
        ),
        _ => None,
    };
    let master = get("MASTER_ADDR")
        .or(slurm_first_host)
        .unwrap_or_else(|| "127.0.0.1".into());
    if nodes > 1 && get("MASTER_ADDR").is_none() && launcher != "Slurm" {
        return Err(EnvError::Inconsistent(
            "MASTER_ADDR is not set, and this job spans several nodes: set it to the host \
             of rank 0 on every rank"
                .into(),
        ));
    }
    let (master_addr, port_in_addr) = split_host_port(&master)?;
    let master_port = match parse(get, "MASTER_PORT", "port")? {
        Some(p) => p,
        None => port_in_addr.unwrap_or(DEFAULT_PORT),
    };
    Ok((master_addr, master_port))
}

/// What a network wait's limit must be (`--timeout`, `ZEROPP_TIMEOUT_S`,
/// `timeout_s=`).
pub const WAIT_LIMIT: &str = "a positive number of seconds, at most 1e9";

/// `s` seconds, where that is a time a wait can add to now: finite, not
/// negative, at most 1e9 (31 years; `Instant + Duration` panics past what
/// the clock holds).
pub fn seconds(s: f64) -> Option<Duration> {
    Duration::try_from_secs_f64(s).ok().filter(|_| s <= 1e9)
}

/// A network wait's limit of `s` seconds, where that is one ([`seconds`],
/// not zero); the one rule for every place a user gives it.
pub fn wait_limit(s: f64) -> Option<Duration> {
    seconds(s).filter(|d| !d.is_zero())
}

/// Every network wait's limit: `ZEROPP_TIMEOUT_S`, else the default.
fn timeout(get: &dyn Fn(&str) -> Option<String>) -> Result<Duration, EnvError> {
    match parse::<f64>(get, "ZEROPP_TIMEOUT_S", "number of seconds")? {
        Some(s) => wait_limit(s).ok_or_else(|| EnvError::Invalid {
            name: "ZEROPP_TIMEOUT_S".into(),
            value: s.to_string(),
            what: &WAIT_LIMIT[2..],
        }),
        None => Ok(DEFAULT_TIMEOUT),
    }
}

impl RankFacts {
    /// Reads the facts from the process environment.
    pub fn from_env() -> Result<RankFacts, EnvError> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Reads the facts through `get` (tests pass a map).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<RankFacts, EnvError> {
        let p = Placement::from_launcher(get)?;
        let node_rank = p.check(get)?;
        let (master_addr, master_port) = master(get, p.launcher, p.world / p.local_world)?;
        // torchrun's workers set TORCHELASTIC_*: its agent holds
        // MASTER_PORT with the store zeropp then joins.
        let torch_store = match get("TORCHELASTIC_RUN_ID") {
            Some(run) if p.launcher == "torchrun-style" => Some(format!(
                "{run}/{}",
                get("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())
            )),
            _ => None,
        };
        let launcher = if torch_store.is_some() {
            "torchrun"
        } else {
            p.launcher
        };
        // zeropp launch --islands holds the job's store (one per launch).
        let store = get("ZEROPP_STORE").filter(|s| !s.is_empty());
        if let Some(s) = &store
            && !matches!(split_host_port(s), Ok((_, Some(_))))
        {
            return Err(EnvError::Invalid {
                name: "ZEROPP_STORE".into(),
                value: s.clone(),
                what: "host:port of the job's store",
            });
        }
        // The launcher's store is reachable by whoever reaches its port:
        // this job's keys live under a name only the token's holders derive
        // (the store lists no keys), as the token guards rank 0's own store.
        let torch_store = torch_store.or_else(|| {
            let token = get("ZEROPP_TOKEN").unwrap_or_default();
            store
                .as_ref()
                .map(|_| format!("job/{:016x}", fnv1a(token.as_bytes())))
        });
        let token = match get("ZEROPP_TOKEN") {
            Some(t) if !t.is_empty() => t,
            // Drawn by rank 0 and shared through torchrun's store.
            _ if p.world == 1 || torch_store.is_some() => String::new(),
            _ => {
                return Err(EnvError::Inconsistent(
                    "ZEROPP_TOKEN is not set: set it to the same secret on every rank \
                     (for example `export ZEROPP_TOKEN=$(openssl rand -hex 16)` before srun or \
                     mpirun); `zeropp launch` sets it for you"
                        .into(),
                ));
            }
        };
        let islands = parse::<usize>(get, "ZEROPP_ISLANDS", "number of islands")?.unwrap_or(1);
        let rejoin = get("ZEROPP_REJOIN").is_some_and(|v| v == "1");
        let attempt =
            parse::<usize>(get, "ZEROPP_ATTEMPT", "start count")?.unwrap_or(usize::from(rejoin));
        let restarts = parse::<usize>(get, "ZEROPP_RESTARTS", "restart count")?.unwrap_or(0);
        Ok(RankFacts {
            rank: p.rank,
            world_size: p.world,
            local_rank: p.local_rank,
            local_world_size: p.local_world,
            node_rank,
            master_addr,
            master_port,
            token,
            timeout: timeout(get)?,
            launcher,
            torch_store,
            islands: islands.max(1),
            rejoin,
            store,
            attempt,
            restarts,
        })
    }

    /// Nodes in the job.
    pub fn nodes(&self) -> usize {
        self.world_size / self.local_world_size
    }

    /// Whether the launcher starts this job's lost islands again.
    pub fn islands_restart(&self) -> bool {
        self.islands > 1 && self.restarts > 0
    }

    /// The ranks of this rank's island (the whole job without islands).
    pub fn island_ranks(&self) -> std::ops::Range<usize> {
        let size = self.world_size / self.islands.max(1);
        let first = self.rank / size.max(1) * size;
        first..first + size
    }
}

/// FNV-1a, 64 bits: a name derived from a secret (not a MAC: it keeps
/// keys unguessable to those without the secret, in a store that lists
/// none).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `host`, `host:port`, `[v6]:port` → host and optional port.
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>), EnvError> {
    let bad = || EnvError::Invalid {
        name: "MASTER_ADDR".into(),
        value: s.into(),
        what: "host or host:port",
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').ok_or_else(bad)?;
        let port = match tail.strip_prefix(':') {
            Some(p) => Some(p.parse().map_err(|_| bad())?),
            None if tail.is_empty() => None,
            None => return Err(bad()),
        };
        return Ok((host.into(), port));
    }
    match s.matches(':').count() {
        0 if !s.is_empty() => Ok((s.into(), None)),
        1 => {
            let (h, p) = s.split_once(':').ok_or_else(bad)?;
            if h.is_empty() {
                return Err(bad());
            }
            Ok((h.into(), Some(p.parse().map_err(|_| bad())?)))
        }
        _ if s.parse::<std::net::Ipv6Addr>().is_ok() => Ok((s.into(), None)),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn facts(vars: &[(&str, &str)]) -> Result<RankFacts, EnvError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RankFacts::from_lookup(&move |k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_slurm_and_open_mpi_variables() {
        let t = facts(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("ZEROPP_TOKEN", "s3cret"),
        ])
        .unwrap();
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.node_rank, t.nodes()),
            (5, 8, 1, 1, 2)
        );
        assert_eq!((t.master_addr.as_str(), t.master_port), ("10.0.0.1", 1234));

        let s = facts(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("MASTER_ADDR", "node01:4000"),
            ("ZEROPP_TOKEN", "x"),
        ])
        .unwrap();
        assert_eq!(
            (s.rank, s.local_world_size, s.node_rank, s.master_port),
            (3, 2, 1, 4000)
        );
        assert_eq!(s.launcher, "Slurm");

        let o = facts(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "[fe80::1]:99"),
            ("ZEROPP_TOKEN", "x"),
        ])
        .unwrap();
        assert_eq!(
            (o.node_rank, o.master_addr.as_str(), o.master_port),
            (1, "fe80::1", 99)
        );
    }

    /// What `torchrun --standalone --nproc-per-node 4` (torch 2.15) sets for
    /// rank 2 (a subset): no ZEROPP_TOKEN needed, the store is torchrun's.
    #[test]
    fn torchrun_joins_its_agents_store() {
        let t = facts(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "none"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ])
        .unwrap();
        assert_eq!(t.launcher, "torchrun");
        assert_eq!(t.torch_store.as_deref(), Some("none/0"));
        assert!(t.token.is_empty());
        // Hand-set torchrun-style variables still need the token.
        let plain = facts(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert!(plain.unwrap_err().to_string().contains("ZEROPP_TOKEN"));
    }

    /// What `mpirun -np 4` (Open MPI 4.1, one host) sets for rank 1:
    /// OMPI_COMM_WORLD_NODE_RANK is the rank on the node.
    #[test]
    fn open_mpi_node_rank_is_not_the_nodes_index() {
        let o = facts(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_COMM_WORLD_NODE_RANK", "1"),
            ("ZEROPP_TOKEN", "x"),
        ])
        .unwrap();
        assert_eq!((o.node_rank, o.nodes(), o.local_rank), (0, 1, 1));
        // 2 hosts x 2 (--map-by slot): rank 3 is local rank 1 of node 1.
        let o = facts(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_COMM_WORLD_NODE_RANK", "1"),
            ("MASTER_ADDR", "h0"),
            ("ZEROPP_TOKEN", "x"),
        ])
        .unwrap();
        assert_eq!((o.node_rank, o.nodes()), (1, 2));
    }

    /// A two-node `srun -N 2 -n 4` step typed on a login node: rank 0 runs
    /// on the first host of the step's nodelist, not on the login node.
    #[test]
    fn slurm_rendezvous_is_the_first_host_of_the_step() {
        let vars = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[01-04,07]"),
            ("SLURM_STEP_NODELIST", "gpu[03-04]"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.1.0.5"),
            ("ZEROPP_TOKEN", "x"),
        ];
        let s = facts(&vars).unwrap();
        assert_eq!((s.master_addr.as_str(), s.master_port), ("gpu03", 29500));
        let mut job_only = vars.to_vec();
        job_only.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        assert_eq!(facts(&job_only).unwrap().master_addr, "gpu01");
        let mut with_master = vars.to_vec();
        with_master.push(("MASTER_ADDR", "head:7000"));
        let m = facts(&with_master).unwrap();
        assert_eq!((m.master_addr.as_str(), m.master_port), ("head", 7000));
        let mut bad = vars.to_vec();
        bad.retain(|(k, _)| *k != "SLURM_STEP_NODELIST");
        bad.retain(|(k, _)| *k != "SLURM_JOB_NODELIST");
        bad.push(("SLURM_JOB_NODELIST", "gpu[01-"));
        assert!(facts(&bad).unwrap_err().to_string().contains("unbalanced"));
    }

    #[test]
    fn inconsistent_facts_are_errors_that_say_what_is_wrong() {
        assert_eq!(facts(&[]), Err(EnvError::Missing));
        let base = [
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("ZEROPP_TOKEN", "t"),
        ];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            facts(&v).unwrap_err().to_string()
        };
        assert!(with(&[("RANK", "4")]).contains("outside the world size 4"));
        assert!(with(&[("RANK", "1"), ("LOCAL_RANK", "2")]).contains("local rank 2"));
        assert!(with(&[("RANK", "x")]).contains("RANK=\"x\""));
        assert!(with(&[("RANK", "1"), ("ZEROPP_TIMEOUT_S", "-1")]).contains("ZEROPP_TIMEOUT_S"));
        // Past what a clock holds: refused, not a panic at the first wait.
        assert!(with(&[("RANK", "1"), ("ZEROPP_TIMEOUT_S", "1e30")]).contains("at most 1e9"));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e30] {
            assert_eq!(wait_limit(bad), None, "{bad}");
        }
        assert_eq!(wait_limit(0.5), Some(Duration::from_millis(500)));
        assert_eq!(seconds(0.0), Some(Duration::ZERO));
        let odd = facts(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "6"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
            ("ZEROPP_TOKEN", "t"),
        ]);
        assert!(odd.unwrap_err().to_string().contains("not a multiple"));
        let no_token = facts(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]);
        assert!(no_token.unwrap_err().to_string().contains("ZEROPP_TOKEN"));
        let no_master = facts(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("ZEROPP_TOKEN", "t"),
        ]);
        assert!(no_master.unwrap_err().to_string().contains("MASTER_ADDR"));
    }
}
