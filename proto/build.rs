//! Compiles the manager's `.proto` files with `protox` (pure Rust, no `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/regions/v1/common.proto",
        "proto/regions/v1/namespace.proto",
        "proto/regions/v1/regions.proto",
        "proto/regions/v1/cluster.proto",
        "proto/regions/v1/sync.proto",
        "proto/regions/v1/agent.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
