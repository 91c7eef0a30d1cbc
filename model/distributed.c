// Multi-process launch, environment, unique-id exchange and the NCCL communicator (model/distributed.h).
#include "model/distributed.h"
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "layers/common.h"
#ifdef DIT_NCCL
#include <nccl.h>
#endif

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void sleep_seconds(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

// ---- environment ---------------------------------------------------------------------------

// An integer in [lo, hi] from variable `name`; *found = 0 when it is not set.
static int env_int(DistGetenv get, void *ctx, const char *name, int lo, int hi, int *out, int *found, char *err) {
    const char *text = get(name, ctx);
    *found = text != NULL;
    if (!text) return 0;
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi) {
        dit_set_error(err, "environment: %s='%s': expected an integer in [%d, %d]", name, text, lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

// One launcher's variables: rank and size are required together; local rank/size are optional
// (default: rank and size, one machine).
typedef struct { const char *launcher, *rank, *size, *local_rank, *local_size; } LauncherVars;

static const LauncherVars launchers[] = {
    {"train_dit", "DIT_RANK", "DIT_WORLD_SIZE", "DIT_LOCAL_RANK", "DIT_LOCAL_WORLD_SIZE"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"},
};

static int parse_launcher(DistEnv *env, const LauncherVars *v, DistGetenv get, void *ctx, int *found, char *err) {
    int has_rank, has_size, has_local, has_local_size;
    if (env_int(get, ctx, v->rank, 0, INT_MAX, &env->rank, &has_rank, err) ||
        env_int(get, ctx, v->size, 1, INT_MAX, &env->world_size, &has_size, err))
        return -1;
    // a rank without a size is an error, except Slurm's: sbatch sets SLURM_PROCID for its one process
    *found = has_size || (has_rank && strcmp(v->launcher, "srun") != 0);
    if (!*found) return 0;
    if (!has_rank || !has_size) {
        dit_set_error(err, "environment: %s is set but %s is not (%s sets both)", has_rank ? v->rank : v->size,
                      has_rank ? v->size : v->rank, v->launcher);
        return -1;
    }
    if (env->rank >= env->world_size) {
        dit_set_error(err, "environment: %s=%d is not below %s=%d", v->rank, env->rank, v->size, env->world_size);
        return -1;
    }
    env->local_rank = env->rank;
    env->local_world_size = env->world_size;
    if (env_int(get, ctx, v->local_rank, 0, env->world_size - 1, &env->local_rank, &has_local, err)) return -1;
    // Slurm's tasks-per-node is a list such as "2(x3)": only a plain number is used
    const char *ls = get(v->local_size, ctx);
    if (ls && strspn(ls, "0123456789") == strlen(ls) &&
        env_int(get, ctx, v->local_size, 1, env->world_size, &env->local_world_size, &has_local_size, err))
        return -1;
    if (env->local_rank >= env->local_world_size) {
        dit_set_error(err, "environment: %s=%d is not below the local size %d", v->local_rank, env->local_rank,
                      env->local_world_size);
        return -1;
    }
    snprintf(env->launcher, sizeof(env->launcher), "%s", v->launcher);
    return 0;
}

int dist_env_parse(DistEnv *env, DistGetenv get, void *ctx, char *err) {
    memset(env, 0, sizeof(*env));
    env->world_size = env->local_world_size = 1;
    snprintf(env->launcher, sizeof(env->launcher), "none");
    for (size_t i = 0; i < sizeof(launchers) / sizeof(launchers[0]); i++) {
        int found;
        if (parse_launcher(env, &launchers[i], get, ctx, &found, err) != 0) return -1;
        if (found) break;
    }
    const char *run = get("DIT_RUN_ID", ctx), *job = get("SLURM_JOB_ID", ctx), *step = get("SLURM_STEP_ID", ctx);
    const char *pmix = get("PMIX_NAMESPACE", ctx), *ompi = get("OMPI_MCA_ess_base_jobid", ctx);
    if (run) snprintf(env->run_id, sizeof(env->run_id), "%s", run);
    else if (job) snprintf(env->run_id, sizeof(env->run_id), "slurm-%s.%s", job, step ? step : "0");
    else if (pmix) snprintf(env->run_id, sizeof(env->run_id), "%s", pmix);
    else if (ompi) snprintf(env->run_id, sizeof(env->run_id), "ompi-%s", ompi);
    const char *addr = get("DIT_MASTER_ADDR", ctx);
    if (addr) snprintf(env->master_addr, sizeof(env->master_addr), "%s", addr);
    int has_port;
    env->master_port = DIST_DEFAULT_PORT;
    if (env_int(get, ctx, "DIT_MASTER_PORT", 1, 65535, &env->master_port, &has_port, err)) return -1;
    return 0;
}

static const char *process_getenv(const char *name, void *ctx) {
    (void)ctx;
    return getenv(name);
}

int dist_env_from_environ(DistEnv *env, char *err) { return dist_env_parse(env, process_getenv, NULL, err); }

uint64_t dist_rank_seed(uint64_t seed, int rank) {
    if (rank == 0) return seed;
    uint64_t z = (uint64_t)rank + 0x9E3779B97F4A7C15ull;   // splitmix64(rank)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return seed ^ (z ^ (z >> 31));
}

int dist_mesh_make(DistMesh *mesh, int world, int rank, int ulysses, int ring, char *err) {
    if (ulysses < 1 || ring < 1 || world < 1 || rank < 0 || rank >= world) {
        dit_set_error(err, "dist_mesh_make: need --sp-ulysses and --sp-ring >= 1 and 0 <= rank < world "
                           "(got U=%d R=%d, rank %d of %d)", ulysses, ring, rank, world);
        return -1;
    }
    int sp = ulysses * ring;
    if (world % sp) {
        dit_set_error(err, "%d GPUs do not split into sequence-parallel groups of --sp-ulysses %d x --sp-ring %d "
                           "= %d GPUs (the world size must be a multiple of U·R)", world, ulysses, ring, sp);
        return -1;
    }
    int sp_rank = rank % sp;
    *mesh = (DistMesh){.world = world, .ulysses = ulysses, .ring = ring, .sp = sp, .dp = world / sp, .rank = rank,
                       .dp_rank = rank / sp, .sp_rank = sp_rank, .ulysses_rank = sp_rank % ulysses,
                       .ring_rank = sp_rank / ulysses};
    return 0;
}

// ---- unique id through a file --------------------------------------------------------------

int dist_id_file_path(char *path, size_t cap, const char *dir, const char *run_id, char *err) {
    if (!run_id || !run_id[0]) {
        dit_set_error(err, "the NCCL id file needs a run id the same on every rank and new for each run: "
                           "set DIT_RUN_ID (or DIT_MASTER_ADDR/DIT_MASTER_PORT for the TCP exchange)");
        return -1;
    }
    char safe[128];
    snprintf(safe, sizeof(safe), "%s", run_id);
    for (char *p = safe; *p; p++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", *p)) *p = '_';
    if ((size_t)snprintf(path, cap, "%s/.nccl_id.%s", dir, safe) >= cap) {
        dit_set_error(err, "the NCCL id file name in '%s' is longer than %zu bytes", dir, cap - 1);
        return -1;
    }
    return 0;
}

int dist_id_file_publish(const char *path, const void *bytes, size_t n, char *err) {
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) {
        dit_set_error(err, "%s: cannot create the NCCL id file: %s", tmp, strerror(errno));
        return -1;
    }
    ssize_t wrote = write(fd, bytes, n);
    int sync_rc = fsync(fd), close_rc = close(fd);
    if (wrote != (ssize_t)n || sync_rc != 0 || close_rc != 0 || rename(tmp, path) != 0) {
        dit_set_error(err, "%s: cannot write %zu bytes and rename it to %s: %s", tmp, n, path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

int dist_id_file_wait(const char *path, void *bytes, size_t n, double timeout_s, char *err) {
    double start = now_seconds();
    for (;;) {
        int fd = open(path, O_RDONLY);   // rank 0 renames a complete file into place
        if (fd >= 0) {
            struct stat st;
            ssize_t got = fstat(fd, &st) == 0 && (size_t)st.st_size == n ? read(fd, bytes, n) : -1;
            close(fd);
            if (got == (ssize_t)n) return 0;
            dit_set_error(err, "%s: expected %zu bytes (an NCCL unique id), found %lld", path, n, (long long)st.st_size);
            return -1;
        }
        if (errno != ENOENT) {
            dit_set_error(err, "%s: cannot open the NCCL id file: %s", path, strerror(errno));
            return -1;
        }
        if (now_seconds() - start > timeout_s) {
            dit_set_error(err, "%s: rank 0 did not write the NCCL id file within %g s (is OUT on a file "
                               "system every rank sees, and did rank 0 start?)", path, timeout_s);
            return -1;
        }
        sleep_seconds(0.02);
    }
}

// ---- unique id over TCP --------------------------------------------------------------------

// Waits until fd is ready for `events` or the deadline passes: 1 ready, 0 timeout, -1 error.
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - now_seconds();
        if (left <= 0) return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int rc = poll(&p, 1, (int)(left * 1e3) + 1);
        if (rc < 0 && errno == EINTR) continue;
        return rc < 0 ? -1 : rc > 0;
    }
}

int dist_id_tcp_serve(int port, int clients, const void *bytes, size_t n, double timeout_s, char *err) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                               .sin_addr.s_addr = htonl(INADDR_ANY)};
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(fd, clients) != 0) {
        dit_set_error(err, "rank 0: cannot listen on TCP port %d (DIT_MASTER_PORT) for the NCCL id: %s", port,
                      strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    double deadline = now_seconds() + timeout_s;
    int served = 0;
    while (served < clients) {
        int ready = wait_fd(fd, POLLIN, deadline);
        int conn = ready > 0 ? accept(fd, NULL, NULL) : -1;
        if (conn < 0) {
            dit_set_error(err, "rank 0: %d of %d ranks fetched the NCCL id from TCP port %d within %g s%s%s", served,
                          clients, port, timeout_s, ready == 0 ? "" : ": ", ready == 0 ? "" : strerror(errno));
            close(fd);
            return -1;
        }
        ssize_t sent = send(conn, bytes, n, MSG_NOSIGNAL);
        close(conn);
        if (sent == (ssize_t)n) served++;
    }
    close(fd);
    return 0;
}

// One attempt: connect to one resolved address and read n bytes (before the deadline).
static int fetch_once(const struct addrinfo *ai, void *bytes, size_t n, double deadline) {
    int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd < 0) return -1;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        close(fd);
        return -1;
    }
    size_t got = 0;
    while (got < n && wait_fd(fd, POLLIN, deadline) > 0) {
        ssize_t r = recv(fd, (char *)bytes + got, n - got, 0);
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    return got == n ? 0 : -1;
}

int dist_id_tcp_fetch(const char *addr, int port, void *bytes, size_t n, double timeout_s, char *err) {
    char port_text[16];
    snprintf(port_text, sizeof(port_text), "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *list = NULL;
    int rc = getaddrinfo(addr, port_text, &hints, &list);
    if (rc != 0) {
        dit_set_error(err, "DIT_MASTER_ADDR=%s: cannot resolve: %s", addr, gai_strerror(rc));
        return -1;
    }
    double deadline = now_seconds() + timeout_s;
    while (now_seconds() < deadline) {
        for (struct addrinfo *ai = list; ai; ai = ai->ai_next) {
            if (fetch_once(ai, bytes, n, deadline) == 0) {
                freeaddrinfo(list);
                return 0;
            }
        }
        sleep_seconds(0.05);
    }
    freeaddrinfo(list);
    dit_set_error(err, "could not fetch the NCCL id from rank 0 at %s:%d within %g s (did rank 0 start? "
                       "DIT_MASTER_ADDR/DIT_MASTER_PORT)", addr, port, timeout_s);
    return -1;
}

// ---- local launch --------------------------------------------------------------------------

static pid_t *launched;   // for the signal handler: the children of dist_launch_local
static int launched_count;

static void forward_signal(int sig) {
    for (int i = 0; i < launched_count; i++)
        if (launched[i] > 0) kill(launched[i], sig);
}

static void describe_status(char *text, size_t cap, int status) {
    if (WIFEXITED(status)) snprintf(text, cap, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status)) snprintf(text, cap, "was killed by signal %d (%s)", WTERMSIG(status),
                                           strsignal(WTERMSIG(status)));
    else snprintf(text, cap, "stopped (status 0x%x)", status);
}

// In the child: the rank's environment, death with the launcher, exec.
static void exec_rank(int rank, int n, const char *exe, char *const argv[], const char *run_id, pid_t parent) {
    char text[32];
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(125);
    snprintf(text, sizeof(text), "%d", rank);
    setenv("DIT_RANK", text, 1);
    setenv("DIT_LOCAL_RANK", text, 1);
    snprintf(text, sizeof(text), "%d", n);
    setenv("DIT_WORLD_SIZE", text, 1);
    setenv("DIT_LOCAL_WORLD_SIZE", text, 1);
    setenv("DIT_RUN_ID", run_id, 1);
    execv(exe, argv);
    fprintf(stderr, "rank %d: execv %s: %s\n", rank, exe, strerror(errno));
    _exit(127);
}

int dist_launch_local(int n, const char *exe, char *const argv[], const char *run_id, double grace_s, char *err) {
    pid_t *pids = calloc(n, sizeof(pid_t)), parent = getpid();
    if (!pids) {
        dit_set_error(err, "dist_launch_local: out of memory for %d ranks", n);
        return -1;
    }
    struct sigaction forward = {.sa_handler = forward_signal}, old_int, old_term;
    sigemptyset(&forward.sa_mask);
    launched = pids;
    launched_count = n;
    sigaction(SIGINT, &forward, &old_int);
    sigaction(SIGTERM, &forward, &old_term);
    fflush(NULL);
    int running = 0, failed_rank = -1;
    for (int r = 0; r < n; r++) {
        pid_t pid = fork();
        if (pid == 0) exec_rank(r, n, exe, argv, run_id, parent);
        if (pid < 0) {
            dit_set_error(err, "fork of rank %d of %d: %s", r, n, strerror(errno));
            failed_rank = r;
            break;
        }
        pids[r] = pid;
        running++;
    }
    // Poll every rank; after the first failure the others get SIGTERM, then SIGKILL after grace_s.
    double kill_at = 0;
    while (running > 0) {
        for (int r = 0; r < n; r++) {
            int status;
            if (pids[r] <= 0 || waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
            running--;
            if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0) && failed_rank < 0) {
                char text[128];
                describe_status(text, sizeof(text), status);
                dit_set_error(err, "rank %d of %d (pid %d) %s; the other ranks were stopped", r, n, (int)pids[r], text);
                failed_rank = r;
            }
            pids[r] = 0;
        }
        if (failed_rank >= 0 && kill_at == 0) {
            for (int r = 0; r < n; r++) if (pids[r] > 0) kill(pids[r], SIGTERM);
            kill_at = now_seconds() + grace_s;
        }
        if (kill_at > 0 && now_seconds() > kill_at)
            for (int r = 0; r < n; r++) if (pids[r] > 0) kill(pids[r], SIGKILL);
        if (running > 0) sleep_seconds(0.02);
    }
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    launched = NULL;
    launched_count = 0;
    free(pids);
    return failed_rank >= 0 ? -1 : 0;
}

// ---- NCCL communicator ---------------------------------------------------------------------
#ifdef DIT_CUDA
#ifdef DIT_NCCL

struct DistComm {
    ncclComm_t comm;
    int rank, world_size, device;
    double timeout_s;
    cudaStream_t stream;   // for dist_all_gather_u64
    ncclComm_t children[3];// dist_comm_split_mesh's communicators (aborted and destroyed with comm)
    int n_children;
};

// Aborts the communicator (every later collective of this rank fails at once) and writes err.
static int fail(DistComm *c, char *err, const char *fmt, const char *what, const char *cause) {
    char text[DIT_ERR_LEN];
    snprintf(text, sizeof(text), fmt, what, cause);
    dit_set_error(err, "rank %d of %d (GPU %d): %s; NCCL communicator aborted", c->rank, c->world_size, c->device,
                  text);
    if (c->comm) ncclCommAbort(c->comm);
    c->comm = NULL;
    for (int i = 0; i < c->n_children; i++) ncclCommAbort(c->children[i]);
    c->n_children = 0;
    return -1;
}

// A non-blocking NCCL call returned r: waits until the communicator is no longer in progress.
static int settle(DistComm *c, ncclResult_t r, const char *what, char *err) {
    double start = now_seconds();
    while (r == ncclInProgress) {
        if (now_seconds() - start > c->timeout_s) {
            char cause[64];
            snprintf(cause, sizeof(cause), "still in progress after %g s", c->timeout_s);
            return fail(c, err, "%s: %s (did every rank start and reach it?)", what, cause);
        }
        sleep_seconds(1e-4);
        ncclResult_t q = ncclCommGetAsyncError(c->comm, &r);
        if (q != ncclSuccess) r = q;
    }
    if (r != ncclSuccess) {
        char cause[DIT_ERR_LEN / 2];
        snprintf(cause, sizeof(cause), "%s (%s)", ncclGetErrorString(r), c->comm ? ncclGetLastError(c->comm) : "");
        return fail(c, err, "%s: %s", what, cause);
    }
    return 0;
}

// Waits for the work queued on stream (event NULL) or for event, polling for asynchronous NCCL
// errors and the timeout: a collective whose peer exited never completes, and this is where it is
// noticed.
static int wait_until(DistComm *c, cudaStream_t stream, cudaEvent_t event, const char *what, char *err) {
    double start = now_seconds();
    for (;;) {
        cudaError_t q = event ? cudaEventQuery(event) : cudaStreamQuery(stream);
        if (q == cudaSuccess) return 0;
        if (q != cudaErrorNotReady) return fail(c, err, "%s: %s", what, cudaGetErrorString(q));
        ncclResult_t async = ncclSuccess, q_nccl = ncclCommGetAsyncError(c->comm, &async);
        if (q_nccl != ncclSuccess) async = q_nccl;
        if (async != ncclSuccess && async != ncclInProgress)
            return fail(c, err, "%s: %s", what, ncclGetErrorString(async));
        if (now_seconds() - start > c->timeout_s) {
            char cause[128];
            snprintf(cause, sizeof(cause), "not finished after %g s: another rank has probably exited or stalled",
                     c->timeout_s);
            return fail(c, err, "%s: %s", what, cause);
        }
        sleep_seconds(5e-5);
    }
}

static int wait_stream(DistComm *c, cudaStream_t stream, const char *what, char *err) {
    return wait_until(c, stream, NULL, what, err);
}

int dist_wait_event(DistComm *c, cudaEvent_t event, const char *what, char *err) {
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    return wait_until(c, NULL, event, what, err);
}

// The unique id: made by rank 0 and sent by TCP or published in the file; fetched by the others.
static int exchange_id(const DistEnv *env, const char *id_dir, ncclUniqueId *id, double timeout_s, char *err) {
    char path[4096];
    int tcp = env->master_addr[0] != 0;
    if (!tcp && dist_id_file_path(path, sizeof(path), id_dir, env->run_id, err) != 0) return -1;
    if (env->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(id);
        if (r != ncclSuccess) {
            dit_set_error(err, "rank 0: ncclGetUniqueId: %s", ncclGetErrorString(r));
            return -1;
        }
        return tcp ? dist_id_tcp_serve(env->master_port, env->world_size - 1, id, sizeof(*id), timeout_s, err)
                   : dist_id_file_publish(path, id, sizeof(*id), err);
    }
    int rc = tcp ? dist_id_tcp_fetch(env->master_addr, env->master_port, id, sizeof(*id), timeout_s, err)
                 : dist_id_file_wait(path, id, sizeof(*id), timeout_s, err);
    if (rc != 0) {
        char inner[DIT_ERR_LEN];
        snprintf(inner, sizeof(inner), "%s", err ? err : "");
        dit_set_error(err, "rank %d of %d: %s", env->rank, env->world_size, inner);
    }
    return rc;
}

int dist_comm_create(DistComm **comm, const DistEnv *env, const char *id_dir, double timeout_s, char *err) {
    *comm = NULL;
    int devices = 0;
    cudaError_t ce = cudaGetDeviceCount(&devices);
    if (ce != cudaSuccess || env->local_rank >= devices) {
        dit_set_error(err, "rank %d of %d: local rank %d needs GPU %d, but %d GPUs are visible%s%s", env->rank,
                      env->world_size, env->local_rank, env->local_rank, devices, ce ? ": " : "",
                      ce ? cudaGetErrorString(ce) : "");
        return -1;
    }
    DistComm *c = calloc(1, sizeof(DistComm));
    if (!c) {
        dit_set_error(err, "dist_comm_create: out of memory");
        return -1;
    }
    *c = (DistComm){.rank = env->rank, .world_size = env->world_size, .device = env->local_rank, .timeout_s = timeout_s};
    if ((ce = cudaSetDevice(c->device)) != cudaSuccess ||
        (ce = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        dit_set_error(err, "rank %d: cudaSetDevice(%d) / cudaStreamCreate: %s", c->rank, c->device, cudaGetErrorString(ce));
        free(c);
        return -1;
    }
    ncclUniqueId id;
    if (exchange_id(env, id_dir, &id, timeout_s, err) != 0) {
        cudaStreamDestroy(c->stream);
        free(c);
        return -1;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    char what[96];
    snprintf(what, sizeof(what), "ncclCommInitRankConfig (%d ranks)", c->world_size);
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, c->world_size, id, c->rank, &config);
    if (settle(c, r, what, err) != 0) {
        cudaStreamDestroy(c->stream);
        free(c);
        return -1;
    }
    if (env->rank == 0 && !env->master_addr[0]) {   // every rank has joined: the id file is spent
        char path[4096];
        if (dist_id_file_path(path, sizeof(path), id_dir, env->run_id, NULL) == 0) unlink(path);
    }
    *comm = c;
    return 0;
}

int dist_all_reduce_mean(DistComm *c, float *const *buffers, const size_t *counts, int n_buffers,
                         cudaStream_t stream, char *err) {
    char what[128];
    size_t total = 0;
    for (int i = 0; i < n_buffers; i++) total += counts[i];
    snprintf(what, sizeof(what), "ncclAllReduce (mean) of %d buffers, %zu floats", n_buffers, total);
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_buffers && r == ncclSuccess; i++)
        r = ncclAllReduce(buffers[i], buffers[i], counts[i], ncclFloat32, ncclAvg, c->comm, stream);
    ncclResult_t end = ncclGroupEnd();
    if (settle(c, r != ncclSuccess ? r : end, what, err) != 0) return -1;
    return wait_stream(c, stream, what, err);
}

static void scaled_what(char *what, size_t cap, const size_t *counts, int n_buffers) {
    size_t total = 0;
    for (int i = 0; i < n_buffers; i++) total += counts[i];
    snprintf(what, cap, "ncclAllReduce (scaled sum) of %d buffers, %zu floats", n_buffers, total);
}

int dist_all_reduce_scaled_queue(DistComm *c, float *const *buffers, const size_t *counts, const float *scales,
                                 int n_buffers, cudaStream_t stream, char *err) {
    enum { MAX_BUFFERS = 8 };
    char what[128];
    scaled_what(what, sizeof(what), counts, n_buffers);
    if (n_buffers > MAX_BUFFERS) {
        dit_set_error(err, "dist_all_reduce_scaled: %d buffers, at most %d", n_buffers, MAX_BUFFERS);
        return -1;
    }
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    ncclRedOp_t ops[MAX_BUFFERS];
    for (int i = 0; i < n_buffers; i++) {
        float scale = scales[i];
        if (settle(c, ncclRedOpCreatePreMulSum(&ops[i], &scale, ncclFloat32, ncclScalarHostImmediate, c->comm),
                   what, err) != 0)
            return -1;
    }
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_buffers && r == ncclSuccess; i++)
        r = ncclAllReduce(buffers[i], buffers[i], counts[i], ncclFloat32, ops[i], c->comm, stream);
    ncclResult_t end = ncclGroupEnd();
    if (settle(c, r != ncclSuccess ? r : end, what, err) != 0) return -1;
    for (int i = 0; i < n_buffers; i++) ncclRedOpDestroy(ops[i], c->comm);
    return 0;
}

int dist_all_reduce_scaled(DistComm *c, float *const *buffers, const size_t *counts, const float *scales,
                           int n_buffers, cudaStream_t stream, char *err) {
    char what[128];
    scaled_what(what, sizeof(what), counts, n_buffers);
    if (dist_all_reduce_scaled_queue(c, buffers, counts, scales, n_buffers, stream, err) != 0) return -1;
    return wait_stream(c, stream, what, err);
}

int dist_reduce_scatter_scaled_queue(DistComm *c, float *buffer, size_t count, float scale, cudaStream_t stream,
                                     char *err) {
    char what[128];
    snprintf(what, sizeof(what), "ncclReduceScatter (scaled sum) of %zu floats per rank", count);
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    ncclRedOp_t op;
    if (settle(c, ncclRedOpCreatePreMulSum(&op, &scale, ncclFloat32, ncclScalarHostImmediate, c->comm), what, err) != 0)
        return -1;
    if (settle(c, ncclReduceScatter(buffer, buffer + (size_t)c->rank * count, count, ncclFloat32, op, c->comm, stream),
               what, err) != 0)
        return -1;
    ncclRedOpDestroy(op, c->comm);
    return 0;
}

int dist_reduce_ranges_scaled_queue(DistComm *c, float *buffer, size_t count, const size_t *offsets,
                                    const size_t *numels, int n_ranges, float scale, cudaStream_t stream, char *err) {
    char what[160];
    size_t total = 0;
    for (int i = 0; i < n_ranges; i++) total += numels[i];
    snprintf(what, sizeof(what), "ncclReduce (scaled sum) of %d ranges, %zu floats (%zu per rank's part)", n_ranges,
             total, count);
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    for (int i = 0; i < n_ranges; i++)
        if (offsets[i] + numels[i] > count * c->world_size) {
            dit_set_error(err, "%s: range %d [%zu, %zu) outside the buffer of %d·%zu floats", what, i, offsets[i],
                          offsets[i] + numels[i], c->world_size, count);
            return -1;
        }
    ncclRedOp_t op;
    if (settle(c, ncclRedOpCreatePreMulSum(&op, &scale, ncclFloat32, ncclScalarHostImmediate, c->comm), what, err) != 0)
        return -1;
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_ranges && r == ncclSuccess; i++) {
        // [a, end): the piece of range i that belongs to rank `root`
        for (size_t a = offsets[i], hi = offsets[i] + numels[i]; a < hi && r == ncclSuccess;) {
            int root = (int)(a / count);
            size_t end = (root + 1) * count < hi ? (root + 1) * count : hi;
            r = ncclReduce(buffer + a, buffer + a, end - a, ncclFloat32, op, root, c->comm, stream);
            a = end;
        }
    }
    ncclResult_t end = ncclGroupEnd();
    if (settle(c, r != ncclSuccess ? r : end, what, err) != 0) return -1;
    ncclRedOpDestroy(op, c->comm);
    return 0;
}

static void gather_what(char *what, size_t cap, size_t bytes, int n_buffers) {
    snprintf(what, cap, "ncclAllGather of %d buffers, %zu bytes per rank", n_buffers, bytes);
}

int dist_all_gather_queue(DistComm *c, void *const *buffers, size_t bytes, int n_buffers, cudaStream_t stream,
                          char *err) {
    char what[128];
    gather_what(what, sizeof(what), bytes, n_buffers);
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < n_buffers && r == ncclSuccess; i++)
        r = ncclAllGather((char *)buffers[i] + (size_t)c->rank * bytes, buffers[i], bytes, ncclChar, c->comm, stream);
    ncclResult_t end = ncclGroupEnd();
    return settle(c, r != ncclSuccess ? r : end, what, err);
}

int dist_all_gather(DistComm *c, void *const *buffers, size_t bytes, int n_buffers, cudaStream_t stream, char *err) {
    if (dist_all_gather_queue(c, buffers, bytes, n_buffers, stream, err) != 0) return -1;
    char what[128];
    gather_what(what, sizeof(what), bytes, n_buffers);
    return wait_stream(c, stream, what, err);
}

void dist_comm_rank(const DistComm *c, int *rank, int *world_size) {
    *rank = c->rank;
    *world_size = c->world_size;
}

// One ncclCommSplit into a blocking communicator; NULL (and no split) for a group of one rank,
// which every rank then skips alike (the sizes are the same on every rank).
static int split_group(DistComm *c, int size, int color, int key, const char *name, ncclComm_t *child, char *err) {
    *child = NULL;
    if (size == 1) return 0;
    char what[128];
    snprintf(what, sizeof(what), "ncclCommSplit (%s group %d of %d ranks)", name, color, size);
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    // With a non-blocking parent the split runs in the background and NCCL writes *child only
    // when the new communicator is complete: wait for that (or an error of the parent).
    volatile ncclComm_t *ready = child;
    ncclResult_t r = ncclCommSplit(c->comm, color, key, child, &config);
    double start = now_seconds();
    while ((r == ncclSuccess || r == ncclInProgress) && *ready == NULL) {
        if (now_seconds() - start > c->timeout_s)
            return fail(c, err, "%s: %s", what, "not complete within the timeout (did every rank reach it?)");
        sleep_seconds(1e-4);
        ncclResult_t q = ncclCommGetAsyncError(c->comm, &r);
        if (q != ncclSuccess) r = q;
    }
    if (settle(c, r, what, err) != 0) return -1;   // the parent's background work has finished
    ncclResult_t q = ncclCommGetAsyncError(*child, &r);
    if (settle(c, q != ncclSuccess ? q : r, what, err) != 0) return -1;
    int n = 0;
    if ((r = ncclCommCount(*child, &n)) != ncclSuccess || n != size) {
        char cause[160];
        snprintf(cause, sizeof(cause), "ncclCommCount of the new communicator: %d ranks (%s), expected %d", n,
                 ncclGetErrorString(r), size);
        return fail(c, err, "%s: %s", what, cause);
    }
    c->children[c->n_children++] = *child;
    return 0;
}

int dist_comm_split_mesh(DistComm *c, const DistMesh *m, struct ncclComm **sp, struct ncclComm **ulysses,
                         struct ncclComm **ring, char *err) {
    *sp = *ulysses = *ring = NULL;
    if (m->world != c->world_size || m->rank != c->rank) {
        dit_set_error(err, "dist_comm_split_mesh: the mesh is for rank %d of %d, the communicator rank %d of %d",
                      m->rank, m->world, c->rank, c->world_size);
        return -1;
    }
    if (c->n_children) {
        dit_set_error(err, "dist_comm_split_mesh: this communicator was split already");
        return -1;
    }
    if (split_group(c, m->sp, m->dp_rank, m->sp_rank, "sequence-parallel", sp, err) != 0 ||
        split_group(c, m->ulysses, m->dp_rank * m->ring + m->ring_rank, m->ulysses_rank, "Ulysses", ulysses, err) != 0 ||
        split_group(c, m->ring, m->dp_rank * m->ulysses + m->ulysses_rank, m->ring_rank, "ring", ring, err) != 0)
        return -1;
    return 0;
}

int dist_all_gather_u64(DistComm *c, const uint64_t *mine, size_t n, uint64_t *all, char *err) {
    char what[96];
    snprintf(what, sizeof(what), "ncclAllGather of %zu uint64 per rank", n);
    if (!c->comm) return fail(c, err, "%s: %s", what, "the communicator was aborted earlier");
    size_t bytes = n * c->world_size * sizeof(uint64_t);
    uint64_t *buf = NULL;
    cudaError_t ce = cudaMalloc((void **)&buf, bytes);
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(buf + c->rank * n, mine, n * sizeof(uint64_t), cudaMemcpyHostToDevice, c->stream);
    if (ce != cudaSuccess) {
        cudaFree(buf);
        return fail(c, err, "%s: %s", what, cudaGetErrorString(ce));
    }
    int rc = settle(c, ncclAllGather(buf + c->rank * n, buf, n, ncclUint64, c->comm, c->stream), what, err);
    if (rc == 0 && (ce = cudaMemcpyAsync(all, buf, bytes, cudaMemcpyDeviceToHost, c->stream)) != cudaSuccess)
        rc = fail(c, err, "%s: %s", what, cudaGetErrorString(ce));
    if (rc == 0) rc = wait_stream(c, c->stream, what, err);
    cudaFree(buf);
    return rc;
}

void dist_comm_destroy(DistComm *c) {
    if (!c) return;
    if (c->comm) {
        char err[DIT_ERR_LEN];
        if (settle(c, ncclCommFinalize(c->comm), "ncclCommFinalize", err) != 0) fprintf(stderr, "%s\n", err);
        if (c->comm) ncclCommDestroy(c->comm);
    }
    for (int i = 0; i < c->n_children; i++) {
        ncclCommFinalize(c->children[i]);
        ncclCommDestroy(c->children[i]);
    }
    cudaStreamDestroy(c->stream);
    free(c);
}

#else   // CUDA without NCCL

struct DistComm { int unused; };

int dist_comm_create(DistComm **comm, const DistEnv *env, const char *id_dir, double timeout_s, char *err) {
    (void)id_dir; (void)timeout_s;
    *comm = NULL;
    dit_set_error(err, "rank %d of %d: this build has no NCCL (the Makefile found no nccl.h), so it cannot "
                       "train on several GPUs", env->rank, env->world_size);
    return -1;
}

int dist_all_reduce_mean(DistComm *c, float *const *buffers, const size_t *counts, int n_buffers,
                         cudaStream_t stream, char *err) {
    (void)c; (void)buffers; (void)counts; (void)n_buffers; (void)stream;
    dit_set_error(err, "dist_all_reduce_mean: this build has no NCCL");
    return -1;
}

int dist_all_reduce_scaled(DistComm *c, float *const *buffers, const size_t *counts, const float *scales,
                           int n_buffers, cudaStream_t stream, char *err) {
    (void)c; (void)buffers; (void)counts; (void)scales; (void)n_buffers; (void)stream;
    dit_set_error(err, "dist_all_reduce_scaled: this build has no NCCL");
    return -1;
}

int dist_all_reduce_scaled_queue(DistComm *c, float *const *buffers, const size_t *counts, const float *scales,
                                 int n_buffers, cudaStream_t stream, char *err) {
    return dist_all_reduce_scaled(c, buffers, counts, scales, n_buffers, stream, err);
}

int dist_reduce_scatter_scaled_queue(DistComm *c, float *buffer, size_t count, float scale, cudaStream_t stream,
                                     char *err) {
    (void)c; (void)buffer; (void)count; (void)scale; (void)stream;
    dit_set_error(err, "dist_reduce_scatter_scaled_queue: this build has no NCCL");
    return -1;
}

int dist_reduce_ranges_scaled_queue(DistComm *c, float *buffer, size_t count, const size_t *offsets,
                                    const size_t *numels, int n_ranges, float scale, cudaStream_t stream, char *err) {
    (void)c; (void)buffer; (void)count; (void)offsets; (void)numels; (void)n_ranges; (void)scale; (void)stream;
    dit_set_error(err, "dist_reduce_ranges_scaled_queue: this build has no NCCL");
    return -1;
}

int dist_all_gather_queue(DistComm *c, void *const *buffers, size_t bytes, int n_buffers, cudaStream_t stream,
                          char *err) {
    (void)c; (void)buffers; (void)bytes; (void)n_buffers; (void)stream;
    dit_set_error(err, "dist_all_gather: this build has no NCCL");
    return -1;
}

int dist_all_gather(DistComm *c, void *const *buffers, size_t bytes, int n_buffers, cudaStream_t stream, char *err) {
    return dist_all_gather_queue(c, buffers, bytes, n_buffers, stream, err);
}

void dist_comm_rank(const DistComm *c, int *rank, int *world_size) {
    (void)c;
    *rank = 0;
    *world_size = 1;
}

int dist_wait_event(DistComm *c, cudaEvent_t event, const char *what, char *err) {
    (void)c; (void)event;
    dit_set_error(err, "dist_wait_event (%s): this build has no NCCL", what);
    return -1;
}

int dist_comm_split_mesh(DistComm *c, const DistMesh *mesh, struct ncclComm **sp, struct ncclComm **ulysses,
                         struct ncclComm **ring, char *err) {
    (void)c; (void)mesh;
    *sp = *ulysses = *ring = NULL;
    dit_set_error(err, "dist_comm_split_mesh: this build has no NCCL");
    return -1;
}

int dist_all_gather_u64(DistComm *c, const uint64_t *mine, size_t n, uint64_t *all, char *err) {
    (void)c; (void)mine; (void)n; (void)all;
    dit_set_error(err, "dist_all_gather_u64: this build has no NCCL");
    return -1;
}

void dist_comm_destroy(DistComm *c) { (void)c; }

#endif
#endif
