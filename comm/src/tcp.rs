//! The TCP transport: one connection per pair of ranks, a reader thread per
//! connection that files arriving frames into the mailbox, and a writer
//! thread per connection that sends posted buffers in order. Works wherever
//! IP does (one host, namespaces, Ethernet clusters) and needs no library.
//!
//! Connection set-up: every rank binds a listener first and publishes its
//! address (rendezvous); then rank `i` connects to each lower rank and
//! accepts each higher one. The caller's first frame is a `Hello` carrying its
//! rank and the job token; a connection with a wrong token, an unknown rank or
//! a duplicate rank is refused and logged, and the job goes on.

use std::io::BufReader;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::mailbox::Mailbox;
use super::pool::BufferPool;
use super::wire::{self, Header, HelloError, Kind, ReadFrame};
use super::{CommError, SendHandle, Tag, Transport};
use super::{SendFailed, io_err};

/// Settings of a TCP mesh.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// Shared secret of the job; peers without it are refused.
    pub token: String,
    /// How long building the mesh may take in all.
    pub connect_timeout: Duration,
    /// How long one write may block on a peer that does not read.
    pub write_timeout: Duration,
    /// Islands: this rank's island, whose ranks may be restarted and
    /// reconnect ([`Rejoins`]); `None`: a dead rank stays dead.
    pub rejoins: Option<Rejoins>,
}

/// How a rank of a job of islands takes part in rejoins.
#[derive(Clone, Debug)]
pub struct Rejoins {
    /// The ranks of this rank's island.
    pub island: Range<usize>,
    /// This rank is a restarted one joining a running job: it connects to
    /// every rank it can outside its island (a rank that does not answer
    /// is counted dead) and builds its island's part of the mesh anew.
    /// Its hellos while the mesh is built say so: a rank of another island
    /// still building it keeps it out of its collectives until it takes
    /// its island back.
    pub rejoining: bool,
}

struct Outgoing {
    tag: Tag,
    data: Bytes,
    done: SendHandle,
}

struct Peer {
    queue: Option<mpsc::Sender<Outgoing>>,
    stream: TcpStream,
    threads: Vec<JoinHandle<()>>,
}

/// Each peer's connection, `None` for a rank not reached.
type Peers = Arc<Vec<RwLock<Option<Peer>>>>;

/// One rank's end of a TCP mesh.
pub struct TcpTransport {
    rank: usize,
    world_size: usize,
    mailbox: Arc<Mailbox>,
    /// Each peer's connection (replaced when a restarted rank reconnects).
    peers: Peers,
    /// With islands: the thread taking restarted ranks' connections.
    acceptor: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

fn hello_payload(token: &str, world_size: usize) -> Vec<u8> {
    let mut p = (world_size as u64).to_le_bytes().to_vec();
    p.extend_from_slice(token.as_bytes());
    p
}

/// A hello's tag: the caller is a restarted rank of a lost island that
/// asks to rejoin (0: a rank of the job as it started).
const HELLO_RESTARTED: Tag = 1;

/// Sends this rank's hello; `restarted`: it is a restarted rank building
/// its part of the mesh ([`Rejoins::rejoining`]; a rank's answer to a later
/// rejoiner says 0: it is a member by then).
fn send_hello(
    stream: &mut TcpStream,
    (rank, restarted): (usize, bool),
    options: &TcpOptions,
    world: usize,
) -> std::io::Result<()> {
    let payload = hello_payload(&options.token, world);
    let header = Header {
        kind: Kind::Hello,
        source: rank as u32,
        tag: if restarted { HELLO_RESTARTED } else { 0 },
        len: payload.len() as u64,
    };
    wire::write_frame(stream, &header, &payload)
}

/// Whether this rank is a restarted one rejoining a running job.
fn rejoining(options: &TcpOptions) -> bool {
    options.rejoins.as_ref().is_some_and(|r| r.rejoining)
}

/// A checked hello: who sent it, and whether it is a restarted rank.
struct Greeting {
    rank: usize,
    restarted: bool,
}

/// Reads a `Hello` and returns the caller's rank if its token and world size
/// match.
fn read_hello(
    stream: &mut TcpStream,
    token: &str,
    world_size: usize,
    timeout: Duration,
) -> Result<Greeting, HelloError> {
    stream.set_read_timeout(Some(timeout))?;
    let ReadFrame::Frame(header, payload) = wire::read_frame(stream)? else {
        return Err(HelloError::Closed);
    };
    if header.kind != Kind::Hello || payload.len() < 8 {
        return Err(HelloError::NotHello);
    }
    let their_world = u64::from_le_bytes(payload[..8].try_into().unwrap_or([0; 8])) as usize;
    if &payload[8..] != token.as_bytes() {
        return Err(HelloError::WrongToken);
    }
    if their_world != world_size {
        return Err(HelloError::WorldSize {
            rank: header.source as usize,
            theirs: their_world,
            ours: world_size,
        });
    }
    stream.set_read_timeout(None)?;
    Ok(Greeting {
        rank: header.source as usize,
        restarted: header.tag == HELLO_RESTARTED,
    })
}

/// Connects to `peer` at `addr` and trades hellos, retrying until
/// `deadline`.
fn connect_to(
    rank: usize,
    (peer, addr): (usize, &SocketAddr),
    options: &TcpOptions,
    deadline: Instant,
    world_size: usize,
) -> Result<(TcpStream, bool), CommError> {
    loop {
        let mut stream = loop {
            match TcpStream::connect_timeout(addr, Duration::from_secs(5)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("connect to rank {peer} at {addr}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => return Err(io_err(format!("rank {peer} at {addr}"))(e)),
            }
        };
        send_hello(&mut stream, (rank, rejoining(options)), options, world_size)
            .map_err(io_err(format!("rank {peer} at {addr}")))?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        match read_hello(
            &mut stream,
            &options.token,
            world_size,
            remaining.max(Duration::from_millis(1)),
        ) {
            Ok(answer) if answer.rank == peer => return Ok((stream, answer.restarted)),
            Ok(Greeting { rank: answer, .. }) => {
                return Err(CommError::Join(format!(
                    "the listener at {addr} answered as rank {answer}, expected rank {peer}: \
                     two ranks share one address, or the rendezvous table is wrong"
                )));
            }
            // A live rank refuses a restarted one until it has seen its
            // earlier self die: try again.
            Err(_) if rejoining(options) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(reason) => {
                return Err(CommError::PeerFailed {
                    peer,
                    reason: format!(
                        "refused the connection or answered wrongly ({reason}); is it the same \
                         job (token, world size)?"
                    ),
                });
            }
        }
    }
}

/// Accepts the connections of every rank above `rank` that does not
/// connect to it itself (`connects`: the ranks this one connected to), each
/// checked by its hello, into `streams` (with whether the rank said it
/// was restarted), until `deadline`.
fn accept_higher(
    (rank, world_size): (usize, usize),
    listener: &TcpListener,
    options: &TcpOptions,
    deadline: Instant,
    connects: &dyn Fn(usize) -> bool,
    streams: &mut [Option<(TcpStream, bool)>],
) -> Result<(), CommError> {
    listener
        .set_nonblocking(true)
        .map_err(io_err("the listener"))?;
    let mut missing: usize = (rank + 1..world_size).filter(|&p| !connects(p)).count();
    while missing > 0 {
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(io_err("an accepted socket"))?;
                let remaining = deadline.saturating_duration_since(Instant::now());
                match read_hello(
                    &mut stream,
                    &options.token,
                    world_size,
                    remaining.max(Duration::from_millis(1)),
                ) {
                    Ok(Greeting {
                        rank: peer,
                        restarted,
                    }) if peer > rank
                        && peer < world_size
                        && !connects(peer)
                        && streams[peer].is_none() =>
                    {
                        send_hello(&mut stream, (rank, rejoining(options)), options, world_size)
                            .map_err(io_err(format!("rank {peer} at {from}")))?;
                        streams[peer] = Some((stream, restarted));
                        missing -= 1;
                    }
                    Ok(Greeting { rank: peer, .. }) => tracing::warn!(
                        "refused a connection from {from}: it claims rank {peer}, which is \
                         not expected here (duplicate, lower or out of range)"
                    ),
                    Err(reason) => {
                        tracing::warn!("refused a connection from {from}: {reason}")
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let absent: Vec<usize> = (rank + 1..world_size)
                        .filter(|&p| !connects(p) && streams[p].is_none())
                        .collect();
                    return Err(CommError::Join(format!(
                        "ranks {absent:?} did not connect within {:?}; they failed to start \
                         or cannot reach this host",
                        options.connect_timeout
                    )));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io_err("the listener")(e)),
        }
    }
    Ok(())
}

impl TcpTransport {
    /// Builds the mesh. `listener` is this rank's bound listener (its address
    /// is `addresses[rank]`); `addresses` lists every rank's listener.
    pub fn connect(
        rank: usize,
        addresses: &[SocketAddr],
        listener: TcpListener,
        options: &TcpOptions,
    ) -> Result<Self, CommError> {
        let pool = BufferPool::from_env()?;
        let world_size = addresses.len();
        if rank >= world_size {
            return Err(CommError::NoSuchRank {
                peer: rank,
                world: world_size,
            });
        }
        let deadline = Instant::now() + options.connect_timeout;
        let mut streams: Vec<Option<(TcpStream, bool)>> = (0..world_size).map(|_| None).collect();

        // A rejoining rank connects to every rank outside its island too
        // (they take restarted ranks on their acceptor thread); the ranks
        // of another island that do not answer are dead.
        let rejoining = options.rejoins.as_ref().filter(|r| r.rejoining);
        let connects = |p: usize| p < rank || rejoining.is_some_and(|r| !r.island.contains(&p));
        let mut unreachable: Vec<(usize, String)> = Vec::new();
        // Connect to every lower rank (their listeners exist: they bound them
        // before publishing their addresses).
        for (peer, addr) in addresses.iter().enumerate() {
            if peer == rank || !connects(peer) {
                continue;
            }
            let outside = rejoining.is_some_and(|r| !r.island.contains(&peer));
            // A rank of a lost island is not waited for long.
            let until = if outside {
                deadline.min(Instant::now() + Duration::from_secs(10))
            } else {
                deadline
            };
            match connect_to(rank, (peer, addr), options, until, world_size) {
                Ok(connected) => streams[peer] = Some(connected),
                Err(e) if outside => {
                    tracing::warn!("rejoining: rank {peer} at {addr} did not take us ({e})");
                    unreachable.push((
                        peer,
                        format!("it did not answer when this island rejoined ({e})"),
                    ));
                }
                Err(e) => return Err(e),
            }
        }

        // Accept every higher rank (a rejoining rank: those of its island).
        accept_higher(
            (rank, world_size),
            &listener,
            options,
            deadline,
            &connects,
            &mut streams,
        )?;

        let mailbox = Arc::new(Mailbox::default());
        for (peer, why) in unreachable {
            mailbox.peer_died(peer, why);
        }
        let mut peers: Vec<RwLock<Option<Peer>>> = Vec::with_capacity(world_size);
        for (peer, stream) in streams.into_iter().enumerate() {
            peers.push(RwLock::new(match stream {
                Some((stream, restarted)) => {
                    if restarted
                        && options
                            .rejoins
                            .as_ref()
                            .is_some_and(|r| !r.island.contains(&peer))
                    {
                        // A restarted rank of another island, rejoining,
                        // reached this rank while it still built the mesh:
                        // it asks to rejoin, and is in no collective until
                        // its island is taken back — a wait on it fails at
                        // once, not at the timeout.
                        mailbox.revive(peer);
                        tracing::info!(
                            "rank {peer} is a restarted rank of its island: it asks to rejoin"
                        );
                    }
                    Some(Self::start_peer(
                        rank, peer, stream, &mailbox, &pool, options,
                    )?)
                }
                None => None,
            }));
        }
        let peers = Arc::new(peers);
        let acceptor = match &options.rejoins {
            Some(_) => Some(Self::accept_rejoins(
                rank,
                listener,
                (&peers, &mailbox, &pool),
                options,
                world_size,
            )?),
            None => None,
        };
        Ok(TcpTransport {
            rank,
            world_size,
            mailbox,
            peers,
            acceptor,
        })
    }

    /// Islands: a thread that takes the connection of a restarted rank
    /// whose earlier connection died, in its place.
    fn accept_rejoins(
        rank: usize,
        listener: TcpListener,
        (peers, mailbox, pool): (&Peers, &Arc<Mailbox>, &Arc<BufferPool>),
        options: &TcpOptions,
        world_size: usize,
    ) -> Result<(Arc<AtomicBool>, JoinHandle<()>), CommError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (peers, mailbox, pool, options) = (
            peers.clone(),
            mailbox.clone(),
            pool.clone(),
            options.clone(),
        );
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("zeropp-rejoins".into())
            .spawn(move || {
                while !stopping.load(Ordering::Relaxed) {
                    let (mut stream, from) = match listener.accept() {
                        Ok(c) => c,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!("the rejoin listener failed: {e}");
                            return;
                        }
                    };
                    let _ = stream.set_nonblocking(false);
                    let hello = read_hello(
                        &mut stream,
                        &options.token,
                        world_size,
                        Duration::from_secs(10),
                    );
                    let peer = match hello {
                        Ok(Greeting { rank: p, .. })
                            if p != rank && p < world_size && mailbox.is_gone(p) =>
                        {
                            p
                        }
                        Ok(Greeting { rank: p, .. }) => {
                            tracing::warn!(
                                "refused a connection from {from} claiming rank {p}: that rank's \
                                 connection is alive"
                            );
                            continue;
                        }
                        Err(reason) => {
                            tracing::warn!("refused a connection from {from}: {reason}");
                            continue;
                        }
                    };
                    if let Err(e) = send_hello(&mut stream, (rank, false), &options, world_size) {
                        tracing::warn!("rank {peer} reconnecting from {from}: {e}");
                        continue;
                    }
                    // Its earlier self's leftovers go before the new
                    // connection delivers anything.
                    mailbox.revive(peer);
                    match Self::start_peer(rank, peer, stream, &mailbox, &pool, &options) {
                        Ok(new) => {
                            let old = peers[peer]
                                .write()
                                .unwrap_or_else(|p| p.into_inner())
                                .replace(new);
                            drop(old);
                            tracing::info!("rank {peer} rejoined from {from}");
                        }
                        Err(e) => {
                            mailbox.peer_died(peer, format!("its new connection failed: {e}"));
                        }
                    }
                }
            })
            .map_err(io_err("the rejoin thread"))?;
        Ok((stop, thread))
    }

    fn start_peer(
        rank: usize,
        peer: usize,
        stream: TcpStream,
        mailbox: &Arc<Mailbox>,
        pool: &Arc<BufferPool>,
        options: &TcpOptions,
    ) -> Result<Peer, CommError> {
        stream.set_nodelay(true).map_err(io_err("a socket"))?;
        stream
            .set_write_timeout(Some(options.write_timeout))
            .map_err(io_err("a socket"))?;
        let read_half = stream.try_clone().map_err(io_err("a socket"))?;
        let write_half = stream.try_clone().map_err(io_err("a socket"))?;

        let (inbox, pool) = (mailbox.clone(), pool.clone());
        let reader = std::thread::Builder::new()
            .name(format!("zeropp-rx-{peer}"))
            .spawn(move || read_from(peer, read_half, &inbox, &pool))
            .map_err(io_err("a reader thread"))?;
        let (queue, outgoing) = mpsc::channel::<Outgoing>();
        let failures = mailbox.clone();
        let writer = std::thread::Builder::new()
            .name(format!("zeropp-tx-{peer}"))
            .spawn(move || write_to(rank, peer, write_half, outgoing, &failures))
            .map_err(io_err("a writer thread"))?;
        Ok(Peer {
            queue: Some(queue),
            stream,
            threads: vec![reader, writer],
        })
    }

    fn check(&self, peer: usize) -> Result<(), CommError> {
        if peer < self.world_size {
            Ok(())
        } else {
            Err(CommError::NoSuchRank {
                peer,
                world: self.world_size,
            })
        }
    }
}

/// A peer's reader thread: files each frame from `peer` in the mailbox
/// until its goodbye, or records why its connection ended.
fn read_from(peer: usize, read_half: TcpStream, inbox: &Mailbox, pool: &Arc<BufferPool>) {
    let mut r = BufReader::with_capacity(1 << 16, read_half);
    loop {
        let why = match wire::read_frame_pooled(&mut r, pool) {
            Ok(Some((h, payload))) if h.source as usize == peer => match h.kind {
                Kind::Data => {
                    inbox.deliver(peer, h.tag, payload.into_bytes());
                    continue;
                }
                Kind::Goodbye => {
                    let why = "it closed its connections (it finished or shut down)";
                    inbox.peer_left(peer, why.into());
                    return;
                }
                Kind::Hello => "it sent a second hello: protocol error".to_string(),
            },
            Ok(Some((h, _))) => format!(
                "a frame on its connection claims to come from rank {}",
                h.source
            ),
            Ok(None) => "its connection closed without a goodbye (the process died or was killed)"
                .to_string(),
            Err(e) => format!("its connection broke: {e}"),
        };
        inbox.peer_died(peer, why);
        return;
    }
}

/// A peer's writer thread: writes each queued message to `peer`, then a
/// goodbye once the queue closes; after a failed write every later send
/// fails with the same reason.
fn write_to(
    rank: usize,
    peer: usize,
    mut write_half: TcpStream,
    outgoing: mpsc::Receiver<Outgoing>,
    failures: &Mailbox,
) {
    let mut broken: Option<String> = None;
    for msg in outgoing {
        if let Some(reason) = &broken {
            msg.done.complete(Err(SendFailed(reason.clone())));
            continue;
        }
        let header = Header {
            kind: Kind::Data,
            source: rank as u32,
            tag: msg.tag,
            len: msg.data.len() as u64,
        };
        let written = wire::write_frame(&mut write_half, &header, &msg.data);
        // The bytes let go before the send completes: a reused buffer is
        // back in its pool when the sender's wait ends.
        let Outgoing { data, done, .. } = msg;
        drop(data);
        match written {
            Ok(()) => done.complete(Ok(())),
            Err(e) => {
                let reason = format!("sending to it failed: {e}");
                failures.peer_died_unless_leaving(peer, reason.clone(), Duration::from_millis(500));
                done.complete(Err(SendFailed(reason.clone())));
                broken = Some(reason);
            }
        }
    }
    // The queue closed: say goodbye so the peer knows this was on purpose.
    if broken.is_none() {
        let bye = Header {
            kind: Kind::Goodbye,
            source: rank as u32,
            tag: 0,
            len: 0,
        };
        let _ = wire::write_frame(&mut write_half, &bye, &[]);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.acceptor.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
        // Close the queues: writers flush what was posted, say goodbye, end.
        let mut peers: Vec<Peer> = self
            .peers
            .iter()
            .filter_map(|p| p.write().unwrap_or_else(|p| p.into_inner()).take())
            .collect();
        for p in &mut peers {
            p.queue.take();
        }
        for p in &mut peers {
            if let Some(writer) = p.threads.pop() {
                let _ = writer.join();
            }
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        self.mailbox.close();
        for p in &mut peers {
            for t in p.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn send(&self, peer: usize, tag: Tag, data: Bytes) -> Result<SendHandle, CommError> {
        if peer == self.rank {
            self.mailbox.deliver(peer, tag, data);
            return Ok(SendHandle::done());
        }
        self.check(peer)?;
        let done = SendHandle::default();
        let slot = self.peers[peer].read().unwrap_or_else(|p| p.into_inner());
        let Some(connection) = slot.as_ref() else {
            return Err(CommError::PeerFailed {
                peer,
                reason: "it was not reachable when this rank joined".into(),
            });
        };
        let queue = connection.queue.as_ref().ok_or(CommError::Closed)?;
        queue
            .send(Outgoing {
                tag,
                data,
                done: done.clone(),
            })
            .map_err(|_| CommError::PeerFailed {
                peer,
                reason: "its writer thread has stopped".into(),
            })?;
        Ok(done)
    }

    fn recv(&self, peer: usize, tag: Tag, timeout: Duration) -> Result<Bytes, CommError> {
        self.check(peer)?;
        self.mailbox.take(peer, tag, timeout)
    }

    fn probe(&self, peer: usize, tag: Tag) -> bool {
        self.mailbox.has(peer, tag)
    }

    fn first_death(&self) -> Option<(usize, String)> {
        self.mailbox.first_death()
    }

    fn contain_deaths(&self, fatal: std::ops::Range<usize>) {
        self.mailbox.contain(fatal)
    }

    fn declare_dead(&self, peer: usize, reason: String) {
        self.mailbox.peer_died(peer, reason)
    }

    fn readmit(&self, peer: usize) {
        self.mailbox.readmit(peer)
    }

    fn waiting_from(&self, tag: Tag) -> Vec<usize> {
        self.mailbox.sources_with(tag)
    }

    fn name(&self) -> &'static str {
        "tcp"
    }
}
