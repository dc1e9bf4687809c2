//! Reliable-connected queue pairs: connecting two of them, and one-sided READ, WRITE,
//! compare-and-swap and fetch-and-add posted as one linked list of work requests with one
//! signalled completion.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use crate::device::ProtectionDomain;
use crate::error::{Result, VerbsError};
use crate::memory::{Access, LocalMemory, Registration};
use crate::window::MemoryWindow;

/// How long a waiter polls the completion queue before it sleeps on the completion channel
/// (a round trip on real NICs takes a few microseconds: those are served polling).
const SPIN: Duration = Duration::from_micros(50);
/// Completion events acknowledged at once (each acknowledgement takes a lock).
const ACK_EVERY: u32 = 64;

/// Where a peer's memory is: its address there and the remote key of its registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub rkey: u32,
}

/// A range of the local [`RegisteredBuffer`] an operation reads from or writes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Local {
    pub offset: usize,
    pub len: usize,
}

/// One one-sided operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Copies `local.len` bytes at `remote` into `local`.
    Read { local: Local, remote: Remote },
    /// Copies `local` to `remote`.
    Write { local: Local, remote: Remote },
    /// If the 8-byte word at `remote` (8-aligned) equals `expected`, replaces it with `new`;
    /// its old value lands in the 8 bytes at `local` (native byte order).
    CompareSwap {
        local: usize,
        remote: Remote,
        expected: u64,
        new: u64,
    },
    /// Adds `add` to the 8-byte word at `remote`; its old value lands at `local`.
    FetchAdd {
        local: usize,
        remote: Remote,
        add: u64,
    },
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Read { .. } => "READ",
            Op::Write { .. } => "WRITE",
            Op::CompareSwap { .. } => "compare-and-swap",
            Op::FetchAdd { .. } => "fetch-and-add",
        }
    }

    /// The local range the operation touches.
    fn local(&self) -> Local {
        match *self {
            Op::Read { local, .. } | Op::Write { local, .. } => local,
            Op::CompareSwap { local, .. } | Op::FetchAdd { local, .. } => Local {
                offset: local,
                len: 8,
            },
        }
    }
}

/// What a peer needs to connect its queue pair to this one, exchanged out of band (over the
/// transport's tcp connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    /// `ibv_mtu` of the port (1: 256 bytes ... 5: 4096).
    pub mtu: u8,
    pub gid: [u8; 16],
}

impl Endpoint {
    /// Encoded length.
    pub const LEN: usize = 27;

    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..10].copy_from_slice(&self.lid.to_le_bytes());
        b[10] = self.mtu;
        b[11..27].copy_from_slice(&self.gid);
        b
    }

    pub fn from_bytes(b: &[u8]) -> Result<Endpoint> {
        if b.len() != Self::LEN {
            return Err(VerbsError::Invalid(format!(
                "an endpoint of {} bytes (expected {})",
                b.len(),
                Self::LEN
            )));
        }
        let word = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 4];
            w.copy_from_slice(&b[r]);
            u32::from_le_bytes(w)
        };
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[11..27]);
        Ok(Endpoint {
            qpn: word(0..4),
            psn: word(4..8) & 0xff_ffff,
            lid: u16::from_le_bytes([b[8], b[9]]),
            mtu: b[10],
            gid,
        })
    }
}

/// A reliable-connected queue pair with a completion queue of its own. One operation list is
/// in flight at a time ([`QueuePair::execute`] takes `&mut self` and waits for it).
#[derive(Debug)]
pub struct QueuePair {
    qp: *mut ffi::ibv_qp,
    cq: *mut ffi::ibv_cq,
    /// The completion channel the CQ signals when armed: a waiter that polled for
    /// [`SPIN`] without a completion sleeps on its descriptor.
    channel: *mut ffi::ibv_comp_channel,
    /// Completion events received and not acknowledged yet (all are before the CQ goes).
    unacked: u32,
    pd: Arc<ProtectionDomain>,
    psn: u32,
    max_wr: u32,
    connected: bool,
    /// A completion failed or timed out: the queue pair is in the error state (or destroyed)
    /// and must be replaced.
    broken: bool,
}

// SAFETY: QP and CQ handles may be used from any thread (libibverbs is thread safe); all use
// goes through `&mut self`, so one thread at a time.
unsafe impl Send for QueuePair {}
// SAFETY: `&QueuePair` only reads plain fields.
unsafe impl Sync for QueuePair {}

impl QueuePair {
    /// A new queue pair of `pd` taking up to `max_wr` work requests at once.
    pub fn create(pd: &Arc<ProtectionDomain>, max_wr: u32) -> Result<QueuePair> {
        let device = pd.device();
        let max_wr = max_wr.clamp(1, 4096);
        let cqe = libc::c_int::try_from(max_wr).unwrap_or(4096);
        // SAFETY: a live context; the channel is owned by the returned value (destroyed in
        // Drop, after the CQ).
        let channel = unsafe { ffi::ibv_create_comp_channel(device.raw()) };
        if channel.is_null() {
            return Err(VerbsError::last(format!(
                "ibv_create_comp_channel({})",
                device.name()
            )));
        }
        // SAFETY: a live context and channel; the CQ is owned by the returned value
        // (destroyed in Drop, after the QP).
        let cq = unsafe { ffi::ibv_create_cq(device.raw(), cqe, std::ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = VerbsError::last(format!("ibv_create_cq({}, {cqe})", device.name()));
            // SAFETY: the channel made above, used by no CQ.
            unsafe { ffi::ibv_destroy_comp_channel(channel) };
            return Err(e);
        }
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: cq,
            recv_cq: cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: max_wr,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: a live PD and CQ and an initialised attribute struct.
        let qp = unsafe { ffi::ibv_create_qp(pd.raw(), &mut init) };
        if qp.is_null() {
            let e = VerbsError::last(format!("ibv_create_qp({})", device.name()));
            // SAFETY: the CQ and channel made above, unused by any QP, no event received.
            unsafe {
                ffi::ibv_destroy_cq(cq);
                ffi::ibv_destroy_comp_channel(channel);
            }
            return Err(e);
        }
        Ok(QueuePair {
            qp,
            cq,
            channel,
            unacked: 0,
            pd: Arc::clone(pd),
            psn: rand::random::<u32>() & 0xff_ffff,
            max_wr,
            connected: false,
            broken: false,
        })
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> Endpoint {
        let device = self.pd.device();
        Endpoint {
            qpn: if self.qp.is_null() {
                0
            } else {
                // SAFETY: a non-null `qp` is live until `destroy` nulls it.
                unsafe { (*self.qp).qp_num }
            },
            psn: self.psn,
            lid: device.lid(),
            mtu: u8::try_from(device.active_mtu()).unwrap_or(1),
            gid: device.gid(),
        }
    }

    /// Whether a failure broke this queue pair (replace it: create and connect a new one).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    fn modify(&mut self, attr: &mut ffi::ibv_qp_attr, mask: u32, step: &str) -> Result<()> {
        let mask = libc::c_int::try_from(mask).unwrap_or(libc::c_int::MAX);
        // SAFETY: a live QP and an initialised attribute struct; libibverbs reads only the
        // fields the mask names.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask) };
        if rc != 0 {
            return Err(VerbsError::errno(format!("ibv_modify_qp to {step}"), rc));
        }
        Ok(())
    }

    /// Connects this queue pair to the peer's (RESET → INIT → RTR → RTS), allowing the peer
    /// remote reads, writes and atomics on registrations that allow them.
    pub fn connect(&mut self, remote: &Endpoint) -> Result<()> {
        use ffi::ibv_qp_attr_mask as m;
        if self.connected || self.broken || self.qp.is_null() {
            return Err(VerbsError::Invalid(
                "connect of a queue pair that is connected or broken".into(),
            ));
        }
        let device = Arc::clone(self.pd.device());
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: device.port(),
            qp_access_flags: access,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            (m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS).0,
            "INIT",
        )?;
        let mtu = u32::from(remote.mtu).min(device.active_mtu()).max(1);
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: device.max_rd_atomic(),
            min_rnr_timer: 12,
            ..Default::default()
        };
        attr.ah_attr.is_global = 1;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = device.port();
        attr.ah_attr.grh.dgid.raw = remote.gid;
        attr.ah_attr.grh.sgid_index = device.gid_index();
        attr.ah_attr.grh.hop_limit = 64;
        self.modify(
            &mut attr,
            (m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER)
                .0,
            "RTR",
        )?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            // 4.096 µs × 2^14 ≈ 67 ms per try, 7 tries: a dead peer fails a request in about
            // half a second.
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: self.psn,
            max_rd_atomic: device.max_init_rd_atomic(),
            ..Default::default()
        };
        self.modify(
            &mut attr,
            (m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC)
                .0,
            "RTS",
        )?;
        self.connected = true;
        Ok(())
    }

    /// Posts `ops` (in batches of at most the queue's depth, each one linked list with its
    /// last request signalled) and waits for them, at most `timeout` per batch. Their local
    /// ranges are in `buf`. A failed or timed-out batch breaks the queue pair
    /// ([`QueuePair::is_broken`]); by the time this returns, the device no longer touches
    /// `buf` for these operations.
    pub fn execute(
        &mut self,
        buf: &mut impl LocalMemory,
        ops: &[Op],
        timeout: Duration,
    ) -> Result<()> {
        if !self.connected || self.broken || self.qp.is_null() {
            return Err(VerbsError::Invalid(
                "an operation on a queue pair that is not connected or is broken".into(),
            ));
        }
        for op in ops {
            let l = op.local();
            if l.offset
                .checked_add(l.len)
                .is_none_or(|end| end > buf.size())
                || u32::try_from(l.len).is_err()
            {
                return Err(VerbsError::Invalid(format!(
                    "{} of {} bytes at offset {} of a {}-byte buffer",
                    op.name(),
                    l.len,
                    l.offset,
                    buf.size()
                )));
            }
            if matches!(op, Op::CompareSwap { .. } | Op::FetchAdd { .. }) {
                let remote = match op {
                    Op::CompareSwap { remote, .. } | Op::FetchAdd { remote, .. } => remote,
                    _ => unreachable!("matched above"),
                };
                if !remote.addr.is_multiple_of(8) {
                    return Err(VerbsError::Invalid(format!(
                        "{} at {:#x}: atomics need an 8-byte aligned address",
                        op.name(),
                        remote.addr
                    )));
                }
            }
        }
        let depth = usize::try_from(self.max_wr).unwrap_or(1);
        for batch in ops.chunks(depth) {
            self.execute_batch(buf, batch, timeout)?;
        }
        Ok(())
    }

    fn execute_batch(
        &mut self,
        buf: &mut impl LocalMemory,
        ops: &[Op],
        timeout: Duration,
    ) -> Result<()> {
        let (base, lkey) = (buf.base(), buf.local_key());
        let mut sges: Vec<ffi::ibv_sge> = ops
            .iter()
            .map(|op| {
                let l = op.local();
                ffi::ibv_sge {
                    addr: base + l.offset as u64,
                    // Checked to fit in `execute`.
                    length: u32::try_from(l.len).unwrap_or(u32::MAX),
                    lkey,
                }
            })
            .collect();
        let mut wrs: Vec<ffi::ibv_send_wr> = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let mut wr = ffi::ibv_send_wr {
                wr_id: i as u64,
                num_sge: 1,
                ..Default::default()
            };
            match *op {
                Op::Read { remote, .. } | Op::Write { remote, .. } => {
                    wr.opcode = if matches!(op, Op::Read { .. }) {
                        ffi::ibv_wr_opcode::IBV_WR_RDMA_READ
                    } else {
                        ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
                    };
                    wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                        remote_addr: remote.addr,
                        rkey: remote.rkey,
                    };
                }
                Op::CompareSwap {
                    remote,
                    expected,
                    new,
                    ..
                } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                    wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                        remote_addr: remote.addr,
                        compare_add: expected,
                        swap: new,
                        rkey: remote.rkey,
                    };
                }
                Op::FetchAdd { remote, add, .. } => {
                    wr.opcode = ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                    wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                        remote_addr: remote.addr,
                        compare_add: add,
                        swap: 0,
                        rkey: remote.rkey,
                    };
                }
            }
            wrs.push(wr);
        }
        // Link the list now that neither vector moves any more, through one raw pointer
        // into each (no reference into them is made again until the post returns).
        let n = wrs.len();
        let (wr_base, sge_base) = (wrs.as_mut_ptr(), sges.as_mut_ptr());
        for i in 0..n {
            // SAFETY: `i < n` indexes both vectors (one SGE per request), which stay alive
            // and unmoved until after the post.
            unsafe {
                let wr = wr_base.add(i);
                (*wr).sg_list = sge_base.add(i);
                (*wr).next = if i + 1 < n {
                    wr_base.add(i + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        if n == 0 {
            return Ok(());
        }
        // SAFETY: `n > 0`, so `n - 1` indexes the last request.
        unsafe { (*wr_base.add(n - 1)).send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live, connected QP; `wrs` and `sges` outlive the call (the provider copies
        // them into its queue), and the local ranges lie in `buf`, registered and borrowed
        // exclusively until the completion below (or the QP's destruction) ends the DMA.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(post) => post(self.qp, wr_base, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            // Requests before the bad one may have been posted: the QP cannot be trusted.
            self.break_now();
            return Err(VerbsError::errno("ibv_post_send", rc));
        }
        self.wait(ops, n as u64 - 1, timeout)
    }

    /// Binds `window` to `len` bytes at `addr` of `registration` (registered with
    /// [`Access::bind_windows`], in this queue pair's protection domain) with the remote
    /// rights of `access`, for peers of this queue pair only; returns the window's new remote
    /// key (earlier bindings' keys stop working). Waits at most `timeout`; a failure breaks
    /// the queue pair.
    pub fn bind_window(
        &mut self,
        window: &mut MemoryWindow,
        registration: &Registration,
        addr: u64,
        len: u64,
        access: Access,
        timeout: Duration,
    ) -> Result<u32> {
        if !self.connected || self.broken || self.qp.is_null() {
            return Err(VerbsError::Invalid(
                "a window bound on a queue pair that is not connected or is broken".into(),
            ));
        }
        let reg_end = registration.addr() + registration.len() as u64;
        if len == 0
            || addr < registration.addr()
            || addr.checked_add(len).is_none_or(|end| end > reg_end)
        {
            return Err(VerbsError::Invalid(format!(
                "a window of {len} bytes at {addr:#x} outside the registration of {} bytes at \
                 {:#x}",
                registration.len(),
                registration.addr()
            )));
        }
        if !Arc::ptr_eq(window.pd(), &self.pd) {
            return Err(VerbsError::Invalid(
                "a window of another protection domain".into(),
            ));
        }
        let rkey = window.next_rkey();
        let mut wr = ffi::ibv_send_wr {
            wr_id: 0,
            num_sge: 0,
            opcode: ffi::ibv_wr_opcode::IBV_WR_BIND_MW,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_2 = ffi::ibv_send_wr__bindgen_ty_4 {
            bind_mw: ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
                mw: window.raw(),
                rkey,
                bind_info: ffi::ibv_mw_bind_info {
                    mr: registration.raw(),
                    addr,
                    length: len,
                    mw_access_flags: access.window_flags(),
                },
            },
        };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: a live, connected QP; the request outlives the call (the provider copies
        // it); the window and registration are live and of this QP's PD (checked above).
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(post) => post(self.qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            self.break_now();
            return Err(VerbsError::errno("ibv_post_send(BIND_MW)", rc));
        }
        self.wait(&[], 0, timeout)?;
        window.bound(rkey);
        Ok(rkey)
    }

    /// Polls the completion queue until the signalled request `last` completes (or any
    /// completes with an error): busy for [`SPIN`], then asleep on the completion channel
    /// (armed, then polled once more so that a completion that came in between is not
    /// missed).
    fn wait(&mut self, ops: &[Op], last: u64, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut armed = false;
        loop {
            if self.poll(ops, last)? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                self.break_now();
                return Err(VerbsError::Timeout(timeout));
            }
            if waited < SPIN {
                std::hint::spin_loop();
                continue;
            }
            if !armed {
                self.arm()?;
                armed = true;
                // Whatever completed before arming raised no event: poll again first.
                continue;
            }
            self.sleep(timeout - waited)?;
            armed = false;
        }
    }

    /// One poll of the CQ: `Ok(true)` once `last` completed; an error completion breaks
    /// the queue pair.
    fn poll(&mut self, ops: &[Op], last: u64) -> Result<bool> {
        // SAFETY: ibv_wc is plain data (integers); zeroed is valid, and poll_cq fills it.
        let mut wc: [ffi::ibv_wc; 4] = unsafe { std::mem::zeroed() };
        // SAFETY: a live CQ and room for 4 completions.
        let n = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.poll_cq {
                Some(poll) => poll(self.cq, 4, wc.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            self.break_now();
            return Err(VerbsError::Lost("ibv_poll_cq failed".into()));
        }
        for c in wc.iter().take(usize::try_from(n).unwrap_or(0)) {
            if let Some((status, _vendor)) = c.error() {
                let op = usize::try_from(c.wr_id())
                    .ok()
                    .and_then(|i| ops.get(i))
                    .map_or("request", Op::name);
                // SAFETY: ibv_wc_status_str returns a static NUL-terminated string.
                let text = unsafe {
                    std::ffi::CStr::from_ptr(ffi::ibv_wc_status_str(status))
                        .to_string_lossy()
                        .into_owned()
                };
                // The DMA of every request of the list is over once the QP is gone.
                self.break_now();
                return Err(VerbsError::Completion { op, status, text });
            }
            if c.wr_id() == last {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Asks the CQ for an event at its next completion.
    fn arm(&mut self) -> Result<()> {
        // SAFETY: a live CQ; `req_notify_cq` is the provider's (ibv_req_notify_cq is an
        // inline wrapper around it).
        let rc = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.req_notify_cq {
                Some(notify) => notify(self.cq, 0),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            self.break_now();
            return Err(VerbsError::Lost(format!(
                "ibv_req_notify_cq: {}",
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    /// Sleeps until the armed CQ raises an event or `left` passes.
    fn sleep(&mut self, left: Duration) -> Result<()> {
        // SAFETY: a live channel.
        let fd = unsafe { (*self.channel).fd };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n <= 0 {
            // A timeout (the caller checks the time) or EINTR: poll the CQ again.
            return Ok(());
        }
        let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: a live channel with an event ready (poll said so: this read does not
        // block); the event names our CQ, acknowledged before the CQ goes.
        let rc = unsafe { ffi::ibv_get_cq_event(self.channel, &mut cq, &mut ctx) };
        if rc != 0 {
            let cause = std::io::Error::last_os_error();
            self.break_now();
            return Err(VerbsError::Lost(format!("ibv_get_cq_event: {cause}")));
        }
        self.unacked += 1;
        if self.unacked >= ACK_EVERY {
            self.ack();
        }
        Ok(())
    }

    /// Acknowledges the completion events received.
    fn ack(&mut self) {
        if self.unacked > 0 && !self.cq.is_null() {
            // SAFETY: a live CQ and the number of its events received and not acknowledged.
            unsafe { ffi::ibv_ack_cq_events(self.cq, self.unacked) };
            self.unacked = 0;
        }
    }

    /// Destroys the QP and CQ at once (after which the device no longer touches the memory
    /// of their requests) and marks the queue pair broken.
    fn break_now(&mut self) {
        self.broken = true;
        self.destroy();
    }

    fn destroy(&mut self) {
        if !self.qp.is_null() {
            // SAFETY: the QP made in `create`, destroyed once (then nulled).
            unsafe { ffi::ibv_destroy_qp(self.qp) };
            self.qp = std::ptr::null_mut();
        }
        // Destroying a CQ waits for its events to be acknowledged.
        self.ack();
        if !self.cq.is_null() {
            // SAFETY: the CQ made in `create`, destroyed once after its QP.
            unsafe { ffi::ibv_destroy_cq(self.cq) };
            self.cq = std::ptr::null_mut();
        }
        if !self.channel.is_null() {
            // SAFETY: the channel made in `create`, destroyed once after its CQ.
            unsafe { ffi::ibv_destroy_comp_channel(self.channel) };
            self.channel = std::ptr::null_mut();
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.destroy();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_round_trip_through_bytes() {
        let e = Endpoint {
            qpn: 0x12,
            psn: 0xabcdef,
            lid: 7,
            mtu: 3,
            gid: [
                0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0x24, 0x13, 0xff, 0xfe, 0xc5, 0x51, 0x8f,
            ],
        };
        assert_eq!(Endpoint::from_bytes(&e.to_bytes()).unwrap(), e);
        assert!(Endpoint::from_bytes(&e.to_bytes()[1..]).is_err());
    }
}
