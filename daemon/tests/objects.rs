//! Object requests (small regions stored as objects, docs/ARCHITECTURE.md "Small regions as
//! objects") against a real transport server over sockets: the manager (cluster secret)
//! allocates and frees; a capability reads and writes only its own region's object, with its
//! rights; objects keep their bytes while compaction moves them, and requests through the old
//! pointer are answered with where the object is now.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::{Client, TOKEN, server, status};
use regions_daemon::objects::ObjectStore;
use regions_daemon::pools::Pools;
use regions_proto::auth::Secret;
use regions_proto::capability::{Capability, CapabilityKey, RIGHT_READ, RIGHT_WRITE, now_ms};
use regions_proto::frame::{
    Frame, HeldObject, OBJECT_REF_LEN, ObjectRef, Op, Request, Settle, SettleObject,
};

fn token(ino: u64, rights: u8, range: (u64, u64)) -> Bytes {
    let key = CapabilityKey::from_secret(&Secret::new(TOKEN).unwrap());
    Bytes::from(key.mint(&Capability {
        ino,
        rights,
        expires_ms: now_ms() + 60_000,
        issued: 3,
        offset: range.0,
        len: range.1,
        host: 0,
    }))
}

fn call(c: &mut Client, req: &Request, cap: u64) -> Frame {
    let mut out = BytesMut::new();
    req.to_frame(7, cap).encode(&mut out);
    c.send_raw(&out).unwrap();
    c.recv().expect("the server closed the connection")
}

/// A connection to `addr` holding a capability to read and write all of region `ino`.
fn holding_capability(addr: std::net::SocketAddr, ino: u64) -> Client {
    let mut app = Client::connect(addr);
    let ok = call(
        &mut app,
        &Request::Hello {
            token: token(ino, RIGHT_READ | RIGHT_WRITE, (0, u64::MAX)),
        },
        5,
    );
    assert_eq!(status(&ok), 0);
    app
}

fn alloc(node: &mut Client, ino: u64, len: u32) -> ObjectRef {
    let reply = node.call(&Request::ObjAlloc {
        ino,
        len,
        manager: 1,
    });
    assert_eq!(status(&reply), 0, "{:?}", reply.error_message());
    let (at, rest) = ObjectRef::decode(Op::ObjAlloc, &reply.payload).unwrap();
    let capacity = u32::from_le_bytes(rest.try_into().unwrap());
    assert!(
        capacity >= len && capacity < len + 512,
        "capacity {capacity}"
    );
    at
}

fn write(ino: u64, at: ObjectRef, offset: u32, data: &[u8]) -> Request {
    Request::ObjWrite {
        ino,
        at,
        offset,
        data: Bytes::copy_from_slice(data),
    }
}

fn read(ino: u64, at: ObjectRef, offset: u32, len: u32) -> Request {
    Request::ObjRead {
        ino,
        at,
        offset,
        len,
    }
}

/// The bytes of a read reply and where the object is now.
fn bytes_of(reply: &Frame) -> (ObjectRef, Vec<u8>) {
    assert_eq!(status(reply), 0, "{:?}", reply.error_message());
    assert!(reply.payload.len() >= OBJECT_REF_LEN);
    let (now, data) = ObjectRef::decode(Op::ObjRead, &reply.payload).unwrap();
    (now, data.to_vec())
}

fn serving_objects(store: &Arc<ObjectStore>) -> regions_daemon::transport::TransportServer {
    let (srv, _) = server(Arc::new(Pools::new()), Duration::from_millis(50));
    srv.serve_objects(Arc::clone(store));
    srv
}

#[test]
fn a_capability_reaches_its_own_regions_object_only() {
    let store = Arc::new(ObjectStore::new(4 << 20).unwrap());
    let srv = serving_objects(&store);
    let mut node = Client::authenticated(srv.local_addr(), TOKEN);
    let mine = alloc(&mut node, 10, 300);
    let theirs = alloc(&mut node, 11, 300);
    assert_eq!(
        status(&node.call(&write(11, theirs, 0, b"secret of 11"))),
        0
    );

    let mut app = holding_capability(srv.local_addr(), 10);
    assert_eq!(
        status(&call(&mut app, &write(10, mine, 100, b"hello object"), 5)),
        0
    );
    let (now, data) = bytes_of(&call(&mut app, &read(10, mine, 98, 16), 5));
    assert_eq!(now, mine);
    assert_eq!(&data, b"\0\0hello object\0\0");

    // Attacks from a capability for region 10: its own region named with the other object,
    // the other region named, allocating, freeing, reading past the slot.
    let stolen = call(&mut app, &read(10, theirs, 0, 12), 5);
    assert_eq!(
        status(&stolen),
        libc::ESTALE,
        "{:?}",
        stolen.error_message()
    );
    assert_eq!(
        status(&call(&mut app, &read(11, theirs, 0, 12), 5)),
        libc::EACCES
    );
    assert_eq!(
        status(&call(&mut app, &write(11, theirs, 0, b"overwrite"), 5)),
        libc::EACCES
    );
    let grab = call(
        &mut app,
        &Request::ObjAlloc {
            ino: 10,
            len: 10,
            manager: 1,
        },
        5,
    );
    assert_eq!(status(&grab), libc::EACCES);
    assert!(grab.error_message().unwrap().contains("manager"));
    let compact = call(&mut app, &Request::ObjCompact, 5);
    assert_eq!(status(&compact), libc::EACCES);
    assert_eq!(
        status(&call(
            &mut app,
            &Request::ObjFree {
                ino: 11,
                at: theirs
            },
            5
        )),
        libc::EACCES
    );
    assert_eq!(
        status(&call(&mut app, &read(10, mine, 0, 8192), 5)),
        libc::EINVAL
    );
    let (_, untouched) = bytes_of(&node.call(&read(11, theirs, 0, 12)));
    assert_eq!(&untouched, b"secret of 11");

    // Read-only, and a byte range: writes and bytes outside are refused.
    let ro = call(
        &mut app,
        &Request::Hello {
            token: token(10, RIGHT_READ, (0, 64)),
        },
        6,
    );
    assert_eq!(status(&ro), 0);
    assert_eq!(
        status(&call(&mut app, &write(10, mine, 0, b"x"), 6)),
        libc::EACCES
    );
    assert_eq!(status(&call(&mut app, &read(10, mine, 0, 64), 6)), 0);
    assert_eq!(
        status(&call(&mut app, &read(10, mine, 60, 8), 6)),
        libc::EACCES
    );

    // Past its slot a write is EFBIG: the region must move to a segment first.
    let big = call(&mut app, &write(10, mine, 300, &[1u8; 1000]), 5);
    assert_eq!(status(&big), libc::EFBIG, "{:?}", big.error_message());

    // Moving to chunks: the manager freezes the object; writes are refused (ESTALE, the
    // writer refreshes its map), reads still served. Only the manager may freeze.
    let freeze = Request::ObjFreeze {
        ino: 10,
        at: mine,
        manager: 1,
    };
    assert_eq!(status(&call(&mut app, &freeze, 5)), libc::EACCES);
    assert_eq!(status(&node.call(&freeze)), 0);
    let late = call(&mut app, &write(10, mine, 0, b"late"), 5);
    assert_eq!(status(&late), libc::ESTALE, "{:?}", late.error_message());
    let (_, kept) = bytes_of(&call(&mut app, &read(10, mine, 100, 12), 5));
    assert_eq!(&kept, b"hello object");
    assert_eq!(status(&node.call(&write(11, theirs, 0, b"still free"))), 0);

    // Freed by the manager: the next access through the old pointer is stale.
    assert_eq!(
        status(&node.call(&Request::ObjFree { ino: 10, at: mine })),
        0
    );
    assert_eq!(
        status(&call(&mut app, &read(10, mine, 0, 4), 5)),
        libc::ESTALE
    );
}

#[test]
fn objects_keep_their_bytes_across_compaction_and_old_pointers_are_corrected() {
    let store = Arc::new(ObjectStore::new(16 << 20).unwrap());
    store.set_auto_compaction(false);
    let srv = serving_objects(&store);
    let mut node = Client::authenticated(srv.local_addr(), TOKEN);
    let content = |ino: u64| format!("region {ino} ").repeat(8).into_bytes();
    let mut live: Vec<(u64, ObjectRef)> = (0..600u64)
        .map(|i| {
            let ino = 100 + i;
            let at = alloc(&mut node, ino, 120);
            assert_eq!(status(&node.call(&write(ino, at, 0, &content(ino)))), 0);
            (ino, at)
        })
        .collect();
    // Free most of them, every block keeping a few: sparse blocks to merge.
    let mut kept = Vec::new();
    for (i, (ino, at)) in live.drain(..).enumerate() {
        if i % 5 == 0 {
            kept.push((ino, at));
        } else {
            assert_eq!(status(&node.call(&Request::ObjFree { ino, at })), 0);
        }
    }
    // Readers on their own connections check every kept object, over and over, while the
    // compaction runs: never a torn or foreign byte, never a refusal.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let before = store.allocated_bytes();
    let addr = srv.local_addr();
    let (done, passes) = std::thread::scope(|s| {
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (kept, stop) = (&kept, &stop);
                s.spawn(move || {
                    let mut reader = Client::authenticated(addr, TOKEN);
                    let mut passes = 0;
                    while passes < 2 || !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for &(ino, at) in kept {
                            let want = content(ino);
                            let reply = reader.call(&read(ino, at, 0, want.len() as u32));
                            assert_eq!(bytes_of(&reply).1, want, "region {ino}");
                        }
                        passes += 1;
                    }
                    passes
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        let reply = node.call(&Request::ObjCompact);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let passes: Vec<usize> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        (reply, passes)
    });
    assert!(passes.iter().all(|&p| p >= 2), "{passes:?}");
    assert_eq!(status(&done), 0, "{:?}", done.error_message());
    let done = regions_proto::frame::ObjectCompaction::decode(&done.payload).unwrap();
    assert!(done.blocks_freed > 0, "{done:?}");
    assert_eq!(done.bytes_freed, before - store.allocated_bytes());
    assert!(done.bytes_freed > 0, "{done:?}");
    // Every kept object reads back through the pointer taken before the compaction; a moved
    // one is answered with its new slot, which works too.
    let mut moved = 0;
    for (ino, at) in kept {
        let want = content(ino);
        let (now, data) = bytes_of(&node.call(&read(ino, at, 0, want.len() as u32)));
        assert_eq!(data, want, "region {ino}");
        if now != at {
            moved += 1;
            assert_eq!((now.address, now.id), (at.address, at.id));
            let (again, data) = bytes_of(&node.call(&read(ino, now, 0, want.len() as u32)));
            assert_eq!((again, data), (now, want));
        }
    }
    assert!(
        moved > 0 && moved as u64 <= done.objects_moved,
        "{moved} {done:?}"
    );
}

#[test]
fn a_daemon_without_an_object_store_says_so() {
    let (srv, _) = server(Arc::new(Pools::new()), Duration::from_millis(50));
    let mut node = Client::authenticated(srv.local_addr(), TOKEN);
    let reply = node.call(&Request::ObjAlloc {
        ino: 3,
        len: 10,
        manager: 1,
    });
    assert_eq!(status(&reply), libc::EOPNOTSUPP);
    assert!(reply.error_message().unwrap().contains("object store"));
}

#[test]
fn a_refit_copies_into_a_smaller_object_or_changes_nothing() {
    let store = Arc::new(ObjectStore::new(4 << 20).unwrap());
    let srv = serving_objects(&store);
    let mut node = Client::authenticated(srv.local_addr(), TOKEN);
    let big = alloc(&mut node, 20, 4000);
    assert_eq!(status(&node.call(&write(20, big, 0, b"keep me"))), 0);
    assert_eq!(status(&node.call(&write(20, big, 3000, b"far"))), 0);
    // A byte in use past the new size: refused, and the object takes writes as before.
    let refused = node.call(&Request::ObjRefit {
        ino: 20,
        at: big,
        len: 100,
        manager: 1,
    });
    assert_eq!(
        status(&refused),
        libc::EBUSY,
        "{:?}",
        refused.error_message()
    );
    assert_eq!(status(&node.call(&write(20, big, 3000, b"\0\0\0"))), 0);
    // Now it fits: the new object holds the bytes, the old one is frozen.
    let reply = node.call(&Request::ObjRefit {
        ino: 20,
        at: big,
        len: 100,
        manager: 1,
    });
    assert_eq!(status(&reply), 0, "{:?}", reply.error_message());
    let (small, rest) = ObjectRef::decode(Op::ObjRefit, &reply.payload).unwrap();
    assert!(u32::from_le_bytes(rest.try_into().unwrap()) < 4000);
    let (_, bytes) = bytes_of(&node.call(&read(20, small, 0, 7)));
    assert_eq!(&bytes, b"keep me");
    let late = node.call(&write(20, big, 0, b"late"));
    assert_eq!(status(&late), libc::ESTALE, "{:?}", late.error_message());
    assert_eq!(status(&node.call(&write(20, small, 0, b"new!"))), 0);
    // A capability holder may not refit.
    let mut app = holding_capability(srv.local_addr(), 20);
    let refit = Request::ObjRefit {
        ino: 20,
        at: small,
        len: 10,
        manager: 1,
    };
    assert_eq!(status(&call(&mut app, &refit, 5)), libc::EACCES);
    // Nor list moved objects (other regions' among them) or correct a pointer.
    let list = Request::ObjIndirect { max: 10 };
    assert_eq!(status(&call(&mut app, &list, 6)), libc::EACCES);
    let correct = Request::ObjCorrect { ino: 20, at: small };
    assert_eq!(status(&call(&mut app, &correct, 7)), libc::EACCES);
    // Nor list or settle the objects an earlier manager left.
    let inherited = Request::ObjInherited {
        manager: 2,
        max: 10,
    };
    assert_eq!(status(&call(&mut app, &inherited, 8)), libc::EACCES);
    let settle = Request::ObjSettle {
        manager: 2,
        objects: vec![SettleObject {
            ino: 20,
            at: small,
            settle: Settle::Free,
        }],
    };
    assert_eq!(status(&call(&mut app, &settle, 9)), libc::EACCES);
    // The node may: nothing moved here, so nothing is listed, and its own block's pointer
    // is already the one a correction gives.
    let listed = node.call(&list);
    assert_eq!(status(&listed), 0);
    assert!(listed.payload.is_empty());
    let corrected = node.call(&correct);
    assert_eq!(status(&corrected), 0, "{:?}", corrected.error_message());
    let (now, _) = ObjectRef::decode(Op::ObjCorrect, &corrected.payload).unwrap();
    assert_eq!((now.address, now.id), (small.address, small.id));
}

/// After a manager restarts, the store lists the objects its predecessor allocated (and which
/// it froze); the new manager keeps those its regions name, ending the freeze it left, and
/// frees the others. What the new manager allocates is its own, and a settled object is not
/// settled again.
#[test]
fn a_new_manager_settles_the_objects_its_predecessor_left() {
    let store = Arc::new(ObjectStore::new(4 << 20).unwrap());
    let srv = serving_objects(&store);
    let mut node = Client::authenticated(srv.local_addr(), TOKEN);
    // Manager 1 places two regions' objects and freezes the first (a fit under way).
    let named = alloc(&mut node, 30, 100);
    let orphan = alloc(&mut node, 31, 100);
    assert_eq!(status(&node.call(&write(31, orphan, 0, b"lost"))), 0);
    let freeze = Request::ObjFreeze {
        ino: 30,
        at: named,
        manager: 1,
    };
    assert_eq!(status(&node.call(&freeze)), 0);
    // It dies. Manager 2 allocates before it asks: its own object is not inherited.
    let fresh = node.call(&Request::ObjAlloc {
        ino: 32,
        len: 50,
        manager: 2,
    });
    assert_eq!(status(&fresh), 0);
    let (fresh, _) = ObjectRef::decode(Op::ObjAlloc, &fresh.payload).unwrap();
    let ask = Request::ObjInherited {
        manager: 2,
        max: 100,
    };
    let listed = node.call(&ask);
    assert_eq!(status(&listed), 0, "{:?}", listed.error_message());
    let mut held = HeldObject::decode_all(&listed.payload).unwrap();
    held.sort_by_key(|h| h.object.ino);
    assert_eq!(held.len(), 2, "{held:?}");
    let seen = |h: &HeldObject| (h.object.ino, h.object.old, h.frozen);
    assert_eq!(seen(&held[0]), (30, named, true));
    assert_eq!(seen(&held[1]), (31, orphan, false));
    // Still frozen until settled: a freeze does not lapse.
    let late = node.call(&write(30, named, 0, b"x"));
    assert_eq!(status(&late), libc::ESTALE);
    let settle = Request::ObjSettle {
        manager: 2,
        objects: vec![
            SettleObject {
                ino: 30,
                at: named,
                settle: Settle::KeepAndThaw,
            },
            SettleObject {
                ino: 31,
                at: orphan,
                settle: Settle::Free,
            },
            // Not inherited: left alone.
            SettleObject {
                ino: 32,
                at: fresh,
                settle: Settle::Free,
            },
        ],
    };
    let reply = node.call(&settle);
    assert_eq!(status(&reply), 0, "{:?}", reply.error_message());
    assert_eq!(
        &reply.payload[..],
        &[1, 0, 0, 0, 1, 0, 0, 0],
        "kept 1, freed 1"
    );
    assert_eq!(status(&node.call(&write(30, named, 0, b"mine"))), 0);
    assert_eq!(status(&node.call(&read(31, orphan, 0, 4))), libc::ESTALE);
    assert_eq!(status(&node.call(&read(32, fresh, 0, 4))), 0);
    // Settled objects are listed no more; settling again changes nothing.
    let listed = node.call(&ask);
    assert!(listed.payload.is_empty(), "{:?}", listed.payload);
    let reply = node.call(&settle);
    assert_eq!(&reply.payload[..], &[0; 8]);
    // A freeze by the manager served is its own: a keep does not end it.
    let freeze = Request::ObjFreeze {
        ino: 30,
        at: named,
        manager: 2,
    };
    assert_eq!(status(&node.call(&freeze)), 0);
    let third = Request::ObjInherited {
        manager: 3,
        max: 100,
    };
    let listed = HeldObject::decode_all(&node.call(&third).payload).unwrap();
    let frozen: Vec<_> = listed
        .iter()
        .filter(|h| h.frozen)
        .map(|h| h.object.ino)
        .collect();
    assert_eq!(frozen, vec![30], "manager 3 inherits manager 2's freeze");
    let keep_by_2 = Request::ObjSettle {
        manager: 3,
        objects: vec![SettleObject {
            ino: 30,
            at: named,
            settle: Settle::Keep,
        }],
    };
    assert_eq!(status(&node.call(&keep_by_2)), 0);
    let still = node.call(&write(30, named, 0, b"x"));
    assert_eq!(
        status(&still),
        libc::ESTALE,
        "a keep without thaw leaves it frozen"
    );
}
