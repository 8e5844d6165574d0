//! A client of PyTorch's c10d `TCPStore` — the store torchrun's agent
//! serves at `MASTER_ADDR:MASTER_PORT` for its workers — so that ranks
//! started by torchrun rendezvous through it instead of opening a port of
//! their own (that port is the agent's: zeropp's own store cannot take it);
//! and a server of the same wire ([`StoreServer`]), which `zeropp launch
//! --islands` holds for a job of islands, so that the job's store outlives
//! any rank (a restarted island 0 rejoins) and torch's own `TCPStore`
//! client reaches it (`ZEROPP_STORE`).
//!
//! The wire (torch 2.x): a connection starts with `VALIDATE` and the magic
//! number, then a `PING` whose nonce the server echoes. Commands are one
//! byte, strings and byte arrays a little-endian u64 length and the bytes:
//! `SET key value`; `WAIT n key...` → one byte (0: ready) — on timeout the
//! client sends `CANCEL_WAIT` and reads the server's answer(s); `GET key`
//! → length and value; `ADD key i64` → i64; `COMPARE_SET key expected
//! desired` → the value now; `CHECK n key...` → one byte (0: all set);
//! `GETNUMKEYS` → i64; `DELETE_KEY key` → i64 (deleted); `APPEND key
//! bytes`; `MULTI_GET n key...` → each value; `MULTI_SET n (key value)...`.
//! Python's `TCPStore` prefixes keys with `/`; zeropp's keys live under
//! `/zeropp/`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::CommError;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const GETNUMKEYS: u8 = 7;
const DELETE_KEY: u8 = 8;
const APPEND: u8 = 9;
const MULTI_GET: u8 = 10;
const MULTI_SET: u8 = 11;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const MAGIC: u32 = 0x3C85_F7CE;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
const READY: u8 = 0;
const NOT_READY: u8 = 1;
/// A value larger than this is refused (facts are small).
const MAX_VALUE: u64 = 64 << 20;
/// A command naming more keys than this is refused (the server's).
const MAX_KEYS: u64 = 1 << 20;

/// One connection to a `TCPStore`.
pub struct TorchStore {
    stream: TcpStream,
    addr: SocketAddr,
}

fn io(addr: SocketAddr) -> impl Fn(std::io::Error) -> CommError {
    move |e| CommError::Io {
        what: format!("the store at {addr} (torchrun's agent's, or zeropp launch's)"),
        source: e,
    }
}

fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    buf.extend_from_slice(&(b.len() as u64).to_le_bytes());
    buf.extend_from_slice(b);
}

impl TorchStore {
    /// Connects (retrying until `timeout`: the agent may still be starting)
    /// and validates the connection.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<TorchStore, CommError> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("torch's store at {addr} not reachable yet: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => {
                    return Err(CommError::Join(format!(
                        "cannot reach the job's store at {addr} within {timeout:?}: {e}; torchrun's \
                         agent or node 0's `zeropp launch --islands` holds it (ZEROPP_STORE); \
                         check MASTER_ADDR/MASTER_PORT"
                    )));
                }
            }
        };
        stream.set_nodelay(true).map_err(io(addr))?;
        stream.set_read_timeout(Some(timeout)).map_err(io(addr))?;
        let mut s = TorchStore { stream, addr };
        let nonce = std::process::id();
        let mut hello = vec![VALIDATE];
        hello.extend_from_slice(&MAGIC.to_le_bytes());
        hello.push(PING);
        hello.extend_from_slice(&nonce.to_le_bytes());
        s.send(&hello)?;
        let echoed = u32::from_le_bytes(s.read_array()?);
        if echoed != nonce {
            return Err(CommError::Malformed(format!(
                "{addr} answered the store's ping with {echoed:#x}, not {nonce:#x}: is it \
                 a TCPStore (torchrun's agent's, or zeropp launch's)?"
            )));
        }
        Ok(s)
    }

    fn send(&mut self, b: &[u8]) -> Result<(), CommError> {
        self.stream.write_all(b).map_err(io(self.addr))
    }

    fn read_array<const N: usize>(&mut self) -> Result<[u8; N], CommError> {
        let mut b = [0u8; N];
        self.stream.read_exact(&mut b).map_err(io(self.addr))?;
        Ok(b)
    }

    /// Says the connection is alive (the server echoes a nonce).
    pub fn ping(&mut self) -> Result<(), CommError> {
        let mut b = vec![PING];
        b.extend_from_slice(&7u32.to_le_bytes());
        self.send(&b)?;
        match u32::from_le_bytes(self.read_array()?) {
            7 => Ok(()),
            other => Err(CommError::Malformed(format!(
                "{} answered a ping with {other:#x}",
                self.addr
            ))),
        }
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let mut b = vec![SET];
        put_bytes(&mut b, key.as_bytes());
        put_bytes(&mut b, value);
        self.send(&b)
    }

    /// Waits until every key exists, up to `timeout`.
    pub fn wait(&mut self, keys: &[String], timeout: Duration) -> Result<(), CommError> {
        let mut b = vec![WAIT];
        b.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut b, k.as_bytes());
        }
        self.send(&b)?;
        self.stream
            .set_read_timeout(Some(timeout))
            .map_err(io(self.addr))?;
        let mut r = [0u8; 1];
        match self.stream.read_exact(&mut r) {
            Ok(()) if r[0] == STOP_WAITING => return Ok(()),
            Ok(()) => {
                return Err(CommError::Malformed(format!(
                    "torch's store answered a wait with {}",
                    r[0]
                )));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(io(self.addr)(e)),
        }
        // Timed out: cancel, then read the server's answer (it may have
        // answered the wait just before the cancel).
        self.stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(io(self.addr))?;
        self.send(&[CANCEL_WAIT])?;
        let mut answer = self.read_array::<1>()?[0];
        if answer == STOP_WAITING {
            answer = self.read_array::<1>()?[0];
        }
        if answer != WAIT_CANCELED {
            return Err(CommError::Malformed(format!(
                "torch's store answered a cancelled wait with {answer}"
            )));
        }
        Err(CommError::Join(format!(
            "timed out after {timeout:?} waiting in the job's store for {} key(s) such as {:?}: \
             a rank did not arrive (raise ZEROPP_TIMEOUT_S if it is just slow)",
            keys.len(),
            keys.first().map(String::as_str).unwrap_or("")
        )))
    }

    /// Whether every key is set (without waiting).
    pub fn check(&mut self, keys: &[String]) -> Result<bool, CommError> {
        let mut b = vec![CHECK];
        b.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut b, k.as_bytes());
        }
        self.send(&b)?;
        match self.read_array::<1>()?[0] {
            READY => Ok(true),
            NOT_READY => Ok(false),
            other => Err(CommError::Malformed(format!(
                "torch's store answered a check with {other}"
            ))),
        }
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.wait(&[key.to_string()], timeout)?;
        let mut b = vec![GET];
        put_bytes(&mut b, key.as_bytes());
        self.send(&b)?;
        let len = u64::from_le_bytes(self.read_array()?);
        if len > MAX_VALUE {
            return Err(CommError::Malformed(format!(
                "torch's store holds {len} bytes under {key:?}; zeropp's facts are small"
            )));
        }
        let mut v = vec![0u8; len as usize];
        self.stream.read_exact(&mut v).map_err(io(self.addr))?;
        Ok(v)
    }
}

/// The keys, and the waits not answered yet.
#[derive(Default)]
struct Keys {
    values: std::collections::HashMap<Vec<u8>, Vec<u8>>,
    waits: Vec<Waiting>,
    /// The connection that last set each [`HELD`] key: its end removes
    /// the key unless another set it since.
    held_by: std::collections::HashMap<Vec<u8>, u64>,
}

/// A connection's `WAIT` for keys not all set yet.
struct Waiting {
    connection: u64,
    keys: Vec<Vec<u8>>,
    answer: Arc<Mutex<TcpStream>>,
}

impl Keys {
    fn has_all(&self, keys: &[Vec<u8>]) -> bool {
        keys.iter().all(|k| self.values.contains_key(k))
    }

    /// Sets `key` and answers every wait it completes.
    fn set(&mut self, key: Vec<u8>, value: Vec<u8>) {
        self.values.insert(key, value);
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waits)
            .into_iter()
            .partition(|w| w.keys.iter().all(|k| self.values.contains_key(k)));
        self.waits = waiting;
        for w in ready {
            let mut answer = lock(&w.answer);
            if answer.write_all(&[STOP_WAITING]).is_err() {
                // Gone, or not reading: its reader ends the connection.
                let _ = answer.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A server of torch's `TCPStore` wire (the commands in the module's
/// doc), in memory, for as long as the process lives: `zeropp launch
/// --islands` holds the job's store, which torch's `TCPStore(...,
/// is_master=False)` and [`TorchStore`] reach alike.
pub struct StoreServer {
    addr: SocketAddr,
    keys: Arc<Mutex<Keys>>,
}

/// A key whose name ends so lives only as long as the connection that set
/// it: a launcher of another node says it still runs by holding one. Such
/// a connection must say something (a `PING`) at least every
/// [`HELD_SILENCE`], or it is taken for gone (a host that died sends no
/// end).
pub const HELD: &str = "/held";
pub const HELD_SILENCE: Duration = Duration::from_secs(30);

impl StoreServer {
    /// Listens on `addr` (port 0: any free one) and serves every
    /// connection on a thread of its own.
    pub fn bind(addr: SocketAddr) -> Result<StoreServer, CommError> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            CommError::Join(format!(
                "the job's store cannot listen on {addr}: {e}; pick a free port"
            ))
        })?;
        let addr = listener.local_addr().map_err(io(addr))?;
        let keys = Arc::new(Mutex::new(Keys::default()));
        let served = keys.clone();
        std::thread::spawn(move || {
            let keys = served;
            for (id, conn) in (0u64..).zip(listener.incoming()) {
                let Ok(stream) = conn else {
                    // Out of descriptors, say: not a busy loop.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                };
                let keys = keys.clone();
                std::thread::spawn(move || {
                    let from = stream
                        .peer_addr()
                        .map_or_else(|_| "?".into(), |a| a.to_string());
                    if let Err(e) = serve_connection(stream, &keys, id) {
                        tracing::warn!("the job's store dropped the client at {from}: {e}");
                    }
                    let mut keys = lock(&keys);
                    keys.waits.retain(|w| w.connection != id);
                    let mine: Vec<Vec<u8>> = keys
                        .held_by
                        .iter()
                        .filter(|&(_, &c)| c == id)
                        .map(|(k, _)| k.clone())
                        .collect();
                    for k in mine {
                        keys.held_by.remove(&k);
                        keys.values.remove(&k);
                    }
                });
            }
        });
        Ok(StoreServer { addr, keys })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether `key` is set (read in this process, not over the wire).
    pub fn has(&self, key: &str) -> bool {
        lock(&self.keys).values.contains_key(key.as_bytes())
    }
}

fn bad(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what)
}

fn read_u8(r: &mut impl Read) -> std::io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let len = read_u64(r)?;
    if len > MAX_VALUE {
        return Err(bad(format!(
            "a value of {len} bytes (the most is {MAX_VALUE})"
        )));
    }
    let mut v = vec![0u8; len as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn read_keys(r: &mut impl Read) -> std::io::Result<Vec<Vec<u8>>> {
    let n = read_u64(r)?;
    if n > MAX_KEYS {
        return Err(bad(format!("{n} keys in one command")));
    }
    (0..n).map(|_| read_bytes(r)).collect()
}

/// One client: validated by the magic number, then its commands until it
/// closes the connection. Answers go through `answer`, which a `SET` from
/// another connection also writes when it completes this one's wait.
fn serve_connection(stream: TcpStream, keys: &Mutex<Keys>, id: u64) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    // A client that stops reading is dropped, not waited on (answers to
    // its waits are written under the keys' lock).
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut c = Connection {
        answer: Arc::new(Mutex::new(stream.try_clone()?)),
        reader: stream.try_clone()?,
        r: std::io::BufReader::new(stream),
        keys,
        id,
    };
    let mut magic = [0u8; 4];
    if read_u8(&mut c.r)? != VALIDATE || {
        c.r.read_exact(&mut magic)?;
        u32::from_le_bytes(magic) != MAGIC
    } {
        return Err(bad("not a TCPStore client (no validation)".into()));
    }
    loop {
        match read_u8(&mut c.r) {
            Ok(command) => c.serve(command)?,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// One client's connection, as the store serves it.
struct Connection<'a> {
    r: std::io::BufReader<TcpStream>,
    /// The same socket: its read timeout is set once it holds a key.
    reader: TcpStream,
    /// Where answers go (a wait's answer from another connection's thread).
    answer: Arc<Mutex<TcpStream>>,
    keys: &'a Mutex<Keys>,
    id: u64,
}

impl Connection<'_> {
    fn reply(&self, b: &[u8]) -> std::io::Result<()> {
        lock(&self.answer).write_all(b)
    }

    /// A value's answer: its length, then its bytes.
    fn reply_value(&self, v: &[u8]) -> std::io::Result<()> {
        let mut b = Vec::with_capacity(v.len() + 8);
        put_bytes(&mut b, v);
        self.reply(&b)
    }

    /// Reads and serves one command's arguments and answer.
    fn serve(&mut self, command: u8) -> std::io::Result<()> {
        match command {
            PING => {
                let mut nonce = [0u8; 4];
                self.r.read_exact(&mut nonce)?;
                self.reply(&nonce)
            }
            SET => self.set(),
            COMPARE_SET => self.compare_set(),
            GET => {
                let k = read_bytes(&mut self.r)?;
                let v = lock(self.keys).values.get(&k).cloned().unwrap_or_default();
                self.reply_value(&v)
            }
            ADD => self.add(),
            CHECK => {
                let ks = read_keys(&mut self.r)?;
                let ready = lock(self.keys).has_all(&ks);
                self.reply(&[if ready { READY } else { NOT_READY }])
            }
            WAIT => self.wait(),
            CANCEL_WAIT => {
                lock(self.keys).waits.retain(|w| w.connection != self.id);
                self.reply(&[WAIT_CANCELED])
            }
            GETNUMKEYS => {
                let n = lock(self.keys).values.len() as i64;
                self.reply(&n.to_le_bytes())
            }
            DELETE_KEY => {
                let k = read_bytes(&mut self.r)?;
                let n = i64::from(lock(self.keys).values.remove(&k).is_some());
                self.reply(&n.to_le_bytes())
            }
            APPEND => {
                let (k, more) = (read_bytes(&mut self.r)?, read_bytes(&mut self.r)?);
                let mut keys = lock(self.keys);
                let mut v = keys.values.get(&k).cloned().unwrap_or_default();
                v.extend_from_slice(&more);
                keys.set(k, v);
                Ok(())
            }
            MULTI_GET => self.multi_get(),
            MULTI_SET => self.multi_set(),
            other => Err(bad(format!(
                "command {other}, which this store does not serve (torch's queues are not served)"
            ))),
        }
    }

    fn set(&mut self) -> std::io::Result<()> {
        let (k, v) = (read_bytes(&mut self.r)?, read_bytes(&mut self.r)?);
        let mut keys = lock(self.keys);
        if k.ends_with(HELD.as_bytes()) {
            keys.held_by.insert(k.clone(), self.id);
            // From now on this connection must keep talking.
            self.reader.set_read_timeout(Some(HELD_SILENCE))?;
        }
        keys.set(k, v);
        Ok(())
    }

    fn compare_set(&mut self) -> std::io::Result<()> {
        let (k, expected) = (read_bytes(&mut self.r)?, read_bytes(&mut self.r)?);
        let desired = read_bytes(&mut self.r)?;
        let now = {
            let mut keys = lock(self.keys);
            match keys.values.get(&k) {
                // torch's own servers: a missing key is set only when
                // nothing was expected.
                None if expected.is_empty() => {
                    keys.set(k, desired.clone());
                    desired
                }
                None => expected,
                Some(v) if *v == expected => {
                    keys.set(k, desired.clone());
                    desired
                }
                Some(v) => v.clone(),
            }
        };
        self.reply_value(&now)
    }

    fn add(&mut self) -> std::io::Result<()> {
        let k = read_bytes(&mut self.r)?;
        let mut by = [0u8; 8];
        self.r.read_exact(&mut by)?;
        let sum = {
            let mut keys = lock(self.keys);
            let was = match keys.values.get(&k) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| bad("ADD to a key that holds no number".into()))?,
            };
            let sum = was.wrapping_add(i64::from_le_bytes(by));
            keys.set(k, sum.to_string().into_bytes());
            sum
        };
        self.reply(&sum.to_le_bytes())
    }

    fn wait(&mut self) -> std::io::Result<()> {
        let ks = read_keys(&mut self.r)?;
        let mut keys = lock(self.keys);
        if keys.has_all(&ks) {
            drop(keys);
            return self.reply(&[STOP_WAITING]);
        }
        keys.waits.push(Waiting {
            connection: self.id,
            keys: ks,
            answer: self.answer.clone(),
        });
        Ok(())
    }

    fn multi_get(&mut self) -> std::io::Result<()> {
        let ks = read_keys(&mut self.r)?;
        let mut b = Vec::new();
        {
            let keys = lock(self.keys);
            for k in &ks {
                put_bytes(&mut b, keys.values.get(k).map_or(&[][..], Vec::as_slice));
            }
        }
        self.reply(&b)
    }

    fn multi_set(&mut self) -> std::io::Result<()> {
        let n = read_u64(&mut self.r)?;
        if n > MAX_KEYS {
            return Err(bad(format!("{n} keys in one command")));
        }
        let pairs = (0..n)
            .map(|_| Ok((read_bytes(&mut self.r)?, read_bytes(&mut self.r)?)))
            .collect::<std::io::Result<Vec<_>>>()?;
        let mut keys = lock(self.keys);
        for (k, v) in pairs {
            keys.set(k, v);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> SocketAddr {
        StoreServer::bind("127.0.0.1:0".parse().unwrap())
            .unwrap()
            .addr()
    }

    #[test]
    fn a_wait_ends_when_another_client_sets_the_keys_and_a_timed_out_one_is_cancelled() {
        let addr = server();
        let t = Duration::from_secs(10);
        let mut a = TorchStore::connect(addr, t).unwrap();
        let mut b = TorchStore::connect(addr, t).unwrap();
        // Nothing set: the wait times out, is cancelled, and the
        // connection serves on.
        let err = a
            .wait(&["k".into()], Duration::from_millis(200))
            .unwrap_err();
        assert!(err.to_string().contains("timed out"), "{err}");
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            b.set("k", b"v1").unwrap();
            b.set("j", b"").unwrap();
            b
        });
        a.wait(&["k".into(), "j".into()], t).unwrap();
        assert_eq!(a.get("k", t).unwrap(), b"v1");
        let mut b = setter.join().unwrap();
        b.set("k", b"v2").unwrap();
        // A set has no answer: a ping on the same connection is answered
        // once it is in (connections are not ordered among themselves).
        b.ping().unwrap();
        assert_eq!(a.get("k", t).unwrap(), b"v2");
        assert_eq!(a.get("j", t).unwrap(), b"");
    }

    #[test]
    fn a_held_key_lives_as_long_as_the_connection_that_set_it_last() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let t = Duration::from_secs(10);
        let gone = |key: &str| {
            let until = Instant::now() + t;
            while server.has(key) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(10));
            }
            !server.has(key)
        };
        let mut first = TorchStore::connect(server.addr(), t).unwrap();
        first.set("node1/held", b"1").unwrap();
        first.set("node1/joined", b"1").unwrap();
        first.ping().unwrap();
        assert!(server.has("node1/held"));
        drop(first);
        assert!(gone("node1/held"), "its connection ended: the key goes");
        assert!(server.has("node1/joined"), "an ordinary key stays");
        // A launcher that connects again before its old connection ends:
        // the old one's end leaves the new one's key.
        let mut old = TorchStore::connect(server.addr(), t).unwrap();
        old.set("node2/held", b"1").unwrap();
        old.ping().unwrap();
        let mut new = TorchStore::connect(server.addr(), t).unwrap();
        new.set("node2/held", b"1").unwrap();
        new.ping().unwrap();
        drop(old);
        std::thread::sleep(Duration::from_millis(200));
        assert!(server.has("node2/held"));
        drop(new);
        assert!(gone("node2/held"));
    }

    #[test]
    fn a_caller_that_is_not_a_store_client_is_dropped_and_the_store_serves_on() {
        let addr = server();
        let mut junk = TcpStream::connect(addr).unwrap();
        junk.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut rest = Vec::new();
        // The server closes the connection without answering.
        junk.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(junk.read_to_end(&mut rest).unwrap(), 0);
        // A command naming absurd sizes is refused the same way.
        let mut huge = TcpStream::connect(addr).unwrap();
        let mut b = vec![VALIDATE];
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.push(SET);
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        huge.write_all(&b).unwrap();
        huge.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert_eq!(huge.read_to_end(&mut rest).unwrap(), 0);
        let mut ok = TorchStore::connect(addr, Duration::from_secs(10)).unwrap();
        ok.set("a", b"1").unwrap();
        assert_eq!(ok.get("a", Duration::from_secs(10)).unwrap(), b"1");
    }
}
