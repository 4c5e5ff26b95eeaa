//! Synchronisation between the threads of a run: per-rank event tables (RecordEvent /
//! WaitEvent across a rank's stream threads) and the step barrier. Every wait polls an abort
//! flag, so a failure on one thread ends the run instead of hanging it.

use crate::comm::ABORTED;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

const POLL: Duration = Duration::from_millis(20);
/// Spins on an event before parking (events are often recorded within microseconds).
const SPINS: u32 = 200;

/// One rank's events: for each event, the last step (1-based) it was recorded in. A wait in
/// step `s` returns once the event's stamp is at least `s`, so events need no reset between
/// steps.
pub struct EventTable {
    stamps: Vec<AtomicU64>,
    lock: Mutex<()>,
    cv: Condvar,
}

impl EventTable {
    pub fn new(n: usize) -> EventTable {
        EventTable {
            stamps: (0..n).map(|_| AtomicU64::new(0)).collect(),
            lock: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// Marks event `e` recorded in step `stamp` (1-based) and wakes its waiters. Everything
    /// the recording thread wrote before is visible to a thread whose wait returns.
    pub fn record(&self, e: usize, stamp: u64) {
        self.stamps[e].store(stamp, Ordering::Release);
        let _g = self.lock.lock();
        self.cv.notify_all();
    }

    /// Blocks until event `e` was recorded in step `stamp` (or later).
    pub fn wait(&self, e: usize, stamp: u64, abort: &AtomicBool) -> Result<(), String> {
        let ready = || self.stamps[e].load(Ordering::Acquire) >= stamp;
        for _ in 0..SPINS {
            if ready() {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let mut g = self
            .lock
            .lock()
            .map_err(|_| "an event lock was poisoned".to_string())?;
        while !ready() {
            if abort.load(Ordering::Relaxed) {
                return Err(ABORTED.into());
            }
            g = self
                .cv
                .wait_timeout(g, POLL)
                .map_err(|_| "an event lock was poisoned".to_string())?
                .0;
        }
        Ok(())
    }
}

/// A reusable barrier for `n` threads that gives up when the abort flag is set.
pub struct StepBarrier {
    n: usize,
    state: Mutex<(usize, u64)>,
    cv: Condvar,
}

impl StepBarrier {
    pub fn new(n: usize) -> StepBarrier {
        StepBarrier {
            n,
            state: Mutex::new((0, 0)),
            cv: Condvar::new(),
        }
    }

    pub fn wait(&self, abort: &AtomicBool) -> Result<(), String> {
        let mut g = self
            .state
            .lock()
            .map_err(|_| "the step barrier was poisoned".to_string())?;
        let gen = g.1;
        g.0 += 1;
        if g.0 == self.n {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while g.1 == gen {
            if abort.load(Ordering::Relaxed) {
                return Err(ABORTED.into());
            }
            g = self
                .cv
                .wait_timeout(g, POLL)
                .map_err(|_| "the step barrier was poisoned".to_string())?
                .0;
        }
        Ok(())
    }
}
