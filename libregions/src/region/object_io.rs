//! Reads and writes of a small region stored as an object in a daemon's object store
//! (docs/ARCHITECTURE.md, "Small regions as objects"). They go to that daemon with object
//! requests over tcp, also on the object's own host (its neighbours share its memory, so no
//! process is handed it). What needs region memory (a mapping, a segment, words for atomics)
//! first moves the region to chunks ([`Region::ensure_chunks`]); a write past the object's
//! capacity reserves space and so moves it too. While the region moves, reads are served from
//! the object (its bytes are final once frozen) and writes wait for the move to end.

use std::time::{Duration, Instant};

use regions_proto::frame::{ObjectRef, Op, Request};
use regions_proto::v1;

use super::Region;
use crate::error::{RegionsError, Result};

/// How long a writer waits for a region to finish moving to chunks.
const MOVE_WAIT: Duration = Duration::from_secs(5);
/// Pause between looks at a moving region's map.
const MOVE_POLL: Duration = Duration::from_millis(2);

impl Region {
    /// The region's object, when it is a small region stored as one and reached as such:
    /// a session that asks for RDMA only moves it to chunks first (objects are reached over
    /// tcp).
    pub(crate) fn object(&self) -> Result<Option<v1::ObjectPlacement>> {
        let object = self.placed_object()?;
        if object.is_some() && !self.authority.tcp_allowed() {
            self.ensure_chunks()?;
            return self.placed_object();
        }
        Ok(object)
    }

    /// The region's object as its map says.
    fn placed_object(&self) -> Result<Option<v1::ObjectPlacement>> {
        Ok(self
            .state
            .read()
            .map_err(|_| Self::poisoned())?
            .object
            .clone())
    }

    /// Whether the region is a small region stored as an object.
    pub fn is_object(&self) -> bool {
        self.placed_object().is_ok_and(|o| o.is_some())
    }

    /// Waits (at most [`MOVE_WAIT`]) while the region moves from its object to chunks.
    pub(crate) fn wait_moved(&self) -> Result<()> {
        let deadline = Instant::now() + MOVE_WAIT;
        while self.placed_object()?.is_some_and(|o| o.moving) {
            if Instant::now() >= deadline {
                return Err(RegionsError::Daemon {
                    addr: self.authority.peer().to_owned(),
                    errno: libc::EAGAIN,
                    message: format!(
                        "region {} is still moving from its object to chunks after {} s: try \
                         again",
                        self.ino,
                        MOVE_WAIT.as_secs()
                    ),
                });
            }
            std::thread::sleep(MOVE_POLL);
            self.refresh()?;
        }
        Ok(())
    }

    /// Moves a small region stored as an object to chunks (for what needs region memory);
    /// nothing to do for any other region.
    pub(crate) fn ensure_chunks(&self) -> Result<()> {
        if self.placed_object()?.is_none() {
            return Ok(());
        }
        let info = self.authority.to_chunks(self.ino)?;
        self.state
            .write()
            .map_err(|_| Self::poisoned())?
            .apply(info, true);
        self.wait_moved()
    }

    /// Reads `buf.len()` bytes at `offset` of the object `o`.
    pub(crate) fn object_read(
        &self,
        o: &v1::ObjectPlacement,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let (offset, len) = object_range(o, offset, buf.len())?;
        self.renew_if_due()?;
        let request = Request::ObjRead {
            ino: self.ino,
            at: at(o),
            offset,
            len,
        };
        let reply = self.object_request(o, &request)?;
        let (now, bytes) = ObjectRef::decode(Op::ObjRead, &reply).map_err(|e| {
            RegionsError::Invalid(format!("object read reply of region {}: {e}", self.ino))
        })?;
        if bytes.len() != buf.len() {
            return Err(RegionsError::Invalid(format!(
                "object read of region {} returned {} bytes, not {}",
                self.ino,
                bytes.len(),
                buf.len()
            )));
        }
        buf.copy_from_slice(bytes);
        self.note_object_slot(now);
        crate::transport::TransportStats::add(
            &self.authority.stats().remote_bytes_read,
            buf.len() as u64,
        );
        Ok(())
    }

    /// Writes `data` at `offset` of the object `o`.
    pub(crate) fn object_write(
        &self,
        o: &v1::ObjectPlacement,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let (offset, _) = object_range(o, offset, data.len())?;
        self.renew_if_due()?;
        let request = Request::ObjWrite {
            ino: self.ino,
            at: at(o),
            offset,
            data: bytes::Bytes::copy_from_slice(data),
        };
        let reply = self.object_request(o, &request)?;
        if let Ok((now, _)) = ObjectRef::decode(Op::ObjWrite, &reply) {
            self.note_object_slot(now);
        }
        crate::transport::TransportStats::add(
            &self.authority.stats().remote_bytes_written,
            data.len() as u64,
        );
        Ok(())
    }

    /// Sends an object request for `o`. A refusal as stale while the map still names `o` (the
    /// manager is moving or fitting it and has not recorded where yet) is waited out (at most
    /// [`MOVE_WAIT`]); once the map names something else the refusal goes to the caller, whose
    /// refresh then finds the new place.
    fn object_request(&self, o: &v1::ObjectPlacement, request: &Request) -> Result<Vec<u8>> {
        let deadline = Instant::now() + MOVE_WAIT;
        loop {
            let sent = self
                .authority
                .tcp_transport(&o.transport_addr)?
                .request(request, true);
            match sent {
                Err(e) if e.errno() == libc::ESTALE && Instant::now() < deadline => {
                    std::thread::sleep(MOVE_POLL);
                    self.refresh()?;
                    let same = self
                        .placed_object()?
                        .is_some_and(|now| now.address == o.address && now.id == o.id);
                    if !same {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
    }

    /// Remembers where a compaction moved the object (the daemon said where it is now: another
    /// slot, or, once the manager recorded its pointer at another block, that block).
    fn note_object_slot(&self, now: ObjectRef) {
        if let Ok(mut s) = self.state.write()
            && let Some(o) = s.object.as_mut()
            && o.id == now.id
        {
            (o.address, o.slot) = (now.address, now.slot);
        }
    }
}

fn at(o: &v1::ObjectPlacement) -> ObjectRef {
    ObjectRef {
        address: o.address,
        slot: o.slot,
        id: o.id,
    }
}

/// `offset` and `len` as an object request names them, checked against the object.
fn object_range(o: &v1::ObjectPlacement, offset: u64, len: usize) -> Result<(u32, u32)> {
    let end = offset.saturating_add(len as u64);
    if end > u64::from(o.capacity) {
        return Err(RegionsError::Invalid(format!(
            "{len} bytes at {offset} run past the {} bytes of the region's object",
            o.capacity
        )));
    }
    Ok((offset as u32, len as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_stay_inside_the_object() {
        let o = v1::ObjectPlacement {
            capacity: 100,
            ..Default::default()
        };
        assert_eq!(object_range(&o, 10, 90).unwrap(), (10, 90));
        assert!(object_range(&o, 10, 91).is_err());
        assert!(object_range(&o, u64::MAX, 1).is_err());
    }
}
