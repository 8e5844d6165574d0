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
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::io_err;
use super::mailbox::Mailbox;
use super::pool::BufferPool;
use super::wire::{self, Header, Kind, ReadFrame};
use super::{CommError, SendHandle, Tag, Transport};

/// Settings of a TCP mesh.
#[derive(Clone, Debug)]
pub struct TcpOptions {
    /// Shared secret of the job; peers without it are refused.
    pub token: String,
    /// How long building the mesh may take in all.
    pub connect_timeout: Duration,
    /// How long one write may block on a peer that does not read.
    pub write_timeout: Duration,
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

/// One rank's end of a TCP mesh.
pub struct TcpTransport {
    rank: usize,
    world_size: usize,
    mailbox: Arc<Mailbox>,
    peers: Vec<Option<Peer>>,
}

fn hello_payload(token: &str, world_size: usize) -> Vec<u8> {
    let mut p = (world_size as u64).to_le_bytes().to_vec();
    p.extend_from_slice(token.as_bytes());
    p
}

fn send_hello(
    stream: &mut TcpStream,
    rank: usize,
    token: &str,
    world: usize,
) -> std::io::Result<()> {
    let payload = hello_payload(token, world);
    let header = Header {
        kind: Kind::Hello,
        source: rank as u32,
        tag: 0,
        len: payload.len() as u64,
    };
    wire::write_frame(stream, &header, &payload)
}

/// Reads a `Hello` and returns the caller's rank if its token and world size
/// match.
fn read_hello(
    stream: &mut TcpStream,
    token: &str,
    world_size: usize,
    timeout: Duration,
) -> Result<usize, String> {
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let frame = wire::read_frame(stream).map_err(|e| e.to_string())?;
    let ReadFrame::Frame(header, payload) = frame else {
        return Err("closed before saying hello".into());
    };
    if header.kind != Kind::Hello || payload.len() < 8 {
        return Err("first frame is not a hello".into());
    }
    let their_world = u64::from_le_bytes(payload[..8].try_into().unwrap_or([0; 8])) as usize;
    if &payload[8..] != token.as_bytes() {
        return Err("wrong job token".into());
    }
    if their_world != world_size {
        return Err(format!(
            "rank {} believes the world has {their_world} ranks, this rank {world_size}",
            header.source
        ));
    }
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok(header.source as usize)
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
        let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();

        // Connect to every lower rank (their listeners exist: they bound them
        // before publishing their addresses).
        for (peer, addr) in addresses.iter().enumerate().take(rank) {
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
            send_hello(&mut stream, rank, &options.token, world_size)
                .map_err(io_err(format!("rank {peer} at {addr}")))?;
            let remaining = deadline.saturating_duration_since(Instant::now());
            let answer = read_hello(&mut stream, &options.token, world_size, remaining.max(Duration::from_millis(1)))
                .map_err(|reason| CommError::PeerFailed {
                    peer,
                    reason: format!("refused the connection or answered wrongly ({reason}); is it the same job (token, world size)?"),
                })?;
            if answer != peer {
                return Err(CommError::Join(format!(
                    "the listener at {addr} answered as rank {answer}, expected rank {peer}: \
                     two ranks share one address, or the rendezvous table is wrong"
                )));
            }
            streams[peer] = Some(stream);
        }

        // Accept every higher rank.
        listener
            .set_nonblocking(true)
            .map_err(io_err("the listener"))?;
        let mut missing: usize = world_size - rank - 1;
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
                        Ok(peer) if peer > rank && peer < world_size && streams[peer].is_none() => {
                            send_hello(&mut stream, rank, &options.token, world_size)
                                .map_err(io_err(format!("rank {peer} at {from}")))?;
                            streams[peer] = Some(stream);
                            missing -= 1;
                        }
                        Ok(peer) => tracing::warn!(
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
                            .filter(|&p| streams[p].is_none())
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

        let mailbox = Arc::new(Mailbox::default());
        let mut peers: Vec<Option<Peer>> = (0..world_size).map(|_| None).collect();
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else { continue };
            peers[peer] = Some(Self::start_peer(
                rank, peer, stream, &mailbox, &pool, options,
            )?);
        }
        Ok(TcpTransport {
            rank,
            world_size,
            mailbox,
            peers,
        })
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
        let mut write_half = stream.try_clone().map_err(io_err("a socket"))?;

        let inbox = mailbox.clone();
        let pool = pool.clone();
        let reader = std::thread::Builder::new()
            .name(format!("zeropp-rx-{peer}"))
            .spawn(move || {
                let mut r = BufReader::with_capacity(1 << 16, read_half);
                loop {
                    match wire::read_frame_pooled(&mut r, &pool) {
                        Ok(Some((h, payload))) if h.source as usize == peer => match h.kind {
                            Kind::Data => inbox.deliver(peer, h.tag, payload.into_bytes()),
                            Kind::Goodbye => {
                                inbox.peer_left(peer, "it closed its connections (it finished or shut down)".into());
                                return;
                            }
                            Kind::Hello => {
                                inbox.peer_died(peer, "it sent a second hello: protocol error".into());
                                return;
                            }
                        },
                        Ok(Some((h, _))) => {
                            inbox.peer_died(peer, format!("a frame on its connection claims to come from rank {}", h.source));
                            return;
                        }
                        Ok(None) => {
                            inbox.peer_died(peer, "its connection closed without a goodbye (the process died or was killed)".into());
                            return;
                        }
                        Err(e) => {
                            inbox.peer_died(peer, format!("its connection broke: {e}"));
                            return;
                        }
                    }
                }
            })
            .map_err(io_err("a reader thread"))?;

        let (queue, outgoing) = mpsc::channel::<Outgoing>();
        let failures = mailbox.clone();
        let writer = std::thread::Builder::new()
            .name(format!("zeropp-tx-{peer}"))
            .spawn(move || {
                let mut broken: Option<String> = None;
                for msg in outgoing {
                    if let Some(reason) = &broken {
                        msg.done.complete(Err(reason.clone()));
                        continue;
                    }
                    let header = Header {
                        kind: Kind::Data,
                        source: rank as u32,
                        tag: msg.tag,
                        len: msg.data.len() as u64,
                    };
                    match wire::write_frame(&mut write_half, &header, &msg.data) {
                        Ok(()) => msg.done.complete(Ok(())),
                        Err(e) => {
                            let reason = format!("sending to it failed: {e}");
                            failures.peer_died_unless_leaving(
                                peer,
                                reason.clone(),
                                Duration::from_millis(500),
                            );
                            msg.done.complete(Err(reason.clone()));
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
            })
            .map_err(io_err("a writer thread"))?;
        Ok(Peer {
            queue: Some(queue),
            stream,
            threads: vec![reader, writer],
        })
    }

    fn peer(&self, peer: usize) -> Result<&Peer, CommError> {
        match self.peers.get(peer) {
            Some(Some(p)) => Ok(p),
            _ => Err(CommError::NoSuchRank {
                peer,
                world: self.world_size,
            }),
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Close the queues: writers flush what was posted, say goodbye, end.
        let mut peers: Vec<Peer> = self.peers.iter_mut().filter_map(Option::take).collect();
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
        let done = SendHandle::default();
        let queue = self.peer(peer)?.queue.as_ref().ok_or(CommError::Closed)?;
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
        if peer != self.rank {
            self.peer(peer)?;
        }
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

    fn name(&self) -> &'static str {
        "tcp"
    }
}
