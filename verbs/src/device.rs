//! An opened RDMA device, the port and GID its queue pairs use, and protection domains.

use std::ffi::CStr;
use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::error::{Result, VerbsError};

/// The port every queue pair uses (soft-RoCE and most NICs have one).
const PORT: u8 = 1;

/// The names of the RDMA devices of this host (empty when there are none, or no driver).
pub fn device_names() -> Result<Vec<String>> {
    let list = DeviceList::get()?;
    Ok(list.devices().map(device_name).collect())
}

/// `ibv_get_device_list`'s array, freed on drop.
struct DeviceList {
    list: *mut *mut ffi::ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList> {
        let mut n: libc::c_int = 0;
        // SAFETY: ibv_get_device_list writes the count into `n` and returns a NULL-terminated
        // array owned by the caller (freed in Drop), or NULL with errno set.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            // No driver loaded (ENOSYS) is a host without devices, not a failure.
            if e.raw_os_error() == Some(libc::ENOSYS) {
                return Ok(DeviceList {
                    list: std::ptr::null_mut(),
                    len: 0,
                });
            }
            return Err(VerbsError::Call {
                what: "ibv_get_device_list".into(),
                cause: e,
            });
        }
        Ok(DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    fn devices(&self) -> impl Iterator<Item = *mut ffi::ibv_device> + '_ {
        (0..self.len).filter_map(move |i| {
            // SAFETY: `list` holds `len` device pointers (checked non-null above when len > 0).
            let d = unsafe { *self.list.add(i) };
            (!d.is_null()).then_some(d)
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: the array came from ibv_get_device_list and is freed once; devices
            // opened from it stay valid (libibverbs documents this).
            unsafe { ffi::ibv_free_device_list(self.list) };
        }
    }
}

fn device_name(d: *mut ffi::ibv_device) -> String {
    // SAFETY: `d` is a device of a live list; the name is a NUL-terminated string it owns.
    let name = unsafe { ffi::ibv_get_device_name(d) };
    if name.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated, valid while the list lives (copied out here).
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

/// An opened RDMA device and what its queue pairs need of it: the port, its MTU and LID, and
/// the GID at the chosen index.
#[derive(Debug)]
pub struct Device {
    ctx: *mut ffi::ibv_context,
    name: String,
    gid_index: u8,
    gid: [u8; 16],
    lid: u16,
    active_mtu: u32,
    /// RDMA READs and atomics this device answers at once per queue pair (responder).
    max_rd_atomic: u8,
    /// ... and has outstanding at once per queue pair (initiator).
    max_init_rd_atomic: u8,
    atomics: AtomicScope,
    /// The device binds type 2 memory windows (to one queue pair each).
    windows: bool,
}

/// What a device's 8-byte atomics are atomic with respect to (`ibv_device_attr.atomic_cap`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicScope {
    /// The device performs no atomics.
    None,
    /// Other atomics through this device only: a CPU's atomic instruction on the same word
    /// may interleave with one (`IBV_ATOMIC_HCA`, most devices, soft-RoCE included).
    Device,
    /// Atomic with respect to the CPUs too (`IBV_ATOMIC_GLOB`).
    Global,
}

// SAFETY: libibverbs contexts may be used from any thread (the library is thread safe); the
// struct holds no thread-affine state and only reads its own fields after construction.
unsafe impl Send for Device {}
// SAFETY: see `Send`; every verbs call made through `&Device` is thread safe.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `name`, or the first one when `None`, using GID `gid_index` of port 1.
    pub fn open(name: Option<&str>, gid_index: u8) -> Result<Arc<Device>> {
        let list = DeviceList::get()?;
        let found = list
            .devices()
            .find(|d| name.is_none_or(|n| device_name(*d) == n))
            .ok_or_else(|| VerbsError::NoDevice(name.map(str::to_owned)))?;
        let dev_name = device_name(found);
        // SAFETY: `found` is a device of the live list; the context is owned by the Device
        // (closed in Drop).
        let ctx = unsafe { ffi::ibv_open_device(found) };
        if ctx.is_null() {
            return Err(VerbsError::last(format!("ibv_open_device({dev_name})")));
        }
        drop(list);
        let mut device = Device {
            ctx,
            name: dev_name,
            gid_index,
            gid: [0; 16],
            lid: 0,
            active_mtu: 0,
            max_rd_atomic: 1,
            max_init_rd_atomic: 1,
            atomics: AtomicScope::None,
            windows: false,
        };
        device.query()?;
        Ok(Arc::new(device))
    }

    /// Fills in the port, GID and device attributes.
    fn query(&mut self) -> Result<()> {
        // SAFETY: ibv_port_attr is plain data (integers); all zeroes is a valid value.
        let mut port: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a writable attribute struct; the compat type is the
        // prefix layout libibverbs' own ibv_query_port macro passes.
        let rc = unsafe {
            ffi::ibv_query_port(
                self.ctx,
                PORT,
                (&raw mut port).cast::<ffi::_compat_ibv_port_attr>(),
            )
        };
        if rc != 0 {
            return Err(VerbsError::errno(
                format!("ibv_query_port({}, {PORT})", self.name),
                rc,
            ));
        }
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(VerbsError::Invalid(format!(
                "port {PORT} of RDMA device {} is not active (state {}): is its network \
                 interface up?",
                self.name, port.state
            )));
        }
        self.lid = port.lid;
        self.active_mtu = port.active_mtu;
        // SAFETY: ibv_gid is a union of plain bytes; zeroed is valid.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a writable gid.
        let rc = unsafe {
            ffi::ibv_query_gid(self.ctx, PORT, libc::c_int::from(self.gid_index), &mut gid)
        };
        if rc != 0 {
            return Err(VerbsError::errno(
                format!("ibv_query_gid({}, index {})", self.name, self.gid_index),
                rc,
            ));
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        self.gid = unsafe { gid.raw };
        // SAFETY: ibv_device_attr is plain data; zeroed is valid.
        let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live context and a writable attribute struct.
        let rc = unsafe { ffi::ibv_query_device(self.ctx, &mut attr) };
        if rc != 0 {
            return Err(VerbsError::errno(
                format!("ibv_query_device({})", self.name),
                rc,
            ));
        }
        self.max_rd_atomic = u8::try_from(attr.max_qp_rd_atom.clamp(1, 16)).unwrap_or(1);
        self.max_init_rd_atomic = u8::try_from(attr.max_qp_init_rd_atom.clamp(1, 16)).unwrap_or(1);
        self.windows = attr.device_cap_flags & ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2B != 0;
        self.atomics = match attr.atomic_cap {
            ffi::IBV_ATOMIC_GLOB => AtomicScope::Global,
            ffi::IBV_ATOMIC_HCA => AtomicScope::Device,
            _ => AtomicScope::None,
        };
        Ok(())
    }

    /// The device's name ("rxe0", "mlx5_0").
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the device binds type 2B memory windows: windows reached through one queue
    /// pair only ([`crate::MemoryWindow`]).
    pub fn has_windows(&self) -> bool {
        self.windows
    }

    /// What the device's 8-byte atomics are atomic with respect to.
    pub fn atomic_scope(&self) -> AtomicScope {
        self.atomics
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_context {
        self.ctx
    }

    pub(crate) fn gid(&self) -> [u8; 16] {
        self.gid
    }

    pub(crate) fn gid_index(&self) -> u8 {
        self.gid_index
    }

    pub(crate) fn lid(&self) -> u16 {
        self.lid
    }

    pub(crate) fn active_mtu(&self) -> u32 {
        self.active_mtu
    }

    pub(crate) fn max_rd_atomic(&self) -> u8 {
        self.max_rd_atomic
    }

    pub(crate) fn max_init_rd_atomic(&self) -> u8 {
        self.max_init_rd_atomic
    }

    pub(crate) fn port(&self) -> u8 {
        PORT
    }

    /// A new protection domain of this device.
    pub fn protection_domain(self: &Arc<Self>) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: a live context; the PD is owned by the returned value (freed in Drop), which
        // keeps the device open.
        let pd = unsafe { ffi::ibv_alloc_pd(self.ctx) };
        if pd.is_null() {
            return Err(VerbsError::last(format!("ibv_alloc_pd({})", self.name)));
        }
        Ok(Arc::new(ProtectionDomain {
            pd,
            device: Arc::clone(self),
        }))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the context was opened in `open`, and everything made from it (PDs, CQs,
        // QPs, MRs) holds an Arc of this Device, so none is left.
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
}

/// A protection domain: registrations and queue pairs of one domain only reach each other.
#[derive(Debug)]
pub struct ProtectionDomain {
    pd: *mut ffi::ibv_pd,
    device: Arc<Device>,
}

// SAFETY: a PD handle may be used from any thread (libibverbs is thread safe).
unsafe impl Send for ProtectionDomain {}
// SAFETY: see `Send`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_pd {
        self.pd
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: the PD was allocated in `protection_domain`; registrations and queue pairs
        // hold an Arc of it, so none is left.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}
