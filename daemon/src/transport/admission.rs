//! What the transport server lets in, and how much it holds for its peers
//! (docs/SECURITY.md, "Resource limits").
//!
//! - [`Admission`] keeps every open connection with its age and whether it
//!   authenticated. At most [`Limits::max_unauthenticated`] connections may be
//!   waiting to authenticate: a new one past that evicts the oldest of them
//!   that has not started the handshake (or, if all have, the oldest), so a
//!   flood of silent connections costs each attacker its own slot for at most
//!   a moment and never locks out a real client, which starts the handshake
//!   at once and finishes it a round trip later. At most [`Limits::max_connections`] are open in all: past
//!   that, a new connection evicts the oldest unauthenticated one, or is
//!   closed at once when every connection is authenticated.
//! - [`Budget`] bounds the bytes all connections together hold in request
//!   payloads they have read and not yet served. A connection reserves each
//!   piece before it reads it, and waits (bounded) when the budget is spent.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Makes the allocator give large buffers (request payloads) back to the system when they
/// are freed, so that the daemon's resident memory follows what it holds rather than its peak:
/// glibc otherwise raises its mmap threshold after the first such free and keeps later large
/// buffers in its heaps.
pub fn return_large_buffers_to_the_os() {
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallopt only changes the allocator's tuning; it is called before the
        // daemon starts its threads, and any value is valid for M_MMAP_THRESHOLD.
        let set = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10) };
        if set != 1 {
            tracing::debug!(
                "mallopt(M_MMAP_THRESHOLD) refused; large buffers may stay in the heap"
            );
        }
    }
}

/// Caps on connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once that have not authenticated yet.
    pub max_unauthenticated: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            max_unauthenticated: 128,
        }
    }
}

/// An open connection.
#[derive(Debug)]
struct Slot {
    /// A handle to close it with.
    stream: TcpStream,
    opened: Instant,
    /// It sent a well-formed first HELLO step (a client at work, not a silent socket).
    started: bool,
    authenticated: bool,
    /// Closed to make room; its thread has not ended yet.
    evicted: bool,
}

/// Why a new connection was not let in.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub open: usize,
}

/// The open connections and the caps on them.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    slots: Mutex<HashMap<u64, Slot>>,
    evictions: AtomicU64,
    refusals: AtomicU64,
}

impl Admission {
    pub fn new(limits: Limits) -> Admission {
        Admission {
            limits,
            slots: Mutex::new(HashMap::new()),
            evictions: AtomicU64::new(0),
            refusals: AtomicU64::new(0),
        }
    }

    /// Lets connection `id` in (`stream` is a handle to close it with),
    /// evicting the oldest unauthenticated connection when a cap is reached;
    /// refuses it when every connection is authenticated and the total cap
    /// is reached.
    pub fn admit(&self, id: u64, stream: TcpStream) -> Result<(), Refused> {
        let Ok(mut slots) = self.slots.lock() else {
            return Err(Refused { open: 0 });
        };
        let live = slots.values().filter(|s| !s.evicted);
        let (mut open, mut waiting) = (0usize, 0usize);
        for s in live {
            open += 1;
            waiting += usize::from(!s.authenticated);
        }
        let full = open >= self.limits.max_connections;
        if full || waiting >= self.limits.max_unauthenticated {
            let oldest = slots
                .iter_mut()
                .filter(|(_, s)| !s.evicted && !s.authenticated)
                .min_by_key(|(_, s)| (s.started, s.opened));
            match oldest {
                Some((_, victim)) => {
                    victim.evicted = true;
                    let _ = victim.stream.shutdown(Shutdown::Both);
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                }
                None if full => {
                    self.refusals.fetch_add(1, Ordering::Relaxed);
                    return Err(Refused { open });
                }
                None => {}
            }
        }
        slots.insert(
            id,
            Slot {
                stream,
                opened: Instant::now(),
                started: false,
                authenticated: false,
                evicted: false,
            },
        );
        Ok(())
    }

    /// Connection `id` started the handshake: it is evicted only after every silent one.
    pub fn started(&self, id: u64) {
        if let Ok(mut slots) = self.slots.lock()
            && let Some(s) = slots.get_mut(&id)
        {
            s.started = true;
        }
    }

    /// Connection `id` authenticated: it is no longer a candidate for eviction.
    pub fn authenticated(&self, id: u64) {
        if let Ok(mut slots) = self.slots.lock()
            && let Some(s) = slots.get_mut(&id)
        {
            s.authenticated = true;
        }
    }

    /// Connection `id` ended.
    pub fn remove(&self, id: u64) {
        if let Ok(mut slots) = self.slots.lock() {
            slots.remove(&id);
        }
    }

    /// Closes every connection (shutdown).
    pub fn close_all(&self) {
        if let Ok(slots) = self.slots.lock() {
            for s in slots.values() {
                let _ = s.stream.shutdown(Shutdown::Both);
            }
        }
    }

    /// Unauthenticated connections closed to make room, since start.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Connections closed at once because the server was full, since start.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }
}

/// Bytes of request payloads held by all connections together.
#[derive(Debug)]
pub struct Budget {
    max: u64,
    used: AtomicU64,
}

/// How often a connection waiting for budget looks again.
const BUDGET_POLL: Duration = Duration::from_millis(1);

impl Budget {
    pub fn new(max: u64) -> Budget {
        Budget {
            max,
            used: AtomicU64::new(0),
        }
    }

    /// Reserves `n` bytes, waiting up to `timeout` for others to release
    /// theirs; `false` when the budget stayed spent. A reservation larger
    /// than the whole budget is granted only while nothing else is held.
    pub fn reserve(&self, n: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let used = self.used.load(Ordering::Acquire);
            let fits = used.saturating_add(n) <= self.max || used == 0;
            if fits {
                if self
                    .used
                    .compare_exchange(used, used + n, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return true;
                }
                continue;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(BUDGET_POLL);
        }
    }

    /// Gives back `n` reserved bytes.
    pub fn release(&self, n: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(n))
            });
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The most that may be reserved at once.
    pub fn max(&self) -> u64 {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::sync::Arc;

    use super::*;

    /// A connected socket (the server end is dropped: only the handle matters).
    fn socket(listener: &TcpListener) -> TcpStream {
        let s = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let _ = listener.accept().unwrap();
        s
    }

    #[test]
    fn the_oldest_waiting_connection_makes_room() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = Admission::new(Limits {
            max_connections: 3,
            max_unauthenticated: 2,
        });
        a.admit(1, socket(&l)).unwrap();
        a.admit(2, socket(&l)).unwrap();
        a.authenticated(1);
        a.admit(3, socket(&l)).unwrap(); // 1 authenticated, 2 and 3 waiting
        assert_eq!(a.evictions(), 0);
        a.admit(4, socket(&l)).unwrap(); // a third waiting one: 2 goes
        assert_eq!(a.evictions(), 1);
        {
            let slots = a.slots.lock().unwrap();
            assert!(slots[&2].evicted && !slots[&3].evicted && !slots[&1].evicted);
        }
        a.remove(2);
        a.authenticated(3);
        a.authenticated(4);
        // Full (3 of 3) and all authenticated: the next one is refused.
        assert_eq!(a.admit(5, socket(&l)), Err(Refused { open: 3 }));
        assert_eq!(a.refusals(), 1);
        a.remove(4);
        a.admit(5, socket(&l)).unwrap();
    }

    #[test]
    fn silent_connections_go_before_ones_that_started_the_handshake() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = Admission::new(Limits {
            max_connections: 100,
            max_unauthenticated: 2,
        });
        a.admit(1, socket(&l)).unwrap();
        a.started(1);
        a.admit(2, socket(&l)).unwrap();
        a.admit(3, socket(&l)).unwrap(); // 2 (silent) goes, not the older 1
        let slots = a.slots.lock().unwrap();
        assert!(!slots[&1].evicted && slots[&2].evicted && !slots[&3].evicted);
    }

    #[test]
    fn the_budget_bounds_what_is_held_and_waits_for_releases() {
        let b = Arc::new(Budget::new(100));
        assert!(b.reserve(60, Duration::ZERO));
        assert!(!b.reserve(50, Duration::from_millis(5)));
        let releaser = {
            let b = Arc::clone(&b);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                b.release(60);
            })
        };
        assert!(
            b.reserve(50, Duration::from_secs(5)),
            "granted after the release"
        );
        releaser.join().unwrap();
        assert_eq!(b.used(), 50);
        b.release(50);
        assert!(b.reserve(500, Duration::ZERO), "an oversized piece alone");
        assert!(!b.reserve(1, Duration::ZERO));
        b.release(500);
        assert_eq!(b.used(), 0);
    }
}
