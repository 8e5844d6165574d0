//! A client of PyTorch's c10d `TCPStore` — the store torchrun's agent
//! serves at `MASTER_ADDR:MASTER_PORT` for its workers — so that ranks
//! started by torchrun rendezvous through it instead of opening a port of
//! their own (that port is the agent's: zeropp's own store cannot take it).
//!
//! The wire (torch 2.x): a connection starts with `VALIDATE` and the magic
//! number, then a `PING` whose nonce the server echoes. Commands are one
//! byte, strings and byte arrays a little-endian u64 length and the bytes:
//! `SET key value`; `WAIT n key...` → one byte (0: ready) — on timeout the
//! client sends `CANCEL_WAIT` and reads the server's answer(s); `GET key`
//! → length and value; `ADD key i64` → i64. Python's `TCPStore` prefixes
//! keys with `/`; zeropp's keys live under `/zeropp/`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::CommError;

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const WAIT: u8 = 6;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
const MAGIC: u32 = 0x3C85_F7CE;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// A value larger than this is refused (facts are small).
const MAX_VALUE: u64 = 64 << 20;

/// One connection to a `TCPStore`.
pub struct TorchStore {
    stream: TcpStream,
    addr: SocketAddr,
}

fn io(addr: SocketAddr) -> impl Fn(std::io::Error) -> CommError {
    move |e| CommError::Io {
        what: format!("torch's TCPStore at {addr} (torchrun's agent)"),
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
                        "cannot reach torchrun's store at {addr} within {timeout:?}: {e}; \
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
                 torchrun's TCPStore?"
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
            "timed out after {timeout:?} waiting in torchrun's store for {} key(s) such as {:?}: \
             a rank did not arrive (raise ZEROPP_TIMEOUT_S if it is just slow)",
            keys.len(),
            keys.first().map(String::as_str).unwrap_or("")
        )))
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
