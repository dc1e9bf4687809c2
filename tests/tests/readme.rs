//! The README and the docs hold true: the README's set-up and CI install the same packages
//! (both run `scripts/install-deps.sh`, and neither installs anything else behind its back),
//! and every repository path the docs name exists.

use std::process::Command;

use regions_tests::repo_root;

fn read(rel: &str) -> String {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The shell commands of the first ```sh block after `heading` in the README.
fn first_sh_block_after(readme: &str, heading: &str) -> Vec<String> {
    let start = readme
        .find(heading)
        .unwrap_or_else(|| panic!("README.md has no {heading:?} section"));
    let rest = &readme[start..];
    let open = rest
        .find("```sh\n")
        .unwrap_or_else(|| panic!("no ```sh block under {heading:?}"));
    let body = &rest[open + 6..];
    let close = body.find("```").expect("the ```sh block is closed");
    body[..close]
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

fn script_packages() -> Vec<String> {
    let out = Command::new("sh")
        .arg(repo_root().join("scripts/install-deps.sh"))
        .arg("--list")
        .output()
        .expect("run scripts/install-deps.sh --list");
    assert!(
        out.status.success(),
        "install-deps.sh --list failed: {out:?}"
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

#[test]
fn quick_start_installs_dependencies_before_building() {
    let readme = read("README.md");
    let commands = first_sh_block_after(&readme, "## Quick start");
    let install = commands
        .iter()
        .position(|c| c == "scripts/install-deps.sh")
        .unwrap_or_else(|| {
            panic!("the quick start does not run scripts/install-deps.sh: {commands:?}")
        });
    let build = commands
        .iter()
        .position(|c| c.starts_with("cargo build"))
        .expect("the quick start builds with cargo");
    assert!(
        install < build,
        "dependencies must be installed before the build: {commands:?}"
    );
    assert!(
        !readme.contains("apt-get install"),
        "the README installs packages outside scripts/install-deps.sh"
    );
}

#[test]
fn ci_installs_exactly_what_the_readme_installs() {
    let ci = read(".ci/run");
    let commands: Vec<&str> = ci
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert!(
        commands.contains(&"scripts/install-deps.sh"),
        ".ci/run does not run scripts/install-deps.sh"
    );
    for c in &commands {
        assert!(
            !c.contains("apt-get") && !c.contains("apt ") && !c.contains("pip install"),
            ".ci/run installs something itself ({c:?}): add it to scripts/install-deps.sh instead"
        );
    }
    // The script's own apt-get line installs its list and nothing else.
    let script = read("scripts/install-deps.sh");
    let installs: Vec<&str> = script
        .lines()
        .filter(|l| l.trim_start().starts_with("apt-get install"))
        .collect();
    assert_eq!(installs.len(), 1, "one apt-get install in the script");
    assert!(
        installs[0].trim_end().ends_with("$missing"),
        "{}",
        installs[0]
    );
    let packages = script_packages();
    for needed in [
        "fuse3",
        "libclang-dev",
        "attr",
        "iproute2",
        "python3-numpy",
        "r-cran-ff",
    ] {
        assert!(
            packages.iter().any(|p| p == needed),
            "install-deps.sh does not install {needed}"
        );
    }
    // The README names every package the script installs.
    let readme = read("README.md");
    for p in &packages {
        assert!(
            readme.contains(&format!("`{p}`")),
            "README.md does not mention {p}"
        );
    }
}

/// Every file or folder of the repository that the docs name in backquotes
/// (`daemon/src/agent/map.rs`, `manager/src/sync/`) exists: the docs follow the code when
/// modules move.
#[test]
fn paths_named_in_the_docs_exist() {
    let root = repo_root();
    let tops: Vec<String> = std::fs::read_dir(&root)
        .expect("list the repository root")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.') && n != "target")
        .collect();
    let mut docs = vec!["README.md".to_owned()];
    for e in std::fs::read_dir(root.join("docs")).expect("list docs/") {
        let name = e.expect("a docs entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".md") {
            docs.push(format!("docs/{name}"));
        }
    }
    let mut checked = 0;
    let mut missing = Vec::new();
    for doc in &docs {
        let text = read(doc);
        for quoted in text.split('`').skip(1).step_by(2) {
            let path = quoted.trim_end_matches([',', '.', ':']);
            let Some((top, rest)) = path.split_once('/') else {
                continue;
            };
            // Repository paths only: a top-level folder, then names without spaces,
            // braces or wildcards (`proto/proto/regions/v1/{a,b}.proto` is a pattern).
            if !tops.iter().any(|t| t == top)
                || rest.is_empty() && !path.ends_with('/')
                || path.contains(|c: char| c.is_whitespace() || "{}*<>$()=".contains(c))
            {
                continue;
            }
            checked += 1;
            if !root.join(path).exists() {
                missing.push(format!("{doc}: {path}"));
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} paths found in the docs: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "the docs name paths that do not exist:\n{}",
        missing.join("\n")
    );
}
