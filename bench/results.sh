# Sourced by bench/run and bench/enqueue: what a run prints on stdout also
# goes to a results file, headed by what ran where and on which commit.
# The history of the figures is these files (bench/results/), not the docs.
#
#   results_start KIND ARGS...   OBX_BENCH_RESULTS names the file (default
#                                bench/results/UTC-TIME-KIND.txt); =off: none
results_start() {
  local kind=$1
  shift
  local file=${OBX_BENCH_RESULTS:-bench/results/$(date -u +%Y%m%d-%H%M%S)-$kind.txt}
  [ "$file" != off ] || return 0
  mkdir -p "$(dirname "$file")"
  {
    echo "# $0 $*"
    echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git describe --always --dirty 2>/dev/null || echo unknown)"
    echo "# $(nproc) cores, $(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo), $(awk '/^MemTotal/ { printf "%d GiB", $2 / 1048576 }' /proc/meminfo)"
    env | grep -E '^(OBX_BENCH|BENCH)_' | sort | sed 's/^/# /' || true
  } >"$file"
  exec > >(tee -a "$file")
  echo "$0: results also in $file" >&2
}
