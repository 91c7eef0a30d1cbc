// Tests of the multi-process machinery that needs no GPU (model/distributed.h): the environment
// of each launcher, the per-rank seeds, the unique-id exchange through a file and over TCP, and
// the local launcher (every rank's environment; a failing rank stops the others, quickly), and the
// data-parallel × Ulysses × ring mesh.
// The NCCL part is tested on 2 GPUs by test/test_distributed_cuda.c.
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "layers/common.h"
#include "model/distributed.h"

// ---- environment ---------------------------------------------------------------------------

// A getenv over a NULL-terminated list of "NAME=value" strings.
static const char *table_getenv(const char *name, void *ctx) {
    size_t len = strlen(name);
    for (const char *const *e = ctx; *e; e++)
        if (!strncmp(*e, name, len) && (*e)[len] == '=') return *e + len + 1;
    return NULL;
}

static int parse(DistEnv *env, const char *const *vars, char *err) {
    return dist_env_parse(env, table_getenv, (void *)vars, err);
}

Test(environment, nothing_set_is_one_process) {
    const char *vars[] = {NULL};
    DistEnv env;
    char err[DIT_ERR_LEN];
    cr_assert_eq(parse(&env, vars, err), 0, "%s", err);
    cr_assert_eq(env.rank, 0);
    cr_assert_eq(env.world_size, 1);
    cr_assert_eq(env.local_rank, 0);
    cr_assert_str_eq(env.launcher, "none");
    cr_assert_str_eq(env.run_id, "");
    cr_assert_str_eq(env.master_addr, "");
    cr_assert_eq(env.master_port, DIST_DEFAULT_PORT);
}

Test(environment, each_launcher) {
    const char *dit[] = {"DIT_RANK=3", "DIT_WORLD_SIZE=4", "DIT_LOCAL_RANK=1", "DIT_LOCAL_WORLD_SIZE=2",
                         "DIT_RUN_ID=abc", "DIT_MASTER_ADDR=node7", "DIT_MASTER_PORT=1234", NULL};
    const char *ompi[] = {"OMPI_COMM_WORLD_RANK=5", "OMPI_COMM_WORLD_SIZE=8", "OMPI_COMM_WORLD_LOCAL_RANK=1",
                          "OMPI_COMM_WORLD_LOCAL_SIZE=4", "PMIX_NAMESPACE=prterun-x-1@1", NULL};
    const char *slurm[] = {"SLURM_PROCID=2", "SLURM_STEP_NUM_TASKS=4", "SLURM_LOCALID=0",
                           "SLURM_STEP_TASKS_PER_NODE=2(x2)", "SLURM_JOB_ID=99", "SLURM_STEP_ID=3", NULL};
    // DIT_ wins over the others (train_dit --gpus run inside an allocation)
    const char *both[] = {"SLURM_PROCID=0", "SLURM_STEP_NUM_TASKS=1", "DIT_RANK=1", "DIT_WORLD_SIZE=2", NULL};
    DistEnv env;
    char err[DIT_ERR_LEN];
    cr_assert_eq(parse(&env, dit, err), 0, "%s", err);
    cr_assert(env.rank == 3 && env.world_size == 4 && env.local_rank == 1 && env.local_world_size == 2);
    cr_assert_str_eq(env.launcher, "train_dit");
    cr_assert_str_eq(env.run_id, "abc");
    cr_assert_str_eq(env.master_addr, "node7");
    cr_assert_eq(env.master_port, 1234);
    cr_assert_eq(parse(&env, ompi, err), 0, "%s", err);
    cr_assert(env.rank == 5 && env.world_size == 8 && env.local_rank == 1 && env.local_world_size == 4);
    cr_assert_str_eq(env.launcher, "mpirun");
    cr_assert_str_eq(env.run_id, "prterun-x-1@1");
    cr_assert_eq(parse(&env, slurm, err), 0, "%s", err);
    cr_assert(env.rank == 2 && env.world_size == 4 && env.local_rank == 0);
    cr_assert_eq(env.local_world_size, 4, "a Slurm list '2(x2)' is not a local size: the world size stays");
    cr_assert_str_eq(env.launcher, "srun");
    cr_assert_str_eq(env.run_id, "slurm-99.3");
    cr_assert_eq(parse(&env, both, err), 0, "%s", err);
    cr_assert(env.rank == 1 && env.world_size == 2);
    cr_assert_str_eq(env.launcher, "train_dit");
}

Test(environment, sbatch_without_srun_is_one_process) {
    const char *vars[] = {"SLURM_PROCID=0", "SLURM_NTASKS=4", "SLURM_JOB_ID=7", NULL};
    DistEnv env;
    char err[DIT_ERR_LEN];
    cr_assert_eq(parse(&env, vars, err), 0, "%s", err);
    cr_assert(env.rank == 0 && env.world_size == 1);
    cr_assert_str_eq(env.launcher, "none");
}

// Each bad environment fails with a message naming the variable.
Test(environment, errors_name_the_variable) {
    const struct { const char *vars[4]; const char *expect; } cases[] = {
        {{"DIT_RANK=1", NULL}, "DIT_WORLD_SIZE"},
        {{"DIT_WORLD_SIZE=2", NULL}, "DIT_RANK"},
        {{"DIT_RANK=2", "DIT_WORLD_SIZE=2", NULL}, "DIT_RANK=2 is not below DIT_WORLD_SIZE=2"},
        {{"DIT_RANK=x", "DIT_WORLD_SIZE=2", NULL}, "DIT_RANK='x'"},
        {{"DIT_RANK=-1", "DIT_WORLD_SIZE=2", NULL}, "DIT_RANK='-1'"},
        {{"DIT_RANK=0", "DIT_WORLD_SIZE=0", NULL}, "DIT_WORLD_SIZE='0'"},
        {{"DIT_RANK=0", "DIT_WORLD_SIZE=2", "DIT_LOCAL_RANK=2", NULL}, "DIT_LOCAL_RANK='2'"},
        {{"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2x", NULL}, "OMPI_COMM_WORLD_SIZE='2x'"},
        {{"DIT_MASTER_PORT=70000", NULL}, "DIT_MASTER_PORT='70000'"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        DistEnv env;
        char err[DIT_ERR_LEN] = "";
        cr_assert_eq(parse(&env, cases[i].vars, err), -1, "case %zu (%s) was accepted", i, cases[i].expect);
        cr_assert(strstr(err, cases[i].expect), "case %zu: expected '%s' in: %s", i, cases[i].expect, err);
    }
}

Test(environment, rank_seeds) {
    cr_assert_eq(dist_rank_seed(42, 0), 42, "rank 0 must train exactly as one process");
    uint64_t seen[64];
    for (int r = 0; r < 64; r++) {
        seen[r] = dist_rank_seed(42, r);
        for (int q = 0; q < r; q++) cr_assert_neq(seen[r], seen[q], "ranks %d and %d share a seed", q, r);
        cr_assert_neq(dist_rank_seed(43, r), seen[r]);
    }
}

// ---- the data-parallel × Ulysses × ring mesh -------------------------------------------------

// 16 ranks, U = 2, R = 4: groups of 8 consecutive ranks; inside one, Ulysses pairs are contiguous
// and ring members 2 apart; every (dp, ring, ulysses) triple occurs exactly once.
Test(mesh, ranks_of_the_groups) {
    char err[DIT_ERR_LEN];
    int seen[2][4][2] = {{{0}}};
    for (int r = 0; r < 16; r++) {
        DistMesh m;
        cr_assert_eq(dist_mesh_make(&m, 16, r, 2, 4, err), 0, "%s", err);
        cr_assert_eq(m.sp, 8);
        cr_assert_eq(m.dp, 2);
        cr_assert_eq(m.dp_rank, r / 8, "rank %d", r);
        cr_assert_eq(m.sp_rank, r % 8, "rank %d", r);
        cr_assert_eq(m.ulysses_rank, r % 2, "rank %d: Ulysses groups are contiguous", r);
        cr_assert_eq(m.ring_rank, (r % 8) / 2, "rank %d: ring groups are strided by U", r);
        cr_assert_eq(m.sp_rank, m.ring_rank * m.ulysses + m.ulysses_rank);
        seen[m.dp_rank][m.ring_rank][m.ulysses_rank]++;
    }
    for (int d = 0; d < 2; d++)
        for (int g = 0; g < 4; g++)
            for (int u = 0; u < 2; u++) cr_assert_eq(seen[d][g][u], 1);
    DistMesh one;
    cr_assert_eq(dist_mesh_make(&one, 1, 0, 1, 1, err), 0, "%s", err);
    cr_assert(one.sp == 1 && one.dp == 1 && one.sp_rank == 0 && one.dp_rank == 0);
}

Test(mesh, sizes_that_do_not_divide_are_errors) {
    char err[DIT_ERR_LEN];
    DistMesh m;
    cr_assert_eq(dist_mesh_make(&m, 6, 0, 4, 1, err), -1);
    cr_assert(strstr(err, "6 GPUs") && strstr(err, "multiple of U·R"), "%s", err);
    cr_assert_eq(dist_mesh_make(&m, 1, 0, 2, 1, err), -1, "U = 2 on one GPU");
    cr_assert_eq(dist_mesh_make(&m, 4, 0, 0, 1, err), -1);
    cr_assert(strstr(err, "--sp-ulysses"), "%s", err);
}

// ---- the unique id through a file ----------------------------------------------------------

static void temp_dir(char *dir) {
    strcpy(dir, "/tmp/test_distributed_XXXXXX");
    cr_assert(mkdtemp(dir), "mkdtemp");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

Test(id_file, path_needs_a_run_id_and_is_sanitized) {
    char path[256], err[DIT_ERR_LEN];
    cr_assert_eq(dist_id_file_path(path, sizeof(path), "out", "", err), -1);
    cr_assert(strstr(err, "DIT_RUN_ID"), "%s", err);
    cr_assert_eq(dist_id_file_path(path, sizeof(path), "out", "a/b c@1.x-y_z", err), 0, "%s", err);
    cr_assert_str_eq(path, "out/.nccl_id.a_b_c_1.x-y_z");
}

Test(id_file, published_bytes_are_read_back_and_no_temp_file_remains) {
    char dir[64], path[256], err[DIT_ERR_LEN];
    temp_dir(dir);
    cr_assert_eq(dist_id_file_path(path, sizeof(path), dir, "run1", err), 0, "%s", err);
    unsigned char id[128], got[128];
    for (int i = 0; i < 128; i++) id[i] = (unsigned char)(i * 37 + 11);
    cr_assert_eq(dist_id_file_publish(path, id, sizeof(id), err), 0, "%s", err);
    cr_assert_eq(dist_id_file_wait(path, got, sizeof(got), 1.0, err), 0, "%s", err);
    cr_assert_eq(memcmp(id, got, sizeof(id)), 0);
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "test $(ls -A %s | wc -l) -eq 1", dir);
    cr_assert_eq(system(cmd), 0, "a temporary file was left in %s", dir);
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    system(cmd);
}

// The waiter polls: a file published 0.3 s later (by another process) is found.
Test(id_file, waiter_finds_a_file_published_later) {
    char dir[64], path[256], err[DIT_ERR_LEN];
    temp_dir(dir);
    cr_assert_eq(dist_id_file_path(path, sizeof(path), dir, "run2", err), 0, "%s", err);
    unsigned char id[128], got[128];
    memset(id, 0xA5, sizeof(id));
    pid_t pid = fork();
    if (pid == 0) {
        usleep(300000);
        _exit(dist_id_file_publish(path, id, sizeof(id), NULL) == 0 ? 0 : 1);
    }
    double t0 = now_s();
    cr_assert_eq(dist_id_file_wait(path, got, sizeof(got), 10.0, err), 0, "%s", err);
    double waited = now_s() - t0;
    cr_assert(waited > 0.2 && waited < 5.0, "waited %.3f s", waited);
    cr_assert_eq(memcmp(id, got, sizeof(id)), 0);
    int status;
    waitpid(pid, &status, 0);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

Test(id_file, missing_file_times_out_and_a_wrong_size_is_an_error) {
    char dir[64], path[256], err[DIT_ERR_LEN];
    temp_dir(dir);
    cr_assert_eq(dist_id_file_path(path, sizeof(path), dir, "run3", err), 0, "%s", err);
    unsigned char got[128];
    double t0 = now_s();
    cr_assert_eq(dist_id_file_wait(path, got, sizeof(got), 0.3, err), -1);
    double waited = now_s() - t0;
    cr_assert(waited >= 0.3 && waited < 2.0, "timed out after %.3f s, expected 0.3", waited);
    cr_assert(strstr(err, path) && strstr(err, "within 0.3 s"), "%s", err);
    cr_assert_eq(dist_id_file_publish(path, got, 7, err), 0, "%s", err);
    cr_assert_eq(dist_id_file_wait(path, got, sizeof(got), 0.3, err), -1);
    cr_assert(strstr(err, "expected 128 bytes") && strstr(err, "found 7"), "%s", err);
}

// ---- the unique id over TCP ----------------------------------------------------------------

typedef struct { int port, clients; unsigned char id[128]; int rc; char err[DIT_ERR_LEN]; } Server;
typedef struct { int port; unsigned char id[128]; int rc; char err[DIT_ERR_LEN]; } Client;

static void *serve(void *arg) {
    Server *s = arg;
    s->rc = dist_id_tcp_serve(s->port, s->clients, s->id, sizeof(s->id), 10.0, s->err);
    return NULL;
}

static void *fetch(void *arg) {
    Client *c = arg;
    c->rc = dist_id_tcp_fetch("127.0.0.1", c->port, c->id, sizeof(c->id), 10.0, c->err);
    return NULL;
}

// Ports apart for concurrent test processes (Criterion forks one per test, pids often adjacent).
static int test_port(int offset) { return 20000 + 3 * (int)(getpid() % 10000) + offset; }

Test(id_tcp, three_clients_get_the_id_even_when_they_start_first) {
    Server s = {.port = test_port(0), .clients = 3};
    for (int i = 0; i < 128; i++) s.id[i] = (unsigned char)(255 - i);
    Client c[3];
    pthread_t tc[3], ts;
    for (int i = 0; i < 3; i++) {
        c[i] = (Client){.port = s.port};
        pthread_create(&tc[i], NULL, fetch, &c[i]);
    }
    usleep(200000);   // the clients retry until the server listens
    pthread_create(&ts, NULL, serve, &s);
    for (int i = 0; i < 3; i++) pthread_join(tc[i], NULL);
    pthread_join(ts, NULL);
    cr_assert_eq(s.rc, 0, "%s", s.err);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(c[i].rc, 0, "client %d: %s", i, c[i].err);
        cr_assert_eq(memcmp(c[i].id, s.id, 128), 0, "client %d got other bytes", i);
    }
}

Test(id_tcp, no_server_and_missing_clients_time_out) {
    unsigned char id[128] = {0};
    char err[DIT_ERR_LEN];
    double t0 = now_s();
    cr_assert_eq(dist_id_tcp_fetch("127.0.0.1", test_port(1), id, sizeof(id), 0.3, err), -1);
    cr_assert(now_s() - t0 < 3.0);
    cr_assert(strstr(err, "within 0.3 s"), "%s", err);
    t0 = now_s();
    cr_assert_eq(dist_id_tcp_serve(test_port(2), 2, id, sizeof(id), 0.3, err), -1);
    cr_assert(now_s() - t0 < 3.0);
    cr_assert(strstr(err, "0 of 2 ranks"), "%s", err);
}

// ---- local launch --------------------------------------------------------------------------

static int launch_sh(int n, const char *script, double grace_s, char *err) {
    char *const argv[] = {"sh", "-c", (char *)script, NULL};
    return dist_launch_local(n, "/bin/sh", argv, "run-7", grace_s, err);
}

Test(launch, every_rank_gets_its_environment) {
    char dir[64], script[512], err[DIT_ERR_LEN];
    temp_dir(dir);
    snprintf(script, sizeof(script),
             "echo \"$DIT_RANK $DIT_WORLD_SIZE $DIT_LOCAL_RANK $DIT_LOCAL_WORLD_SIZE $DIT_RUN_ID\" > %s/rank_$DIT_RANK", dir);
    cr_assert_eq(launch_sh(3, script, 1.0, err), 0, "%s", err);
    for (int r = 0; r < 3; r++) {
        char path[128], line[128] = "", expect[64];
        snprintf(path, sizeof(path), "%s/rank_%d", dir, r);
        FILE *f = fopen(path, "r");
        cr_assert(f, "rank %d wrote nothing", r);
        cr_assert(fgets(line, sizeof(line), f));
        fclose(f);
        snprintf(expect, sizeof(expect), "%d 3 %d 3 run-7\n", r, r);
        cr_assert_str_eq(line, expect, "rank %d", r);
    }
}

// Rank 1 fails at once while rank 0 would run 30 s: SIGTERM stops rank 0 at once (well before the
// 3 s grace after which SIGKILL would), and the error names rank 1.
Test(launch, a_failing_rank_stops_the_others) {
    char err[DIT_ERR_LEN];
    double t0 = now_s();
    cr_assert_eq(launch_sh(2, "if [ $DIT_RANK = 1 ]; then exit 3; fi; exec sleep 30", 3.0, err), -1);
    double took = now_s() - t0;
    cr_assert(took < 2.0, "took %.1f s: the sleeping rank was not stopped by SIGTERM", took);
    cr_assert(strstr(err, "rank 1 of 2") && strstr(err, "exited with status 3"), "%s", err);
}

// A rank that ignores SIGTERM is killed after the grace period; a rank killed by a signal is named.
Test(launch, sigterm_ignored_then_killed_and_signals_reported) {
    char err[DIT_ERR_LEN];
    double t0 = now_s();
    cr_assert_eq(launch_sh(2, "trap '' TERM; if [ $DIT_RANK = 0 ]; then sleep 0.2; kill -9 $$; fi; exec sleep 30", 0.5, err), -1);
    double took = now_s() - t0;
    cr_assert(took >= 0.5 && took < 5.0, "took %.1f s, expected the 0.5 s grace then SIGKILL", took);
    cr_assert(strstr(err, "rank 0 of 2") && strstr(err, "signal 9"), "%s", err);
}

Test(launch, a_missing_program_fails) {
    char err[DIT_ERR_LEN];
    char *const argv[] = {"nope", NULL};
    cr_assert_eq(dist_launch_local(2, "/nonexistent/train_dit", argv, "r", 1.0, err), -1);
    cr_assert(strstr(err, "status 127"), "%s", err);
}
