//! Demos of regions (DESIGN.md, "examples/"); they arrive with the demo issue.
