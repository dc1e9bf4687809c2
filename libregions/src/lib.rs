//! The regions client core (DESIGN.md, "Client side"). Built by the data-plane
//! and libregions issues; this crate holds the place in the workspace layout.
