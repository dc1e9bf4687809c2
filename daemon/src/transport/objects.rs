//! Object requests of the transport ([`regions_proto::frame::Op::ObjAlloc`] and the others):
//! small regions live as objects in the daemon's [`ObjectStore`] (docs/ARCHITECTURE.md,
//! "Small regions as objects"), reached only through the daemon, never through shared memory.
//!
//! Who may do what:
//! - allocating, freeing, moving objects, correcting their pointers and settling the objects
//!   an earlier manager left is the manager's,
//!   compacting on demand the administrator's (`regionfs compact`): connections that proved
//!   the cluster secret;
//! - reads and writes need the region named by the request: a node component (cluster secret)
//!   names it in the header, an application's capability must be for that region and cover
//!   the bytes. The store then checks that the object belongs to that region (`ESTALE` when
//!   it does not: the caller's map is stale).

use bytes::{BufMut, Bytes, BytesMut};
use regions_proto::frame::{
    HELD_OBJECT_LEN, HeldObject, INDIRECT_OBJECT_LEN, IndirectObject, OBJECT_REF_LEN,
    ObjectCompaction, ObjectRef, Request, Settle,
};

use crate::error::{DaemonError, Result};
use crate::objects::{ObjectStore, Owner};
use crate::transport::auth::{OUT_OF_REACH, Reach};

/// The owner an object request acts for. Inode numbers are never reused, so the generation
/// is always 0.
fn owner(ino: u64) -> Owner {
    Owner { ino, generation: 0 }
}

/// Whether `reach` may touch `len` bytes at `offset` of region `ino`'s object.
fn check_reach(reach: Reach, ino: u64, offset: u32, len: u32) -> Result<()> {
    match reach {
        Reach::Named(named) if named == ino => Ok(()),
        Reach::Capability(cap)
            if cap.ino == ino && cap.covers(u64::from(offset), u64::from(len)) =>
        {
            Ok(())
        }
        _ => Err(DaemonError::Denied(OUT_OF_REACH.into())),
    }
}

fn node_only(secret: bool, what: &str) -> Result<()> {
    if secret {
        return Ok(());
    }
    Err(DaemonError::Denied(format!(
        "{what} refused: only node components and administrators holding the cluster secret \
         may (the manager allocates and frees objects, `regionfs compact` compacts)"
    )))
}

fn with_ref(at: ObjectRef, extra: usize) -> BytesMut {
    let mut out = BytesMut::with_capacity(OBJECT_REF_LEN + extra);
    at.encode(&mut out);
    out
}

/// Serves one object request; the reply payload, or the refusal.
pub fn serve(store: &ObjectStore, secret: bool, reach: Reach, request: Request) -> Result<Bytes> {
    match request {
        Request::ObjAlloc { ino, len, manager } => {
            node_only(secret, "allocating an object")?;
            store.serve_manager(manager);
            let (at, capacity) = store.alloc_with_capacity(owner(ino), len)?;
            let mut out = with_ref(at, 4);
            out.put_u32_le(capacity);
            Ok(out.freeze())
        }
        Request::ObjFree { ino, at } => {
            node_only(secret, "freeing an object")?;
            store.free(owner(ino), at)?;
            Ok(Bytes::new())
        }
        Request::ObjRead {
            ino,
            at,
            offset,
            len,
        } => {
            check_reach(reach, ino, offset, len)?;
            let mut buf = vec![0u8; len as usize];
            let now = store.read(owner(ino), at, offset, &mut buf)?.unwrap_or(at);
            let mut out = with_ref(now, buf.len());
            out.extend_from_slice(&buf);
            Ok(out.freeze())
        }
        Request::ObjWrite {
            ino,
            at,
            offset,
            data,
        } => {
            let len = u32::try_from(data.len())
                .map_err(|_| DaemonError::Invalid("object write too large".into()))?;
            check_reach(reach, ino, offset, len)?;
            let now = store.write(owner(ino), at, offset, &data)?.unwrap_or(at);
            Ok(with_ref(now, 0).freeze())
        }
        Request::ObjFreeze { ino, at, manager } => {
            node_only(secret, "freezing an object")?;
            store.serve_manager(manager);
            store.freeze(owner(ino), at)?;
            Ok(Bytes::new())
        }
        Request::ObjRefit {
            ino,
            at,
            len,
            manager,
        } => {
            node_only(secret, "fitting an object")?;
            store.serve_manager(manager);
            let (new, capacity) = store.refit(owner(ino), at, len)?;
            let mut out = with_ref(new, 4);
            out.put_u32_le(capacity);
            Ok(out.freeze())
        }
        Request::ObjThaw { ino, at } => {
            node_only(secret, "thawing an object")?;
            store.thaw(owner(ino), at)?;
            Ok(Bytes::new())
        }
        Request::ObjIndirect { max } => {
            node_only(secret, "listing moved objects")?;
            let found = store.indirect(max as usize);
            let mut out = BytesMut::with_capacity(found.len() * INDIRECT_OBJECT_LEN);
            for x in found {
                IndirectObject {
                    ino: x.owner.ino,
                    old: x.old,
                    new: x.new,
                }
                .encode(&mut out);
            }
            Ok(out.freeze())
        }
        Request::ObjCorrect { ino, at } => {
            node_only(secret, "correcting an object's pointer")?;
            let new = store.correct(owner(ino), at)?;
            Ok(with_ref(new, 0).freeze())
        }
        Request::ObjInherited { manager, max } => {
            node_only(secret, "listing inherited objects")?;
            let found = store.inherited(manager, max as usize);
            let mut out = BytesMut::with_capacity(found.len() * HELD_OBJECT_LEN);
            for x in found {
                HeldObject {
                    object: IndirectObject {
                        ino: x.object.owner.ino,
                        old: x.object.old,
                        new: x.object.new,
                    },
                    frozen: x.frozen,
                }
                .encode(&mut out);
            }
            Ok(out.freeze())
        }
        Request::ObjSettle { manager, objects } => {
            node_only(secret, "settling inherited objects")?;
            let (mut kept, mut freed) = (0u32, 0u32);
            for o in objects {
                // One that went meanwhile (freed by its region's own work) is not counted.
                match store.settle(manager, owner(o.ino), o.at, o.settle) {
                    Ok(true) if o.settle == Settle::Free => freed += 1,
                    Ok(true) => kept += 1,
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(ino = o.ino, error = %e, "inherited object not settled")
                    }
                }
            }
            if freed > 0 {
                tracing::info!(
                    kept,
                    freed,
                    "objects no region names freed for a new manager"
                );
            }
            let mut out = BytesMut::with_capacity(8);
            out.put_u32_le(kept);
            out.put_u32_le(freed);
            Ok(out.freeze())
        }
        Request::ObjCompact => {
            node_only(secret, "compacting the object store")?;
            let done = store.compact(None)?;
            tracing::info!(?done, "object store compacted on request");
            Ok(ObjectCompaction {
                blocks_freed: u64::from(done.blocks_freed),
                objects_merged: done.objects_merged,
                objects_moved: done.objects_moved,
                bytes_freed: done.bytes_freed,
            }
            .encode())
        }
        other => Err(DaemonError::Invalid(format!(
            "{} is not an object request",
            other.op()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use regions_proto::capability::{Capability, RIGHT_READ, RIGHT_WRITE, WHOLE_REGION};

    fn cap(ino: u64, offset: u64, len: u64) -> Reach {
        Reach::Capability(Capability {
            ino,
            rights: RIGHT_READ | RIGHT_WRITE,
            expires_ms: u64::MAX,
            issued: 1,
            offset,
            len,
            host: 0,
        })
    }

    fn read(store: &ObjectStore, reach: Reach, ino: u64, at: ObjectRef, len: u32) -> Result<Bytes> {
        let req = Request::ObjRead {
            ino,
            at,
            offset: 0,
            len,
        };
        serve(store, false, reach, req).map(|b| b.slice(OBJECT_REF_LEN..))
    }

    #[test]
    fn only_node_components_allocate_and_free_and_reads_stay_in_their_region() {
        let store = ObjectStore::new(1 << 20).unwrap();
        let alloc = Request::ObjAlloc {
            ino: 5,
            len: 100,
            manager: 1,
        };
        let refused = serve(&store, false, cap(5, 0, WHOLE_REGION), alloc.clone());
        assert_eq!(refused.unwrap_err().errno(), libc::EACCES);
        let reply = serve(&store, true, Reach::Named(5), alloc).unwrap();
        let (at, rest) = ObjectRef::decode(regions_proto::frame::Op::ObjAlloc, &reply).unwrap();
        assert!(u32::from_le_bytes(rest.try_into().unwrap()) >= 100);
        let other = serve(
            &store,
            true,
            Reach::Named(6),
            Request::ObjAlloc {
                ino: 6,
                len: 10,
                manager: 1,
            },
        );
        let (theirs, _) =
            ObjectRef::decode(regions_proto::frame::Op::ObjAlloc, &other.unwrap()).unwrap();

        let write = Request::ObjWrite {
            ino: 5,
            at,
            offset: 0,
            data: Bytes::from_static(b"mine"),
        };
        serve(&store, false, cap(5, 0, WHOLE_REGION), write).unwrap();
        assert_eq!(
            &read(&store, cap(5, 0, WHOLE_REGION), 5, at, 4).unwrap()[..],
            b"mine"
        );
        // A capability for another region, or for other bytes, reaches nothing here.
        let wrong = read(&store, cap(6, 0, WHOLE_REGION), 5, at, 4);
        assert_eq!(wrong.unwrap_err().errno(), libc::EACCES);
        let narrow = read(&store, cap(5, 64, 8), 5, at, 4);
        assert_eq!(narrow.unwrap_err().errno(), libc::EACCES);
        // Naming one's own region but another region's object: the store refuses it as stale.
        let theft = read(&store, cap(5, 0, WHOLE_REGION), 5, theirs, 4);
        assert_eq!(theft.unwrap_err().errno(), libc::ESTALE);

        let free = Request::ObjFree { ino: 5, at };
        let refused = serve(&store, false, cap(5, 0, WHOLE_REGION), free.clone());
        assert_eq!(refused.unwrap_err().errno(), libc::EACCES);
        serve(&store, true, Reach::Named(5), free).unwrap();
        let gone = read(&store, cap(5, 0, WHOLE_REGION), 5, at, 4);
        assert_eq!(gone.unwrap_err().errno(), libc::ESTALE);
    }
}
