// Multi-process training on several GPUs: who am I (rank, world size, local rank from the
// environment of train_dit --gpus, mpirun or srun), the launch of N local ranks, the exchange of
// NCCL's unique id (a file in a shared directory, or TCP to rank 0), and an NCCL communicator
// whose collectives never hang: the host waits for them polling for NCCL errors and a timeout,
// and aborts the communicator with a message naming the rank (dev/notes_sequence_parallel.md,
// "Multi-GPU launch and data parallel").
//
// Environment, first match wins:
//   DIT_RANK, DIT_WORLD_SIZE, DIT_LOCAL_RANK[, DIT_LOCAL_WORLD_SIZE]   train_dit --gpus N (or by hand)
//   OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE               mpirun (Open MPI)
//   SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID                   srun (inside a job step only:
//                                                                       sbatch alone sets no STEP_NUM_TASKS)
//   none of them: one process, rank 0 of 1.
// Run id (names the unique-id file, so a stale file of an earlier run is never read): DIT_RUN_ID,
// else SLURM_JOB_ID.SLURM_STEP_ID, else PMIX_NAMESPACE / OMPI_MCA_ess_base_jobid (mpirun).
// Id exchange: DIT_MASTER_ADDR (and DIT_MASTER_PORT, default 29517) select TCP; otherwise the file.
// Every function returns 0, or -1 with a message in err (layers/common.h's convention).
#pragma once
#include <stddef.h>
#include <stdint.h>
#ifdef DIT_CUDA
#include <cuda_runtime_api.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define DIST_DEFAULT_PORT 29517

typedef struct {
    int rank, world_size, local_rank, local_world_size;
    char launcher[16];       // "none", "train_dit", "mpirun", "srun"
    char run_id[128];        // the same on every rank of one run ("" when none was found)
    char master_addr[256];   // "" unless DIT_MASTER_ADDR is set (then TCP)
    int master_port;
} DistEnv;

// A getenv: returns the value of `name` or NULL (tests pass their own table).
typedef const char *(*DistGetenv)(const char *name, void *ctx);
// Fills env from the variables above; errors name the variable and the value (not an integer,
// rank outside [0, world), a rank variable without its size, ...).
int dist_env_parse(DistEnv *env, DistGetenv get, void *ctx, char *err);
int dist_env_from_environ(DistEnv *env, char *err);

// The seed of rank r's own streams (data order, flips, label drop, t, noise): the seed itself for
// rank 0 (so one process trains exactly as before), seed ^ splitmix64(r) for r > 0.
uint64_t dist_rank_seed(uint64_t seed, int rank);

// The data-parallel × Ulysses × ring mesh of `world` ranks (dev/notes_sequence_parallel.md):
// a sequence-parallel (SP) group is sp = U·R consecutive ranks, data parallel runs over the
// dp = world / sp groups; inside a group, sp_rank = ring_rank·U + ulysses_rank: a Ulysses group
// is U contiguous ranks (the fastest links), a ring group R ranks U apart. The SP rank also
// orders the sequence: it holds tokens sp_rank·T/sp .. of every image.
typedef struct {
    int world, ulysses, ring, sp, dp;
    int rank, dp_rank, sp_rank, ulysses_rank, ring_rank;
} DistMesh;
// Fills mesh for `rank` of `world`; error (naming the sizes) when world % (U·R) != 0 or U, R < 1.
int dist_mesh_make(DistMesh *mesh, int world, int rank, int ulysses, int ring, char *err);

// ---- unique-id exchange --------------------------------------------------------------------
// DIR/.nccl_id.<run_id> (characters outside [A-Za-z0-9._-] replaced by '_'). Error when run_id is "".
int dist_id_file_path(char *path, size_t cap, const char *dir, const char *run_id, char *err);
// Writes n bytes to path atomically: path.tmp.<pid>, fsync, rename.
int dist_id_file_publish(const char *path, const void *bytes, size_t n, char *err);
// Polls (every 20 ms) until path holds exactly n bytes and reads them; error after timeout_s.
int dist_id_file_wait(const char *path, void *bytes, size_t n, double timeout_s, char *err);
// TCP: rank 0 listens on `port` (all interfaces) and sends the n bytes to each of `clients`
// connections; the others connect to addr:port (retrying until timeout_s) and read them.
int dist_id_tcp_serve(int port, int clients, const void *bytes, size_t n, double timeout_s, char *err);
int dist_id_tcp_fetch(const char *addr, int port, void *bytes, size_t n, double timeout_s, char *err);

// ---- local launch --------------------------------------------------------------------------
// Starts n processes execv(exe, argv) with DIT_RANK=r, DIT_WORLD_SIZE=n, DIT_LOCAL_RANK=r,
// DIT_LOCAL_WORLD_SIZE=n, DIT_RUN_ID=run_id in their environment (each dies with the launcher:
// PR_SET_PDEATHSIG), waits for all of them and forwards SIGINT/SIGTERM. The first rank that exits
// non-zero or by a signal ends the run: the others get SIGTERM, then SIGKILL after grace_s, and
// err names that rank and its status. 0 when every rank exits 0.
int dist_launch_local(int n, const char *exe, char *const argv[], const char *run_id, double grace_s, char *err);

// ---- NCCL communicator (DIT_NCCL builds; otherwise dist_comm_create fails with a message) ----
#ifdef DIT_CUDA
typedef struct DistComm DistComm;
// Selects CUDA device env->local_rank, exchanges the unique id (TCP when env->master_addr is
// set, else the file in id_dir) and creates a non-blocking NCCL communicator of
// env->world_size ranks. Every later wait on NCCL gives up after timeout_s seconds.
int dist_comm_create(DistComm **comm, const DistEnv *env, const char *id_dir, double timeout_s, char *err);
// In place on stream: buffers[i][0..counts[i]) = mean over the ranks (ncclAvg), all buffers in
// one NCCL group. Returns after the collective finished: the host polls the stream and
// ncclCommGetAsyncError; on an NCCL error or after the timeout the communicator is aborted and
// err names the rank, the operation and the cause.
int dist_all_reduce_mean(DistComm *c, float *const *buffers, const size_t *counts, int n_buffers,
                         cudaStream_t stream, char *err);
// In place on stream: buffers[i][0..counts[i]) = scales[i] · Σ over the ranks (ncclSum with a
// pre-multiplied scale, ncclRedOpCreatePreMulSum), all buffers in one group, waited for as
// dist_all_reduce_mean. Sequence parallelism sums the gradients over the SP group and averages
// them over data parallel: scale 1/dp.
int dist_all_reduce_scaled(DistComm *c, float *const *buffers, const size_t *counts, const float *scales,
                           int n_buffers, cudaStream_t stream, char *err);
// dist_all_reduce_scaled without the wait: the collective is only queued on stream. Wait for it
// with dist_wait_event on an event recorded after it (or after later work on the stream).
int dist_all_reduce_scaled_queue(DistComm *c, float *const *buffers, const size_t *counts, const float *scales,
                                 int n_buffers, cudaStream_t stream, char *err);
// In place on stream, ZeRO-1's gradient reduction: buffer holds world·count floats; afterwards
// rank r's part buffer[r·count .. (r+1)·count) = scale · Σ over the ranks of that part (ncclSum
// with a pre-multiplied scale, as dist_all_reduce_scaled) and the other parts are undefined.
// Only queued: wait with dist_wait_event.
int dist_reduce_scatter_scaled_queue(DistComm *c, float *buffer, size_t count, float scale, cudaStream_t stream,
                                     char *err);
// ZeRO-1's gradient reduction for parts of the buffer (layout as above: element i belongs to rank
// i / count): in place on stream, for each range [offsets[i], offsets[i] + numels[i]), cut at
// the part boundaries, each piece = scale · Σ over the ranks on the rank it belongs to
// (ncclReduce to that root, PreMulSum with the scale: one ncclGroup, one operator); elsewhere
// the pieces are left as they were. Every rank must pass the same ranges. Only queued: wait
// with dist_wait_event. On 2 ranks each element is s·a + s·b as in the reduce-scatter (one
// addition, commutative), so the two give bitwise the same sums; with more ranks NCCL's order
// of the additions may differ between the two collectives.
int dist_reduce_ranges_scaled_queue(DistComm *c, float *buffer, size_t count, const size_t *offsets,
                                    const size_t *numels, int n_ranges, float scale, cudaStream_t stream, char *err);
// In place on stream: each of the n_buffers buffers holds world·bytes bytes; afterwards every
// rank has rank r's part [r·bytes, (r+1)·bytes) of every rank r (one NCCL group). The _queue
// form only queues it (wait with dist_wait_event); dist_all_gather waits as dist_all_reduce_mean.
int dist_all_gather_queue(DistComm *c, void *const *buffers, size_t bytes, int n_buffers, cudaStream_t stream,
                          char *err);
int dist_all_gather(DistComm *c, void *const *buffers, size_t bytes, int n_buffers, cudaStream_t stream, char *err);
// This rank and the number of ranks.
void dist_comm_rank(const DistComm *c, int *rank, int *world_size);
// Waits until event has completed, polling ncclCommGetAsyncError and the timeout as the waits of
// the collectives do (on an error or the timeout: abort, err names the rank and `what`).
int dist_wait_event(DistComm *c, cudaEvent_t event, const char *what, char *err);
// all[r·n .. r·n + n) = rank r's mine[0..n) on every rank (host arrays), with the same waiting.
int dist_all_gather_u64(DistComm *c, const uint64_t *mine, size_t n, uint64_t *all, char *err);
// NCCL's communicator type (ncclComm_t is `struct ncclComm *`), opaque outside the NCCL files.
struct ncclComm;
// The sub-communicators of this rank's groups in the mesh, by ncclCommSplit of c (every rank of
// c must call it with the same mesh sizes): the SP group (ranks of one dp_rank, key sp_rank), its
// Ulysses group and its ring group. A group of size 1 gets NULL (no split). They are blocking
// communicators (the sequence-parallel collectives enqueue and return); c keeps them, aborts them
// with itself when one of its collectives fails, and destroys them with itself.
int dist_comm_split_mesh(DistComm *c, const DistMesh *mesh, struct ncclComm **sp, struct ncclComm **ulysses,
                         struct ncclComm **ring, char *err);
// Finalizes (waits for outstanding work, with the timeout; aborts when it fails) and frees.
void dist_comm_destroy(DistComm *c);
#endif

#ifdef __cplusplus
}
#endif
