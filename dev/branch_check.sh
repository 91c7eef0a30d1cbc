# The GPU-machine half of a branch check: a branch's dev/NAME_gpu.sh builds a folder DIR here
# (its tests, planted builds, its train_dit and main's as train_dit_base, HEAD and BASE files, this
# file) and, in one device call, sources this file and runs its steps against main's binary:
#
#   . "$D/branch_check.sh"; bc_init "$D"         # D: the folder; O=$OUT, temp dir, summary $S
#   bc_step NAME SECONDS LOG COMMAND...           # one line per step into $S: rc and last log line
#   bc_ckpt NAME ARGS...                          # 6 deterministic DiT-S steps, checkpoints compared
#   bc_losses NAME ARGS...                        # 4 deterministic steps: step, loss, grad norm compared
#                                                 # (when they differ: the largest relative loss difference)
#   bc_timed NAME ARGS...                         # 12 steps, new then main (interleave calls for rounds)
#   bc_times NAME...                              # median ms of steps 4-12 of timed runs, main - new
#   bc_peak NAME                                  # peak memory of timed run NAME, new then main
#   bc_kernels REGEX ARGS...                      # CUPTI kernel ms per step (dev/kernel_times.c)
#   bc_done                                       # removes the temp dir, prints $S
#
# ARGS are train_dit arguments; BC_C and BC_A hold the step-table configurations c (16K tokens,
# hidden 2048, depth 4) and a (DiT-B/2, 256 tokens × 64), sage attention, 12 steps. Steps share
# one deadline (BUDGET_S seconds from bc_init, default 300): a step that would pass it is skipped.
# A merge rule belongs in the branch's script, written before the run.

BC_RUN="--device gpu --data synthetic --attn sage --steps 12 --ckpt-every 0 --sample-every 0 --seed 1"
BC_C="$BC_RUN --hidden 2048 --heads 16 --depth 4 --batch 1 --image-size 256 --patch 2"
BC_A="$BC_RUN --hidden 768 --heads 12 --depth 12 --batch 64 --image-size 32 --patch 2"

bc_init() {
    D=$1
    O=${OUT:-branch_check_out}
    L=$(mktemp -d)
    S=$O/summary.txt
    BC_DEADLINE=$((SECONDS + ${BUDGET_S:-300}))
    mkdir -p "$O"
    : > "$S"
    export LD_LIBRARY_PATH=$PWD/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "binaries of $(cat "$D/HEAD" 2>/dev/null); base (main) $(cat "$D/BASE" 2>/dev/null)" >> "$S"
    timeout -k 3 10 nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$S" 2>&1
}

bc_step() {
    local name=$1 t=$2 log=$3
    shift 3
    [ "$t" -gt $((BC_DEADLINE - SECONDS)) ] && t=$((BC_DEADLINE - SECONDS))
    if [ "$t" -lt 2 ]; then echo "$name: skipped (deadline)" >> "$S"; return; fi
    echo "=== $name" >> "$log"
    timeout -k 3 "$t" "$@" >> "$log" 2>&1
    local rc=$?
    echo "$name: rc=$rc$([ $rc -ge 124 ] && echo ' (cut by timeout)') ($(tail -n 1 "$log" | cut -c1-160)) at $SECONDS s" >> "$S"
}

# both binaries with the same arguments into $L/<prefix>_<name>_new and _base
bc_both() {
    local prefix=$1 name=$2 t=$3
    shift 3
    bc_step ${prefix}_${name}_new "$t" "$O/train.log" "$D/train_dit" "$@" --out "$L/${prefix}_${name}_new"
    bc_step ${prefix}_${name}_base "$t" "$O/train.log" "$D/train_dit_base" "$@" --out "$L/${prefix}_${name}_base"
}

bc_ckpt() {
    local name=$1
    shift
    bc_both k "$name" 25 --device gpu --data synthetic --model S --batch 8 --image-size 32 --steps 6 \
        --ckpt-every 6 --sample-every 0 --seed 5 --deterministic "$@"
    if cmp "$L/k_${name}_new/ckpt_000006.safetensors" "$L/k_${name}_base/ckpt_000006.safetensors" >> "$S" 2>&1; then
        echo "ckpt_${name}: EQUAL" >> "$S"
    else
        echo "ckpt_${name}: DIFFERENT (or missing)" >> "$S"
    fi
    rm -f "$L"/k_${name}_*/ckpt_*
}

bc_losses() {
    local name=$1
    shift
    bc_both d "$name" 40 "$@" --deterministic --steps 4
    if [ -s "$L/d_${name}_new/train_log.csv" ] &&
        cmp -s <(cut -d, -f1-3 "$L/d_${name}_new/train_log.csv") <(cut -d, -f1-3 "$L/d_${name}_base/train_log.csv"); then
        echo "losses_${name}: EQUAL ($(wc -l < "$L/d_${name}_new/train_log.csv") lines)" >> "$S"
    else
        echo "losses_${name}: DIFFERENT (or missing); largest relative loss difference:" \
            "$(paste -d, <(cut -d, -f2 "$L/d_${name}_new/train_log.csv" 2>/dev/null) \
                         <(cut -d, -f2 "$L/d_${name}_base/train_log.csv" 2>/dev/null) |
               awk -F, 'NR > 1 && $2 != 0 {d = ($1 - $2) / $2; if (d < 0) d = -d; if (d > m) m = d}
                        END {printf "%.2e over %d steps\n", m, NR - 1}')" >> "$S"
    fi
}

bc_timed() {
    local name=$1
    shift
    bc_both t "$name" 40 "$@"
}

# the median of the ms column over steps 4-12 of a train_log.csv
bc_median_ms() {
    awk -F, 'NR > 1 && $1 >= 4 && $1 <= 12 {print $5}' "$1" 2>/dev/null | sort -g |
        awk '{v[NR] = $1} END {if (NR == 9) print v[5]; else print "n/a"}'
}

bc_times() {
    echo "== ms/step (median of steps 4-12): new | main | main - new (> 0: new faster)" >> "$S"
    local r n b
    for r in "$@"; do
        n=$(bc_median_ms "$L/t_${r}_new/train_log.csv")
        b=$(bc_median_ms "$L/t_${r}_base/train_log.csv")
        echo "$r: $n | $b | $(awk -v a="$b" -v b="$n" 'BEGIN {if (a + 0 == 0 || b + 0 == 0) print "n/a"; else printf "%+.2f\n", a - b}')" >> "$S"
    done
}

bc_peak() {
    local k
    echo "== peak memory of $1 (its last step line): new, main" >> "$S"
    for k in new base; do
        awk -v sec="=== t_$1_$k" '$0 == sec {on = 1; next} /^===/ {on = 0} on && /MiB peak/ {last = $0}
            END {n = split(last, f, "|"); print f[n]}' "$O/train.log" >> "$S"
    done
}

# CUPTI sums (dev/kernel_times.c, $D/libkernel_times.so) of the kernels whose names match REGEX, and
# of all, over --steps 11, divided by 11: ms per step. The preload goes inside timeout (a preloaded
# timeout would write its own empty list over the trainer's).
bc_kernels() {
    local regex=$1 b
    shift
    [ -f "$D/libkernel_times.so" ] || { echo "bc_kernels: no $D/libkernel_times.so" >> "$S"; return; }
    echo "== kernel ms/step (new, then main): /$regex/, total" >> "$S"
    for b in train_dit train_dit_base; do
        timeout 90 env LD_PRELOAD="$PWD/$D/libkernel_times.so" KERNEL_TIMES_OUT="$O/kernels_$b.txt" "$D/$b" "$@" \
            --steps 11 --out "$L/p_$b" > /dev/null 2>&1
        awk -v what="$b" -v re="$regex" '{t += $1} $0 ~ re {
                k = $0; sub(/^[^ ]* [^ ]* (void )?/, "", k); sub(/\(.*/, "", k); s[k] += $1}
            END {line = what ":"; for (k in s) line = line sprintf(" %s %.3f", k, s[k] / 11e6);
                 printf "%s | total %.3f\n", line, t / 11e6}' "$O/kernels_$b.txt" >> "$S"
    done
}

bc_done() {
    rm -rf "$L"
    cat "$S"
}
