// Kernel time per kernel name for any CUDA program, through CUPTI's activity API: load it with
//   LD_PRELOAD=build/libkernel_times.so ./train_dit ...
// and at exit it writes "total_ns count name" lines (demangled, sorted by total time) to
// $KERNEL_TIMES_OUT (default stderr). dev/profile_step.py groups them into attention / GEMM /
// the rest. Our GPU machine has no Nsight Systems; CUPTI comes with the CUDA toolkit.
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

static void add_kernel(const char *name, uint64_t ns) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (const char *c = name; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
    for (size_t i = h % TABLE_SIZE, probes = 0; probes < TABLE_SIZE; i = (i + 1) % TABLE_SIZE, probes++) {
        if (!table[i].name) table[i].name = strdup(name);
        if (!strcmp(table[i].name, name)) { table[i].total_ns += ns; table[i].count++; return; }
    }
    fprintf(stderr, "kernel_times: more than %d kernel names; %s not counted\n", TABLE_SIZE, name);
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
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)record;
        add_kernel(k->name, k->end - k->start);
    }
    free(buffer);
}

static int by_total_desc(const void *a, const void *b) {
    const KernelTotal *x = a, *y = b;
    return (x->total_ns < y->total_ns) - (x->total_ns > y->total_ns);
}

__attribute__((constructor)) static void kernel_times_start(void) {
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS)
        fprintf(stderr, "kernel_times: CUPTI activity tracing could not be enabled\n");
}

__attribute__((destructor)) static void kernel_times_report(void) {
    cuptiActivityFlushAll(1);
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
