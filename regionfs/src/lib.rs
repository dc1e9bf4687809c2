//! The regions FUSE file system (DESIGN.md, "Client side"). Built by the
//! regionfs issue; this crate holds the place in the workspace layout.
