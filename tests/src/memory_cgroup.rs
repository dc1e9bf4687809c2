//! A memory cgroup with a limit, for tests that run a process under memory pressure: cgroup v2
//! (`memory.max`) where the unified hierarchy has the memory controller, else cgroup v1
//! (`memory.limit_in_bytes`). Removed on drop (its processes must have exited).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

pub struct MemoryCgroup {
    dir: PathBuf,
    v2: bool,
}

impl MemoryCgroup {
    /// A new cgroup named after `name` and this process, limited to `limit` bytes of memory.
    pub fn create(name: &str, limit: u64) -> anyhow::Result<MemoryCgroup> {
        let leaf = format!("{name}-{}", std::process::id());
        let v2_roots = [
            Path::new("/sys/fs/cgroup"),
            Path::new("/sys/fs/cgroup/unified"),
        ];
        for root in v2_roots {
            let controllers = std::fs::read_to_string(root.join("cgroup.controllers"));
            if controllers.is_ok_and(|c| c.split_whitespace().any(|w| w == "memory")) {
                // Children get the controller only when the root enables it for them.
                let _ = std::fs::write(root.join("cgroup.subtree_control"), "+memory");
                let dir = root.join(&leaf);
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("creating cgroup {}", dir.display()))?;
                let g = MemoryCgroup { dir, v2: true };
                std::fs::write(g.dir.join("memory.max"), limit.to_string())
                    .context("setting memory.max")?;
                let _ = std::fs::write(g.dir.join("memory.swap.max"), "0");
                return Ok(g);
            }
        }
        let v1 = Path::new("/sys/fs/cgroup/memory");
        if v1.join("memory.limit_in_bytes").exists() {
            let dir = v1.join(&leaf);
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating cgroup {}", dir.display()))?;
            let g = MemoryCgroup { dir, v2: false };
            std::fs::write(g.dir.join("memory.limit_in_bytes"), limit.to_string())
                .context("setting memory.limit_in_bytes")?;
            return Ok(g);
        }
        bail!(
            "no memory cgroup controller here (neither cgroup v2 with `memory` nor \
             /sys/fs/cgroup/memory): this test needs one"
        )
    }

    /// The file a process writes its pid to in order to join.
    pub fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Highest memory use of the cgroup so far, in bytes (None when the kernel does not say).
    pub fn peak(&self) -> Option<u64> {
        let file = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Times the cgroup hit its limit and the kernel killed a process for it.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = if self.v2 {
            ("memory.events", "oom_kill")
        } else {
            ("memory.oom_control", "oom_kill")
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|t| {
                t.lines().find_map(|l| {
                    let mut w = l.split_whitespace();
                    (w.next() == Some(key)).then(|| w.next()?.parse().ok())?
                })
            })
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}
