#!/usr/bin/env bash
# Instructions per call of the filter's own work, natively (examples/native_work.rs), counted
# by callgrind: each workload runs once and 101 times, and the difference over 100 is printed,
# so that start-up does not count. Needs valgrind. Usage: bench/native-instructions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)"; exit 1; }
cargo build --quiet --release --example native_work
binary=${CARGO_TARGET_DIR:-target}/release/examples/native_work
count() {
    valgrind --tool=callgrind --callgrind-out-file=/dev/null "$binary" "$1" "$2" 2>&1 \
        | sed -n 's/.*refs: *//p' | tr -d ,
}
printf '%-20s %12s\n' workload instructions
for workload in request request_merge_off usage_answer token_event usage_event; do
    once=$(count "$workload" 1)
    many=$(count "$workload" 101)
    printf '%-20s %12d\n' "$workload" $(((many - once) / 100))
done
