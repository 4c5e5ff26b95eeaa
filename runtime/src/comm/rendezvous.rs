//! Process-group set-up over TCP, torchrun style.
//!
//! A multi-process run (one process per rank: per GPU on the CUDA backend, or CPU processes
//! whose collectives go over [`super::tcp`]) has each process learn its place from the environment
//! ([`DistEnv`]: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, as `hzp launch` and torchrun set them). Rank 0 listens on
//! `MASTER_ADDR:MASTER_PORT`; every other rank connects (retrying until the timeout, since
//! rank 0 may start later) and says who it is. After that the group can broadcast bytes from
//! rank 0 (the NCCL unique ids), all-gather small byte strings and meet at barriers.
//!
//! # Wire format
//!
//! Every message is a frame: a 4-byte little-endian length, then that many bytes (at most
//! [`MAX_FRAME`]). A connecting rank sends the hello frame `HZP-RDV1 <rank> <world>`;
//! rank 0 answers `ok` or `error: <why>` (a rank out of range, a second rank with the same
//! number, a different world size). Broadcast: rank 0 sends one frame to each rank. All-gather:
//! each rank sends its frame to rank 0, which sends back the concatenation (a count, then
//! one length-prefixed entry per rank, in rank order). A barrier is an all-gather of nothing.
//! Reads and writes time out ([`Rendezvous::set_timeout`]); errors name the peer rank and
//! the address.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest frame accepted (a guard against a stray connection sending garbage).
pub const MAX_FRAME: usize = 64 << 20;

const HELLO: &str = "HZP-RDV1";

/// Where this process stands in a multi-process run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistEnv {
    /// One process alone: rank 0 of 1.
    pub fn single() -> DistEnv {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    }

    /// Reads the torchrun variables from the process environment (see [`DistEnv::from_lookup`]).
    pub fn from_env() -> Result<DistEnv, String> {
        DistEnv::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
    /// `MASTER_PORT`. None of them set: a single process. `RANK` and `WORLD_SIZE` set: the
    /// rest default as torchrun's would (`LOCAL_RANK` = `RANK`, `LOCAL_WORLD_SIZE` =
    /// `WORLD_SIZE`, `127.0.0.1:29500`). Bad values are errors that name the variable.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<DistEnv, String> {
        let num = |k: &str| -> Result<Option<usize>, String> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
                    format!("environment variable {k}={v:?} is not a non-negative integer")
                }),
            }
        };
        let (rank, world) = (num("RANK")?, num("WORLD_SIZE")?);
        let (rank, world_size) = match (rank, world) {
            (None, None) => {
                if get("LOCAL_RANK").is_some() {
                    return Err("LOCAL_RANK is set but RANK and WORLD_SIZE are not: start the processes with `hzp launch` (or torchrun)".into());
                }
                return Ok(DistEnv::single());
            }
            (Some(r), Some(w)) => (r, w),
            (Some(_), None) => return Err("RANK is set but WORLD_SIZE is not".into()),
            (None, Some(_)) => return Err("WORLD_SIZE is set but RANK is not".into()),
        };
        if world_size == 0 {
            return Err("WORLD_SIZE is 0".into());
        }
        if rank >= world_size {
            return Err(format!("RANK={rank} is not below WORLD_SIZE={world_size}"));
        }
        let local_world_size = num("LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
        let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
        if local_world_size == 0 || local_rank >= local_world_size {
            return Err(format!(
                "LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}"
            ));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        if master_addr.trim().is_empty() {
            return Err("MASTER_ADDR is empty".into());
        }
        let master_port = match get("MASTER_PORT") {
            None => 29500,
            Some(p) => p
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| {
                    format!("environment variable MASTER_PORT={p:?} is not a port number (1-65535)")
                })?,
        };
        Ok(DistEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        })
    }

    pub fn master(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }
}

/// Why the rendezvous failed. Messages name the rank, the peer and the address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousError(pub String);

impl fmt::Display for RendezvousError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RendezvousError {}

type R<T> = Result<T, RendezvousError>;

fn err<T>(s: impl Into<String>) -> R<T> {
    Err(RendezvousError(s.into()))
}

/// A connected process group (see the [module docs](self)).
pub struct Rendezvous {
    rank: usize,
    world: usize,
    master: String,
    /// On rank 0: the stream of rank `i` at index `i - 1`. Elsewhere: the one stream to rank 0.
    peers: Vec<TcpStream>,
    timeout: Duration,
}

fn write_frame(s: &mut TcpStream, data: &[u8]) -> io::Result<()> {
    if data.len() > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a frame of {} bytes exceeds {MAX_FRAME}", data.len()),
        ));
    }
    let mut buf = Vec::with_capacity(4 + data.len());
    buf.extend_from_slice(&(data.len() as u32).to_le_bytes());
    buf.extend_from_slice(data);
    s.write_all(&buf)?;
    s.flush()
}

fn read_frame(s: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the peer announced a frame of {n} bytes (the limit is {MAX_FRAME}): not an hzp rendezvous peer"),
        ));
    }
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn describe(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "timed out".into(),
        io::ErrorKind::UnexpectedEof => "the connection closed (the peer exited?)".into(),
        _ => e.to_string(),
    }
}

fn resolve(addr: &str) -> R<Vec<SocketAddr>> {
    match addr.to_socket_addrs() {
        Ok(a) => {
            let v: Vec<SocketAddr> = a.collect();
            if v.is_empty() {
                err(format!(
                    "MASTER_ADDR:MASTER_PORT {addr} resolves to no address"
                ))
            } else {
                Ok(v)
            }
        }
        Err(e) => err(format!(
            "cannot resolve MASTER_ADDR:MASTER_PORT {addr}: {e}"
        )),
    }
}

impl Rendezvous {
    /// Connects the group of `env` within `timeout` (rank 0 waits that long for everyone;
    /// the others retry connecting that long). A single process needs no network.
    pub fn connect(env: &DistEnv, timeout: Duration) -> R<Rendezvous> {
        let master = env.master();
        let mut rv = Rendezvous {
            rank: env.rank,
            world: env.world_size,
            master: master.clone(),
            peers: Vec::new(),
            timeout,
        };
        if env.world_size == 1 {
            return Ok(rv);
        }
        let deadline = Instant::now() + timeout;
        if env.rank == 0 {
            let addrs = resolve(&master)?;
            let listener = match TcpListener::bind(&addrs[..]) {
                Ok(l) => l,
                Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => {
                    TcpListener::bind(("0.0.0.0", env.master_port)).map_err(|e| {
                        RendezvousError(format!(
                            "rank 0 cannot listen on port {}: {e}",
                            env.master_port
                        ))
                    })?
                }
                Err(e) => {
                    return err(format!(
                    "rank 0 cannot listen on {master}: {e} (is another run using MASTER_PORT {}?)",
                    env.master_port
                ))
                }
            };
            listener
                .set_nonblocking(true)
                .map_err(|e| RendezvousError(format!("rank 0: {e}")))?;
            let mut slots: Vec<Option<TcpStream>> = (1..env.world_size).map(|_| None).collect();
            let mut joined = 0;
            while joined < env.world_size - 1 {
                match listener.accept() {
                    Ok((mut s, peer)) => {
                        s.set_nonblocking(false)
                            .and_then(|_| s.set_nodelay(true))
                            .and_then(|_| s.set_read_timeout(Some(timeout)))
                            .and_then(|_| s.set_write_timeout(Some(timeout)))
                            .map_err(|e| RendezvousError(format!("rank 0: {e}")))?;
                        let hello = match read_frame(&mut s) {
                            Ok(h) => h,
                            // not one of ours (a port scanner, a stale client): ignore it
                            Err(_) => continue,
                        };
                        match check_hello(&hello, env.world_size, &slots) {
                            Ok(r) => {
                                write_frame(&mut s, b"ok").map_err(|e| {
                                    RendezvousError(format!(
                                        "rank 0: answering rank {r} at {peer}: {}",
                                        describe(&e)
                                    ))
                                })?;
                                slots[r - 1] = Some(s);
                                joined += 1;
                            }
                            Err(why) => {
                                let _ = write_frame(&mut s, format!("error: {why}").as_bytes());
                                return err(format!(
                                    "rank 0: a process from {peer} joined the rendezvous at {master} wrongly: {why}"
                                ));
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            let missing: Vec<String> = slots
                                .iter()
                                .enumerate()
                                .filter(|(_, s)| s.is_none())
                                .map(|(i, _)| (i + 1).to_string())
                                .collect();
                            return err(format!(
                                "rank 0: timed out after {:.0} s waiting at {master} for rank(s) {} of {} to join",
                                timeout.as_secs_f64(),
                                missing.join(", "),
                                env.world_size
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => return err(format!("rank 0: accepting at {master}: {e}")),
                }
            }
            rv.peers = slots.into_iter().map(|s| s.expect("all joined")).collect();
        } else {
            let addrs = resolve(&master)?;
            let mut last = String::new();
            let stream = loop {
                let mut got = None;
                for a in &addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    match TcpStream::connect_timeout(a, left.max(Duration::from_millis(50))) {
                        Ok(s) => {
                            got = Some(s);
                            break;
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
                if let Some(s) = got {
                    break s;
                }
                if Instant::now() >= deadline {
                    return err(format!(
                        "rank {}: could not reach rank 0 at {master} within {:.0} s ({last}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same for every rank?",
                        env.rank,
                        timeout.as_secs_f64()
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let mut s = stream;
            s.set_nodelay(true)
                .and_then(|_| s.set_read_timeout(Some(timeout)))
                .and_then(|_| s.set_write_timeout(Some(timeout)))
                .map_err(|e| RendezvousError(format!("rank {}: {e}", env.rank)))?;
            let hello = format!("{HELLO} {} {}", env.rank, env.world_size);
            write_frame(&mut s, hello.as_bytes())
                .and_then(|_| read_frame(&mut s))
                .map_err(|e| {
                    RendezvousError(format!(
                        "rank {}: joining at {master}: {}",
                        env.rank,
                        describe(&e)
                    ))
                })
                .and_then(|answer| {
                    if answer == b"ok" {
                        Ok(())
                    } else {
                        err(format!(
                            "rank {}: rank 0 at {master} refused: {}",
                            env.rank,
                            String::from_utf8_lossy(&answer)
                        ))
                    }
                })?;
            rv.peers = vec![s];
        }
        Ok(rv)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The address of this process on the interface it reaches the group by (rank 0: the
    /// one the others connected to); `None` for a process alone.
    pub fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.peers.first()?.local_addr().ok().map(|a| a.ip())
    }

    /// Timeout of every later read and write.
    pub fn set_timeout(&mut self, t: Duration) -> R<()> {
        self.timeout = t;
        for s in &self.peers {
            s.set_read_timeout(Some(t))
                .and_then(|_| s.set_write_timeout(Some(t)))
                .map_err(|e| RendezvousError(format!("rank {}: {e}", self.rank)))?;
        }
        Ok(())
    }

    fn io_err(&self, peer: usize, what: &str, e: io::Error) -> RendezvousError {
        RendezvousError(format!(
            "rank {}: {what} rank {peer} (rendezvous at {}): {}",
            self.rank,
            self.master,
            describe(&e)
        ))
    }

    /// Rank 0's `data` on every rank. Rank 0 passes `Some`, the others `None`.
    pub fn broadcast(&mut self, data: Option<&[u8]>) -> R<Vec<u8>> {
        if self.rank == 0 {
            let Some(d) = data else {
                return err("rank 0 must pass the data to broadcast");
            };
            for i in 0..self.peers.len() {
                write_frame(&mut self.peers[i], d)
                    .map_err(|e| self.io_err(i + 1, "sending to", e))?;
            }
            Ok(d.to_vec())
        } else if self.world == 1 {
            err("broadcast on one rank needs the data")
        } else {
            read_frame(&mut self.peers[0]).map_err(|e| self.io_err(0, "receiving from", e))
        }
    }

    /// Every rank's `mine`, in rank order, on every rank.
    pub fn all_gather(&mut self, mine: &[u8]) -> R<Vec<Vec<u8>>> {
        if self.world == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for i in 0..self.peers.len() {
                let f = read_frame(&mut self.peers[i])
                    .map_err(|e| self.io_err(i + 1, "receiving from", e))?;
                all.push(f);
            }
            let packed = pack(&all);
            if packed.len() > MAX_FRAME {
                return err(format!(
                    "rank 0: the gathered data ({} bytes) exceeds the frame limit",
                    packed.len()
                ));
            }
            for i in 0..self.peers.len() {
                write_frame(&mut self.peers[i], &packed)
                    .map_err(|e| self.io_err(i + 1, "sending to", e))?;
            }
            Ok(all)
        } else {
            write_frame(&mut self.peers[0], mine).map_err(|e| self.io_err(0, "sending to", e))?;
            let packed =
                read_frame(&mut self.peers[0]).map_err(|e| self.io_err(0, "receiving from", e))?;
            let all = unpack(&packed).ok_or_else(|| {
                RendezvousError(format!(
                    "rank {}: rank 0 sent a malformed gather",
                    self.rank
                ))
            })?;
            if all.len() != self.world {
                return err(format!(
                    "rank {}: rank 0 gathered {} entries for a world of {}",
                    self.rank,
                    all.len(),
                    self.world
                ));
            }
            Ok(all)
        }
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> R<()> {
        self.all_gather(&[]).map(|_| ())
    }
}

fn check_hello(hello: &[u8], world: usize, slots: &[Option<TcpStream>]) -> Result<usize, String> {
    let text = std::str::from_utf8(hello).map_err(|_| "a hello that is not text".to_string())?;
    let mut it = text.split(' ');
    if it.next() != Some(HELLO) {
        return Err(format!(
            "unexpected hello {text:?} (another program, or another hzp version?)"
        ));
    }
    let rank: usize = it
        .next()
        .and_then(|r| r.parse().ok())
        .ok_or_else(|| format!("hello without a rank: {text:?}"))?;
    let w: usize = it
        .next()
        .and_then(|r| r.parse().ok())
        .ok_or_else(|| format!("hello without a world size: {text:?}"))?;
    if w != world {
        return Err(format!(
            "rank {rank} has WORLD_SIZE={w}, rank 0 has WORLD_SIZE={world}"
        ));
    }
    if rank == 0 || rank >= world {
        return Err(format!("rank {rank} is not in 1..{world}"));
    }
    if slots[rank - 1].is_some() {
        return Err(format!("two processes say they are rank {rank}"));
    }
    Ok(rank)
}

fn pack(all: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(all.len() as u32).to_le_bytes());
    for a in all {
        out.extend_from_slice(&(a.len() as u32).to_le_bytes());
        out.extend_from_slice(a);
    }
    out
}

fn unpack(b: &[u8]) -> Option<Vec<Vec<u8>>> {
    let u32_at = |i: usize| -> Option<usize> {
        Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?) as usize)
    };
    let n = u32_at(0)?;
    let mut at = 4;
    let mut out = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let len = u32_at(at)?;
        at += 4;
        out.push(b.get(at..at.checked_add(len)?)?.to_vec());
        at += len;
    }
    (at == b.len()).then_some(out)
}
