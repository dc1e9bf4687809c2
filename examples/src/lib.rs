//! Demos of regions (docs/ARCHITECTURE.md, "tests and examples"); they arrive with the demo issue.
