//! rmalloc from processes on several hosts in one region at once (libregions'
//! `rmalloc::shared`: per-process arenas, a directory reached with the transport's atomics,
//! remote frees through a ring): three hosts allocate and free on two threads each, a fourth
//! checks every live block and every arena's heap and frees some of the others' blocks, the
//! three hosts' next processes take those blocks back, and the fourth checks again.
//!
//! The long version (10 s, with throughput against one host alone) is
//! `cargo bench -p regions-tests --bench shared_heap`.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::Duration;

use regions_tests::Cluster;
use regions_tests::heap_runs::{check, start_stress};

const WAIT: Duration = Duration::from_secs(120);

#[test]
fn three_hosts_allocate_in_one_region_at_once_and_a_fourth_checks_the_heap() {
    let cluster = Cluster::start(4, "1G").unwrap();
    let mounts: Vec<_> = (1..=4).map(|h| cluster.mount(h).unwrap()).collect();
    std::fs::File::create(mounts[0].path("heap")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| -> PathBuf { dir.path().join(name) };

    // Three hosts at once, two threads each.
    let runs: Vec<_> = (0..3)
        .map(|h| {
            let live = file(&format!("live1-{h}"));
            start_stress(&mounts[h].path("heap"), h as u32 + 1, 2.0, 2, live).unwrap()
        })
        .collect();
    let mut lists = Vec::new();
    for r in runs {
        lists.push(r.live.clone());
        let ops = r.finish(WAIT).unwrap();
        assert!(ops > 1000, "only {ops} operations");
    }

    // The fourth host checks everything and frees every third block: remote frees, since it
    // owns no arena.
    let mut args: Vec<&OsStr> = Vec::new();
    for l in &lists {
        args.extend([OsStr::new("--live"), l.as_os_str()]);
    }
    let freed = file("freed");
    args.extend([
        OsStr::new("--free-every"),
        OsStr::new("3"),
        OsStr::new("--freed-out"),
        freed.as_os_str(),
    ]);
    let c = check(&mounts[3].path("heap"), &args, WAIT).unwrap();
    assert!(c.arenas >= 3, "{c:?}");
    assert!(c.blocks > 100 && c.freed > 30, "{c:?}");
    assert_eq!(c.pending, 0, "{c:?}");

    // The hosts' next processes adopt the arenas their predecessors handed back, take the
    // freed blocks back and allocate again.
    let runs: Vec<_> = (0..3)
        .map(|h| {
            let live = file(&format!("live2-{h}"));
            start_stress(&mounts[h].path("heap"), h as u32 + 1, 1.0, 2, live).unwrap()
        })
        .collect();
    let mut second = Vec::new();
    for r in runs {
        second.push(r.live.clone());
        r.finish(WAIT).unwrap();
    }

    // The first round's blocks that nobody freed are intact, the freed ones are free (or
    // handed out again), and the second round's blocks are intact too.
    let freed_set: std::collections::HashSet<String> = std::fs::read_to_string(&freed)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let kept = file("kept");
    let mut kept_text = String::new();
    for l in &lists {
        for line in std::fs::read_to_string(l).unwrap().lines() {
            if !freed_set.contains(line) {
                kept_text.push_str(line);
                kept_text.push('\n');
            }
        }
    }
    std::fs::write(&kept, kept_text).unwrap();
    let mut args: Vec<&OsStr> = vec![OsStr::new("--live"), kept.as_os_str()];
    for l in &second {
        args.extend([OsStr::new("--live"), l.as_os_str()]);
    }
    args.extend([OsStr::new("--freed"), freed.as_os_str()]);
    let c2 = check(&mounts[3].path("heap"), &args, WAIT).unwrap();
    assert!(
        c2.pending < c.freed,
        "no remote free was taken back: {c2:?} after {c:?}"
    );
}
