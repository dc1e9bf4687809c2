//! Reading a process's Prometheus page (`--metrics-listen`) in tests: a free loopback
//! address to serve it on, one plain HTTP GET, and the sum of a metric's samples.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// Bound on one scrape (connect, request, response).
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// A loopback address with a port that was free a moment ago.
pub fn free_addr() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// `GET /metrics` over a plain TCP connection; the body of a 200 answer.
pub fn scrape(addr: &str) -> anyhow::Result<String> {
    let addr: SocketAddr = addr.parse()?;
    let mut stream = TcpStream::connect_timeout(&addr, SCRAPE_TIMEOUT)?;
    stream.set_read_timeout(Some(SCRAPE_TIMEOUT))?;
    stream.set_write_timeout(Some(SCRAPE_TIMEOUT))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: regions\r\nConnection: close\r\n\r\n")?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("no HTTP header in {answer:?}"))?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "not a 200 answer: {head}");
    Ok(body.to_owned())
}

/// The sum of the samples of `name` whose labels include every pair of `want`.
pub fn sample(page: &str, name: &str, want: &[(&str, &str)]) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, labels) = match series.split_once('{') {
                Some((m, rest)) => (m, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            let matches = metric == name
                && want.iter().all(|(k, v)| {
                    let pair = format!("{k}=\"{v}\"");
                    labels.split(',').any(|kv| kv == pair)
                });
            if matches {
                value.parse::<f64>().ok()
            } else {
                None
            }
        })
        .sum()
}
