//! The regions daemon: memfd pools, the transport server and the host agent
//! (DESIGN.md, "Data plane"). Built by the data-plane issue; this crate holds
//! the place in the workspace layout.
