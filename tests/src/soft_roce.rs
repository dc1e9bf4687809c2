//! A virtual machine with a soft-RoCE device, for the RDMA tests: this machine's kernel has no
//! RDMA, but Debian's kernel package has `rdma_rxe`, and `vng` (virtme-ng) boots that kernel
//! under qemu with this machine's files as the VM's root (read-only), so binaries built here
//! run inside it as they are.
//!
//! [`run`] boots the VM (software emulation: KVM is not usable here), loads `rdma_rxe`, makes a
//! veth pair and the device `rxe0` on it, waits until its port is active, runs a shell
//! script, and returns what it printed. Everything the VM needs (`vng`, qemu, the kernel
//! image) is installed by `scripts/install-deps.sh`; when one is missing, [`run`] fails and
//! says which.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

/// The RDMA device the VM has.
pub const DEVICE: &str = "rxe0";

/// The newest Debian kernel image under /boot (`vmlinuz-*-amd64`).
pub fn kernel_image() -> anyhow::Result<PathBuf> {
    let mut images: Vec<PathBuf> = std::fs::read_dir("/boot")
        .context("cannot list /boot")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-") && n.ends_with("-amd64"))
        })
        .collect();
    images.sort();
    images.pop().context(
        "no /boot/vmlinuz-*-amd64: the RDMA tests boot Debian's kernel (package \
         linux-image-amd64, installed by scripts/install-deps.sh)",
    )
}

/// Boots the VM, sets up `rxe0`, runs `script` (POSIX sh) and returns its output (stdout and
/// stderr together). Fails when the VM cannot start, the device does not come up, or the run
/// takes longer than `timeout`.
pub fn run(script: &str, timeout: Duration) -> anyhow::Result<String> {
    // `vng` where pip put it on PATH, else the same entry point through python3.
    let mut vng = match which("vng") {
        Some(path) => Command::new(path),
        None => {
            let mut c = Command::new("python3");
            c.args([
                "-c",
                "import sys; from virtme_ng.run import main; sys.argv[0] = 'vng'; sys.exit(main())",
            ]);
            c
        }
    };
    let kernel = kernel_image()?;
    let dir = tempfile::Builder::new()
        .prefix("soft-roce")
        .tempdir_in(std::env::temp_dir())
        .context("temporary directory")?;
    let path = dir.path().join("run.sh");
    let marker = "soft-roce: device ready";
    let whole = format!(
        "#!/bin/sh\n\
         set -e\n\
         modprobe rdma_rxe\n\
         ip link set lo up\n\
         sysctl -qw net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0\n\
         ip link add veth0 type veth peer name veth1\n\
         ip link set veth0 up\n\
         ip link set veth1 up\n\
         rdma link add {DEVICE} type rxe netdev veth0\n\
         i=0\n\
         until grep -q ACTIVE /sys/class/infiniband/{DEVICE}/ports/1/state 2>/dev/null; do\n\
           i=$((i+1)); [ $i -lt 100 ] || {{ echo 'soft-roce: {DEVICE} never became active'; exit 1; }}\n\
           sleep 0.1\n\
         done\n\
         i=0\n\
         until ip -6 addr show dev veth0 | grep -q 'fe80.*scope link' && ! ip -6 addr show dev veth0 | grep -q tentative; do\n\
           i=$((i+1)); [ $i -lt 100 ] || {{ echo 'soft-roce: veth0 has no usable link-local address'; exit 1; }}\n\
           sleep 0.1\n\
         done\n\
         echo '{marker}'\n\
         set +e\n\
         {script}\n\
         echo \"soft-roce: script exit $?\"\n"
    );
    std::fs::write(&path, whole).context("write the VM script")?;
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let mut child = vng
        .arg("--run")
        .arg(&kernel)
        .args(["--disable-kvm", "--memory", "2G", "--cpus", "2", "--exec"])
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start vng")?;
    let out_pipe = child.stdout.take().context("vng stdout")?;
    let err_pipe = child.stderr.take().context("vng stderr")?;
    let out = std::thread::spawn(move || read_all(out_pipe));
    let err = std::thread::spawn(move || read_all(err_pipe));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() >= deadline {
            // The VM is one qemu process (vng execs into it or waits for it): kill both.
            let _ = child.kill();
            let _ = child.wait();
            bail!("the soft-RoCE VM did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = format!(
        "{}{}",
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default()
    );
    ensure!(
        status.success() || text.contains("soft-roce: script exit"),
        "vng failed ({status}); is virtme-ng installed (scripts/install-deps.sh installs it \
         with pip)?\n{text}"
    );
    ensure!(
        text.contains(marker),
        "the soft-RoCE device did not come up in the VM:\n{text}"
    );
    Ok(text)
}

fn read_all(mut r: impl std::io::Read) -> String {
    let mut s = String::new();
    let _ = r.read_to_string(&mut s);
    s
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
