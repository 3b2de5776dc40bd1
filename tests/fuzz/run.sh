#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS on a scratch copy of its committed
# corpus (new inputs it finds are not written into the checkout). An input
# that crashes is kept next to where ctest runs, as fuzz-<target>-crash-...
#   tests/fuzz/run.sh FUZZER CORPUS_DIR SECONDS
set -euo pipefail
fuzzer=$1 corpus=$2 seconds=$3
keep="$PWD/fuzz-$(basename "$fuzzer")-"
work=$(mktemp -d /tmp/obx-fuzz-XXXXXX)
trap 'rm -rf "$work"' EXIT
cp -r "$corpus"/. "$work"/
"$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=1024 -print_final_stats=1 \
  -artifact_prefix="$keep" "$work"
