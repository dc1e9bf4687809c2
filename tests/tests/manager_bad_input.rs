//! The real manager refuses bad requests with the right errno (or gRPC code)
//! and keeps serving afterwards.

use std::io::Write as _;
use std::time::Duration;

use regions_proto::auth::{AttachSecret, Secret};
use regions_proto::v1::{self, cluster_client::ClusterClient, namespace_client::NamespaceClient};
use regions_tests::{
    Clients, MAX_MESSAGE, ManagerProcess, ROOT_INO, caller, channel, connect, errno_of, has_errno,
    write_secret,
};
use tonic::{Code, Status};

const UID: u32 = 1000;
const HOST: u32 = 1;

/// Asserts that `result` is a manager refusal with `errno`.
#[track_caller]
fn assert_errno<T: std::fmt::Debug>(result: Result<T, Status>, errno: i32, what: &str) {
    match result {
        Ok(v) => panic!("{what}: succeeded ({v:?}), expected errno {errno}"),
        Err(status) => {
            assert!(has_errno(&status), "{what}: {status:?} carries no errno");
            assert_eq!(errno_of(&status), errno, "{what}: {status:?}");
        }
    }
}

fn mkdir_req(uid: u32, parent: u64, name: &str, mode: u32) -> v1::MkdirRequest {
    v1::MkdirRequest {
        caller: caller(uid, HOST),
        parent,
        name: name.to_owned(),
        mode,
    }
}

fn create_req(uid: u32, parent: u64, name: &str) -> v1::CreateRequest {
    v1::CreateRequest {
        caller: caller(uid, HOST),
        parent,
        name: name.to_owned(),
        mode: 0o644,
        ..Default::default()
    }
}

fn setxattr_req(ino: u64, name: &str, value: &[u8]) -> v1::SetXattrRequest {
    v1::SetXattrRequest {
        caller: caller(UID, HOST),
        ino,
        name: name.to_owned(),
        value: value.to_vec(),
        flags: 0,
    }
}

async fn getxattr(c: &mut Clients, ino: u64, name: &str) -> Result<Vec<u8>, Status> {
    c.namespace
        .get_xattr(v1::GetXattrRequest {
            caller: caller(UID, HOST),
            ino,
            name: name.to_owned(),
        })
        .await
        .map(|r| r.into_inner().value)
}

/// Starts a manager on a fresh directory.
async fn start() -> (tempfile::TempDir, ManagerProcess, Clients, Secret) {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("secret");
    let secret = write_secret(&secret_file).unwrap();
    let manager = ManagerProcess::start(&dir.path().join("data"), &secret_file).unwrap();
    let clients = connect(manager.addr, &secret).await.unwrap();
    (dir, manager, clients, secret)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_the_manager_survives() {
    let (_dir, mut manager, mut c, _secret) = start().await;
    let ns = &mut c.namespace;

    // ---- unknown inodes: ENOENT ----
    let nowhere = 0xdead_beef;
    assert_errno(
        ns.get_attr(v1::GetAttrRequest {
            caller: caller(UID, HOST),
            ino: nowhere,
        })
        .await,
        libc::ENOENT,
        "getattr of an unknown inode",
    );
    assert_errno(
        ns.lookup(v1::LookupRequest {
            caller: caller(UID, HOST),
            parent: nowhere,
            name: "x".into(),
        })
        .await,
        libc::ENOENT,
        "lookup in an unknown directory",
    );
    assert_errno(
        ns.lookup(v1::LookupRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "absent".into(),
        })
        .await,
        libc::ENOENT,
        "lookup of an absent name",
    );
    assert_errno(
        ns.read_dir(v1::ReadDirRequest {
            caller: caller(UID, HOST),
            ino: nowhere,
            offset: 0,
            limit: 0,
        })
        .await,
        libc::ENOENT,
        "readdir of an unknown inode",
    );
    assert_errno(
        ns.mkdir(mkdir_req(UID, nowhere, "x", 0o755)).await,
        libc::ENOENT,
        "mkdir in an unknown directory",
    );
    assert_errno(
        ns.create(create_req(UID, nowhere, "x")).await,
        libc::ENOENT,
        "create in an unknown directory",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(nowhere, "user.a", b"1")).await,
        libc::ENOENT,
        "setxattr of an unknown inode",
    );
    assert_errno(
        ns.get_xattr(v1::GetXattrRequest {
            caller: caller(UID, HOST),
            ino: nowhere,
            name: "user.a".into(),
        })
        .await,
        libc::ENOENT,
        "getxattr of an unknown inode",
    );
    assert_errno(
        ns.unlink(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "absent".into(),
        })
        .await,
        libc::ENOENT,
        "unlink of an absent name",
    );

    // ---- names ----
    for bad in ["a/b", "/", "a\0b", "\0", "", ".", ".."] {
        assert_errno(
            ns.mkdir(mkdir_req(UID, ROOT_INO, bad, 0o755)).await,
            libc::EINVAL,
            &format!("mkdir {bad:?}"),
        );
        assert_errno(
            ns.create(create_req(UID, ROOT_INO, bad)).await,
            libc::EINVAL,
            &format!("create {bad:?}"),
        );
    }
    let long = "n".repeat(256);
    assert_errno(
        ns.mkdir(mkdir_req(UID, ROOT_INO, &long, 0o755)).await,
        libc::ENAMETOOLONG,
        "mkdir of a 256-byte name",
    );
    assert_errno(
        ns.create(create_req(UID, ROOT_INO, &long)).await,
        libc::ENAMETOOLONG,
        "create of a 256-byte name",
    );
    // 256 bytes of two-byte characters: the limit is in bytes, not characters.
    let wide = "é".repeat(128);
    assert_errno(
        ns.create(create_req(UID, ROOT_INO, &wide)).await,
        libc::ENAMETOOLONG,
        "create of 128 two-byte characters",
    );
    let max = "m".repeat(255);
    let made = ns
        .create(create_req(UID, ROOT_INO, &max))
        .await
        .expect("a 255-byte name is allowed")
        .into_inner();
    let found = ns
        .lookup(v1::LookupRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: max.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.ino, made.ino);
    let max_dir = format!("d{}", "m".repeat(254));
    ns.mkdir(mkdir_req(UID, ROOT_INO, &max_dir, 0o755))
        .await
        .expect("a 255-byte directory name is allowed");
    assert_errno(
        ns.rename(v1::RenameRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: max.clone(),
            new_parent: ROOT_INO,
            new_name: long.clone(),
            flags: 0,
        })
        .await,
        libc::ENAMETOOLONG,
        "rename to a 256-byte name",
    );
    assert_errno(
        ns.rename(v1::RenameRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: max.clone(),
            new_parent: ROOT_INO,
            new_name: "x/y".into(),
            flags: 0,
        })
        .await,
        libc::EINVAL,
        "rename to a name with '/'",
    );

    // ---- region attribute values ----
    let region = ns
        .create(create_req(UID, ROOT_INO, "region"))
        .await
        .unwrap()
        .into_inner()
        .ino;
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.persistent", b"2"))
            .await,
        libc::EINVAL,
        "persistent = 2",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.persistent", b""))
            .await,
        libc::EINVAL,
        "persistent = empty",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.multihosted", b"maybe"))
            .await,
        libc::EINVAL,
        "multihosted = maybe",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.hostalloc", b"x"))
            .await,
        libc::EINVAL,
        "hostalloc = x",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.hostalloc", b"1,-2"))
            .await,
        libc::EINVAL,
        "hostalloc = 1,-2",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.hostalloc", b"0"))
            .await,
        libc::EINVAL,
        "hostalloc = 0",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(
            region,
            "user.regions.vaddr",
            b"0x400000000000",
        ))
        .await,
        libc::EPERM,
        "setting vaddr",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.ownerpid", b"1"))
            .await,
        libc::EPERM,
        "setting ownerpid",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.colour", b"1"))
            .await,
        libc::EINVAL,
        "unknown region attribute",
    );
    let big = vec![b'v'; 64 * 1024 + 1];
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.big", &big)).await,
        libc::E2BIG,
        "value over 64 KiB",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "user.regions.persistent", &big))
            .await,
        libc::E2BIG,
        "region value over 64 KiB",
    );
    ns.set_xattr(setxattr_req(region, "user.big", &big[..64 * 1024]))
        .await
        .expect("a 64 KiB value is allowed");
    let xattr_name_too_long = format!("user.{}", "x".repeat(251));
    assert_errno(
        ns.set_xattr(setxattr_req(region, &xattr_name_too_long, b"1"))
            .await,
        libc::ERANGE,
        "xattr name over 255 bytes",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(region, "security.selinux", b"1"))
            .await,
        libc::ENOTSUP,
        "non-user xattr",
    );
    assert_errno(
        ns.set_xattr(v1::SetXattrRequest {
            flags: 3,
            ..setxattr_req(region, "user.a", b"1")
        })
        .await,
        libc::EINVAL,
        "setxattr with both CREATE and REPLACE",
    );
    assert_errno(
        ns.rename(v1::RenameRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "region".into(),
            new_parent: ROOT_INO,
            new_name: "r2".into(),
            flags: 3,
        })
        .await,
        libc::EINVAL,
        "rename with NOREPLACE|EXCHANGE",
    );
    // Refused values left the attributes alone.
    assert_eq!(
        getxattr(&mut c, region, "user.regions.persistent")
            .await
            .unwrap(),
        b"1"
    );
    assert_eq!(
        getxattr(&mut c, region, "user.regions.hostalloc")
            .await
            .unwrap(),
        b""
    );
    assert_eq!(
        getxattr(&mut c, region, "user.big").await.unwrap().len(),
        64 * 1024
    );
    // Good values are taken (shell tools add a newline).
    c.namespace
        .set_xattr(setxattr_req(region, "user.regions.persistent", b"0\n"))
        .await
        .unwrap();
    c.namespace
        .set_xattr(setxattr_req(region, "user.regions.hostalloc", b"3,1"))
        .await
        .unwrap();
    assert_eq!(
        getxattr(&mut c, region, "user.regions.persistent")
            .await
            .unwrap(),
        b"0"
    );
    assert_eq!(
        getxattr(&mut c, region, "user.regions.hostalloc")
            .await
            .unwrap(),
        b"3,1"
    );
    let ns = &mut c.namespace;

    // ---- existing and non-empty ----
    let dir = ns
        .mkdir(mkdir_req(UID, ROOT_INO, "full", 0o755))
        .await
        .unwrap()
        .into_inner()
        .ino;
    ns.create(create_req(UID, dir, "inside")).await.unwrap();
    assert_errno(
        ns.rmdir(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "full".into(),
        })
        .await,
        libc::ENOTEMPTY,
        "rmdir of a non-empty directory",
    );
    assert_errno(
        ns.create(create_req(UID, dir, "inside")).await,
        libc::EEXIST,
        "create over an existing region",
    );
    assert_errno(
        ns.create(create_req(UID, ROOT_INO, "full")).await,
        libc::EEXIST,
        "create over an existing directory",
    );
    assert_errno(
        ns.mkdir(mkdir_req(UID, ROOT_INO, "region", 0o755)).await,
        libc::EEXIST,
        "mkdir over an existing region",
    );
    assert_errno(
        ns.rmdir(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "region".into(),
        })
        .await,
        libc::ENOTDIR,
        "rmdir of a region",
    );
    assert_errno(
        ns.unlink(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "full".into(),
        })
        .await,
        libc::EISDIR,
        "unlink of a directory",
    );
    assert_errno(
        ns.rename(v1::RenameRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "full".into(),
            new_parent: dir,
            new_name: "self".into(),
            flags: 0,
        })
        .await,
        libc::EINVAL,
        "rename of a directory into itself",
    );
    assert_errno(
        ns.create(create_req(UID, region, "child")).await,
        libc::ENOTDIR,
        "create inside a region",
    );

    // ---- permissions ----
    let locked = ns
        .mkdir(mkdir_req(0, ROOT_INO, "locked", 0o755))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((locked.uid, locked.mode & 0o7777), (0, 0o755));
    assert_errno(
        ns.create(create_req(UID, locked.ino, "mine")).await,
        libc::EACCES,
        "uid 1000 creates in a 0755 root dir",
    );
    assert_errno(
        ns.mkdir(mkdir_req(UID, locked.ino, "mine", 0o755)).await,
        libc::EACCES,
        "uid 1000 mkdirs in a 0755 root dir",
    );
    ns.create(create_req(0, locked.ino, "roots"))
        .await
        .expect("root may create there");
    assert_errno(
        ns.unlink(v1::RemoveRequest {
            caller: caller(UID, HOST),
            parent: locked.ino,
            name: "roots".into(),
        })
        .await,
        libc::EACCES,
        "uid 1000 unlinks in a 0755 root dir",
    );
    assert_errno(
        ns.set_xattr(setxattr_req(locked.ino, "user.regions.persistent", b"0"))
            .await,
        libc::EPERM,
        "uid 1000 sets a region attribute of root's directory",
    );
    // Sticky root: uid 1001 may not remove uid 1000's region.
    assert_errno(
        ns.unlink(v1::RemoveRequest {
            caller: caller(1001, HOST),
            parent: ROOT_INO,
            name: "region".into(),
        })
        .await,
        libc::EPERM,
        "uid 1001 unlinks uid 1000's region in the sticky root",
    );

    // ---- requests without a caller: InvalidArgument ----
    let status = ns
        .lookup(v1::LookupRequest {
            caller: None,
            parent: ROOT_INO,
            name: "region".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(errno_of(&status), libc::EINVAL);
    let status = ns
        .create(v1::CreateRequest {
            caller: None,
            ..create_req(UID, ROOT_INO, "nobody")
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let status = ns
        .read_dir(v1::ReadDirRequest {
            caller: None,
            ino: ROOT_INO,
            offset: 0,
            limit: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_errno(
        ns.lookup(v1::LookupRequest {
            caller: caller(UID, HOST),
            parent: ROOT_INO,
            name: "nobody".into(),
        })
        .await,
        libc::ENOENT,
        "create without a caller created nothing",
    );

    // ---- the cluster secret: Unauthenticated ----
    let bare = channel(manager.addr).await.unwrap();
    let mut anonymous = NamespaceClient::new(bare.clone()).max_decoding_message_size(MAX_MESSAGE);
    let status = anonymous
        .mkdir(mkdir_req(UID, ROOT_INO, "anonymous", 0o755))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::Unauthenticated,
        "no secret: {status:?}"
    );
    let status = ClusterClient::new(bare.clone())
        .stats(v1::StatsRequest {})
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::Unauthenticated,
        "no secret (cluster): {status:?}"
    );
    let wrong = Secret::new("not-the-cluster-secret").unwrap();
    let mut impostor = NamespaceClient::with_interceptor(bare.clone(), AttachSecret::new(&wrong))
        .max_decoding_message_size(MAX_MESSAGE);
    let status = impostor
        .mkdir(mkdir_req(UID, ROOT_INO, "impostor", 0o755))
        .await
        .unwrap_err();
    assert_eq!(
        status.code(),
        Code::Unauthenticated,
        "wrong secret: {status:?}"
    );
    for name in ["anonymous", "impostor"] {
        assert_errno(
            c.namespace
                .lookup(v1::LookupRequest {
                    caller: caller(UID, HOST),
                    parent: ROOT_INO,
                    name: name.into(),
                })
                .await,
            libc::ENOENT,
            "unauthenticated mkdir created nothing",
        );
    }

    // ---- garbage on the socket ----
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\xff\xff\xff\xff\xff\xff"[..],
        &[0u8; 4096][..],
    ] {
        let mut s =
            std::net::TcpStream::connect_timeout(&manager.addr, Duration::from_secs(5)).unwrap();
        let _ = s.write_all(junk);
        drop(s);
    }

    // ---- still alive and answering ----
    assert!(
        manager.is_running(),
        "the manager exited; its log:\n{}",
        manager.log()
    );
    let stats = c
        .cluster
        .stats(v1::StatsRequest {})
        .await
        .expect("stats after bad input")
        .into_inner();
    // The root, "dmmm…" (255 bytes), "full" and "locked".
    assert_eq!(stats.directories, 4, "{stats:?}");
    // "mmm…" (255 bytes), "region", "full/inside" and "locked/roots".
    assert_eq!(stats.regions, 4, "{stats:?}");
    let status = manager.sigterm_and_wait(Duration::from_secs(5)).unwrap();
    assert!(status.success(), "exit after SIGTERM: {status}");
}
