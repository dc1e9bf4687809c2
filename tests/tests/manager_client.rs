//! The blocking manager client (`regions::manager_client::ManagerClient`, what regionfs and the
//! command call the manager with) against a real `regions-manager` that is killed and
//! restarted: threads calling at once use connections of their own, and no call fails
//! because the connection it took sat idle while the manager restarted.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use regions::manager_client::ManagerClient;
use regions_tests::{ManagerProcess, ROOT_INO, caller, write_secret};

const THREADS: usize = 6;

/// Every thread makes one call at the same moment (so the client holds several connections,
/// all idle afterwards); all must succeed.
fn call_from_every_thread(client: &Arc<ManagerClient>, when: &str) {
    let barrier = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let (client, barrier) = (Arc::clone(client), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                client.getattr(&caller(0, 1).expect("caller"), ROOT_INO)
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        let reply = t.join().expect("calling thread");
        match reply {
            Ok(attr) => assert_eq!(attr.ino, ROOT_INO),
            Err(e) => panic!("{when}: the call of thread {i} failed: {e}"),
        }
    }
}

#[test]
fn calls_after_a_manager_restart_succeed_on_connections_that_sat_idle() {
    let dir = tempfile::tempdir().expect("temp dir");
    let secret_file = dir.path().join("secret");
    let secret = write_secret(&secret_file).expect("secret");
    let data = dir.path().join("manager");
    let mut manager = ManagerProcess::start(&data, &secret_file).expect("manager");
    let addr = manager.addr;
    let url = format!("http://{addr}");
    let client = Arc::new(
        ManagerClient::connect(&url, &secret, None, Duration::from_secs(5)).expect("connect"),
    );
    call_from_every_thread(&client, "before the restart");

    // Restarts with no call in between: every connection in the pool sat idle through it,
    // and the calls after it must not fail on them.
    for round in 0..2 {
        manager.sigkill().expect("kill the manager");
        manager = restart(&addr, &data, &secret_file);
        call_from_every_thread(&client, &format!("round {round}, after the restart"));
    }

    // A call while the manager is down fails, saying it cannot be reached and why; once the
    // manager is back, calls succeed again.
    manager.sigkill().expect("kill the manager");
    let down = client
        .getattr(&caller(0, 1).expect("caller"), ROOT_INO)
        .expect_err("a call while the manager is down");
    let text = down.to_string();
    assert!(text.contains(&url) && text.contains("refused"), "{text}");
    let _manager = restart(&addr, &data, &secret_file);
    call_from_every_thread(&client, "after the manager came back");
}

/// The manager again on `addr`, with its data directory.
fn restart(
    addr: &std::net::SocketAddr,
    data: &std::path::Path,
    secret_file: &std::path::Path,
) -> ManagerProcess {
    ManagerProcess::start_in(&[], &addr.to_string(), data, secret_file, &[])
        .expect("restart the manager on its address")
}
