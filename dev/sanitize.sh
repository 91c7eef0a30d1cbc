#!/usr/bin/env bash
# compute-sanitizer over the GPU test suite, on the GPU machine: memcheck (out-of-bounds and
# misaligned accesses, leaks of device memory at exit) and racecheck (shared-memory hazards), one
# Criterion test at a time, skipping the long-sequence tests (N >= 16K: hours under the sanitizer).
#   BIN=.devrun LOGS=$OUT bash dev/sanitize.sh [memcheck|racecheck|both]
# The suites take long under the sanitizer (memcheck: ~2 minutes per determinism test), so
#   BIN=.devrun LOGS=$OUT bash dev/sanitize.sh kernels
# runs memcheck, racecheck and synccheck over BIN/sanitize_attention instead: every attention
# kernel once on small shapes with tails (dev/sanitize_attention.c), in a few seconds each.
set -uo pipefail
BIN=${BIN:-build}; LOGS=${LOGS:-sanitize_logs}; LIBS=${LIBS:-.devlibs}; tools=${1:-both}
[ "$tools" = both ] && tools="memcheck racecheck"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
export LD_LIBRARY_PATH="$PWD/$LIBS:${LD_LIBRARY_PATH:-}"
mkdir -p "$LOGS"
status=0
if [ "$tools" = kernels ]; then
    for tool in memcheck racecheck synccheck; do
        log="$LOGS/${tool}_sanitize_attention.log"
        "$SAN" --tool "$tool" --error-exitcode 99 "$BIN/sanitize_attention" > "$log" 2>&1
        rc=$?
        echo "$tool sanitize_attention rc=$rc $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|kernels ran|FAILED" "$log" | tr '\n' ' ')"
        [ $rc -eq 0 ] || status=1
    done
    exit $status
fi
for tool in $tools; do
    for t in "$BIN"/test_*_cuda; do
        suite_tests=$("$t" --list 2>/dev/null | awk '/: [0-9]+ tests?$/ {suite = $1; sub(":", "", suite)} /[├└]── / {print suite "/" $2}')
        for name in $suite_tests; do
            case "$name" in *long*) continue ;; esac
            log="$LOGS/${tool}_$(basename "$t")_${name//\//_}.log"
            "$SAN" --tool "$tool" --error-exitcode 99 "$t" --filter "$name" -j1 > "$log" 2>&1
            rc=$?
            summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Synthesis" "$log" | tr '\n' ' ')
            echo "$tool $(basename "$t") $name rc=$rc $summary"
            [ $rc -eq 0 ] || status=1
        done
    done
done
exit $status
