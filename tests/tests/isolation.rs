//! Isolation between users on one host, tested as attacks: the test runs as root, sets up
//! regions through a real mount, and runs `regions-attack` as the unprivileged user `nobody`
//! against the real host agent. Each attack must be refused; a control shows the same calls
//! succeed where the user is allowed, so a refusal is the defence and not a broken set-up.

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use regions::agent::AgentClient;
use regions_tests::{Cluster, MountProcess};

/// The unprivileged user the attacks run as.
const NOBODY: u32 = 65534;

/// Fields drop in order: the mounts before the cluster, whose directory holds their mount
/// points (removed with it only once nothing is mounted there).
struct Setup {
    mount: MountProcess,
    /// A mount on host 2, in clusters of two hosts: regions created through it live there,
    /// remote to the attacker on host 1.
    second: Option<MountProcess>,
    _cluster: Cluster,
    /// `regions-attack`, copied where `nobody` may run it.
    attack: PathBuf,
    socket: PathBuf,
}

fn setup() -> Setup {
    setup_with(&[])
}

/// [`setup`] with extra arguments for the daemon.
fn setup_with(daemon_args: &[&str]) -> Setup {
    setup_hosts(1, daemon_args)
}

/// A cluster of `hosts` (1 or 2) with a mount on each; the attacker talks to host 1's agent.
fn setup_hosts(hosts: u32, daemon_args: &[&str]) -> Setup {
    // Regions in chunks: these attacks go at segments, which small regions stored as objects
    // never have (their own attacks: daemon/tests/objects.rs).
    let cluster =
        Cluster::start_with_daemon_args(hosts, "256M", &["--small-regions", "0"], daemon_args)
            .expect("cluster");
    // nobody must reach the agent socket (and the attack binary) below the cluster directory,
    // but not list it.
    std::fs::set_permissions(cluster.dir.path(), std::fs::Permissions::from_mode(0o711))
        .expect("chmod the cluster directory");
    let mount = cluster.mount(1).expect("mount");
    let attack = regions_tests::attack_binary(cluster.dir.path()).expect("attack binary");
    let socket = cluster.daemon(1).expect("daemon").socket.clone();
    let second = (hosts > 1).then(|| cluster.mount(2).expect("mount on host 2"));
    Setup {
        _cluster: cluster,
        mount,
        second,
        attack,
        socket,
    }
}

impl Setup {
    /// Runs `regions-attack SOCKET args…` as nobody and returns its lines as name → outcome.
    fn attack(&self, args: &[&str]) -> HashMap<String, String> {
        let mut cmd = Command::new(&self.attack);
        cmd.arg(&self.socket)
            .args(args)
            .uid(NOBODY)
            .gid(NOBODY)
            .env("RUST_LOG", "off");
        let out = regions_tests::output_within(&mut cmd, Duration::from_secs(60))
            .expect("run the attack");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "regions-attack {args:?} failed: {}\n{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .filter_map(|l| l.split_once(": "))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// Starts `regions-attack SOCKET args…` as nobody with piped stdin, for attacks that
    /// run while the test acts; its stdout lines arrive on the channel.
    fn spawn_attack(
        &self,
        args: &[&str],
    ) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
        use std::io::{BufRead, BufReader};
        let mut cmd = Command::new(&self.attack);
        cmd.arg(&self.socket)
            .args(args)
            .uid(NOBODY)
            .gid(NOBODY)
            .env("RUST_LOG", "off")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        let mut child = regions_tests::spawn_retrying(&mut cmd).expect("start the attack");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        (child, rx)
    }

    /// Creates a region of `bytes` through the mount (as root) with `mode`; returns its inode.
    fn region(&self, rel: &str, bytes: &[u8], mode: u32) -> u64 {
        Self::region_through(&self.mount, rel, bytes, mode)
    }

    /// [`Setup::region`] on host 2 (through its mount), remote to the attacker.
    fn remote_region(&self, rel: &str, bytes: &[u8], mode: u32) -> u64 {
        let second = self.second.as_ref().expect("a cluster of two hosts");
        Self::region_through(second, rel, bytes, mode)
    }

    fn region_through(mount: &MountProcess, rel: &str, bytes: &[u8], mode: u32) -> u64 {
        let path = mount.path(rel);
        std::fs::write(&path, bytes).expect("write a region");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        std::fs::metadata(&path).expect("stat").ino()
    }

    fn dir(&self, rel: &str, mode: u32) -> u64 {
        let path = self.mount.path(rel);
        std::fs::create_dir(&path).expect("mkdir");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        std::fs::metadata(&path).expect("stat").ino()
    }
}

fn refused(outcomes: &HashMap<String, String>, name: &str, errnos: &[i32]) {
    let got = outcomes
        .get(name)
        .unwrap_or_else(|| panic!("attack {name} was not tried: {outcomes:?}"));
    let errno: Option<i32> = got.strip_prefix("refused ").and_then(|e| e.parse().ok());
    assert!(
        errno.is_some_and(|e| errnos.contains(&e)),
        "attack {name}: {got} (expected refused with one of {errnos:?}); all: {outcomes:?}"
    );
}

fn allowed(outcomes: &HashMap<String, String>, name: &str) {
    assert_eq!(
        outcomes.get(name).map(String::as_str),
        Some("ALLOWED"),
        "control {name} should succeed: {outcomes:?}"
    );
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The page of descriptor epochs the mount keeps (which `rmalloc(fd)` trusts to skip its
/// `kcmp`) cannot be changed, replaced or imitated by another user: every route refused,
/// and its counts still move with the mount's opens.
#[test]
fn another_user_cannot_change_or_plant_a_descriptor_epoch_page() {
    let s = setup();
    s.region("file", b"x", 0o644);
    let file = s.mount.path("file");
    let path = {
        let c_file = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        let name = std::ffi::CString::new("user.regions.descriptor_epochs").unwrap();
        let mut buf = vec![0u8; 4096];
        // SAFETY: NUL-terminated strings and a writable buffer of buf.len() bytes.
        let n = unsafe {
            libc::getxattr(
                c_file.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert!(n > 0, "no page named: {}", std::io::Error::last_os_error());
        buf.truncate(n as usize);
        PathBuf::from(String::from_utf8(buf).expect("a path"))
    };
    let before = std::fs::read(&path).expect("the page");
    let out = s.attack(&["epoch-page", path.to_str().expect("a path")]);
    assert_eq!(out.get("read").map(String::as_str), Some("ok"), "{out:?}");
    refused(&out, "open-write", &[libc::EACCES]);
    refused(&out, "mmap-writable", &[libc::EACCES]);
    refused(&out, "mprotect-writable", &[libc::EACCES]);
    refused(&out, "chmod", &[libc::EPERM]);
    refused(&out, "unlink", &[libc::EACCES]);
    refused(&out, "plant", &[libc::EACCES]);
    // The page is the mount's still: an open counts in it.
    drop(std::fs::File::open(&file).unwrap());
    let after = std::fs::read(&path).expect("the page after the attack");
    assert_eq!(after.len(), before.len());
    assert!(
        u64::from_ne_bytes(after[..8].try_into().unwrap())
            > u64::from_ne_bytes(before[..8].try_into().unwrap()),
        "the opens word did not move"
    );
    drop(s);
}

#[test]
fn a_reader_of_a_local_segment_cannot_write_or_seal_it_by_any_route() {
    let s = setup();
    let content = b"root's bytes, 0644, not yours to change";
    let ino = s.region("public", content, 0o644);
    let out = s.attack(&["read-segment", &ino.to_string()]);
    assert_eq!(
        out.get("segment").map(String::as_str),
        Some("ok"),
        "{out:?}"
    );
    refused(&out, "reopen-read-write", &[libc::EACCES]);
    refused(&out, "pwrite", &[libc::EBADF]);
    refused(&out, "mmap-writable", &[libc::EACCES]);
    refused(&out, "mprotect-writable", &[libc::EACCES]);
    refused(&out, "fallocate", &[libc::EBADF]);
    refused(&out, "ftruncate-grow", &[libc::EINVAL, libc::EBADF]);
    refused(&out, "ftruncate-shrink", &[libc::EINVAL, libc::EBADF]);
    refused(&out, "seal-grow", &[libc::EPERM]);
    refused(&out, "seal-future-write", &[libc::EPERM]);
    refused(&out, "segment-writable", &[libc::EACCES]);
    assert_eq!(
        out.get("content").map(String::as_str),
        Some(hex(&content[..16]).as_str()),
        "the segment's bytes are unchanged"
    );
    // And through the mount, as root, after dropping the page cache.
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    assert_eq!(std::fs::read(s.mount.path("public")).unwrap(), content);
    drop(s);
}

/// Runs the `write-segment` attack as nobody on a new 0666 region `shared` of 256 KiB of 7s;
/// returns its outcomes, the region's path and its size.
fn write_segment_attack(s: &Setup) -> (HashMap<String, String>, PathBuf, usize) {
    let size = 256 << 10;
    let ino = s.region("shared", &vec![7u8; size], 0o666);
    let path = s.mount.path("shared");
    let out = s.attack(&[
        "write-segment",
        &ino.to_string(),
        path.to_str().expect("utf-8 mount path"),
    ]);
    (out, path, size)
}

/// The controls of a `write-segment` attack on region `shared` (`size` bytes of 7): the writer
/// wrote through the library and through a mapping, and root reads both through the mount
/// (page cache dropped), the rest of the region untouched.
fn wrote_through_library_and_mapping(out: &HashMap<String, String>, path: &Path, size: usize) {
    allowed(out, "library-write");
    allowed(out, "mapping-write");
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    let now = std::fs::read(path).expect("read the region back");
    assert_eq!(now.len(), size);
    assert_eq!(&now[..8], b"library!");
    assert_eq!(&now[128 << 10..(128 << 10) + 8], b"mapped!!");
    assert!(now[8..128 << 10].iter().all(|&b| b == 7));
    assert!(now[(128 << 10) + 8..].iter().all(|&b| b == 7));
}

#[test]
fn a_writer_of_a_local_region_cannot_grow_seal_or_shrink_its_memory() {
    let s = setup();
    let (out, path, size) = write_segment_attack(&s);
    assert_eq!(
        out.get("segment").map(String::as_str),
        Some("ok"),
        "{out:?}"
    );
    // The writer gets the region's memory to read, not a descriptor that can change the memfd.
    assert_eq!(
        out.get("writable").map(String::as_str),
        Some("false"),
        "{out:?}"
    );
    refused(&out, "reopen-read-write", &[libc::EACCES]);
    refused(&out, "ftruncate-grow", &[libc::EINVAL, libc::EBADF]);
    refused(&out, "fallocate-past-end", &[libc::EBADF]);
    refused(&out, "pwrite-past-end", &[libc::EBADF]);
    refused(&out, "mmap-writable", &[libc::EACCES]);
    for seal in ["seal-grow", "seal-write", "seal-future-write", "seal-seal"] {
        refused(&out, seal, &[libc::EPERM]);
    }
    refused(&out, "ftruncate-shrink", &[libc::EINVAL, libc::EBADF]);
    assert_eq!(
        out.get("size-after").map(String::as_str),
        Some(size.to_string().as_str()),
        "the memfd keeps the size the daemon gave it: {out:?}"
    );
    // The controls: the writer still writes.
    wrote_through_library_and_mapping(&out, &path, size);
    // The daemon still serves the region, and root can still write it.
    std::fs::write(&path, b"still writable").unwrap();
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
    assert_eq!(&std::fs::read(&path).unwrap()[..], b"still writable");
}

/// The opt-out: on a daemon run with `--share-writable-segments`, the same writer gets a
/// writable segment (and with it the growth the test above refuses).
#[test]
fn share_writable_segments_hands_local_writers_a_writable_segment() {
    let s = setup_with(&["--share-writable-segments"]);
    let (out, path, size) = write_segment_attack(&s);
    assert_eq!(
        out.get("writable").map(String::as_str),
        Some("true"),
        "{out:?}"
    );
    allowed(&out, "ftruncate-grow");
    // Seals stay refused whoever writes: the daemon's accesses must not fail.
    for seal in ["seal-grow", "seal-write", "seal-future-write", "seal-seal"] {
        refused(&out, seal, &[libc::EPERM]);
    }
    refused(&out, "ftruncate-shrink", &[libc::EPERM]);
    // The file grew (sparse) past the region, which still reads at its own size.
    wrote_through_library_and_mapping(&out, &path, size);
}

#[test]
fn a_segment_kept_after_its_region_shrank_never_shows_the_next_owners_bytes() {
    const LEN: usize = 512 << 10;
    let s = setup();
    let a = s.region("a", &vec![b'a'; LEN], 0o644);
    let mut agent = AgentClient::connect(&s.socket).expect("root connects");
    let a_chunks: std::collections::HashSet<u64> = agent
        .open(a, false)
        .expect("open a")
        .map
        .into_iter()
        .collect();
    let mut b_chunks = Vec::new();
    // nobody keeps a's segment while root shrinks a to nothing and writes a private region
    // into the memory it gave back.
    let out = attack_across_a_change(&s, &["hold-segment", &a.to_string(), "83"], || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(s.mount.path("a"))
            .and_then(|f| f.set_len(0))
            .expect("truncate a");
        let b = s.region("b", &vec![b'S'; LEN], 0o600);
        b_chunks = agent.open(b, false).expect("open b").map;
    });
    assert!(
        b_chunks.iter().any(|c| a_chunks.contains(c)),
        "b did not reuse a's memory, so this test would prove nothing: {b_chunks:?} vs {a_chunks:?}"
    );
    assert_eq!(
        out.get("segment").map(String::as_str),
        Some("ok"),
        "{out:?}"
    );
    assert!(
        out.get("size")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|n| n >= LEN as u64),
        "the whole old extent was read: {out:?}"
    );
    assert_eq!(
        out.get("marker-bytes").map(String::as_str),
        Some("0"),
        "a's old segment showed b's bytes: {out:?}"
    );
}

#[test]
fn an_inode_number_inside_a_private_directory_gives_eacces() {
    let s = setup();
    // Control: a 0644 region in the (world-searchable) root directory.
    let open_ino = s.region("readable", b"anyone may read this", 0o644);
    let control = s.attack(&["by-inode", &open_ino.to_string()]);
    allowed(&control, "open");
    allowed(&control, "segment");
    allowed(&control, "map-refresh");
    refused(&control, "open-write", &[libc::EACCES]);
    refused(&control, "map-extend", &[libc::EACCES]);

    // The same kind of region inside root's 0700 directory, its number guessed.
    s.dir("private", 0o700);
    let hidden = s.region(
        "private/notes",
        b"root's notes, 0644 but unreachable",
        0o644,
    );
    let out = s.attack(&["by-inode", &hidden.to_string()]);
    for call in ["open", "open-write", "segment", "map-refresh", "map-extend"] {
        refused(&out, call, &[libc::EACCES]);
    }

    // Creating below a 0777 directory that sits inside the private one.
    let inner = s.dir("private/drop", 0o777);
    let out = s.attack(&["create-in", &inner.to_string(), "planted"]);
    refused(&out, "create", &[libc::EACCES]);
    assert!(!s.mount.path("private/drop/planted").exists());
    // Control: a 0777 directory reachable from the root.
    let public = s.dir("drop", 0o777);
    let out = s.attack(&["create-in", &public.to_string(), "planted"]);
    allowed(&out, "create");
}

#[test]
fn a_handle_can_be_closed_only_by_the_process_that_opened_it() {
    let s = setup();
    let ino = s.region("held", b"held open by root", 0o644);
    let mut agent = AgentClient::connect(&s.socket).expect("agent");
    let handle = agent
        .open(ino, false)
        .expect("open through the agent")
        .handle;
    let out = s.attack(&["close", &handle.to_string()]);
    refused(&out, "close", &[libc::EBADF]);
    agent
        .map_close(handle)
        .expect("the opener closes its own handle");
}

/// One user opening connections without end gets at most its share of the host agent; root
/// and other users are still served while it holds them.
#[test]
fn one_user_cannot_hold_every_host_agent_connection() {
    let s = setup();
    let flood = 3 * regions_daemon::agent::MAX_CONNECTIONS_PER_USER;
    let (mut child, rx) = s.spawn_attack(&["flood", &flood.to_string()]);
    let mut answered = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while let Ok(line) =
        rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        if let Some(n) = line.strip_prefix("answered: ") {
            answered = n.parse::<usize>().ok();
        }
        if line.starts_with("holding: ") {
            break;
        }
    }
    let answered = answered.expect("the flood reports how many connections were served");
    assert_eq!(
        answered,
        regions_daemon::agent::MAX_CONNECTIONS_PER_USER,
        "nobody is served on exactly its share of {flood} connections"
    );
    // While nobody holds its share: root is served, and so is another user.
    let mut agent = AgentClient::connect(&s.socket).expect("root connects");
    agent.stats().expect("root is served during the flood");
    let mut other = Command::new(&s.attack);
    other
        .arg(&s.socket)
        .args(["flood", "5"])
        .uid(NOBODY - 1)
        .gid(NOBODY - 1)
        .env("RUST_LOG", "off")
        .stdin(std::process::Stdio::null());
    let out = regions_tests::output_within(&mut other, Duration::from_secs(60)).expect("run");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("answered: 5"),
        "another user during the flood: {text}"
    );
    drop(child.stdin.take());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("wait for the flood").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the flood did not exit after its stdin closed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sync_objects_have_owners_and_modes() {
    let s = setup();
    let sync = regions::sync::SyncClient::connect(&s.socket);
    sync.mutex_init("private-lock")
        .expect("root's private mutex (0600)");
    let shared = regions::sync::SyncClient::connect(&s.socket).with_mode(0o666);
    shared
        .mutex_init("shared-lock")
        .expect("root's shared mutex (0666)");

    let out = s.attack(&["sync", "private-lock"]);
    refused(&out, "lock", &[libc::EACCES]);
    refused(&out, "delete", &[libc::EPERM]);
    // Control: a mutex everyone may use, but only its owner may delete.
    let out = s.attack(&["sync", "shared-lock"]);
    allowed(&out, "lock");
    allowed(&out, "unlock");
    refused(&out, "delete", &[libc::EPERM]);
    // Root's own objects are still there and work.
    sync.mutex_lock("private-lock")
        .expect("root locks its mutex");
    sync.mutex_unlock("private-lock").expect("and unlocks it");
    // A capability for the shared mutex's word reaches that slot only: not the private
    // mutex's word beside it, nor the lock region as a whole.
    let out = s.attack(&["sync-slot", "shared-lock"]);
    allowed(&out, "own-word");
    refused(&out, "previous-slot", &[libc::EACCES]);
    refused(&out, "next-slot", &[libc::EACCES]);
    refused(&out, "whole-region-segment", &[libc::EACCES]);
    refused(&out, "whole-region-open", &[libc::EACCES]);
    sync.delete("shared-lock").expect("the owner deletes");
}

/// Runs `regions-attack revoked INO` as nobody: it reads region `ino` with a capability, then
/// `change` runs (as root, through the mount) and it reads again. Returns its outcomes.
fn across_a_change(s: &Setup, ino: u64, change: impl FnOnce()) -> HashMap<String, String> {
    attack_across_a_change(s, &["revoked", &ino.to_string()], change)
}

/// Runs `regions-attack args…` as nobody; when it prints `ready`, runs `change` and tells it
/// to go on. Returns its outcomes.
fn attack_across_a_change(
    s: &Setup,
    args: &[&str],
    change: impl FnOnce(),
) -> HashMap<String, String> {
    use std::io::Write;
    let (mut child, rx) = s.spawn_attack(args);
    let mut outcomes = HashMap::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut changed = false;
    let mut change = Some(change);
    while let Ok(line) =
        rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
    {
        if line == "ready" {
            if let Some(change) = change.take() {
                change();
            }
            changed = true;
            let stdin = child.stdin.as_mut().expect("piped stdin");
            stdin.write_all(b"go\n").expect("tell the attack to go on");
            continue;
        }
        if let Some((k, v)) = line.split_once(": ") {
            outcomes.insert(k.to_owned(), v.to_owned());
        }
    }
    let status = regions_tests::wait_timeout(&mut child, Duration::from_secs(20)).expect("wait");
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(changed, "the attack never got ready: {outcomes:?}");
    assert!(
        status.is_some_and(|s| s.success()),
        "the attack failed: {outcomes:?}"
    );
    outcomes
}

#[test]
fn capabilities_are_revoked_by_chmod_chown_unlink_and_truncate() {
    use std::os::unix::fs::chown;
    let s = setup_hosts(2, &[]);
    let content = vec![b'r'; 8192];
    // chmod: nobody could read (0644), then cannot (0600). The token it held is refused by
    // the daemon, on its old connection and on a new one, and renewing it is refused too.
    let chmod = s.remote_region("chmod", &content, 0o644);
    let out = across_a_change(&s, chmod, || {
        std::fs::set_permissions(s.mount.path("chmod"), PermissionsExt::from_mode(0o600))
            .expect("chmod 0600");
    });
    assert_eq!(out.get("chunk-local").map(String::as_str), Some("false"));
    allowed(&out, "library-read-before");
    allowed(&out, "old-token-before");
    refused(&out, "old-token", &[libc::EKEYREVOKED]);
    refused(&out, "old-token-new-connection", &[libc::EKEYREVOKED]);
    refused(&out, "library-read", &[libc::EACCES]);

    // chown: nobody read through its group, and the group changes.
    let group = s.remote_region("chown", &content, 0o640);
    chown(s.mount.path("chown"), Some(0), Some(NOBODY)).expect("chgrp nobody");
    let out = across_a_change(&s, group, || {
        chown(s.mount.path("chown"), Some(0), Some(0)).expect("chgrp root");
    });
    allowed(&out, "old-token-before");
    refused(&out, "old-token", &[libc::EKEYREVOKED]);
    refused(&out, "library-read", &[libc::EACCES]);

    // Chunks on the reader's own host are read through the segment descriptor the agent
    // handed at the open, which keeps its rights as a descriptor does: the library reads
    // them after the chmod, while the token (over tcp to the same daemon) is revoked.
    let here = s.region("here", &content, 0o644);
    let out = across_a_change(&s, here, || {
        std::fs::set_permissions(s.mount.path("here"), PermissionsExt::from_mode(0o600))
            .expect("chmod 0600");
    });
    assert_eq!(out.get("chunk-local").map(String::as_str), Some("true"));
    refused(&out, "old-token", &[libc::EKEYREVOKED]);
    allowed(&out, "library-read");

    // A shrinking truncate and an unlink end the tokens too; a holder that may still read
    // (mode 0644; an unlinked region stays readable through its open handle, as a descriptor
    // does) renews without noticing.
    let truncated = s.region("truncate", &content, 0o644);
    let out = across_a_change(&s, truncated, || {
        std::fs::OpenOptions::new()
            .write(true)
            .open(s.mount.path("truncate"))
            .and_then(|f| f.set_len(4096))
            .expect("truncate to 4 KiB");
    });
    refused(&out, "old-token", &[libc::EKEYREVOKED]);
    allowed(&out, "library-read");
    assert_eq!(out.get("content").map(String::as_str), Some("rrrr"));
    let unlinked = s.region("unlink", &content, 0o644);
    let out = across_a_change(&s, unlinked, || {
        std::fs::remove_file(s.mount.path("unlink")).expect("unlink");
    });
    refused(&out, "old-token", &[libc::EKEYREVOKED]);
    allowed(&out, "library-read");
    assert_eq!(out.get("content").map(String::as_str), Some("rrrr"));

    // Control: a change that ends nothing (a timestamp) leaves the token working.
    let touched = s.region("touch", &content, 0o644);
    let out = across_a_change(&s, touched, || {
        let f = std::fs::File::options()
            .write(true)
            .open(s.mount.path("touch"))
            .expect("open");
        f.set_modified(std::time::SystemTime::now())
            .expect("set mtime");
    });
    allowed(&out, "old-token");
    allowed(&out, "library-read");
}
