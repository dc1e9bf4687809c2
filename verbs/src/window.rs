//! Memory windows (type 2B): remote access to a byte range of a registration, granted through
//! one queue pair only, and revoked by deallocating the window.
//!
//! The daemon gives applications (which hold capabilities, not the cluster secret) their
//! one-sided access this way: a window per capability range, bound on the daemon's queue pair
//! of that application's connection (`QueuePair::bind_window`), over a registration that has
//! no remote access of its own ([`crate::Access::WINDOWS_ONLY`]).

use std::sync::Arc;

use ibverbs_sys as ffi;

use crate::device::ProtectionDomain;
use crate::error::{Result, VerbsError};

/// A type 2 memory window of a protection domain: unbound until a queue pair binds it; its
/// remote key stops working when it is rebound or dropped (`ibv_dealloc_mw`).
#[derive(Debug)]
pub struct MemoryWindow {
    mw: *mut ffi::ibv_mw,
    /// The key of the current binding (0: never bound).
    rkey: u32,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: an MW handle may be used and deallocated from any thread (libibverbs is thread
// safe); binding goes through `&mut self`.
unsafe impl Send for MemoryWindow {}
// SAFETY: `&MemoryWindow` only reads plain fields.
unsafe impl Sync for MemoryWindow {}

impl MemoryWindow {
    /// A new unbound type 2 window of `pd`.
    pub fn alloc(pd: &Arc<ProtectionDomain>) -> Result<MemoryWindow> {
        let device = pd.device();
        if !device.has_windows() {
            return Err(VerbsError::Invalid(format!(
                "{} does not bind type 2B memory windows",
                device.name()
            )));
        }
        // SAFETY: a live PD; `alloc_mw` is the provider's (ibv_alloc_mw is an inline wrapper
        // around it); the window is owned by the returned value (deallocated in Drop).
        let mw = unsafe {
            let ctx = (*pd.raw()).context;
            match (*ctx).ops.alloc_mw {
                Some(alloc) => alloc(pd.raw(), ffi::IBV_MW_TYPE_2),
                None => std::ptr::null_mut(),
            }
        };
        if mw.is_null() {
            return Err(VerbsError::last(format!("ibv_alloc_mw({})", device.name())));
        }
        Ok(MemoryWindow {
            mw,
            rkey: 0,
            pd: Arc::clone(pd),
        })
    }

    /// The remote key of the current binding (valid once [`crate::QueuePair::bind_window`]
    /// returned it).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The key the next binding takes: the window's index with the next 8-bit key
    /// (`ibv_inc_rkey`), so that the keys of earlier bindings stop working.
    pub(crate) fn next_rkey(&self) -> u32 {
        let base = if self.rkey == 0 {
            // SAFETY: `mw` is live until Drop; the key is a plain field.
            unsafe { (*self.mw).rkey }
        } else {
            self.rkey
        };
        (base & 0xffff_ff00) | (base.wrapping_add(1) & 0xff)
    }

    pub(crate) fn bound(&mut self, rkey: u32) {
        self.rkey = rkey;
    }

    pub(crate) fn raw(&self) -> *mut ffi::ibv_mw {
        self.mw
    }

    pub(crate) fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: the window allocated in `alloc`, deallocated once; after this its keys fail
        // at the device.
        unsafe {
            let ctx = (*self.pd.raw()).context;
            if let Some(dealloc) = (*ctx).ops.dealloc_mw {
                let rc = dealloc(self.mw);
                if rc != 0 {
                    eprintln!("regions-verbs: ibv_dealloc_mw failed with errno {rc}");
                }
            }
        }
    }
}
