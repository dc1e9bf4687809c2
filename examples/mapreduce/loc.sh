#!/usr/bin/env bash
# Counts the regions-specific code of the map-reduce demo: the lines of
# src/cluster.rs that are code (not blank, not // comments). The job itself
# (hist.rs, main.rs) is counted beside it for scale.
set -euo pipefail
cd "$(dirname "$0")/src"
code_lines() { # file: non-blank lines that are not // comments
  sed '/^\s*$/d; /^\s*\/\//d' "$1" | wc -l
}
regions=$(code_lines cluster.rs)
echo "regions-specific code (src/cluster.rs): $regions lines"
echo "the rest of the job: hist.rs $(code_lines hist.rs) lines (with its tests), main.rs $(code_lines main.rs) lines"
