// Kernel time per kernel name for any CUDA program, through CUPTI's activity API: load it with
//   LD_PRELOAD=build/libkernel_times.so ./train_dit ...
// and at exit it writes "total_ns count name" lines (demangled, sorted by total time) to
// $KERNEL_TIMES_OUT (default stderr). dev/profile_step.py groups them into attention / GEMM /
// the rest. Our GPU machine has no Nsight Systems; CUPTI comes with the CUDA toolkit.
// With KERNEL_TIMES_GAPS=PATH it also records memsets and copies and writes to PATH where the GPU is
// idle between them: from the start of the (KERNEL_TIMES_SKIP + 1)-th launch of the kernel whose
// name contains KERNEL_TIMES_MARK (default flow_matching_inputs_kernel, the first of a training
// step; skip default 3) to the start of its last launch, per step: the time from first start to
// last start, the kernels' and memsets' busy time (their union), the idle gaps, and the gaps summed
// by the pair (activity before → activity after), largest first.
// Build (dev/devrun_prepare.sh does it): gcc -O2 -shared -fPIC -I/usr/local/cuda/include
//   dev/kernel_times.c -o build/libkernel_times.so -L/usr/local/cuda/lib64 -lcupti -lstdc++
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

char *__cxa_demangle(const char *mangled, char *out, size_t *len, int *status);

#define TABLE_SIZE 8192
typedef struct { char *name; uint64_t total_ns, count; } KernelTotal;
static KernelTotal table[TABLE_SIZE];

static int add_kernel(const char *name, uint64_t ns) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (const char *c = name; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
    for (size_t i = h % TABLE_SIZE, probes = 0; probes < TABLE_SIZE; i = (i + 1) % TABLE_SIZE, probes++) {
        if (!table[i].name) table[i].name = strdup(name);
        if (!strcmp(table[i].name, name)) { table[i].total_ns += ns; table[i].count++; return (int)i; }
    }
    fprintf(stderr, "kernel_times: more than %d kernel names; %s not counted\n", TABLE_SIZE, name);
    return -1;
}

// ---- the timeline (KERNEL_TIMES_GAPS) -----------------------------------------------------------
typedef struct { uint64_t start, end; const char *name; } Span;   // name: a table name or a literal
static Span *spans;
static size_t num_spans, cap_spans;
static const char *gaps_path;

static void add_span(uint64_t start, uint64_t end, const char *name) {
    if (!gaps_path || !name) return;
    if (num_spans == cap_spans) {
        cap_spans = cap_spans ? 2 * cap_spans : 1 << 16;
        spans = realloc(spans, cap_spans * sizeof(Span));
        if (!spans) { fprintf(stderr, "kernel_times: out of memory for the timeline\n"); exit(1); }
    }
    spans[num_spans++] = (Span){start, end, name};
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *size = 8u << 20;
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx; (void)stream; (void)size;
    CUpti_Activity *record = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)record;
            add_span(m->start, m->end, "[memset]");
        } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)record;
            add_span(m->start, m->end, "[memcpy]");
        } else if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)record;
            int i = add_kernel(k->name, k->end - k->start);
            add_span(k->start, k->end, i >= 0 ? table[i].name : NULL);
        }
    }
    free(buffer);
}

static int by_total_desc(const void *a, const void *b) {
    const KernelTotal *x = a, *y = b;
    return (x->total_ns < y->total_ns) - (x->total_ns > y->total_ns);
}

static int by_start(const void *a, const void *b) {
    const Span *x = a, *y = b;
    return (x->start > y->start) - (x->start < y->start);
}

// A readable name (demangled, without the argument list), at most 60 characters, in out.
static void short_name(char out[64], const char *name) {
    int status = -1;
    char *readable = __cxa_demangle(name, NULL, NULL, &status);
    const char *n = status == 0 ? readable : name;
    if (!strncmp(n, "void ", 5)) n += 5;
    size_t len = strcspn(n, "(");
    if (len > 60) len = 60;
    memcpy(out, n, len);
    out[len] = 0;
    free(readable);
}

typedef struct { const char *before, *after; uint64_t ns, count; } GapPair;

static int by_gap_desc(const void *a, const void *b) {
    const GapPair *x = a, *y = b;
    return (x->ns < y->ns) - (x->ns > y->ns);
}

static void write_gaps(void) {
    FILE *f = fopen(gaps_path, "w");
    if (!f) { fprintf(stderr, "kernel_times: cannot write %s\n", gaps_path); return; }
    const char *mark = getenv("KERNEL_TIMES_MARK") ? getenv("KERNEL_TIMES_MARK") : "flow_matching_inputs_kernel";
    int skip = getenv("KERNEL_TIMES_SKIP") ? atoi(getenv("KERNEL_TIMES_SKIP")) : 3;
    qsort(spans, num_spans, sizeof(Span), by_start);
    size_t first = num_spans, last = num_spans;
    int marks = 0;
    for (size_t i = 0; i < num_spans; i++)
        if (strstr(spans[i].name, mark) && ++marks > skip) {
            if (first == num_spans) first = i;
            last = i;
        }
    int steps = marks - skip - 1;
    if (steps < 1) {
        fprintf(f, "kernel_times: %d launches of a kernel named *%s*; need more than %d + 1\n", marks, mark, skip);
        fclose(f);
        return;
    }
    static GapPair pairs[4096];
    int num_pairs = 0;
    uint64_t busy = 0, idle = 0, gaps = 0, memset_ns = 0, memsets = 0, end = spans[first].start;
    const char *before = spans[first].name;
    for (size_t i = first; i < last; i++) {
        const Span *sp = &spans[i];
        if (!strcmp(sp->name, "[memset]")) { memset_ns += sp->end - sp->start; memsets++; }
        if (sp->start > end) {
            uint64_t gap = sp->start - end;
            idle += gap;
            gaps++;
            int k = 0;
            while (k < num_pairs && !(pairs[k].before == before && pairs[k].after == sp->name)) k++;
            if (k == num_pairs && num_pairs < 4096) pairs[num_pairs++] = (GapPair){before, sp->name, 0, 0};
            if (k < num_pairs) { pairs[k].ns += gap; pairs[k].count++; }
        }
        uint64_t from = sp->start > end ? sp->start : end;
        if (sp->end > from) { busy += sp->end - from; end = sp->end; before = sp->name; }
    }
    double per = 1e6 * steps;
    fprintf(f, "steps %d (launches %d..%d of *%s*): per step %.3f ms from start to start, busy %.3f ms, "
            "idle %.3f ms in %.1f gaps; memsets %.1f, %.3f ms\n", steps, skip + 1, marks, mark,
            (spans[last].start - spans[first].start) / per, busy / per, idle / per, gaps / (double)steps,
            memsets / (double)steps, memset_ns / per);
    qsort(pairs, num_pairs, sizeof(GapPair), by_gap_desc);
    fprintf(f, "idle ms/step | gaps/step | before -> after\n");
    for (int k = 0; k < num_pairs && k < 40; k++) {
        char b[64], a[64];
        short_name(b, pairs[k].before);
        short_name(a, pairs[k].after);
        fprintf(f, "%.4f | %.1f | %s -> %s\n", pairs[k].ns / per, pairs[k].count / (double)steps, b, a);
    }
    fclose(f);
}

__attribute__((constructor)) static void kernel_times_start(void) {
    gaps_path = getenv("KERNEL_TIMES_GAPS");
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
        (gaps_path && (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS ||
                       cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS)))
        fprintf(stderr, "kernel_times: CUPTI activity tracing could not be enabled\n");
}

__attribute__((destructor)) static void kernel_times_report(void) {
    cuptiActivityFlushAll(1);
    if (gaps_path) write_gaps();
    const char *path = getenv("KERNEL_TIMES_OUT");
    FILE *f = path ? fopen(path, "w") : stderr;
    if (!f) { fprintf(stderr, "kernel_times: cannot write %s\n", path); f = stderr; }
    qsort(table, TABLE_SIZE, sizeof(table[0]), by_total_desc);
    for (int i = 0; i < TABLE_SIZE && table[i].name; i++) {
        int status = -1;
        char *readable = __cxa_demangle(table[i].name, NULL, NULL, &status);
        fprintf(f, "%llu %llu %s\n", (unsigned long long)table[i].total_ns, (unsigned long long)table[i].count,
                status == 0 ? readable : table[i].name);
        free(readable);
    }
    if (f != stderr) fclose(f);
}
