//! The binary frame codec of the tcp data transport between clients and daemons.
//!
//! Every frame is a fixed 64-byte little-endian [`Header`] followed by `payload_len` bytes of
//! payload. Requests carry an [`Op`]; replies reuse the request's op with [`FLAG_REPLY`] set and
//! a `status` (0 = ok, else a POSIX errno). Many requests may be in flight on one connection;
//! `request_id` matches replies to requests.
//!
//! Header layout (byte offsets):
//!
//! | off | field        | type | notes                                         |
//! |-----|--------------|------|-----------------------------------------------|
//! | 0   | magic        | u16  | [`MAGIC`]                                     |
//! | 2   | version      | u8   | [`VERSION`]                                   |
//! | 3   | op           | u8   | [`Op`]                                        |
//! | 4   | flags        | u16  | [`FLAG_REPLY`], [`FLAG_DELTAS`]               |
//! | 6   | reserved     | u16  | must be 0                                     |
//! | 8   | request_id   | u64  |                                               |
//! | 16  | capability   | u64  | token id; 0 = connection-authenticated        |
//! | 24  | pool         | u32  | pool global id, at most [`MAX_POOL`]          |
//! | 28  | status       | u32  | replies: 0 = ok, else a POSIX errno           |
//! | 32  | offset       | u64  |                                               |
//! | 40  | length       | u64  |                                               |
//! | 48  | object_id    | u64  |                                               |
//! | 56  | payload_len  | u32  |                                               |
//! | 60  | delta        | u32  | with [`FLAG_DELTAS`]: see below, else 0       |
//!
//! A client that names the region it means (`object_id`) also says where in the region it
//! believes the bytes are, with [`FLAG_DELTAS`]: `delta` (and, in vector ops, the second
//! field of each range, otherwise reserved) is [`crate::layout::chunk_delta`] of the region
//! offset and the pool offset of its first byte. The daemon refuses (`ESTALE`) a range whose
//! chunks back other region offsets now: a chunk given back to the same region at another
//! offset since the client read its map.
//!
//! Decoding never panics: a bad frame yields a [`FrameError`] whose message says what was
//! wrong, so the daemon can close the connection with a logged reason.

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 64;
/// Magic number at the start of every frame ("RG" little-endian).
pub const MAGIC: u16 = 0x5247;
/// The protocol version this codec speaks. Version 3: requests may state where in their
/// region their ranges lie ([`FLAG_DELTAS`]); version 2: HELLO with the cluster secret is a
/// challenge–response ([`crate::handshake`]); version 1 sent the secret itself. Both ends must
/// speak the same version (upgrade a cluster's components together).
pub const VERSION: u8 = 3;
/// Flag bit marking a reply frame.
pub const FLAG_REPLY: u16 = 1;
/// Flag bit of a request whose `delta` fields say where in its region each range lies.
pub const FLAG_DELTAS: u16 = 2;
/// All flag bits this version knows.
const KNOWN_FLAGS: u16 = FLAG_REPLY | FLAG_DELTAS;
/// Largest pool global id (17 bits).
pub const MAX_POOL: u32 = 0x1FFFF;
/// Encoded size of one [`Range`] in a vector payload.
pub const RANGE_LEN: usize = 24;
/// Size of the count + reserved prefix of a `WriteV` payload.
const WRITEV_PREFIX_LEN: usize = 8;
/// `EIO`, substituted when [`Frame::reply_err`] is given a zero errno.
const EIO: u32 = 5;

/// Errors of decoding or validating a frame. Each one means the peer sent a bad frame.
#[derive(thiserror::Error, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// A complete buffer is shorter than the structure it should hold.
    #[error("truncated frame: need {needed} bytes, have only {have}")]
    Short {
        /// Bytes required.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// The frame does not start with [`MAGIC`].
    #[error(
        "bad frame magic {0:#06x} (expected 0x5247): the peer does not speak the regions \
         transport or the stream lost sync"
    )]
    BadMagic(u16),
    /// The frame's version is not [`VERSION`].
    #[error(
        "unsupported frame version {0} (this build speaks version {VERSION}): upgrade the older side"
    )]
    UnsupportedVersion(u8),
    /// The op byte names no known [`Op`].
    #[error("unknown frame op {0} (known ops are 1..=21)")]
    UnknownOp(u8),
    /// Flag bits other than [`FLAG_REPLY`] and [`FLAG_DELTAS`] are set.
    #[error("unknown frame flags {0:#06x} (only 0x0001 = reply and 0x0002 = deltas are defined)")]
    UnknownFlags(u16),
    /// A payload (or the reply a read would need) is larger than the configured limit.
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    Oversized {
        /// Size asked for.
        len: u64,
        /// Configured limit ([`Limits::max_payload`]).
        max: u32,
    },
    /// A size in the frame is inconsistent with its op.
    #[error("malformed {op} frame: {what} is {actual}, expected {expected}")]
    BadLength {
        /// The frame's op.
        op: Op,
        /// Which size was wrong.
        what: &'static str,
        /// What the op requires.
        expected: u64,
        /// What the frame holds.
        actual: u64,
    },
    /// An atomic op (CAS, fetch-add) targets an offset that is not 8-byte aligned.
    #[error("atomic operation at offset {offset:#x} is not 8-byte aligned")]
    Misaligned {
        /// The offending offset.
        offset: u64,
    },
    /// A vector frame lists more ranges than allowed.
    #[error("vector frame of {count} ranges exceeds the limit of {max} ranges")]
    TooManyRanges {
        /// Ranges in the frame.
        count: u64,
        /// Configured limit ([`Limits::max_ranges`]).
        max: u32,
    },
    /// A pool id does not fit in 17 bits.
    #[error("pool id {0:#x} does not fit in 17 bits (largest pool id is 0x1ffff)")]
    BadPool(u32),
    /// A reserved field is not zero.
    #[error("reserved frame field is not zero: the peer is newer or the frame is corrupt")]
    NonZeroReserved,
    /// `offset + len` of a range does not fit in 64 bits.
    #[error("range at offset {offset:#x} of {len} bytes runs past the end of the 64-bit space")]
    Overflow {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
    },
    /// A reply frame was given where a request was expected.
    #[error("got a {0} reply frame where a request was expected")]
    UnexpectedReply(Op),
}

/// Operation of a frame.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Authenticate the connection; payload = auth token (cluster secret or capability).
    Hello = 1,
    /// Read `length` bytes at `offset`; reply payload = the bytes.
    Read = 2,
    /// Write the payload at `offset`; `length` must equal the payload length.
    Write = 3,
    /// Vector read; payload = 24-byte ranges, reply payload = their concatenated data.
    ReadV = 4,
    /// Vector write; payload = count u32 + reserved u32, the ranges, then the data.
    WriteV = 5,
    /// 8-byte compare-and-swap; payload = expected u64 + new u64, reply payload = old u64.
    Cas = 6,
    /// 8-byte fetch-add; payload = addend u64, reply payload = old u64.
    FetchAdd = 7,
    /// Liveness check, no payload.
    Ping = 8,
    /// Waits until the 8-byte word at `offset` differs from `expected` (changed by a CAS or
    /// fetch-add at the daemon or through a mapped segment) or `timeout_us` passed; payload =
    /// expected u64 + timeout_us u64, reply payload = the word's value then. The connection
    /// serves nothing else meanwhile.
    WaitChange = 9,
    /// Sets up RDMA for this connection: payload = the client's queue pair endpoint
    /// ([`RDMA_ENDPOINT_LEN`] bytes), reply payload = the endpoint of the queue pair the daemon
    /// made for the connection and connected to it (it lives as long as the connection), then
    /// one flags byte ([`RDMA_CONNECT_ATOMICS`]). `EOPNOTSUPP` from a daemon without RDMA.
    RdmaConnect = 10,
    /// Remote keys to READ the chunks of one range (named and checked as a READ of it, but
    /// for whole chunks); reply payload = one [`RdmaChunkKey`] per chunk.
    RdmaReadKeys = 11,
    /// As [`Op::RdmaReadKeys`], for READ, WRITE and atomics (checked as a WRITE).
    RdmaWriteKeys = 12,
    /// Wakes the daemon's `WAIT_CHANGE` waiters of the 8-byte word at `offset` (checked as a
    /// WRITE of it), after a client changed it one-sided over RDMA, which the daemon does not
    /// see; no payload, reply payload = the word's value.
    Wake = 13,
    /// A new object of `length` bytes (zeros) for the region `object_id` in the daemon's
    /// object store (cluster secret only: the manager places small regions); `offset` = the
    /// asking manager's incarnation ([`Op::ObjInherited`]); reply payload = the [`ObjectRef`]
    /// then its capacity as a u32.
    ObjAlloc = 14,
    /// Frees the object named by the payload ([`ObjectRef`]) of the region `object_id`
    /// (cluster secret only); no reply payload.
    ObjFree = 15,
    /// Reads `length` bytes at `offset` of the region `object_id`'s object named by the
    /// payload ([`ObjectRef`]); reply payload = where the object is now ([`ObjectRef`]), then
    /// the bytes.
    ObjRead = 16,
    /// Writes at `offset` of the region `object_id`'s object: payload = its [`ObjectRef`],
    /// then `length` bytes; reply payload = where the object is now ([`ObjectRef`]).
    ObjWrite = 17,
    /// Compacts every size class of the daemon's object store now (cluster secret only);
    /// reply payload = [`ObjectCompaction`].
    ObjCompact = 18,
    /// Marks the region `object_id`'s object named by the payload ([`ObjectRef`]) as moving
    /// to chunks (cluster secret only; `offset` = the manager's incarnation): writes to it
    /// are refused with `ESTALE` from then on, reads still served; no reply payload. Only a
    /// thaw, a free or a later manager's [`Op::ObjSettle`] ends a freeze.
    ObjFreeze = 19,
    /// Takes writes to a frozen object again (a move given up; cluster secret only);
    /// payload = its [`ObjectRef`], no reply payload.
    ObjThaw = 20,
    /// A new object of `length` bytes holding the region `object_id`'s object named by the
    /// payload ([`ObjectRef`]), which is frozen (cluster secret only; `offset` = the manager's
    /// incarnation; `EBUSY` when a byte past the new object's capacity is in use); reply
    /// payload as [`Op::ObjAlloc`]'s.
    ObjRefit = 21,
    /// At most `length` (at most [`MAX_INDIRECT`]) objects whose pointers compaction made
    /// indirect (cluster secret only: the manager corrects them); reply payload = that many
    /// [`IndirectObject`]s.
    ObjIndirect = 22,
    /// Makes the pointer to the region `object_id`'s object at its block's own address its one
    /// pointer, once the manager recorded it (cluster secret only); payload = the object's
    /// [`ObjectRef`] (old or new), reply payload = the new [`ObjectRef`]. The old pointer keeps
    /// working for a grace period.
    ObjCorrect = 23,
    /// At most `length` (at most [`MAX_INDIRECT`]) objects that managers before the one of
    /// incarnation `offset` allocated and that no manager settled since (cluster secret
    /// only): after a manager restarts, the objects its predecessor may have left unnamed or
    /// frozen. The first request of a new incarnation (this or an allocation, fit or freeze)
    /// makes every object the store holds such an object. Reply payload = that many
    /// [`HeldObject`]s; successive calls start where the last one ended.
    ObjInherited = 24,
    /// Settles objects [`Op::ObjInherited`] listed (cluster secret only; `offset` = the
    /// manager's incarnation): payload = [`SettleObject`]s, each kept (and thawed) or freed,
    /// and only while it is still inherited (an object freed or re-allocated meanwhile is
    /// left alone); reply payload = how many were kept and freed (two u32).
    ObjSettle = 25,
}

/// Encoded size of a [`HeldObject`].
pub const HELD_OBJECT_LEN: usize = 8 + 2 * OBJECT_REF_LEN + 4;
/// Encoded size of a [`SettleObject`].
pub const SETTLE_OBJECT_LEN: usize = 8 + OBJECT_REF_LEN + 4;

/// An object an earlier manager allocated ([`Op::ObjInherited`]'s reply).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HeldObject {
    /// Its region, the pointer handed out for it (`old`) and the pointer at its own block
    /// (`new`: the same unless compaction moved it).
    pub object: IndirectObject,
    /// An earlier manager froze it and no one thawed it.
    pub frozen: bool,
}

impl HeldObject {
    /// Appends the encoding.
    pub fn encode(&self, buf: &mut BytesMut) {
        self.object.encode(buf);
        buf.put_u32_le(u32::from(self.frozen));
    }

    /// Decodes a whole [`Op::ObjInherited`] reply payload.
    pub fn decode_all(payload: &[u8]) -> Result<Vec<HeldObject>, FrameError> {
        let op = Op::ObjInherited;
        whole_records(op, payload, HELD_OBJECT_LEN)?;
        payload
            .chunks_exact(HELD_OBJECT_LEN)
            .map(|c| {
                let (object, mut rest) = IndirectObject::decode(op, c)?;
                Ok(HeldObject {
                    object,
                    frozen: rest.get_u32_le() != 0,
                })
            })
            .collect()
    }
}

/// What [`Op::ObjSettle`] does with an inherited object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settle {
    /// Its region names it: it is the new manager's like any other (frozen or not).
    Keep,
    /// Its region names it and does not move: kept, and takes writes again.
    KeepAndThaw,
    /// No region names it: freed.
    Free,
}

/// One object of an [`Op::ObjSettle`] request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SettleObject {
    /// The region it belongs to.
    pub ino: u64,
    /// Its pointer, as [`HeldObject::key`].
    pub at: ObjectRef,
    pub settle: Settle,
}

impl SettleObject {
    /// Appends the encoding.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.put_u64_le(self.ino);
        self.at.encode(buf);
        buf.put_u32_le(match self.settle {
            Settle::Keep => 0,
            Settle::KeepAndThaw => 1,
            Settle::Free => 2,
        });
    }

    /// Decodes a whole [`Op::ObjSettle`] request payload.
    pub fn decode_all(payload: &[u8]) -> Result<Vec<SettleObject>, FrameError> {
        let op = Op::ObjSettle;
        whole_records(op, payload, SETTLE_OBJECT_LEN)?;
        payload
            .chunks_exact(SETTLE_OBJECT_LEN)
            .map(|mut c| {
                let ino = c.get_u64_le();
                let (at, mut rest) = ObjectRef::decode(op, c)?;
                let settle = match rest.get_u32_le() {
                    0 => Settle::Keep,
                    1 => Settle::KeepAndThaw,
                    2 => Settle::Free,
                    other => {
                        return Err(bad_length(op, "settle action (0, 1 or 2)", 2, other.into()));
                    }
                };
                Ok(SettleObject { ino, at, settle })
            })
            .collect()
    }
}

/// Checks that `payload` is whole records of `len` bytes.
fn whole_records(op: Op, payload: &[u8], len: usize) -> Result<(), FrameError> {
    if payload.len().is_multiple_of(len) {
        return Ok(());
    }
    Err(bad_length(
        op,
        "payload length (whole records)",
        (payload.len() / len * len) as u64,
        payload.len() as u64,
    ))
}

/// The most [`IndirectObject`]s one [`Op::ObjIndirect`] asks for (and [`HeldObject`]s one
/// [`Op::ObjInherited`] asks for, [`SettleObject`]s one [`Op::ObjSettle`] carries).
pub const MAX_INDIRECT: u32 = 4096;
/// Encoded size of an [`IndirectObject`].
pub const INDIRECT_OBJECT_LEN: usize = 8 + 2 * OBJECT_REF_LEN;

/// An object whose pointer names another block's address than its own ([`Op::ObjIndirect`]'s
/// reply): its region, the pointer as handed out, and the pointer at its block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IndirectObject {
    /// The region it belongs to.
    pub ino: u64,
    /// The pointer the region's map holds.
    pub old: ObjectRef,
    /// The pointer at the object's own block.
    pub new: ObjectRef,
}

impl IndirectObject {
    /// Appends the encoding.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.put_u64_le(self.ino);
        self.old.encode(buf);
        self.new.encode(buf);
    }

    /// Decodes a whole [`Op::ObjIndirect`] reply payload.
    pub fn decode_all(payload: &[u8]) -> Result<Vec<IndirectObject>, FrameError> {
        let op = Op::ObjIndirect;
        whole_records(op, payload, INDIRECT_OBJECT_LEN)?;
        payload
            .chunks_exact(INDIRECT_OBJECT_LEN)
            .map(|c| Ok(IndirectObject::decode(op, c)?.0))
            .collect()
    }

    /// The one at the start of `payload` (of an `op` reply), and the bytes after it.
    fn decode(op: Op, mut payload: &[u8]) -> Result<(IndirectObject, &[u8]), FrameError> {
        if payload.len() < INDIRECT_OBJECT_LEN {
            return Err(bad_length(
                op,
                "record length",
                INDIRECT_OBJECT_LEN as u64,
                payload.len() as u64,
            ));
        }
        let ino = payload.get_u64_le();
        let (old, rest) = ObjectRef::decode(op, payload)?;
        let (new, rest) = ObjectRef::decode(op, rest)?;
        Ok((IndirectObject { ino, old, new }, rest))
    }
}

/// Encoded size of an [`ObjectCompaction`].
pub const OBJECT_COMPACTION_LEN: usize = 32;

/// What one compaction of a daemon's object store did ([`Op::ObjCompact`]'s reply).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ObjectCompaction {
    /// Blocks merged into others (their memory given back).
    pub blocks_freed: u64,
    /// Objects copied into another block.
    pub objects_merged: u64,
    /// Of those, objects that took another slot.
    pub objects_moved: u64,
    /// Bytes of memory the store held before less after.
    pub bytes_freed: u64,
}

impl ObjectCompaction {
    /// The 32-byte encoding.
    pub fn encode(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(OBJECT_COMPACTION_LEN);
        for v in [
            self.blocks_freed,
            self.objects_merged,
            self.objects_moved,
            self.bytes_freed,
        ] {
            buf.put_u64_le(v);
        }
        buf.freeze()
    }

    /// Decodes a reply payload.
    pub fn decode(mut payload: &[u8]) -> Result<ObjectCompaction, FrameError> {
        let n = OBJECT_COMPACTION_LEN as u64;
        expect_len(
            Op::ObjCompact,
            "reply payload length",
            n,
            payload.len() as u64,
        )?;
        Ok(ObjectCompaction {
            blocks_freed: payload.get_u64_le(),
            objects_merged: payload.get_u64_le(),
            objects_moved: payload.get_u64_le(),
            bytes_freed: payload.get_u64_le(),
        })
    }
}

/// Encoded size of an [`ObjectRef`].
pub const OBJECT_REF_LEN: usize = 12;

/// Where a small region's object is in a daemon's object store: a block address, the slot it
/// was in when the pointer was made (a hint once compaction moved it), and its id in the
/// block. Object requests name it; the daemon finds a moved object by id and replies with
/// where it is now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ObjectRef {
    /// The block address.
    pub address: u32,
    /// The slot (a hint after compaction).
    pub slot: u32,
    /// The object's id in its block (never 0).
    pub id: u32,
}

impl ObjectRef {
    /// Appends the 12-byte encoding.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.put_u32_le(self.address);
        buf.put_u32_le(self.slot);
        buf.put_u32_le(self.id);
    }

    /// The reference at the start of `payload`, and the bytes after it.
    pub fn decode(op: Op, mut payload: &[u8]) -> Result<(ObjectRef, &[u8]), FrameError> {
        if payload.len() < OBJECT_REF_LEN {
            return Err(bad_length(
                op,
                "payload length (an object reference first)",
                OBJECT_REF_LEN as u64,
                payload.len() as u64,
            ));
        }
        let at = ObjectRef {
            address: payload.get_u32_le(),
            slot: payload.get_u32_le(),
            id: payload.get_u32_le(),
        };
        Ok((at, payload))
    }
}

/// Encoded size of a queue pair endpoint in [`Op::RdmaConnect`].
pub const RDMA_ENDPOINT_LEN: usize = 27;
/// Bit of the flags byte after the daemon's endpoint in an [`Op::RdmaConnect`] reply: the
/// client may apply 8-byte atomics one-sided (without it, atomics go over tcp).
pub const RDMA_CONNECT_ATOMICS: u8 = 1;
/// Encoded size of one [`RdmaChunkKey`].
pub const RDMA_CHUNK_KEY_LEN: usize = 24;

/// Where bytes of one pool chunk are for one-sided access: `len` bytes from `pool_offset`
/// (within one chunk), at `addr` in the daemon, reached with the remote key `rkey` (of the
/// whole chunk's registration for node components: `pool_offset` is the chunk's start and
/// `len` the chunk size; of a memory window over the capability's bytes for applications).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaChunkKey {
    pub pool_offset: u64,
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

impl RdmaChunkKey {
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.put_u64_le(self.pool_offset);
        buf.put_u64_le(self.addr);
        buf.put_u32_le(self.rkey);
        // At most a chunk (128 KiB).
        buf.put_u32_le(u32::try_from(self.len).unwrap_or(u32::MAX));
    }

    /// The keys of a reply payload (a whole number of entries, else an error).
    pub fn decode_all(mut payload: &[u8]) -> Result<Vec<RdmaChunkKey>, FrameError> {
        if !payload.len().is_multiple_of(RDMA_CHUNK_KEY_LEN) {
            return Err(bad_length(
                Op::RdmaReadKeys,
                "reply payload length modulo 24 (the key size)",
                0,
                (payload.len() % RDMA_CHUNK_KEY_LEN) as u64,
            ));
        }
        let mut keys = Vec::with_capacity(payload.len() / RDMA_CHUNK_KEY_LEN);
        while !payload.is_empty() {
            keys.push(RdmaChunkKey {
                pool_offset: payload.get_u64_le(),
                addr: payload.get_u64_le(),
                rkey: payload.get_u32_le(),
                len: u64::from(payload.get_u32_le()),
            });
        }
        Ok(keys)
    }
}

impl TryFrom<u8> for Op {
    type Error = FrameError;

    fn try_from(v: u8) -> Result<Self, FrameError> {
        Ok(match v {
            1 => Op::Hello,
            2 => Op::Read,
            3 => Op::Write,
            4 => Op::ReadV,
            5 => Op::WriteV,
            6 => Op::Cas,
            7 => Op::FetchAdd,
            8 => Op::Ping,
            9 => Op::WaitChange,
            10 => Op::RdmaConnect,
            11 => Op::RdmaReadKeys,
            12 => Op::RdmaWriteKeys,
            13 => Op::Wake,
            14 => Op::ObjAlloc,
            15 => Op::ObjFree,
            16 => Op::ObjRead,
            17 => Op::ObjWrite,
            18 => Op::ObjCompact,
            19 => Op::ObjFreeze,
            20 => Op::ObjThaw,
            21 => Op::ObjRefit,
            22 => Op::ObjIndirect,
            23 => Op::ObjCorrect,
            24 => Op::ObjInherited,
            25 => Op::ObjSettle,
            other => return Err(FrameError::UnknownOp(other)),
        })
    }
}

impl Op {
    /// The op's name, as logs and metrics labels show it ("read", "fetch-add", ...).
    pub fn name(self) -> &'static str {
        match self {
            Op::Hello => "hello",
            Op::Read => "read",
            Op::Write => "write",
            Op::ReadV => "readv",
            Op::WriteV => "writev",
            Op::Cas => "cas",
            Op::FetchAdd => "fetch-add",
            Op::Ping => "ping",
            Op::WaitChange => "wait-change",
            Op::RdmaConnect => "rdma-connect",
            Op::RdmaReadKeys => "rdma-read-keys",
            Op::RdmaWriteKeys => "rdma-write-keys",
            Op::Wake => "wake",
            Op::ObjAlloc => "object-alloc",
            Op::ObjFree => "object-free",
            Op::ObjRead => "object-read",
            Op::ObjWrite => "object-write",
            Op::ObjCompact => "object-compact",
            Op::ObjFreeze => "object-freeze",
            Op::ObjThaw => "object-thaw",
            Op::ObjRefit => "object-refit",
            Op::ObjIndirect => "object-indirect",
            Op::ObjCorrect => "object-correct",
            Op::ObjInherited => "object-inherited",
            Op::ObjSettle => "object-settle",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Limits the decoder enforces on untrusted frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload of a frame, and largest data a read or vector read may ask for.
    pub max_payload: u32,
    /// Largest number of ranges in a vector frame.
    pub max_ranges: u32,
}

impl Default for Limits {
    /// 64 MiB payloads, 65,536 ranges.
    fn default() -> Self {
        Limits {
            max_payload: 64 << 20,
            max_ranges: 65_536,
        }
    }
}

/// Where an 8-byte word lies: its region (0: none) and offset there, and the pool range
/// behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WordAt {
    pub ino: u64,
    pub region_offset: u64,
    pub pool: u32,
    pub pool_offset: u64,
}

/// The chunk delta a request states for a range at `region_offset` of region `ino` backed at
/// `pool_offset` ([`crate::layout::chunk_delta`]); none for a range of no region (`ino` 0).
pub fn range_delta(ino: u64, region_offset: u64, pool_offset: u64) -> Option<u32> {
    (ino != 0).then(|| crate::layout::chunk_delta(region_offset, pool_offset))
}

/// The fixed 64-byte frame header. Magic, version and reserved fields are implicit: they are
/// written by [`Header::encode`] and checked by [`Header::decode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Operation (a reply repeats its request's op).
    pub op: Op,
    /// Flag bits ([`FLAG_REPLY`]).
    pub flags: u16,
    /// Chosen by the client; echoed in the reply.
    pub request_id: u64,
    /// Capability token id; 0 = connection-authenticated.
    pub capability: u64,
    /// Pool global id (at most [`MAX_POOL`]).
    pub pool: u32,
    /// Replies: 0 = ok, else a POSIX errno.
    pub status: u32,
    /// Byte offset in the pool.
    pub offset: u64,
    /// Length of the operation in bytes.
    pub length: u64,
    /// Object id.
    pub object_id: u64,
    /// Length of the payload that follows the header.
    pub payload_len: u32,
    /// With [`FLAG_DELTAS`]: the chunk delta of the range of a single-range op.
    pub delta: u32,
}

impl Header {
    /// A request header for `op` with every other field zero.
    pub fn new(op: Op, request_id: u64) -> Header {
        Header {
            op,
            flags: 0,
            request_id,
            capability: 0,
            pool: 0,
            status: 0,
            offset: 0,
            length: 0,
            object_id: 0,
            payload_len: 0,
            delta: 0,
        }
    }

    /// The chunk delta this request states for its single range, if it states one.
    pub fn stated_delta(&self) -> Option<u32> {
        (self.flags & FLAG_DELTAS != 0).then_some(self.delta)
    }

    /// Names region `ino` in this request and, for a region, states where in it the range
    /// backed at `pool_offset` lies (`FLAG_DELTAS`), so that a daemon refuses (`ESTALE`) a
    /// location older than a move of the region's chunks. A vector's ranges state their own.
    pub fn name_region(&mut self, ino: u64, region_offset: u64, pool_offset: u64) {
        self.object_id = ino;
        if let Some(delta) = range_delta(ino, region_offset, pool_offset) {
            self.flags |= FLAG_DELTAS;
            self.delta = delta;
        }
    }

    /// The request of an 8-byte atomic (`Cas`: expected, new; `FetchAdd`: addend) on the word
    /// at `at`, with its payload.
    pub fn atomic(
        op: Op,
        request_id: u64,
        capability: u64,
        at: &WordAt,
        operands: &[u64],
    ) -> (Header, Vec<u8>) {
        let payload: Vec<u8> = operands.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut header = Header::new(op, request_id);
        header.capability = capability;
        header.name_region(at.ino, at.region_offset, at.pool_offset);
        header.pool = at.pool;
        header.offset = at.pool_offset;
        header.length = 8;
        header.payload_len = payload.len() as u32;
        (header, payload)
    }

    /// Appends the 64-byte encoding of this header to `dst`, `payload_len` as stored.
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.reserve(HEADER_LEN);
        dst.put_u16_le(MAGIC);
        dst.put_u8(VERSION);
        dst.put_u8(self.op as u8);
        dst.put_u16_le(self.flags);
        dst.put_u16_le(0);
        dst.put_u64_le(self.request_id);
        dst.put_u64_le(self.capability);
        dst.put_u32_le(self.pool);
        dst.put_u32_le(self.status);
        dst.put_u64_le(self.offset);
        dst.put_u64_le(self.length);
        dst.put_u64_le(self.object_id);
        dst.put_u32_le(self.payload_len);
        dst.put_u32_le(self.delta);
    }

    /// Decodes and validates the header at the start of `src` (magic, version, op, flags,
    /// reserved fields, pool). Bytes after the first [`HEADER_LEN`] are ignored.
    pub fn decode(src: &[u8]) -> Result<Header, FrameError> {
        if src.len() < HEADER_LEN {
            return Err(FrameError::Short {
                needed: HEADER_LEN,
                have: src.len(),
            });
        }
        let mut b = &src[..HEADER_LEN];
        let magic = b.get_u16_le();
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = b.get_u8();
        if version != VERSION {
            return Err(FrameError::UnsupportedVersion(version));
        }
        let op = Op::try_from(b.get_u8())?;
        let flags = b.get_u16_le();
        let reserved16 = b.get_u16_le();
        let header = Header {
            op,
            flags,
            request_id: b.get_u64_le(),
            capability: b.get_u64_le(),
            pool: b.get_u32_le(),
            status: b.get_u32_le(),
            offset: b.get_u64_le(),
            length: b.get_u64_le(),
            object_id: b.get_u64_le(),
            payload_len: b.get_u32_le(),
            delta: b.get_u32_le(),
        };
        if reserved16 != 0 || (header.flags & FLAG_DELTAS == 0 && header.delta != 0) {
            return Err(FrameError::NonZeroReserved);
        }
        header.validate()?;
        Ok(header)
    }

    /// Checks the fields a decoded [`Header`] can still get wrong: flags and pool.
    fn validate(&self) -> Result<(), FrameError> {
        if self.flags & !KNOWN_FLAGS != 0 {
            return Err(FrameError::UnknownFlags(self.flags));
        }
        check_pool(self.pool)
    }
}

/// A header and its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The header; [`Frame::encode`] overrides its `payload_len`.
    pub header: Header,
    /// The payload.
    pub payload: Bytes,
}

impl Frame {
    /// Appends the encoded frame to `dst`, setting `payload_len` from the payload.
    ///
    /// A payload longer than `u32::MAX` bytes is a caller bug; its length is encoded as
    /// `u32::MAX`, which every decoder rejects as oversized.
    pub fn encode(&self, dst: &mut BytesMut) {
        let mut header = self.header;
        header.payload_len = u32::try_from(self.payload.len()).unwrap_or(u32::MAX);
        dst.reserve(HEADER_LEN + self.payload.len());
        header.encode(dst);
        dst.extend_from_slice(&self.payload);
    }

    /// Whether this frame is a reply ([`FLAG_REPLY`] set).
    pub fn is_reply(&self) -> bool {
        self.header.flags & FLAG_REPLY != 0
    }

    /// A successful reply to the request `req`, carrying `payload`.
    pub fn reply_ok(req: &Header, payload: Bytes) -> Frame {
        Frame::reply(req, 0, payload)
    }

    /// A failed reply to the request `req`: status `errno` (a zero errno becomes `EIO`, so the
    /// reply is never mistaken for success) and `msg` as the payload (may be empty).
    pub fn reply_err(req: &Header, errno: u32, msg: &str) -> Frame {
        let status = if errno == 0 { EIO } else { errno };
        Frame::reply(req, status, Bytes::copy_from_slice(msg.as_bytes()))
    }

    /// The message of a failed reply, if it has a valid UTF-8 one.
    pub fn error_message(&self) -> Option<&str> {
        if !self.is_reply() || self.header.status == 0 || self.payload.is_empty() {
            return None;
        }
        std::str::from_utf8(&self.payload).ok()
    }

    fn reply(req: &Header, status: u32, payload: Bytes) -> Frame {
        let header = Header {
            flags: req.flags | FLAG_REPLY,
            capability: 0,
            status,
            payload_len: u32::try_from(payload.len()).unwrap_or(u32::MAX),
            ..*req
        };
        Frame { header, payload }
    }
}

/// Decodes one frame from the front of a stream buffer.
///
/// Returns `Ok(None)` while the header or the payload is incomplete (reserving room for the
/// rest of the payload). The header is validated as soon as its 64 bytes are there, so an
/// oversized `payload_len` is rejected before any of it is buffered. A complete frame is split
/// off the front of `buf`.
pub fn decode_frame(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Frame>, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let header = Header::decode(buf)?;
    let oversized = FrameError::Oversized {
        len: u64::from(header.payload_len),
        max: limits.max_payload,
    };
    if header.payload_len > limits.max_payload {
        return Err(oversized);
    }
    let total = usize::try_from(header.payload_len)
        .ok()
        .and_then(|n| n.checked_add(HEADER_LEN))
        .ok_or(oversized)?;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut bytes = buf.split_to(total);
    bytes.advance(HEADER_LEN);
    Ok(Some(Frame {
        header,
        payload: bytes.freeze(),
    }))
}

/// One range of a vector op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// Pool global id.
    pub pool: u32,
    /// Byte offset in the pool.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The chunk delta of its first byte ([`FLAG_DELTAS`]); `None`: not stated.
    pub delta: Option<u32>,
}

impl Range {
    fn encode(&self, dst: &mut BytesMut) {
        dst.put_u32_le(self.pool);
        dst.put_u32_le(self.delta.unwrap_or(0));
        dst.put_u64_le(self.offset);
        dst.put_u64_le(self.len);
    }

    /// Decodes and validates one range; `src` must be exactly [`RANGE_LEN`] bytes. With
    /// `deltas`, the second field is the range's chunk delta, else reserved.
    fn decode(mut src: &[u8], deltas: bool) -> Result<Range, FrameError> {
        if src.len() != RANGE_LEN {
            return Err(FrameError::Short {
                needed: RANGE_LEN,
                have: src.len(),
            });
        }
        let pool = src.get_u32_le();
        let second = src.get_u32_le();
        if !deltas && second != 0 {
            return Err(FrameError::NonZeroReserved);
        }
        let range = Range {
            pool,
            offset: src.get_u64_le(),
            len: src.get_u64_le(),
            delta: deltas.then_some(second),
        };
        check_pool(range.pool)?;
        check_span(range.offset, range.len)?;
        Ok(range)
    }
}

/// A typed view of a request frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Authenticate: with capability id 0 a step of the cluster-secret handshake
    /// ([`crate::handshake`]), else a capability token.
    Hello {
        /// The handshake step or the capability token.
        token: Bytes,
    },
    /// Read `len` bytes at `offset` of `pool`.
    Read {
        /// Pool global id.
        pool: u32,
        /// Byte offset.
        offset: u64,
        /// Bytes to read.
        len: u64,
    },
    /// Write `data` at `offset` of `pool`.
    Write {
        /// Pool global id.
        pool: u32,
        /// Byte offset.
        offset: u64,
        /// The bytes to write.
        data: Bytes,
    },
    /// Read many ranges; the reply holds their data concatenated.
    ReadV {
        /// The ranges, in reply order.
        ranges: Vec<Range>,
    },
    /// Write many ranges; `data` is their data concatenated.
    WriteV {
        /// The ranges, in data order.
        ranges: Vec<Range>,
        /// Concatenated data, as long as the sum of the range lengths.
        data: Bytes,
    },
    /// 8-byte compare-and-swap at an aligned offset.
    Cas {
        /// Pool global id.
        pool: u32,
        /// 8-byte aligned offset.
        offset: u64,
        /// Value expected at `offset`.
        expected: u64,
        /// Value stored if the expected one was there.
        new: u64,
    },
    /// 8-byte fetch-add at an aligned offset.
    FetchAdd {
        /// Pool global id.
        pool: u32,
        /// 8-byte aligned offset.
        offset: u64,
        /// Value added (wrapping).
        addend: u64,
    },
    /// Liveness check.
    Ping,
    /// Wait for an 8-byte word at an aligned offset to change.
    WaitChange {
        /// Pool global id.
        pool: u32,
        /// 8-byte aligned offset.
        offset: u64,
        /// The value the caller saw.
        expected: u64,
        /// Longest wait in microseconds (the daemon may cap it).
        timeout_us: u64,
    },
    /// Wake the waiters of an 8-byte word.
    Wake {
        /// Pool global id.
        pool: u32,
        /// 8-byte aligned offset.
        offset: u64,
    },
    /// Set up RDMA: the client's queue pair endpoint.
    RdmaConnect { endpoint: Bytes },
    /// Remote keys for the chunks of a range, to read them (`write`: and write them).
    RdmaKeys {
        pool: u32,
        offset: u64,
        len: u64,
        write: bool,
    },
    /// A new object of `len` bytes for region `ino`, asked by the manager of incarnation
    /// `manager`.
    ObjAlloc { ino: u64, len: u32, manager: u64 },
    /// Free region `ino`'s object `at`.
    ObjFree { ino: u64, at: ObjectRef },
    /// Read `len` bytes at `offset` of region `ino`'s object `at`.
    ObjRead {
        ino: u64,
        at: ObjectRef,
        offset: u32,
        len: u32,
    },
    /// Write `data` at `offset` of region `ino`'s object `at`.
    ObjWrite {
        ino: u64,
        at: ObjectRef,
        offset: u32,
        data: Bytes,
    },
    /// Compact the daemon's object store.
    ObjCompact,
    /// Refuse writes to region `ino`'s object `at` from now on (it moves).
    ObjFreeze {
        ino: u64,
        at: ObjectRef,
        manager: u64,
    },
    /// Take writes to region `ino`'s object `at` again.
    ObjThaw { ino: u64, at: ObjectRef },
    /// A new object of `len` bytes with region `ino`'s object `at`'s bytes; `at` frozen.
    ObjRefit {
        ino: u64,
        at: ObjectRef,
        len: u32,
        manager: u64,
    },
    /// At most `max` objects whose pointers are indirect.
    ObjIndirect { max: u32 },
    /// Make region `ino`'s object `at`'s pointer the one at its own block.
    ObjCorrect { ino: u64, at: ObjectRef },
    /// At most `max` objects managers before incarnation `manager` left.
    ObjInherited { manager: u64, max: u32 },
    /// Keep or free objects [`Request::ObjInherited`] listed.
    ObjSettle {
        manager: u64,
        objects: Vec<SettleObject>,
    },
}

impl Request {
    /// The op of this request.
    pub fn op(&self) -> Op {
        match self {
            Request::Hello { .. } => Op::Hello,
            Request::Read { .. } => Op::Read,
            Request::Write { .. } => Op::Write,
            Request::ReadV { .. } => Op::ReadV,
            Request::WriteV { .. } => Op::WriteV,
            Request::Cas { .. } => Op::Cas,
            Request::FetchAdd { .. } => Op::FetchAdd,
            Request::Ping => Op::Ping,
            Request::WaitChange { .. } => Op::WaitChange,
            Request::Wake { .. } => Op::Wake,
            Request::RdmaConnect { .. } => Op::RdmaConnect,
            Request::RdmaKeys { write: false, .. } => Op::RdmaReadKeys,
            Request::RdmaKeys { write: true, .. } => Op::RdmaWriteKeys,
            Request::ObjAlloc { .. } => Op::ObjAlloc,
            Request::ObjFree { .. } => Op::ObjFree,
            Request::ObjRead { .. } => Op::ObjRead,
            Request::ObjWrite { .. } => Op::ObjWrite,
            Request::ObjCompact => Op::ObjCompact,
            Request::ObjFreeze { .. } => Op::ObjFreeze,
            Request::ObjThaw { .. } => Op::ObjThaw,
            Request::ObjRefit { .. } => Op::ObjRefit,
            Request::ObjIndirect { .. } => Op::ObjIndirect,
            Request::ObjCorrect { .. } => Op::ObjCorrect,
            Request::ObjInherited { .. } => Op::ObjInherited,
            Request::ObjSettle { .. } => Op::ObjSettle,
        }
    }

    /// Parses and validates a request frame against every length rule of its op.
    ///
    /// Header fields an op does not use (e.g. `pool` of vector ops, `length` of CAS) are
    /// ignored.
    pub fn parse(frame: &Frame, limits: &Limits) -> Result<Request, FrameError> {
        let h = &frame.header;
        let op = h.op;
        if frame.is_reply() {
            return Err(FrameError::UnexpectedReply(op));
        }
        h.validate()?;
        let payload = &frame.payload;
        let plen = payload.len() as u64;
        check_size(plen, limits)?;
        expect_len(op, "payload_len field", plen, u64::from(h.payload_len))?;
        let (pool, offset) = (h.pool, h.offset);
        Ok(match op {
            Op::Hello => Request::Hello {
                token: payload.clone(),
            },
            Op::Ping => {
                expect_len(op, "payload length", 0, plen)?;
                Request::Ping
            }
            Op::Read => {
                expect_len(op, "payload length", 0, plen)?;
                check_size(h.length, limits)?;
                check_span(offset, h.length)?;
                Request::Read {
                    pool,
                    offset,
                    len: h.length,
                }
            }
            Op::Write => {
                expect_len(
                    op,
                    "length field (must equal payload length)",
                    plen,
                    h.length,
                )?;
                check_span(offset, plen)?;
                Request::Write {
                    pool,
                    offset,
                    data: payload.clone(),
                }
            }
            Op::ReadV => {
                let rem = plen % RANGE_LEN as u64;
                expect_len(op, "payload length modulo 24 (the range size)", 0, rem)?;
                check_count(plen / RANGE_LEN as u64, limits)?;
                let ranges = parse_ranges(payload, h.flags & FLAG_DELTAS != 0)?;
                let total = check_total(&ranges, limits)?;
                expect_len(op, "length field (sum of range lengths)", total, h.length)?;
                Request::ReadV { ranges }
            }
            Op::WriteV => {
                let Some((mut prefix, rest)) = payload.split_at_checked(WRITEV_PREFIX_LEN) else {
                    return Err(bad_length(
                        op,
                        "payload length (range count prefix)",
                        8,
                        plen,
                    ));
                };
                let count = prefix.get_u32_le();
                if prefix.get_u32_le() != 0 {
                    return Err(FrameError::NonZeroReserved);
                }
                check_count(u64::from(count), limits)?;
                // `count` fits in u32, so `table` cannot overflow even on 32-bit targets' u64.
                let table = u64::from(count) * RANGE_LEN as u64;
                let Some((table, data)) = usize::try_from(table)
                    .ok()
                    .and_then(|table| rest.split_at_checked(table))
                else {
                    let actual = rest.len() as u64;
                    return Err(bad_length(op, "range table length", table, actual));
                };
                let ranges = parse_ranges(table, h.flags & FLAG_DELTAS != 0)?;
                let total = check_total(&ranges, limits)?;
                let what = "data length (sum of range lengths)";
                expect_len(op, what, total, data.len() as u64)?;
                expect_len(op, "length field (sum of range lengths)", total, h.length)?;
                let data = payload.slice_ref(data);
                Request::WriteV { ranges, data }
            }
            Op::Cas => {
                expect_len(op, "payload length (expected u64 + new u64)", 16, plen)?;
                check_atomic(offset)?;
                let mut p = &payload[..];
                let (expected, new) = (p.get_u64_le(), p.get_u64_le());
                Request::Cas {
                    pool,
                    offset,
                    expected,
                    new,
                }
            }
            Op::FetchAdd => {
                expect_len(op, "payload length (addend u64)", 8, plen)?;
                check_atomic(offset)?;
                let addend = (&payload[..]).get_u64_le();
                Request::FetchAdd {
                    pool,
                    offset,
                    addend,
                }
            }
            Op::WaitChange => {
                expect_len(op, "payload length (expected u64 + timeout u64)", 16, plen)?;
                check_atomic(offset)?;
                let mut p = &payload[..];
                let (expected, timeout_us) = (p.get_u64_le(), p.get_u64_le());
                Request::WaitChange {
                    pool,
                    offset,
                    expected,
                    timeout_us,
                }
            }
            Op::Wake => {
                expect_len(op, "payload length", 0, plen)?;
                check_atomic(offset)?;
                Request::Wake { pool, offset }
            }
            Op::RdmaConnect => {
                let n = RDMA_ENDPOINT_LEN as u64;
                expect_len(op, "payload length (a queue pair endpoint)", n, plen)?;
                Request::RdmaConnect {
                    endpoint: payload.clone(),
                }
            }
            Op::RdmaReadKeys | Op::RdmaWriteKeys => {
                expect_len(op, "payload length", 0, plen)?;
                check_size(h.length, limits)?;
                check_span(offset, h.length)?;
                Request::RdmaKeys {
                    pool,
                    offset,
                    len: h.length,
                    write: op == Op::RdmaWriteKeys,
                }
            }
            Op::ObjAlloc
            | Op::ObjFree
            | Op::ObjRead
            | Op::ObjWrite
            | Op::ObjFreeze
            | Op::ObjThaw
            | Op::ObjCorrect
            | Op::ObjRefit => parse_object(h, payload)?,
            Op::ObjCompact => {
                expect_len(op, "payload length", 0, plen)?;
                Request::ObjCompact
            }
            Op::ObjIndirect | Op::ObjInherited => {
                expect_len(op, "payload length", 0, plen)?;
                let max = u32::try_from(h.length)
                    .ok()
                    .filter(|m| *m <= MAX_INDIRECT)
                    .ok_or(bad_length(
                        op,
                        "length field (at most)",
                        u64::from(MAX_INDIRECT),
                        h.length,
                    ))?;
                match op {
                    Op::ObjIndirect => Request::ObjIndirect { max },
                    _ => Request::ObjInherited {
                        manager: h.offset,
                        max,
                    },
                }
            }
            Op::ObjSettle => {
                let most = (MAX_INDIRECT as usize * SETTLE_OBJECT_LEN) as u64;
                if plen > most {
                    return Err(bad_length(op, "payload length (at most)", most, plen));
                }
                Request::ObjSettle {
                    manager: h.offset,
                    objects: SettleObject::decode_all(payload)?,
                }
            }
        })
    }

    /// Builds the request frame. A request that would not parse (e.g. a pool id over 17 bits)
    /// still encodes; the receiving side rejects it.
    pub fn to_frame(&self, request_id: u64, capability: u64) -> Frame {
        let mut h = Header {
            capability,
            ..Header::new(self.op(), request_id)
        };
        let mut buf = BytesMut::new();
        let payload = match self {
            Request::Hello { token } => token.clone(),
            Request::Ping => Bytes::new(),
            &Request::Read { pool, offset, len } => {
                (h.pool, h.offset, h.length) = (pool, offset, len);
                Bytes::new()
            }
            Request::Write { pool, offset, data } => {
                (h.pool, h.offset, h.length) = (*pool, *offset, data.len() as u64);
                data.clone()
            }
            Request::ReadV { ranges } => {
                h.length = sum_lengths(ranges);
                h.flags |= deltas_flag(ranges);
                buf.reserve(ranges.len() * RANGE_LEN);
                ranges.iter().for_each(|r| r.encode(&mut buf));
                buf.freeze()
            }
            Request::WriteV { ranges, data } => {
                h.length = sum_lengths(ranges);
                h.flags |= deltas_flag(ranges);
                buf.reserve(WRITEV_PREFIX_LEN + ranges.len() * RANGE_LEN + data.len());
                buf.put_u32_le(u32::try_from(ranges.len()).unwrap_or(u32::MAX));
                buf.put_u32_le(0);
                ranges.iter().for_each(|r| r.encode(&mut buf));
                buf.extend_from_slice(data);
                buf.freeze()
            }
            &Request::Cas {
                pool,
                offset,
                expected,
                new,
            } => {
                (h.pool, h.offset, h.length) = (pool, offset, 8);
                buf.put_u64_le(expected);
                buf.put_u64_le(new);
                buf.freeze()
            }
            &Request::FetchAdd {
                pool,
                offset,
                addend,
            } => {
                (h.pool, h.offset, h.length) = (pool, offset, 8);
                buf.put_u64_le(addend);
                buf.freeze()
            }
            &Request::WaitChange {
                pool,
                offset,
                expected,
                timeout_us,
            } => {
                (h.pool, h.offset, h.length) = (pool, offset, 8);
                buf.put_u64_le(expected);
                buf.put_u64_le(timeout_us);
                buf.freeze()
            }
            &Request::Wake { pool, offset } => {
                (h.pool, h.offset, h.length) = (pool, offset, 8);
                Bytes::new()
            }
            Request::RdmaConnect { endpoint } => endpoint.clone(),
            &Request::RdmaKeys {
                pool, offset, len, ..
            } => {
                (h.pool, h.offset, h.length) = (pool, offset, len);
                Bytes::new()
            }
            &Request::ObjAlloc { ino, len, manager } => {
                (h.object_id, h.offset, h.length) = (ino, manager, u64::from(len));
                Bytes::new()
            }
            &Request::ObjRefit {
                ino,
                at,
                len,
                manager,
            } => {
                (h.object_id, h.offset, h.length) = (ino, manager, u64::from(len));
                at.encode(&mut buf);
                buf.freeze()
            }
            &Request::ObjFreeze { ino, at, manager } => {
                (h.object_id, h.offset) = (ino, manager);
                at.encode(&mut buf);
                buf.freeze()
            }
            &Request::ObjFree { ino, at }
            | &Request::ObjThaw { ino, at }
            | &Request::ObjCorrect { ino, at } => {
                h.object_id = ino;
                at.encode(&mut buf);
                buf.freeze()
            }
            &Request::ObjRead {
                ino,
                at,
                offset,
                len,
            } => {
                (h.object_id, h.offset, h.length) = (ino, u64::from(offset), u64::from(len));
                at.encode(&mut buf);
                buf.freeze()
            }
            Request::ObjWrite {
                ino,
                at,
                offset,
                data,
            } => {
                (h.object_id, h.offset, h.length) = (*ino, u64::from(*offset), data.len() as u64);
                buf.reserve(OBJECT_REF_LEN + data.len());
                at.encode(&mut buf);
                buf.extend_from_slice(data);
                buf.freeze()
            }
            Request::ObjCompact => Bytes::new(),
            &Request::ObjIndirect { max } => {
                h.length = u64::from(max);
                Bytes::new()
            }
            &Request::ObjInherited { manager, max } => {
                (h.offset, h.length) = (manager, u64::from(max));
                Bytes::new()
            }
            Request::ObjSettle { manager, objects } => {
                h.offset = *manager;
                buf.reserve(objects.len() * SETTLE_OBJECT_LEN);
                for o in objects {
                    o.encode(&mut buf);
                }
                buf.freeze()
            }
        };
        h.payload_len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        Frame { header: h, payload }
    }
}

/// Bound on the offsets and lengths of object requests: the largest slot of a daemon's object
/// store (8 KiB with its header; the daemon refuses, exactly, what runs past an object's own
/// slot).
pub const MAX_OBJECT: u32 = 8 << 10;

/// Parses an object request: it names its region (`object_id`, never 0) and keeps within
/// [`MAX_OBJECT`].
fn parse_object(h: &Header, payload: &Bytes) -> Result<Request, FrameError> {
    let op = h.op;
    let ino = h.object_id;
    if ino == 0 {
        return Err(bad_length(op, "object_id field (the region)", 1, 0));
    }
    let small = |what: &'static str, v: u64| -> Result<u32, FrameError> {
        u32::try_from(v)
            .ok()
            .filter(|&v| v <= MAX_OBJECT)
            .ok_or(bad_length(op, what, u64::from(MAX_OBJECT), v))
    };
    let plen = payload.len() as u64;
    Ok(match op {
        Op::ObjAlloc => {
            expect_len(op, "payload length", 0, plen)?;
            Request::ObjAlloc {
                ino,
                len: small("length field (at most)", h.length)?,
                manager: h.offset,
            }
        }
        Op::ObjRefit => {
            expect_len(op, "payload length", OBJECT_REF_LEN as u64, plen)?;
            let (at, _) = ObjectRef::decode(op, payload)?;
            Request::ObjRefit {
                ino,
                at,
                len: small("length field (at most)", h.length)?,
                manager: h.offset,
            }
        }
        Op::ObjFree | Op::ObjFreeze | Op::ObjThaw | Op::ObjCorrect => {
            expect_len(op, "payload length", OBJECT_REF_LEN as u64, plen)?;
            let (at, _) = ObjectRef::decode(op, payload)?;
            match op {
                Op::ObjFree => Request::ObjFree { ino, at },
                Op::ObjFreeze => Request::ObjFreeze {
                    ino,
                    at,
                    manager: h.offset,
                },
                Op::ObjCorrect => Request::ObjCorrect { ino, at },
                _ => Request::ObjThaw { ino, at },
            }
        }
        Op::ObjRead => {
            expect_len(op, "payload length", OBJECT_REF_LEN as u64, plen)?;
            let (at, _) = ObjectRef::decode(op, payload)?;
            let offset = small("offset field (at most)", h.offset)?;
            let len = small("length field (at most)", h.length)?;
            small(
                "offset + length (at most)",
                u64::from(offset) + u64::from(len),
            )?;
            Request::ObjRead {
                ino,
                at,
                offset,
                len,
            }
        }
        _ => {
            let (at, data) = ObjectRef::decode(op, payload)?;
            let what = "length field (must equal the data after the object reference)";
            expect_len(op, what, data.len() as u64, h.length)?;
            let offset = small("offset field (at most)", h.offset)?;
            small("offset + length (at most)", u64::from(offset) + h.length)?;
            Request::ObjWrite {
                ino,
                at,
                offset,
                data: payload.slice_ref(data),
            }
        }
    })
}

fn bad_length(op: Op, what: &'static str, expected: u64, actual: u64) -> FrameError {
    FrameError::BadLength {
        op,
        what,
        expected,
        actual,
    }
}

fn expect_len(op: Op, what: &'static str, expected: u64, actual: u64) -> Result<(), FrameError> {
    if expected == actual {
        Ok(())
    } else {
        Err(bad_length(op, what, expected, actual))
    }
}

/// Checks a payload size (or the reply size a read asks for) against the limit.
fn check_size(len: u64, limits: &Limits) -> Result<(), FrameError> {
    let max = limits.max_payload;
    if len > u64::from(max) {
        Err(FrameError::Oversized { len, max })
    } else {
        Ok(())
    }
}

fn check_pool(pool: u32) -> Result<(), FrameError> {
    if pool > MAX_POOL {
        Err(FrameError::BadPool(pool))
    } else {
        Ok(())
    }
}

fn check_span(offset: u64, len: u64) -> Result<(), FrameError> {
    match offset.checked_add(len) {
        Some(_) => Ok(()),
        None => Err(FrameError::Overflow { offset, len }),
    }
}

fn check_atomic(offset: u64) -> Result<(), FrameError> {
    if !offset.is_multiple_of(8) {
        return Err(FrameError::Misaligned { offset });
    }
    check_span(offset, 8)
}

fn check_count(count: u64, limits: &Limits) -> Result<(), FrameError> {
    let max = limits.max_ranges;
    if count > u64::from(max) {
        Err(FrameError::TooManyRanges { count, max })
    } else {
        Ok(())
    }
}

/// Parses a table of ranges (a whole number of [`RANGE_LEN`]-byte entries).
fn parse_ranges(table: &[u8], deltas: bool) -> Result<Vec<Range>, FrameError> {
    table
        .chunks_exact(RANGE_LEN)
        .map(|r| Range::decode(r, deltas))
        .collect()
}

/// [`FLAG_DELTAS`] when any of `ranges` states its chunk delta (then all are encoded with
/// theirs, 0 for those that state none), else 0.
fn deltas_flag(ranges: &[Range]) -> u16 {
    if ranges.iter().any(|r| r.delta.is_some()) {
        FLAG_DELTAS
    } else {
        0
    }
}

/// Sum of range lengths, saturating (a saturated sum is rejected as oversized anyway).
fn sum_lengths(ranges: &[Range]) -> u64 {
    ranges.iter().fold(0u64, |acc, r| acc.saturating_add(r.len))
}

/// The total data of a vector op, which must fit in one frame payload.
fn check_total(ranges: &[Range], limits: &Limits) -> Result<u64, FrameError> {
    let total = sum_lengths(ranges);
    check_size(total, limits)?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rg(pool: u32, offset: u64, len: u64) -> Range {
        Range {
            pool,
            offset,
            len,
            delta: None,
        }
    }

    fn read(pool: u32, offset: u64, len: u64) -> Request {
        Request::Read { pool, offset, len }
    }

    fn write(offset: u64, data: &'static [u8]) -> Request {
        Request::Write {
            pool: 1,
            offset,
            data: Bytes::from_static(data),
        }
    }

    fn writev(ranges: Vec<Range>, data: &'static [u8]) -> Request {
        Request::WriteV {
            ranges,
            data: Bytes::from_static(data),
        }
    }

    fn cas(offset: u64) -> Request {
        Request::Cas {
            pool: 9,
            offset,
            expected: 1,
            new: u64::MAX,
        }
    }

    fn limits(max_payload: u32, max_ranges: u32) -> Limits {
        Limits {
            max_payload,
            max_ranges,
        }
    }

    fn samples() -> Vec<Request> {
        vec![
            Request::Hello {
                token: Bytes::from_static(b"\x01client-nonce"),
            },
            read(3, 4096, 8192),
            write(7, b"hello"),
            Request::ReadV {
                ranges: vec![rg(1, 0, 4096), rg(2, 8192, 10)],
            },
            writev(vec![rg(1, 0, 3), rg(2, 100, 2), rg(0, 5, 0)], b"abcde"),
            cas(64),
            Request::FetchAdd {
                pool: 9,
                offset: 128,
                addend: 42,
            },
            Request::Ping,
            Request::WaitChange {
                pool: 9,
                offset: 64,
                expected: 7,
                timeout_us: 1000,
            },
            Request::Wake {
                pool: 9,
                offset: 64,
            },
            Request::RdmaConnect {
                endpoint: Bytes::from(vec![7u8; RDMA_ENDPOINT_LEN]),
            },
            Request::RdmaKeys {
                pool: 4,
                offset: 131_072,
                len: 300_000,
                write: false,
            },
            Request::RdmaKeys {
                pool: 4,
                offset: 0,
                len: 1,
                write: true,
            },
            Request::ObjAlloc {
                ino: 7,
                len: 100,
                manager: 0x5eed,
            },
            Request::ObjInherited {
                manager: 0x5eed,
                max: 100,
            },
            Request::ObjSettle {
                manager: 9,
                objects: vec![
                    SettleObject {
                        ino: 7,
                        at: ObjectRef {
                            address: 1,
                            slot: 2,
                            id: 3,
                        },
                        settle: Settle::Keep,
                    },
                    SettleObject {
                        ino: 8,
                        at: ObjectRef {
                            address: 4,
                            slot: 5,
                            id: 6,
                        },
                        settle: Settle::KeepAndThaw,
                    },
                    SettleObject {
                        ino: 9,
                        at: ObjectRef {
                            address: 7,
                            slot: 8,
                            id: 9,
                        },
                        settle: Settle::Free,
                    },
                ],
            },
            Request::ObjFree {
                ino: 7,
                at: ObjectRef {
                    address: 3,
                    slot: 9,
                    id: 0xdead,
                },
            },
            Request::ObjRead {
                ino: 7,
                at: ObjectRef {
                    address: 3,
                    slot: 9,
                    id: 0xdead,
                },
                offset: 10,
                len: 90,
            },
            Request::ObjWrite {
                ino: 7,
                at: ObjectRef {
                    address: 0,
                    slot: 0,
                    id: 1,
                },
                offset: 4,
                data: Bytes::from_static(b"small region"),
            },
            Request::ObjCompact,
            Request::ObjIndirect { max: 100 },
            Request::ObjCorrect {
                ino: 7,
                at: ObjectRef {
                    address: 4,
                    slot: 5,
                    id: 6,
                },
            },
            Request::ObjRefit {
                ino: 7,
                at: ObjectRef {
                    address: 1,
                    slot: 2,
                    id: 3,
                },
                len: 100,
                manager: 1,
            },
            Request::ObjFreeze {
                ino: 7,
                at: ObjectRef {
                    address: 3,
                    slot: 9,
                    id: 0xdead,
                },
                manager: u64::MAX,
            },
        ]
    }

    #[test]
    fn object_requests_name_their_region_and_stay_small() {
        let at = ObjectRef {
            address: 1,
            slot: 2,
            id: 3,
        };
        let limits = Limits::default();
        let no_region = Request::ObjRead {
            ino: 0,
            at,
            offset: 0,
            len: 8,
        }
        .to_frame(1, 0);
        assert!(Request::parse(&no_region, &limits).is_err());
        let huge = Request::ObjAlloc {
            ino: 5,
            len: MAX_OBJECT + 1,
            manager: 1,
        }
        .to_frame(1, 0);
        assert!(Request::parse(&huge, &limits).is_err());
        let past = Request::ObjRead {
            ino: 5,
            at,
            offset: MAX_OBJECT,
            len: 1,
        }
        .to_frame(1, 0);
        assert!(Request::parse(&past, &limits).is_err());
        let mut short = Request::ObjFree { ino: 5, at }.to_frame(1, 0);
        short.payload = short.payload.slice(..OBJECT_REF_LEN - 1);
        short.header.payload_len = (OBJECT_REF_LEN - 1) as u32;
        assert!(Request::parse(&short, &limits).is_err());
        let mut lying = Request::ObjWrite {
            ino: 5,
            at,
            offset: 0,
            data: Bytes::from_static(b"abc"),
        }
        .to_frame(1, 0);
        lying.header.length = 4;
        assert!(Request::parse(&lying, &limits).is_err());
    }

    #[test]
    fn rdma_chunk_keys_round_trip_and_refuse_partial_entries() {
        let keys = vec![
            RdmaChunkKey {
                pool_offset: 0,
                addr: 0x7f00_0000_0000,
                rkey: 0x1234,
                len: 131_072,
            },
            RdmaChunkKey {
                pool_offset: 131_072 + 64,
                addr: 0x7f00_0002_0040,
                rkey: u32::MAX,
                len: 64,
            },
        ];
        let mut buf = BytesMut::new();
        keys.iter().for_each(|k| k.encode(&mut buf));
        assert_eq!(buf.len(), 2 * RDMA_CHUNK_KEY_LEN);
        assert_eq!(RdmaChunkKey::decode_all(&buf).unwrap(), keys);
        assert!(RdmaChunkKey::decode_all(&buf[..30]).is_err());
        // A connect with a short endpoint is refused.
        let mut f = Request::RdmaConnect {
            endpoint: Bytes::from(vec![1u8; 5]),
        }
        .to_frame(1, 0);
        f.header.payload_len = 5;
        assert!(Request::parse(&f, &Limits::default()).is_err());
    }

    fn encode(frame: &Frame) -> BytesMut {
        let mut buf = BytesMut::new();
        frame.encode(&mut buf);
        buf
    }

    /// Decodes exactly one complete frame.
    fn decode_one(mut buf: BytesMut, limits: &Limits) -> Result<Frame, FrameError> {
        let frame = decode_frame(&mut buf, limits)?.expect("a complete frame");
        assert!(buf.is_empty(), "exactly one frame");
        Ok(frame)
    }

    /// Encodes `req` after `edit_frame`, corrupts the bytes with `edit_bytes`, then decodes and
    /// parses them.
    fn mangled(
        req: &Request,
        edit_frame: impl FnOnce(&mut Frame),
        edit_bytes: impl FnOnce(&mut BytesMut),
    ) -> Result<Request, FrameError> {
        let mut frame = req.to_frame(1, 0);
        edit_frame(&mut frame);
        let mut buf = encode(&frame);
        edit_bytes(&mut buf);
        let limits = Limits::default();
        Request::parse(&decode_one(buf, &limits)?, &limits)
    }

    fn parse_req(req: &Request) -> Result<Request, FrameError> {
        mangled(req, |_| (), |_| ())
    }

    fn with_bytes(req: &Request, edit: impl FnOnce(&mut BytesMut)) -> Result<Request, FrameError> {
        mangled(req, |_| (), edit)
    }

    /// The `(op, expected, actual)` of a `BadLength` error.
    fn bad_len(result: Result<Request, FrameError>) -> (Op, u64, u64) {
        match result {
            Err(FrameError::BadLength {
                op,
                expected,
                actual,
                ..
            }) => (op, expected, actual),
            other => panic!("expected BadLength, got {other:?}"),
        }
    }

    fn stream() -> (Vec<Frame>, BytesMut) {
        let mut frames: Vec<Frame> = samples()
            .iter()
            .zip(0..)
            .map(|(r, id)| r.to_frame(id, 77))
            .collect();
        let data = Bytes::from_static(b"data");
        let replies: Vec<Frame> = frames
            .iter()
            .map(|f| Frame::reply_ok(&f.header, data.clone()))
            .chain([Frame::reply_err(&frames[1].header, 2, "no such region")])
            .collect();
        frames.extend(replies);
        let mut buf = BytesMut::new();
        frames.iter().for_each(|f| f.encode(&mut buf));
        (frames, buf)
    }

    /// Feeds `bytes` to the streaming decoder in chunks of the given sizes (cycled).
    fn feed_in_chunks(bytes: &[u8], sizes: &[usize]) -> Vec<Frame> {
        let limits = Limits::default();
        let (mut buf, mut out, mut pos) = (BytesMut::new(), Vec::new(), 0);
        for size in sizes.iter().cycle() {
            if pos == bytes.len() {
                break;
            }
            let end = (pos + size.max(&1)).min(bytes.len());
            buf.extend_from_slice(&bytes[pos..end]);
            pos = end;
            while let Some(frame) = decode_frame(&mut buf, &limits).unwrap() {
                out.push(frame);
            }
        }
        assert!(buf.is_empty());
        out
    }

    #[test]
    fn every_op_round_trips() {
        for req in samples() {
            let frame = req.to_frame(99, 5);
            let decoded = decode_one(encode(&frame), &Limits::default()).unwrap();
            assert_eq!(decoded, frame);
            assert_eq!(decoded.header.capability, 5);
            assert_eq!(Request::parse(&decoded, &Limits::default()).unwrap(), req);
        }
    }

    #[test]
    fn stated_deltas_travel_only_with_their_flag() {
        // A single-range op states its delta in the header.
        let mut frame = read(1, 3 * 131_072, 8).to_frame(1, 0);
        frame.header.flags |= FLAG_DELTAS;
        frame.header.delta = crate::layout::chunk_delta(131_072, 3 * 131_072);
        let buf = encode(&frame);
        assert_eq!(&buf[60..64], &u32::MAX.wrapping_sub(1).to_le_bytes());
        let back = decode_one(buf, &Limits::default()).unwrap();
        assert_eq!(back.header.stated_delta(), Some(u32::MAX - 1));
        // Without the flag the field is reserved.
        let mut bare = read(1, 0, 8).to_frame(1, 0);
        bare.header.delta = 7;
        assert_eq!(
            decode_one(encode(&bare), &Limits::default()),
            Err(FrameError::NonZeroReserved)
        );
        // A vector's ranges carry their own.
        let ranges = vec![
            Range {
                delta: Some(5),
                ..rg(1, 0, 8)
            },
            Range {
                delta: Some(9),
                ..rg(1, 131_072, 8)
            },
        ];
        let mut v = Request::ReadV {
            ranges: ranges.clone(),
        }
        .to_frame(2, 0);
        assert_ne!(v.header.flags & FLAG_DELTAS, 0, "to_frame sets the flag");
        let parsed = Request::parse(&v, &Limits::default()).unwrap();
        assert_eq!(parsed, Request::ReadV { ranges });
        v.header.flags &= !FLAG_DELTAS;
        assert_eq!(
            Request::parse(&v, &Limits::default()),
            Err(FrameError::NonZeroReserved)
        );
    }

    #[test]
    fn header_layout_is_fixed() {
        let buf = encode(&read(0x1_2345, 0x10, 0x20).to_frame(7, 8));
        assert_eq!(buf.len(), HEADER_LEN);
        assert_eq!(&buf[0..4], &[0x47, 0x52, 3, 2]);
        assert_eq!((buf[8], buf[16], buf[32], buf[40]), (7, 8, 0x10, 0x20));
        assert_eq!(&buf[24..28], &0x1_2345u32.to_le_bytes());
    }

    #[test]
    fn replies() {
        let req = Request::FetchAdd {
            pool: 1,
            offset: 8,
            addend: 1,
        }
        .to_frame(42, 9);
        let ok = Frame::reply_ok(&req.header, Bytes::copy_from_slice(&5u64.to_le_bytes()));
        assert!(ok.is_reply() && !req.is_reply());
        let h = ok.header;
        assert_eq!(
            (h.op, h.request_id, h.status, h.capability),
            (Op::FetchAdd, 42, 0, 0)
        );
        assert_eq!(ok.error_message(), None);
        let err = Frame::reply_err(&req.header, 13, "denied");
        let err = decode_one(encode(&err), &Limits::default()).unwrap();
        assert_eq!(
            (err.header.status, err.error_message()),
            (13, Some("denied"))
        );
        assert_eq!(Frame::reply_err(&req.header, 0, "").header.status, EIO);
        let parsed = Request::parse(&ok, &Limits::default());
        assert_eq!(parsed, Err(FrameError::UnexpectedReply(Op::FetchAdd)));
    }

    #[test]
    fn streaming_one_byte_at_a_time() {
        let (frames, buf) = stream();
        assert_eq!(feed_in_chunks(&buf, &[1]), frames);
    }

    #[test]
    fn short_buffers() {
        let buf = encode(&Request::Ping.to_frame(1, 0));
        let short = FrameError::Short {
            needed: 64,
            have: 10,
        };
        assert_eq!(Header::decode(&buf[..10]), Err(short));
        let full = encode(&write(0, b"xyz").to_frame(1, 0));
        for cut in 0..full.len() {
            let mut partial = BytesMut::from(&full[..cut]);
            assert_eq!(decode_frame(&mut partial, &Limits::default()), Ok(None));
            assert_eq!(partial.len(), cut, "incomplete frames stay buffered");
        }
    }

    #[test]
    fn oversized_payload_rejected_from_header_alone() {
        let header = Header {
            payload_len: 1000,
            ..Header::new(Op::Write, 1)
        };
        let mut buf = BytesMut::new();
        header.encode(&mut buf);
        let limits = limits(999, 4);
        let err = decode_frame(&mut buf, &limits).unwrap_err();
        assert_eq!(
            err,
            FrameError::Oversized {
                len: 1000,
                max: 999
            }
        );
        let msg = "frame payload of 1000 bytes exceeds the limit of 999 bytes";
        assert_eq!(err.to_string(), msg);
        let parsed = Request::parse(&read(0, 0, 1000).to_frame(1, 0), &limits);
        assert_eq!(
            parsed,
            Err(FrameError::Oversized {
                len: 1000,
                max: 999
            })
        );
    }

    #[test]
    fn bad_header_fields() {
        let ping = Request::Ping;
        assert_eq!(
            with_bytes(&ping, |b| b[3] = 0),
            Err(FrameError::UnknownOp(0))
        );
        assert_eq!(
            with_bytes(&ping, |b| b[3] = 26),
            Err(FrameError::UnknownOp(26))
        );
        assert_eq!(
            with_bytes(&ping, |b| b[0] = 0),
            Err(FrameError::BadMagic(0x5200))
        );
        let bad_version = with_bytes(&ping, |b| b[2] = 1);
        assert_eq!(bad_version, Err(FrameError::UnsupportedVersion(1)));
        assert_eq!(
            with_bytes(&ping, |b| b[6] = 1),
            Err(FrameError::NonZeroReserved)
        );
        assert_eq!(
            with_bytes(&ping, |b| b[63] = 1),
            Err(FrameError::NonZeroReserved)
        );
        assert_eq!(
            with_bytes(&ping, |b| b[4] = 4),
            Err(FrameError::UnknownFlags(4))
        );
        assert_eq!(
            with_bytes(&ping, |b| b[26] = 2),
            Err(FrameError::BadPool(0x20000))
        );
        let read = read(MAX_POOL + 1, 0, 1);
        assert_eq!(parse_req(&read), Err(FrameError::BadPool(0x20000)));
        let parsed = Request::parse(&read.to_frame(1, 0), &Limits::default());
        assert_eq!(parsed, Err(FrameError::BadPool(0x20000)));
        let ranged = Request::ReadV {
            ranges: vec![rg(1 << 17, 0, 1)],
        };
        assert_eq!(parse_req(&ranged), Err(FrameError::BadPool(1 << 17)));
        let ranged = Request::ReadV {
            ranges: vec![rg(1, 0, 1)],
        };
        assert_eq!(
            with_bytes(&ranged, |b| b[68] = 1),
            Err(FrameError::NonZeroReserved)
        );
        let mut lying = Request::Ping.to_frame(1, 0);
        lying.header.payload_len = 3;
        let lying = Request::parse(&lying, &Limits::default());
        assert_eq!(bad_len(lying), (Op::Ping, 0, 3));
    }

    #[test]
    fn atomics() {
        assert_eq!(
            parse_req(&cas(12)),
            Err(FrameError::Misaligned { offset: 12 })
        );
        let fadd = Request::FetchAdd {
            pool: 1,
            offset: u64::MAX - 7,
            addend: 1,
        };
        let overflow = FrameError::Overflow {
            offset: u64::MAX - 7,
            len: 8,
        };
        assert_eq!(parse_req(&fadd), Err(overflow));
        let short_cas = mangled(&cas(8), |f| f.payload.truncate(8), |_| ());
        assert_eq!(bad_len(short_cas), (Op::Cas, 16, 8));
        let long_fadd = Request::FetchAdd {
            pool: 1,
            offset: 0,
            addend: 1,
        };
        let long_fadd = mangled(&long_fadd, |f| f.payload = Bytes::from(vec![0; 9]), |_| ());
        assert_eq!(bad_len(long_fadd), (Op::FetchAdd, 8, 9));
    }

    #[test]
    fn vector_length_rules() {
        let readv = Request::ReadV {
            ranges: vec![rg(1, 0, 8)],
        };
        let cut = mangled(&readv, |f| f.payload.truncate(23), |_| ());
        assert_eq!(bad_len(cut), (Op::ReadV, 0, 23));
        let wrong_total = mangled(&readv, |f| f.header.length = 9, |_| ());
        assert_eq!(bad_len(wrong_total), (Op::ReadV, 8, 9));

        assert_eq!(
            bad_len(parse_req(&writev(vec![rg(1, 0, 4)], b"abc"))),
            (Op::WriteV, 4, 3)
        );
        let no_prefix = mangled(&writev(vec![], b""), |f| f.payload.truncate(4), |_| ());
        assert_eq!(bad_len(no_prefix), (Op::WriteV, 8, 4));
        let two = writev(vec![rg(1, 0, 1), rg(1, 1, 1)], b"ab");
        let no_table = mangled(&two, |f| f.payload.truncate(8), |_| ());
        assert_eq!(bad_len(no_table), (Op::WriteV, 48, 0));
        assert_eq!(
            with_bytes(&two, |b| b[68] = 1),
            Err(FrameError::NonZeroReserved)
        );
    }

    #[test]
    fn too_many_ranges() {
        let limits = limits(1 << 20, 2);
        let too_many = Err(FrameError::TooManyRanges { count: 3, max: 2 });
        let ranges = vec![rg(0, 0, 1); 3];
        let readv = Request::ReadV {
            ranges: ranges.clone(),
        }
        .to_frame(1, 0);
        assert_eq!(Request::parse(&readv, &limits), too_many);
        let writev = writev(ranges, b"abc").to_frame(1, 0);
        assert_eq!(Request::parse(&writev, &limits), too_many);
    }

    #[test]
    fn offset_plus_len_overflow() {
        let overflow = |offset, len| Err(FrameError::Overflow { offset, len });
        assert_eq!(parse_req(&read(0, u64::MAX, 1)), overflow(u64::MAX, 1));
        assert_eq!(
            parse_req(&write(u64::MAX - 1, b"ab")),
            overflow(u64::MAX - 1, 2)
        );
        let readv = Request::ReadV {
            ranges: vec![rg(0, u64::MAX - 2, 3)],
        };
        assert_eq!(parse_req(&readv), overflow(u64::MAX - 2, 3));
        let big = rg(0, 0, u64::MAX);
        let readv = Request::ReadV {
            ranges: vec![big, big],
        };
        let oversized = FrameError::Oversized {
            len: u64::MAX,
            max: 64 << 20,
        };
        assert_eq!(parse_req(&readv), Err(oversized));
    }

    fn arb_range() -> impl Strategy<Value = Range> + Clone {
        (0..=MAX_POOL, any::<u64>(), 0u64..300)
            .prop_map(|(pool, offset, len)| rg(pool, offset.min(u64::MAX - len), len))
    }

    fn arb_bytes(max: usize) -> impl Strategy<Value = Bytes> {
        prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        let pool = 0..=MAX_POOL;
        let max_read = u64::from(Limits::default().max_payload);
        let aligned = any::<u64>().prop_map(|o| (o & !7).min(u64::MAX - 15));
        let ranges = prop::collection::vec(arb_range(), 0..8);
        prop_oneof![
            arb_bytes(64).prop_map(|token| Request::Hello { token }),
            (pool.clone(), any::<u64>(), 0..=max_read).prop_map(|(pool, offset, len)| read(
                pool,
                offset.min(u64::MAX - len),
                len
            )),
            (pool.clone(), any::<u64>(), arb_bytes(300)).prop_map(|(pool, offset, data)| {
                let offset = offset.min(u64::MAX - data.len() as u64);
                Request::Write { pool, offset, data }
            }),
            ranges.clone().prop_map(|ranges| Request::ReadV { ranges }),
            ranges
                .prop_flat_map(|ranges| {
                    let total = sum_lengths(&ranges) as usize;
                    (Just(ranges), prop::collection::vec(any::<u8>(), total))
                })
                .prop_map(|(ranges, data)| Request::WriteV {
                    ranges,
                    data: data.into()
                }),
            (pool.clone(), aligned.clone(), any::<u64>(), any::<u64>()).prop_map(
                |(pool, offset, expected, new)| Request::Cas {
                    pool,
                    offset,
                    expected,
                    new
                }
            ),
            (pool.clone(), aligned.clone(), any::<u64>()).prop_map(|(pool, offset, addend)| {
                Request::FetchAdd {
                    pool,
                    offset,
                    addend,
                }
            }),
            (pool, aligned, any::<u64>(), any::<u64>()).prop_map(
                |(pool, offset, expected, timeout_us)| Request::WaitChange {
                    pool,
                    offset,
                    expected,
                    timeout_us
                }
            ),
            Just(Request::Ping),
            prop::collection::vec(any::<u8>(), RDMA_ENDPOINT_LEN)
                .prop_map(|e| Request::RdmaConnect { endpoint: e.into() }),
            (0..=MAX_POOL, any::<u64>(), 0..=max_read, any::<bool>()).prop_map(
                |(pool, offset, len, write)| Request::RdmaKeys {
                    pool,
                    offset: offset.min(u64::MAX - len),
                    len,
                    write,
                }
            ),
            (1..u64::MAX, 0..=MAX_OBJECT, any::<u64>())
                .prop_map(|(ino, len, manager)| Request::ObjAlloc { ino, len, manager }),
            (any::<u64>(), 0..=MAX_INDIRECT)
                .prop_map(|(manager, max)| Request::ObjInherited { manager, max }),
            (
                any::<u64>(),
                proptest::collection::vec((1..u64::MAX, any::<[u32; 3]>(), 0..3u32), 0..20)
            )
                .prop_map(|(manager, objects)| Request::ObjSettle {
                    manager,
                    objects: objects
                        .into_iter()
                        .map(|(ino, [address, slot, id], action)| SettleObject {
                            ino,
                            at: ObjectRef { address, slot, id },
                            settle: [Settle::Keep, Settle::KeepAndThaw, Settle::Free]
                                [action as usize],
                        })
                        .collect(),
                }),
            (1..u64::MAX, any::<[u32; 3]>()).prop_map(|(ino, [address, slot, id])| {
                Request::ObjFree {
                    ino,
                    at: ObjectRef { address, slot, id },
                }
            }),
            (
                1..u64::MAX,
                any::<[u32; 3]>(),
                0..=MAX_OBJECT,
                0..=MAX_OBJECT
            )
                .prop_map(|(ino, [address, slot, id], offset, len)| Request::ObjRead {
                    ino,
                    at: ObjectRef { address, slot, id },
                    offset: offset.min(MAX_OBJECT - len),
                    len,
                }),
            (
                1..u64::MAX,
                any::<[u32; 3]>(),
                0..=MAX_OBJECT,
                arb_bytes(300)
            )
                .prop_map(|(ino, [address, slot, id], offset, data)| {
                    Request::ObjWrite {
                        ino,
                        at: ObjectRef { address, slot, id },
                        offset: offset.min(MAX_OBJECT - data.len() as u32),
                        data,
                    }
                }),
            Just(Request::ObjCompact),
            (0..=MAX_INDIRECT).prop_map(|max| Request::ObjIndirect { max }),
            (1..u64::MAX, any::<[u32; 3]>()).prop_map(|(ino, [address, slot, id])| {
                Request::ObjCorrect {
                    ino,
                    at: ObjectRef { address, slot, id },
                }
            }),
            (1..u64::MAX, any::<[u32; 3]>(), any::<u64>()).prop_map(
                |(ino, [address, slot, id], manager)| Request::ObjFreeze {
                    ino,
                    at: ObjectRef { address, slot, id },
                    manager,
                }
            ),
        ]
    }

    /// Streams of valid requests and of frames with a valid header and a random payload
    /// (mostly zero bytes, so random ranges are often well formed), sometimes with one
    /// corrupted byte, so that random input reaches the op-specific checks.
    fn plausible_stream() -> impl Strategy<Value = Vec<u8>> {
        let plen = prop_oneof![Just(0u32), Just(8), Just(16), Just(24), Just(56), 0u32..300];
        let flags = prop_oneof![3 => Just(0u16), 1 => 0u16..3];
        let header = (1u8..=21, flags, any::<[u64; 4]>(), any::<bool>(), plen);
        let frame = header.prop_flat_map(|(op, flags, [id, offset, length, pool], tame, plen)| {
            let op = Op::try_from(op).unwrap_or(Op::Ping);
            let header = Header {
                flags,
                pool: if tame {
                    pool as u32 & MAX_POOL
                } else {
                    pool as u32
                },
                offset: if tame { offset & 0xff8 } else { offset },
                length: if tame { u64::from(plen) } else { length },
                object_id: if tame { (id & 0xffff) | 1 } else { 0 },
                payload_len: plen,
                ..Header::new(op, id)
            };
            let byte = prop_oneof![3 => Just(0u8), 1 => any::<u8>()];
            prop::collection::vec(byte, plen as usize).prop_map(move |payload| {
                let mut b = BytesMut::new();
                header.encode(&mut b);
                b.extend_from_slice(&payload);
                b.to_vec()
            })
        });
        let valid = arb_request().prop_map(|req| encode(&req.to_frame(7, 0)).to_vec());
        let frame = prop_oneof![valid, frame];
        let flip = (
            prop::bool::weighted(0.3),
            any::<prop::sample::Index>(),
            any::<u8>(),
        );
        (prop::collection::vec(frame, 1..4), flip).prop_map(|(frames, (corrupt, at, xor))| {
            let mut bytes = frames.concat();
            if corrupt {
                let i = at.index(bytes.len());
                bytes[i] ^= xor;
            }
            bytes
        })
    }

    proptest! {
        #[test]
        fn any_request_round_trips(req in arb_request(), id in any::<u64>(), cap in any::<u64>()) {
            let frame = req.to_frame(id, cap);
            let decoded = decode_one(encode(&frame), &Limits::default()).unwrap();
            prop_assert_eq!(&decoded, &frame);
            prop_assert_eq!(Request::parse(&decoded, &Limits::default()).unwrap(), req);
        }

        #[test]
        fn random_splits_decode_the_same_frames(
            sizes in prop::collection::vec(1usize..200, 1..20),
        ) {
            let (frames, buf) = stream();
            prop_assert_eq!(feed_in_chunks(&buf, &sizes), frames);
        }

        #[test]
        fn random_bytes_never_panic(
            bytes in prop_oneof![prop::collection::vec(any::<u8>(), 0..600), plausible_stream()],
        ) {
            let limits = limits(256, 4);
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(frame)) = decode_frame(&mut buf, &limits) {
                prop_assert!(frame.payload.len() <= 256);
                prop_assert_eq!(frame.payload.len(), frame.header.payload_len as usize);
                let Ok(req) = Request::parse(&frame, &limits) else { continue };
                match &req {
                    Request::Read { len, .. } => prop_assert!(*len <= 256),
                    Request::ReadV { ranges } | Request::WriteV { ranges, .. } => {
                        prop_assert!(ranges.len() <= 4);
                        prop_assert!(sum_lengths(ranges) <= 256);
                    }
                    _ => {}
                }
                prop_assert_eq!(Request::parse(&req.to_frame(1, 0), &limits), Ok(req));
            }
        }
    }
}
