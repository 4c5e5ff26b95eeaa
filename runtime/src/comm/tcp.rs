//! A communicator between processes: one rank per process (`hzp run` on the CPU under
//! `hzp launch`, torchrun or srun), one TCP connection per pair of members of each
//! communicator.
//!
//! A call sends this member's input to every other member (a header first: the call's
//! number, the caller's label, the byte counts, whether this member's arguments were
//! valid), receives every other member's, then computes its own result with
//! [`super::member_result`], the arithmetic the threads' [`super::Communicator`] uses: the
//! same reductions in member order, so a run is bit-identical to the threaded one. Sending
//! happens on a helper thread while this one receives, so no pair of members waits on each
//! other's full socket buffers.
//!
//! Reads and writes poll the run's abort flag; a peer that closes its connection (its
//! process ended) or sends nothing for longer than the timeout is an error that names its
//! rank and the collective.
//!
//! Set-up ([`connect`]): each process listens on a port of its own, the addresses are
//! all-gathered through the [`Rendezvous`] at `MASTER_ADDR:MASTER_PORT`, and for every
//! communicator the member with the lower rank of each pair connects to the other and says
//! which communicator and rank it is.

use super::rendezvous::Rendezvous;
use super::{check_args, collective_bytes, member_result, LinkModel, ABORTED};
use hzp_ir::{DType, Group, Op};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a blocked read or write looks at the abort flag.
const POLL: Duration = Duration::from_millis(50);
/// The connection hello: `HZP-COMM1 <communicator> <rank>`.
const HELLO: &str = "HZP-COMM1";
/// Bytes of a call's header: call, label, input bytes, output bytes, status.
const HEADER: usize = 33;

/// One group instance on one stream, seen from this process's member (see the
/// [module docs](self)).
pub struct TcpCommunicator {
    members: Vec<usize>,
    me: usize,
    labels: Option<Arc<[String]>>,
    /// The stream to each other member (`None` at `me`).
    peers: Vec<Option<TcpStream>>,
    state: Mutex<Vec<Vec<u8>>>,
    calls: AtomicU64,
    /// The member this one waits for now, plus one (0: none).
    waiting_on: AtomicUsize,
    timeout: Duration,
}

fn describe(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe => "the connection closed (its process ended?)".into(),
        _ => e.to_string(),
    }
}

/// Why a transfer stopped.
enum Stop {
    Abort,
    Timeout,
    Io(io::Error),
}

/// Reads `buf` whole, polling `abort`; gives up after `timeout` without a byte.
fn read_all(
    mut s: &TcpStream,
    buf: &mut [u8],
    abort: &AtomicBool,
    timeout: Duration,
) -> Result<(), Stop> {
    let mut at = 0;
    let mut last = Instant::now();
    while at < buf.len() {
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(Stop::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(k) => {
                at += k;
                last = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if abort.load(Ordering::Relaxed) {
                    return Err(Stop::Abort);
                }
                if last.elapsed() > timeout {
                    return Err(Stop::Timeout);
                }
            }
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    Ok(())
}

/// Writes `buf` whole, polling `abort` (and `stop`, set when the receiving side failed).
fn write_all(
    mut s: &TcpStream,
    buf: &[u8],
    abort: &AtomicBool,
    stop: &AtomicBool,
    timeout: Duration,
) -> Result<(), Stop> {
    let mut at = 0;
    let mut last = Instant::now();
    while at < buf.len() {
        match s.write(&buf[at..]) {
            Ok(0) => return Err(Stop::Io(io::ErrorKind::WriteZero.into())),
            Ok(k) => {
                at += k;
                last = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if abort.load(Ordering::Relaxed) || stop.load(Ordering::Relaxed) {
                    return Err(Stop::Abort);
                }
                if last.elapsed() > timeout {
                    return Err(Stop::Timeout);
                }
            }
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    Ok(())
}

fn header(call: u64, node: usize, input_len: usize, output_len: usize, ok: bool) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..8].copy_from_slice(&call.to_le_bytes());
    h[8..16].copy_from_slice(&(node as u64).to_le_bytes());
    h[16..24].copy_from_slice(&(input_len as u64).to_le_bytes());
    h[24..32].copy_from_slice(&(output_len as u64).to_le_bytes());
    h[32] = u8::from(ok);
    h
}

fn u64_at(h: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[i..i + 8]);
    u64::from_le_bytes(b)
}

impl TcpCommunicator {
    /// The members' global ranks, in member order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// This process's place among the members.
    pub fn member(&self) -> usize {
        self.me
    }

    /// Calls this process's member has entered.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The rank whose data a call waits for now, if any.
    pub fn waiting_for(&self) -> Option<usize> {
        match self.waiting_on.load(Ordering::Relaxed) {
            0 => None,
            m => self.members.get(m - 1).copied(),
        }
    }

    fn label(&self, node: usize) -> String {
        match self.labels.as_deref().and_then(|l| l.get(node)) {
            Some(name) => format!("`{name}`"),
            None => format!("#{node}"),
        }
    }

    /// Runs one collective as this process's member; see [`super::Communicator::run`] for
    /// the arguments (`me` must be [`TcpCommunicator::member`]).
    ///
    /// # Safety
    /// `input` must stay valid and unmodified, and `output` valid and not accessed by
    /// anyone else, until the call returns.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        me: usize,
        op: &Op,
        dtype: DType,
        in_shape: &[usize],
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        output_len: usize,
        link: Option<(&dyn LinkModel, &Group)>,
        abort: &AtomicBool,
        node: usize,
        on_start: Option<&dyn Fn()>,
    ) -> Result<(), String> {
        let rank = self.members[self.me];
        if me != self.me {
            return Err(format!(
                "member {me} of a communicator whose member in this process is {}",
                self.me
            ));
        }
        let n = self.members.len();
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        let mine = check_args(op, dtype, in_shape, n, input_len, output_len)
            .map_err(|e| format!("rank {rank}: {e}"));
        let head = header(call, node, input_len, output_len, mine.is_ok());
        // SAFETY: the caller's contract: `input` holds `input_len` bytes for the call.
        let data: &[u8] = if mine.is_ok() {
            unsafe { std::slice::from_raw_parts(input, input_len) }
        } else {
            &[]
        };
        let mut bufs = self
            .state
            .lock()
            .map_err(|_| "a communicator's lock was poisoned".to_string())?;
        bufs.resize_with(n, Vec::new);
        let stop = AtomicBool::new(false);
        let what = format!(
            "{} (call {call} of the communicator of ranks {:?})",
            self.label(node),
            self.members
        );
        let received: Result<(), String> = std::thread::scope(|sc| {
            let sender = sc.spawn(|| -> Result<(), String> {
                for (j, p) in self.peers.iter().enumerate() {
                    let Some(s) = p else { continue };
                    let r = write_all(s, &head, abort, &stop, self.timeout)
                        .and_then(|()| write_all(s, data, abort, &stop, self.timeout));
                    if let Err(e) = r {
                        return Err(self.stop_message(e, rank, j, "sending", &what));
                    }
                }
                Ok(())
            });
            let got = (|| {
                let mut first_err: Option<String> = None;
                for j in 0..n {
                    let Some(s) = &self.peers[j] else { continue };
                    self.waiting_on.store(j + 1, Ordering::Relaxed);
                    let mut h = [0u8; HEADER];
                    read_all(s, &mut h, abort, self.timeout)
                        .map_err(|e| self.stop_message(e, rank, j, "receiving from", &what))?;
                    let (their_call, their_node) = (u64_at(&h, 0), u64_at(&h, 8) as usize);
                    let (their_in, their_out) = (u64_at(&h, 16) as usize, u64_at(&h, 24) as usize);
                    let their_ok = h[32] == 1;
                    if their_call != call
                        || their_node != node
                        || their_in != input_len
                        || their_out != output_len
                    {
                        return Err(format!(
                            "collective mismatch: call {call} of the communicator of ranks {:?} is {} ({input_len} bytes in, {output_len} out) on rank {rank} but call {their_call}, {} ({their_in} bytes in, {their_out} out), on rank {}",
                            self.members,
                            self.label(node),
                            self.label(their_node),
                            self.members[j]
                        ));
                    }
                    if !their_ok {
                        first_err.get_or_insert_with(|| {
                            format!(
                                "rank {} refused its operands of {}",
                                self.members[j],
                                self.label(node)
                            )
                        });
                        continue;
                    }
                    let buf = &mut bufs[j];
                    buf.resize(their_in, 0);
                    read_all(s, buf, abort, self.timeout)
                        .map_err(|e| self.stop_message(e, rank, j, "receiving from", &what))?;
                }
                match first_err {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            })();
            if got.is_err() {
                stop.store(true, Ordering::Relaxed);
            }
            let sent = sender.join().unwrap_or_else(|_| {
                Err(format!(
                    "rank {rank}: the thread sending {} panicked",
                    self.label(node)
                ))
            });
            got.and(sent)
        });
        self.waiting_on.store(0, Ordering::Relaxed);
        mine?;
        received?;
        let ready_at = Instant::now();
        if let Some(f) = on_start {
            f();
        }
        let inputs: Vec<*const u8> = (0..n)
            .map(|j| {
                if j == self.me {
                    input
                } else {
                    bufs[j].as_ptr()
                }
            })
            .collect();
        // SAFETY: every input holds `input_len` bytes (the headers agreed and the
        // operands were checked), `output` is the caller's.
        unsafe { member_result(self.me, op, dtype, in_shape, &inputs, output)? };
        if let Some((model, group)) = link {
            let bytes = collective_bytes(op, input_len, output_len);
            let d = model
                .duration(op, group, bytes)
                .map_err(|e| format!("rank {rank}: {} on emulated links: {e}", op.name()))?;
            if let Some(until) = ready_at.checked_add(d) {
                let now = Instant::now();
                if until > now {
                    std::thread::sleep(until - now);
                }
            }
        }
        Ok(())
    }

    fn stop_message(&self, e: Stop, rank: usize, j: usize, verb: &str, what: &str) -> String {
        let peer = self.members[j];
        match e {
            Stop::Abort => ABORTED.into(),
            Stop::Timeout => format!(
                "rank {rank}: {verb} rank {peer} in {what}: nothing moved for {:.1} s (is rank {peer} stuck or gone?)",
                self.timeout.as_secs_f64()
            ),
            Stop::Io(e) => format!("rank {rank}: {verb} rank {peer} in {what}: {}", describe(&e)),
        }
    }
}

/// A connection's key: (communicator index, the peer's rank).
type Link = (usize, usize);

/// A communicator to connect: its index (the same in every process) and its members'
/// global ranks, in member order.
pub struct CommSpec {
    pub index: usize,
    pub members: Vec<usize>,
}

/// Connects this process's communicators (`specs`: those with this rank and another
/// member) to the other processes, through the rendezvous `rv` (every process calls it with
/// the specs of its own rank, in the same order of indices). `labels` name the callers'
/// labels (node names) in messages; `timeout` bounds the set-up and every later wait.
pub fn connect(
    rv: &mut Rendezvous,
    specs: &[CommSpec],
    labels: Arc<[String]>,
    timeout: Duration,
) -> Result<Vec<(usize, TcpCommunicator)>, String> {
    let rank = rv.rank();
    let world = rv.world_size();
    let listener = TcpListener::bind(("0.0.0.0", 0))
        .map_err(|e| format!("rank {rank}: cannot open a port for the collectives: {e}"))?;
    let port = listener
        .local_addr()
        .map_err(|e| format!("rank {rank}: {e}"))?
        .port();
    // the address the other processes reach this one at: the one it reaches rank 0 from
    let ip = rv.local_ip().unwrap_or(IpAddr::from([127, 0, 0, 1]));
    let all = rv
        .all_gather(SocketAddr::new(ip, port).to_string().as_bytes())
        .map_err(|e| e.to_string())?;
    let addrs: Vec<SocketAddr> = all
        .iter()
        .enumerate()
        .map(|(r, a)| {
            String::from_utf8_lossy(a)
                .parse()
                .map_err(|_| format!("rank {r} announced a malformed address"))
        })
        .collect::<Result<_, String>>()?;
    if addrs.len() != world {
        return Err(format!(
            "rank {rank}: {} addresses for a world of {world}",
            addrs.len()
        ));
    }
    let expected: usize = specs
        .iter()
        .map(|c| c.members.iter().filter(|&&m| m < rank).count())
        .sum();
    let deadline = Instant::now() + timeout;
    let mut streams: std::collections::HashMap<Link, TcpStream> = Default::default();
    std::thread::scope(|sc| -> Result<(), String> {
        let acceptor = sc.spawn(|| accept_all(&listener, rank, expected, specs, deadline));
        let mut out = Vec::new();
        for c in specs {
            for &m in c.members.iter().filter(|&&m| m > rank) {
                let s = connect_to(addrs[m], rank, m, deadline)?;
                let mut s = s;
                let hello = format!("{HELLO} {} {rank}\n", c.index);
                s.write_all(hello.as_bytes()).map_err(|e| {
                    format!(
                        "rank {rank}: connecting to rank {m} at {}: {}",
                        addrs[m],
                        describe(&e)
                    )
                })?;
                out.push(((c.index, m), s));
            }
        }
        let accepted = acceptor.join().unwrap_or_else(|_| {
            Err(format!(
                "rank {rank}: the thread accepting connections panicked"
            ))
        })?;
        streams.extend(out);
        streams.extend(accepted);
        Ok(())
    })?;
    // every process has all its connections before any collective runs
    rv.barrier().map_err(|e| e.to_string())?;
    let mut comms = Vec::new();
    for c in specs {
        let me =
            c.members.iter().position(|&m| m == rank).ok_or_else(|| {
                format!("rank {rank} is not a member of communicator {}", c.index)
            })?;
        let mut peers = Vec::with_capacity(c.members.len());
        for &m in &c.members {
            if m == rank {
                peers.push(None);
                continue;
            }
            let s = streams.remove(&(c.index, m)).ok_or_else(|| {
                format!(
                    "rank {rank}: no connection from rank {m} for communicator {}",
                    c.index
                )
            })?;
            s.set_nodelay(true)
                .and_then(|()| s.set_read_timeout(Some(POLL)))
                .and_then(|()| s.set_write_timeout(Some(POLL)))
                .map_err(|e| format!("rank {rank}: {e}"))?;
            peers.push(Some(s));
        }
        comms.push((
            c.index,
            TcpCommunicator {
                members: c.members.clone(),
                me,
                labels: Some(labels.clone()),
                peers,
                state: Mutex::new(Vec::new()),
                calls: AtomicU64::new(0),
                waiting_on: AtomicUsize::new(0),
                timeout,
            },
        ));
    }
    Ok(comms)
}

fn connect_to(
    addr: SocketAddr,
    rank: usize,
    peer: usize,
    deadline: Instant,
) -> Result<TcpStream, String> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(50))) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "rank {rank}: cannot connect to rank {peer} at {addr}: {e} (a firewall between the nodes?)"
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Accepts the `expected` connections of lower ranks, each naming its communicator.
fn accept_all(
    listener: &TcpListener,
    rank: usize,
    expected: usize,
    specs: &[CommSpec],
    deadline: Instant,
) -> Result<Vec<(Link, TcpStream)>, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("rank {rank}: {e}"))?;
    let mut got = Vec::with_capacity(expected);
    while got.len() < expected {
        match listener.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(false)
                    .and_then(|()| s.set_read_timeout(Some(Duration::from_secs(10))))
                    .map_err(|e| format!("rank {rank}: {e}"))?;
                let mut line = Vec::new();
                let mut b = [0u8; 1];
                let mut r = &s;
                while line.len() < 64 {
                    match r.read(&mut b) {
                        Ok(1) if b[0] == b'\n' => break,
                        Ok(1) => line.push(b[0]),
                        _ => break,
                    }
                }
                let text = String::from_utf8_lossy(&line).to_string();
                let mut it = text.split(' ');
                let parsed = (it.next() == Some(HELLO))
                    .then(|| {
                        Some((
                            it.next()?.parse::<usize>().ok()?,
                            it.next()?.parse::<usize>().ok()?,
                        ))
                    })
                    .flatten();
                let Some((index, from)) = parsed else {
                    // not one of ours (a port scanner, a stale client): ignore it
                    continue;
                };
                let known = specs
                    .iter()
                    .any(|c| c.index == index && c.members.contains(&from) && from < rank);
                if !known {
                    return Err(format!(
                        "rank {rank}: {peer} connected as rank {from} for communicator {index}, which is not one of this rank's (do all processes run the same plan?)"
                    ));
                }
                got.push(((index, from), s));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!(
                        "rank {rank}: timed out waiting for the other ranks' connections ({} of {expected} arrived)",
                        got.len()
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("rank {rank}: accepting connections: {e}")),
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::rendezvous::DistEnv;
    use hzp_ir::ReduceOp;

    /// Two processes' members on this machine (threads here): rank 1 runs `peer` with its
    /// communicator, rank 0 calls one all-reduce; returns rank 0's result.
    fn all_reduce_against(timeout: Duration, peer: fn(TcpCommunicator)) -> Result<(), String> {
        let port = TcpListener::bind(("127.0.0.1", 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let env = move |rank| DistEnv {
            rank,
            world_size: 2,
            local_rank: rank,
            local_world_size: 2,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        };
        let comm = move |rank| -> TcpCommunicator {
            let mut rv = Rendezvous::connect(&env(rank), Duration::from_secs(20)).unwrap();
            let specs = [CommSpec {
                index: 0,
                members: vec![0, 1],
            }];
            let labels: Arc<[String]> = vec!["grad/AllReduce".to_string()].into();
            connect(&mut rv, &specs, labels, timeout)
                .unwrap()
                .pop()
                .unwrap()
                .1
        };
        let other = std::thread::spawn(move || peer(comm(1)));
        let c = comm(0);
        let input = [1.0f32; 4];
        let mut output = [0.0f32; 4];
        let op = Op::AllReduce {
            group: Group::new(["gpu"]),
            reduce: ReduceOp::Sum,
        };
        let abort = AtomicBool::new(false);
        // SAFETY: both buffers live on this stack frame until the call returns.
        let r = unsafe {
            c.run(
                c.member(),
                &op,
                DType::F32,
                &[4],
                input.as_ptr().cast(),
                16,
                output.as_mut_ptr().cast(),
                16,
                None,
                &abort,
                0,
                None,
            )
        };
        other.join().unwrap();
        r
    }

    #[test]
    fn a_peer_whose_process_ended_is_named() {
        let e = all_reduce_against(Duration::from_secs(20), drop).unwrap_err();
        assert!(e.contains("rank 1") && e.contains("closed"), "{e}");
        assert!(e.contains("grad/AllReduce"), "{e}");
    }

    #[test]
    fn a_peer_that_never_calls_times_out_naming_it() {
        // the peer stays connected (so only the timeout can end the wait) for 3 s
        let e = all_reduce_against(Duration::from_millis(300), |c| {
            std::thread::sleep(Duration::from_secs(3));
            drop(c)
        })
        .unwrap_err();
        assert!(e.contains("rank 1") && e.contains("nothing moved"), "{e}");
    }
}
