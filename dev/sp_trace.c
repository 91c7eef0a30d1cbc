// A per-process GPU timeline of any CUDA/NCCL program (the sibling of dev/kernel_times.c, which
// only sums kernel time by name): load it with
//   LD_PRELOAD=.../libsp_trace.so SP_TRACE_DIR=dir ./train_dit --gpus 2 ...
// and every process (each rank of --gpus N is one: the launcher's children inherit LD_PRELOAD)
// writes dir/trace.rank<DIT_RANK>.<pid>.tsv (rank "x" without DIT_RANK), one record per line,
// tab-separated, times in ns of CUPTI's clock (cuptiGetTimestamp: host and GPU records share it):
//   K start end stream correlation name          a kernel (NCCL's kernels too), demangled name
//   M start end stream correlation bytes kind     a memcpy (kind: CUpti_ActivityMemcpyKind, 1 HtoD,
//                                                 2 DtoH, 8 DtoD, 10 PtoP)
//   S start end stream correlation bytes          a memset
//   R|D start end correlation thread name         a CUDA runtime|driver API call on the host
//   N start end stream ops sent recvd payload nranks
//                                                 one NCCL launch seen from the host: a group
//                                                 (ncclGroupStart..End, times of the outermost
//                                                 ncclGroupEnd) or a call outside a group; ops the
//                                                 distinct operations ("Send,Recv", "AllReduce"),
//                                                 sent/recvd the p2p bytes to/from OTHER ranks,
//                                                 payload the collectives' count·size bytes
// and a header "# rank r pid p dropped d" (d: activity records CUPTI dropped; must be 0).
// NCCL calls are intercepted here (dlsym RTLD_NEXT) and passed on unchanged; the kernels they
// launch are matched to them by dev/sp_timeline.py (same stream, launch time). Our GPU machine
// has no Nsight Systems; CUPTI comes with the CUDA toolkit.
// Build (dev/sp_profile.sh prepare): gcc -O2 -Wall -shared -fPIC -I/usr/local/cuda/include
//   dev/sp_trace.c -o libsp_trace.so -L/usr/local/cuda/lib64 -lcupti -ldl -lpthread -lstdc++
#define _GNU_SOURCE
#include <cupti.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *__cxa_demangle(const char *mangled, char *out, size_t *len, int *status);

static FILE *trace_file;
static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;

// ---- CUPTI activity records -------------------------------------------------------------

static void write_kernel(const CUpti_ActivityKernel10 *k) {
    int status = -1;
    char *readable = __cxa_demangle(k->name, NULL, NULL, &status);
    fprintf(trace_file, "K\t%llu\t%llu\t%u\t%u\t%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
            k->streamId, k->correlationId, status == 0 ? readable : k->name);
    free(readable);
}

static void write_api(const CUpti_ActivityAPI *a, CUpti_CallbackDomain domain) {
    const char *name = NULL;
    if (cuptiGetCallbackName(domain, a->cbid, &name) != CUPTI_SUCCESS || !name) name = "?";
    fprintf(trace_file, "%c\t%llu\t%llu\t%u\t%u\t%s\n", domain == CUPTI_CB_DOMAIN_RUNTIME_API ? 'R' : 'D',
            (unsigned long long)a->start, (unsigned long long)a->end, a->correlationId, a->threadId, name);
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *size = 16u << 20;
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx; (void)stream; (void)size;
    CUpti_Activity *r = NULL;
    pthread_mutex_lock(&trace_lock);
    while (trace_file && cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            write_kernel((const CUpti_ActivityKernel10 *)r);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            fprintf(trace_file, "M\t%llu\t%llu\t%u\t%u\t%llu\t%u\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, m->correlationId, (unsigned long long)m->bytes,
                    (unsigned)m->copyKind);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
            fprintf(trace_file, "S\t%llu\t%llu\t%u\t%u\t%llu\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, m->correlationId, (unsigned long long)m->bytes);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
            write_api((const CUpti_ActivityAPI *)r, CUPTI_CB_DOMAIN_RUNTIME_API);
        } else if (r->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
            write_api((const CUpti_ActivityAPI *)r, CUPTI_CB_DOMAIN_DRIVER_API);
        }
    }
    pthread_mutex_unlock(&trace_lock);
    free(buffer);
}

__attribute__((constructor)) static void sp_trace_start(void) {
    const char *dir = getenv("SP_TRACE_DIR"), *rank = getenv("DIT_RANK");
    char path[4096];
    snprintf(path, sizeof(path), "%s/trace.rank%s.%d.tsv", dir ? dir : ".", rank ? rank : "x", (int)getpid());
    trace_file = fopen(path, "w");
    if (!trace_file) {
        fprintf(stderr, "sp_trace: cannot write %s: nothing is traced\n", path);
        return;
    }
    size_t device_buffer = 64u << 20;   // per-context GPU-side record buffer (default 3 MB)
    size_t attr_size = sizeof(device_buffer);
    cuptiActivitySetAttribute(CUPTI_ACTIVITY_ATTR_DEVICE_BUFFER_SIZE, &attr_size, &device_buffer);
    CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                  CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};
    int ok = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) == CUPTI_SUCCESS;
    for (size_t i = 0; ok && i < sizeof(kinds) / sizeof(kinds[0]); i++)
        ok = cuptiActivityEnable(kinds[i]) == CUPTI_SUCCESS;
    if (!ok) fprintf(stderr, "sp_trace: CUPTI activity tracing could not be enabled\n");
}

// ---- NCCL calls -------------------------------------------------------------------------

static size_t nccl_type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 1;
    }
}

// The launch being collected: ops of the open group (or of one call outside a group).
typedef struct { char ops[128]; unsigned long long sent, recvd, payload; uint32_t stream; int nranks, n_ops; } NcclLaunch;
static NcclLaunch pending;
static int group_depth;

static void *real(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) { fprintf(stderr, "sp_trace: %s not found in the next library\n", name); abort(); }
    return f;
}

static uint64_t now_ns(void) {
    uint64_t t = 0;
    cuptiGetTimestamp(&t);
    return t;
}

static void note_op(const char *op, ncclComm_t comm, cudaStream_t stream, int peer, size_t bytes, int is_p2p,
                    int is_recv) {
    NcclLaunch *p = &pending;
    int me = -1, n = 0;
    ncclResult_t (*user_rank)(const ncclComm_t, int *) = (ncclResult_t (*)(const ncclComm_t, int *))real("ncclCommUserRank");
    ncclResult_t (*count)(const ncclComm_t, int *) = (ncclResult_t (*)(const ncclComm_t, int *))real("ncclCommCount");
    user_rank(comm, &me);
    count(comm, &n);
    if (p->n_ops++ == 0) {
        uint32_t id = 0;
        cuptiGetStreamIdEx(NULL, (CUstream)stream, 0, &id);
        p->stream = id;
        p->nranks = n;
    }
    if (!strstr(p->ops, op)) {
        if (p->ops[0]) strncat(p->ops, ",", sizeof(p->ops) - strlen(p->ops) - 1);
        strncat(p->ops, op, sizeof(p->ops) - strlen(p->ops) - 1);
    }
    if (!is_p2p) p->payload += bytes;
    else if (peer != me) { if (is_recv) p->recvd += bytes; else p->sent += bytes; }
}

static void emit(uint64_t start, uint64_t end) {
    pthread_mutex_lock(&trace_lock);
    if (trace_file && pending.n_ops)
        fprintf(trace_file, "N\t%llu\t%llu\t%u\t%s\t%llu\t%llu\t%llu\t%d\n", (unsigned long long)start,
                (unsigned long long)end, pending.stream, pending.ops, pending.sent, pending.recvd, pending.payload,
                pending.nranks);
    pthread_mutex_unlock(&trace_lock);
    memset(&pending, 0, sizeof(pending));
}

// Runs the real call; outside a group it is a launch of its own.
#define PASS_ON(call)                                                  \
    do {                                                               \
        uint64_t t0 = now_ns();                                        \
        ncclResult_t r_ = call;                                        \
        if (group_depth == 0) emit(t0, now_ns());                      \
        return r_;                                                     \
    } while (0)

ncclResult_t ncclGroupStart(void) {
    static ncclResult_t (*f)(void);
    if (!f) f = (ncclResult_t (*)(void))real("ncclGroupStart");
    group_depth++;
    return f();
}

ncclResult_t ncclGroupEnd(void) {
    static ncclResult_t (*f)(void);
    if (!f) f = (ncclResult_t (*)(void))real("ncclGroupEnd");
    uint64_t t0 = now_ns();
    ncclResult_t r = f();
    if (group_depth > 0 && --group_depth == 0) emit(t0, now_ns());
    return r;
}

ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    static ncclResult_t (*f)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    if (!f) f = (ncclResult_t (*)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t))real("ncclSend");
    note_op("Send", comm, stream, peer, count * nccl_type_size(type), 1, 0);
    PASS_ON(f(buf, count, type, peer, comm, stream));
}

ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
    static ncclResult_t (*f)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    if (!f) f = (ncclResult_t (*)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t))real("ncclRecv");
    note_op("Recv", comm, stream, peer, count * nccl_type_size(type), 1, 1);
    PASS_ON(f(buf, count, type, peer, comm, stream));
}

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    static ncclResult_t (*f)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    if (!f) f = (ncclResult_t (*)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                  cudaStream_t))real("ncclAllReduce");
    note_op("AllReduce", comm, stream, -1, count * nccl_type_size(type), 0, 0);
    PASS_ON(f(send, recv, count, type, op, comm, stream));
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
    static ncclResult_t (*f)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
    if (!f) f = (ncclResult_t (*)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t))real("ncclAllGather");
    note_op("AllGather", comm, stream, -1, count * nccl_type_size(type), 0, 0);
    PASS_ON(f(send, recv, count, type, comm, stream));
}

__attribute__((destructor)) static void sp_trace_finish(void) {
    cuptiActivityFlushAll(1);
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(NULL, 0, &dropped);
    pthread_mutex_lock(&trace_lock);
    if (trace_file) {
        fprintf(trace_file, "# rank %s pid %d dropped %zu\n", getenv("DIT_RANK") ? getenv("DIT_RANK") : "x",
                (int)getpid(), dropped);
        fclose(trace_file);
        trace_file = NULL;
    }
    pthread_mutex_unlock(&trace_lock);
}
