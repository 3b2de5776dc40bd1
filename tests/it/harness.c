/*
 * Integration test harness: see harness.h.
 */
#include "harness.h"

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <setjmp.h>
#include <cmocka.h>

#include <librdkafka/rdkafka.h>

extern char **environ;

int64_t h_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void h_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Says which waits of a test took long: where a slow test spends its time. */
static void note_long_wait(int64_t since_ms, const char *what, const char *detail)
{
    int64_t took = h_now_ms() - since_ms;
    if (took >= (getenv("OBX_IT_TIMES") ? 200 : 1500))
        print_message("[wait %lld ms] %s %s\n", (long long)took, what, detail ? detail : "");
}

/* Postgres refuses to run as root: as root, servers run as "postgres". */
static struct passwd *server_user(void)
{
    if (geteuid() != 0)
        return NULL;
    struct passwd *pw = getpwnam("postgres");
    if (!pw)
        fail_msg("running as root but there is no 'postgres' user to run the server as");
    return pw;
}

/* In a forked child: drop to the server user, die with the parent. The
 * server user may not enter the checkout (a clone in root's 0700 home), so
 * it starts in / and is given only absolute paths in the temp directory. */
static void child_prepare(struct passwd *pw, int deathsig)
{
    if (pw) {
        if (setgid(pw->pw_gid) != 0 || initgroups(pw->pw_name, pw->pw_gid) != 0 ||
            setuid(pw->pw_uid) != 0 || chdir("/") != 0)
            _exit(126);
    }
    prctl(PR_SET_PDEATHSIG, deathsig);
    if (getppid() == 1)
        _exit(126);
}

/* In a child before exec: every descriptor but 0, 1 and 2 closed, so that
 * a relay or a server keeps no copy of the test's sockets and pipes (a
 * writer's Postgres session, the broker's control pipe) open. */
static void close_inherited(void)
{
    long max = sysconf(_SC_OPEN_MAX);
    for (int fd = 3; fd < (max > 0 && max < 65536 ? max : 65536); fd++)
        close(fd);
}

/* Forks argv with stdout and stderr appended to `log`; the child runs as
 * `pw` (NULL = us) and gets `deathsig` when the test process dies. */
static pid_t spawn(char *const argv[], char *const envp[], struct passwd *pw, int deathsig,
                   const char *log)
{
    pid_t pid = fork();
    if (pid < 0)
        fail_msg("fork: %s", strerror(errno));
    if (pid == 0) {
        child_prepare(pw, deathsig);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        close_inherited();
        execve(argv[0], argv, envp ? envp : environ);
        _exit(127);
    }
    return pid;
}

static int wait_exit(pid_t pid, int timeout_ms)
{
    int64_t deadline = h_now_ms() + timeout_ms;
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (r < 0)
            return -2;
        if (h_now_ms() > deadline)
            return -1;
        h_sleep_ms(20);
    }
}

/* Runs argv to completion as the server user (or ourselves); returns status. */
static int run_as_server(char *const argv[], const char *out_path)
{
    return wait_exit(spawn(argv, NULL, server_user(), SIGKILL, out_path), 120000);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f)
        fail_msg("cannot write %s: %s", path, strerror(errno));
    fputs(text, f);
    fclose(f);
}

/* Starts another server on data directory `data`, TCP port `port` (its
 * socket in e->dir too), with `setting` besides ours; returns its pid once
 * it answers, and its conninfo. */
static pid_t start_other_server(struct h_env *e, const char *data, int port, const char *setting,
                                const char *log, char *conninfo, size_t len)
{
    char port_s[16];
    snprintf(port_s, sizeof(port_s), "%d", port);
    char *const argv[] = {PG_BINDIR "/postgres",
                          "-D",
                          (char *)data,
                          "-k",
                          e->dir,
                          "-p",
                          port_s,
                          "-c",
                          "listen_addresses=127.0.0.1",
                          "-c",
                          (char *)setting,
                          "-c",
                          "max_connections=60",
                          "-c",
                          "max_prepared_transactions=4",
                          NULL};
    pid_t pid = spawn(argv, NULL, server_user(), SIGINT, log);
    snprintf(conninfo, len, "host=127.0.0.1 port=%d user=postgres dbname=postgres", port);
    int64_t deadline = h_now_ms() + 30000;
    while (PQping(conninfo) != PQPING_OK) {
        if (h_now_ms() > deadline || waitpid(pid, NULL, WNOHANG) == pid)
            fail_msg("the server in %s did not start, see %s", data, log);
        h_sleep_ms(50);
    }
    return pid;
}

void h_standby_start(struct h_env *e)
{
    char data[300], log[300], primary_port[16];
    if (!e->pg_tcp)
        fail_msg("h_standby_start needs the server on TCP (H_PG_TCP)");
    snprintf(data, sizeof(data), "%s/standby", e->dir);
    snprintf(log, sizeof(log), "%s/standby.log", e->dir);
    snprintf(primary_port, sizeof(primary_port), "%d", e->pg_port);
    /* -R writes primary_conninfo and standby.signal: a streaming standby. */
    char *const backup[] = {PG_BINDIR "/pg_basebackup",
                            "-D",
                            data,
                            "-R",
                            "-X",
                            "stream",
                            "-h",
                            "127.0.0.1",
                            "-p",
                            primary_port,
                            "-U",
                            "postgres",
                            NULL};
    if (run_as_server(backup, log) != 0)
        fail_msg("pg_basebackup failed, see %s", log);
    char conninfo[300];
    e->standby_port = h_free_port();
    /* At least the primary's (command-line) settings. */
    e->standby_pid = start_other_server(e, data, e->standby_port, "hot_standby=on", log, conninfo,
                                        sizeof(conninfo));
    PGconn *c = PQconnectdb(conninfo);
    assert_int_equal(PQstatus(c), CONNECTION_OK);
    assert_int_equal(h_sql_int(c, "SELECT pg_is_in_recovery()::int"), 1);
    PQfinish(c);
}

void h_pooler_start(struct h_env *e, const char *pool_mode, char *conninfo, size_t len)
{
    int slot = e->pooler_pids[0] > 0 ? 1 : 0;
    if (e->pooler_pids[slot] > 0)
        fail_msg("h_pooler_start: two poolers run already");
    char ini[300], users[300], log[300], text[1024];
    int port = h_free_port();
    snprintf(ini, sizeof(ini), "%s/pgbouncer%d.ini", e->dir, slot);
    snprintf(users, sizeof(users), "%s/pgbouncer.users", e->dir);
    snprintf(log, sizeof(log), "%s/pgbouncer%d.log", e->dir, slot);
    write_file(users, "\"postgres\" \"\"\n");
    /* Logs to stderr; no Unix socket and no pid file of its own. */
    snprintf(text, sizeof(text),
             "[databases]\n"
             "postgres = host=%s port=%d dbname=postgres\n"
             "[pgbouncer]\n"
             "listen_addr = 127.0.0.1\n"
             "listen_port = %d\n"
             "unix_socket_dir =\n"
             "auth_type = trust\n"
             "auth_file = %s\n"
             "pool_mode = %s\n"
             "default_pool_size = 20\n"
             "max_client_conn = 200\n",
             e->pg_tcp ? "127.0.0.1" : e->dir, e->pg_port ? e->pg_port : 5432, port, users,
             pool_mode);
    write_file(ini, text);
    char *const argv[] = {"/usr/sbin/pgbouncer", ini, NULL};
    if (access(argv[0], X_OK) != 0)
        fail_msg("%s is missing: scripts/deps installs Debian's pgbouncer", argv[0]);
    /* It refuses to run as root; SIGTERM is its immediate shutdown. */
    e->pooler_pids[slot] = spawn(argv, NULL, server_user(), SIGTERM, log);
    snprintf(conninfo, len, "host=127.0.0.1 port=%d user=postgres dbname=postgres", port);
    int64_t deadline = h_now_ms() + 15000;
    while (PQping(conninfo) != PQPING_OK) {
        if (h_now_ms() > deadline || waitpid(e->pooler_pids[slot], NULL, WNOHANG) != 0)
            fail_msg("pgbouncer did not start, see %s", log);
        h_sleep_ms(50);
    }
}

void h_pooler_stop(struct h_env *e, int slot)
{
    if (e->pooler_pids[slot] <= 0)
        return;
    kill(e->pooler_pids[slot], SIGTERM);
    if (wait_exit(e->pooler_pids[slot], 10000) == -1) {
        kill(e->pooler_pids[slot], SIGKILL);
        wait_exit(e->pooler_pids[slot], 5000);
    }
    e->pooler_pids[slot] = 0;
}

/* A new cluster (another system identifier) for a copy of the test
 * database, with the roles of sql/; its conninfo. */
static void start_copy_server(struct h_env *e, char *conninfo, size_t len, const char *log)
{
    char data[300];
    snprintf(data, sizeof(data), "%s/copy", e->dir);
    char *const initdb[] = {PG_BINDIR "/initdb", "-D",        data, "-A",   "trust",      "-U",
                            "postgres",          "--no-sync", "-E", "UTF8", "--locale=C", NULL};
    if (run_as_server(initdb, log) != 0)
        fail_msg("initdb of the copy failed, see %s", log);
    e->copy_pid = start_other_server(e, data, h_free_port(), "fsync=off", log, conninfo, len);
    PGconn *c = PQconnectdb(conninfo);
    assert_int_equal(PQstatus(c), CONNECTION_OK);
    h_sql(c, "CREATE ROLE outboxd_relay LOGIN; CREATE ROLE outboxd_writer NOLOGIN");
    PQfinish(c);
}

/* pg_dump of the test database (schema_only: its schema alone), restored
 * into the copy's server. */
static void dump_and_restore(struct h_env *e, bool schema_only, const char *conninfo,
                             const char *log)
{
    char dump[300];
    snprintf(dump, sizeof(dump), "%s/dump.custom", e->dir);
    char *const pg_dump[] = {PG_BINDIR "/pg_dump",
                             "-Fc",
                             "-f",
                             dump,
                             "-d",
                             e->conninfo,
                             schema_only ? "--schema-only" : NULL,
                             NULL};
    if (wait_exit(spawn(pg_dump, NULL, NULL, SIGKILL, log), 120000) != 0)
        fail_msg("pg_dump failed, see %s", log);
    char *const pg_restore[] = {
        PG_BINDIR "/pg_restore", "--exit-on-error", "-d", (char *)conninfo, dump, NULL};
    if (wait_exit(spawn(pg_restore, NULL, NULL, SIGKILL, log), 120000) != 0)
        fail_msg("pg_restore failed, see %s", log);
}

void h_restore_copy(struct h_env *e, char *conninfo, size_t len)
{
    char log[300];
    snprintf(log, sizeof(log), "%s/copy.log", e->dir);
    start_copy_server(e, conninfo, len, log);
    dump_and_restore(e, false, conninfo, log);
}

void h_logical_copy(struct h_env *e, char *conninfo, size_t len)
{
    char log[300];
    snprintf(log, sizeof(log), "%s/copy.log", e->dir);
    start_copy_server(e, conninfo, len, log);
    dump_and_restore(e, true, conninfo, log);
    PGconn *p = h_connect(e);
    h_sql(p, "CREATE PUBLICATION obx_cut FOR ALL TABLES");
    PQfinish(p);
    PGconn *c = PQconnectdb(conninfo);
    assert_int_equal(PQstatus(c), CONNECTION_OK);
    h_sql(c, "CREATE SUBSCRIPTION obx_cut CONNECTION '%s' PUBLICATION obx_cut", e->conninfo);
    PQfinish(c);
}

void h_logical_cut_over(struct h_env *e, const char *conninfo)
{
    PGconn *p = h_connect(e);
    PGconn *c = PQconnectdb(conninfo);
    assert_int_equal(PQstatus(c), CONNECTION_OK);
    /* Every table copied, and the stream caught up with the publisher. */
    int64_t lsn = h_sql_int(p, "SELECT pg_current_wal_lsn() - '0/0'");
    int64_t deadline = h_now_ms() + 60000;
    while (h_sql_int(c, "SELECT count(*) FROM pg_subscription_rel WHERE srsubstate <> 'r'") > 0 ||
           h_sql_int(p,
                     "SELECT count(*) FROM pg_stat_replication"
                     " WHERE application_name = 'obx_cut' AND replay_lsn - '0/0' >= %lld",
                     (long long)lsn) == 0) {
        if (h_now_ms() > deadline)
            fail_msg("the logical copy did not catch up in 60 s, see %s/copy.log", e->dir);
        h_sleep_ms(50);
    }
    h_sql(c, "DROP SUBSCRIPTION obx_cut");
    /* Sequences are not replicated: the cut-over moves the identity. */
    int64_t last = h_sql_int(p, "SELECT pg_sequence_last_value("
                                "pg_get_serial_sequence('outbox.events', 'id')::regclass)");
    h_sql(c, "SELECT setval(pg_get_serial_sequence('outbox.events', 'id'), %lld)", (long long)last);
    PQfinish(c);
    PQfinish(p);
}

static void h_pg_restart_stop(struct h_env *e, int sig);
static void remove_tree(const char *path, const char *log);

/* Copies directory `from` to `to` with owners and modes (cp -a). */
static int copy_tree(const char *from, const char *to, const char *log)
{
    char *const cp[] = {"/bin/cp", "-a", (char *)from, (char *)to, NULL};
    return wait_exit(spawn(cp, NULL, NULL, SIGKILL, log), 60000);
}

void h_pg_start(struct h_env *e)
{
    char data[300], log[300], sockdir[300];
    struct passwd *pw = server_user();

    snprintf(data, sizeof(data), "%s/pgdata", e->dir);
    snprintf(log, sizeof(log), "%s/postgres.log", e->dir);
    snprintf(sockdir, sizeof(sockdir), "%s", e->dir);
    if (access(data, F_OK) != 0) {
        char *const initdb[] = {PG_BINDIR "/initdb", "-D",        data, "-A",   "trust",      "-U",
                                "postgres",          "--no-sync", "-E", "UTF8", "--locale=C", NULL};
        int rc = run_as_server(initdb, log);
        if (rc != 0)
            fail_msg("initdb failed (%d), see %s", rc, log);
    }
    char port[16];
    int port_n = e->pg_port ? e->pg_port : 5432;
    snprintf(port, sizeof(port), "%d", port_n);
    char *argv[40] = {PG_BINDIR "/postgres",
                      "-D",
                      data,
                      "-k",
                      sockdir,
                      "-p",
                      port,
                      "-c",
                      e->pg_tcp ? "listen_addresses=127.0.0.1" : "listen_addresses=",
                      "-c",
                      "fsync=off",
                      "-c",
                      "max_connections=60",
                      "-c", /* applications that PREPARE (two-phase commit) */
                      "max_prepared_transactions=4"};
    int argc = 15;
    for (int i = 0; i < 8 && e->pg_opts[i]; i++) {
        argv[argc++] = "-c";
        argv[argc++] = (char *)e->pg_opts[i];
    }
    argv[argc] = NULL;
    /* SIGINT = fast shutdown when the test process dies. */
    pid_t pid = spawn(argv, NULL, pw, SIGINT, log);
    e->pg_pid = pid;
    snprintf(e->conninfo, sizeof(e->conninfo), "host=%s port=%d user=postgres dbname=postgres",
             e->pg_tcp ? "127.0.0.1" : e->dir, port_n);
    int64_t deadline = h_now_ms() + 30000;
    while (PQping(e->conninfo) != PQPING_OK) {
        if (h_now_ms() > deadline || waitpid(pid, NULL, WNOHANG) == pid)
            fail_msg("postgres did not start, see %s", log);
        h_sleep_ms(50);
    }
}

void h_pg_stop(struct h_env *e)
{
    h_pg_restart_stop(e, SIGINT);
}

void h_pg_crash(struct h_env *e)
{
    h_pg_restart_stop(e, SIGQUIT);
}

void h_pg_restart(struct h_env *e, const char *mode)
{
    h_pg_restart_stop(e, strcmp(mode, "immediate") == 0 ? SIGQUIT : SIGINT);
    h_pg_start(e);
}

int h_pg_backup(struct h_env *e)
{
    char backup[300], log[300], port[16];
    snprintf(backup, sizeof(backup), "%s/backup", e->dir);
    snprintf(log, sizeof(log), "%s/backup.log", e->dir);
    snprintf(port, sizeof(port), "%d", e->pg_port ? e->pg_port : 5432);
    remove_tree(backup, log);
    char *const argv[] = {
        PG_BINDIR "/pg_basebackup",       "-D", backup, "-X", "stream",   "-c", "fast", "-h",
        e->pg_tcp ? "127.0.0.1" : e->dir, "-p", port,   "-U", "postgres", NULL};
    return run_as_server(argv, log) == 0 ? 0 : -1;
}

int h_pg_rewind(struct h_env *e)
{
    char backup[300], data[300], lost[300], path[400], log[300];
    snprintf(backup, sizeof(backup), "%s/backup", e->dir);
    snprintf(data, sizeof(data), "%s/pgdata", e->dir);
    snprintf(lost, sizeof(lost), "%s/pgdata.rewound", e->dir);
    snprintf(log, sizeof(log), "%s/postgres.log", e->dir);
    if (access(backup, F_OK) != 0)
        return -1;
    h_pg_restart_stop(e, SIGQUIT);
    remove_tree(lost, log);
    if (rename(data, lost) != 0 || rename(backup, data) != 0)
        fail_msg("h_pg_rewind: cannot swap %s for the backup: %s", data, strerror(errno));
    /* Archive recovery from the backup's own WAL (pg_wal), ended as soon
     * as it is consistent, then a new timeline. */
    snprintf(path, sizeof(path), "%s/recovery.signal", data);
    write_file(path, "");
    struct passwd *pw = server_user();
    if (pw && chown(path, pw->pw_uid, pw->pw_gid) != 0)
        fail_msg("h_pg_rewind: chown %s: %s", path, strerror(errno));
    snprintf(path, sizeof(path), "%s/postgresql.auto.conf", data);
    FILE *f = fopen(path, "a");
    if (!f)
        fail_msg("h_pg_rewind: cannot append to %s: %s", path, strerror(errno));
    fputs("restore_command = 'false'\n"
          "recovery_target = 'immediate'\n"
          "recovery_target_action = 'promote'\n",
          f);
    fclose(f);
    h_pg_start(e);
    int64_t deadline = h_now_ms() + 30000;
    for (;;) {
        PGconn *c = PQconnectdb(e->conninfo);
        bool promoted = false;
        if (PQstatus(c) == CONNECTION_OK) {
            PGresult *r = PQexec(c, "SELECT pg_is_in_recovery()");
            promoted = PQresultStatus(r) == PGRES_TUPLES_OK && PQgetvalue(r, 0, 0)[0] == 'f';
            PQclear(r);
        }
        PQfinish(c);
        if (promoted)
            return 0;
        if (h_now_ms() > deadline)
            fail_msg("h_pg_rewind: the server did not leave recovery in 30 s, see %s", log);
        h_sleep_ms(50);
    }
}

/* Stops the postmaster with `sig`: SIGINT = fast, SIGQUIT = immediate. */
static void h_pg_restart_stop(struct h_env *e, int sig)
{
    if (e->pg_pid <= 0)
        return;
    kill(e->pg_pid, sig);
    if (wait_exit(e->pg_pid, 30000) == -1) {
        kill(e->pg_pid, SIGKILL);
        wait_exit(e->pg_pid, 5000);
    }
    e->pg_pid = 0;
}

static int name_cmp(const struct dirent **a, const struct dirent **b)
{
    return strcmp((*a)->d_name, (*b)->d_name);
}

static int is_sql_file(const struct dirent *d)
{
    size_t n = strlen(d->d_name);
    return n > 4 && strcmp(d->d_name + n - 4, ".sql") == 0;
}

/* Applies the sql/ files in file-name order with psql, as the README says.
 * psql runs as the test's own user: only the server needs the server user,
 * and that user cannot read a checkout in a 0700 home directory. */
static void apply_migrations(struct h_env *e)
{
    struct dirent **list;
    char log[300];
    int n = scandir(OBX_SOURCE_DIR "/sql", &list, is_sql_file, name_cmp);
    if (n <= 0)
        fail_msg("no migrations in " OBX_SOURCE_DIR "/sql");
    snprintf(log, sizeof(log), "%s/psql.log", e->dir);
    for (int i = 0; i < n; i++) {
        char file[600];
        snprintf(file, sizeof(file), OBX_SOURCE_DIR "/sql/%s", list[i]->d_name);
        char *const argv[] = {PG_BINDIR "/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d",
                              e->conninfo,       "-f", file, NULL};
        int rc = wait_exit(spawn(argv, NULL, NULL, SIGKILL, log), 120000);
        if (rc != 0)
            fail_msg("psql -f %s failed (%d), see %s", file, rc, log);
        free(list[i]);
    }
    free(list);
}

/* The checker's record of what was committed: a copy of every row as
 * inserted (or fixed by an UPDATE), kept by a trigger in the same
 * transaction, so rows the relay deletes (relay.on_sent = delete) or
 * retention purges can still be compared with Kafka byte for byte. */
static const char keep_committed_sql[] =
    "CREATE SCHEMA obx_test;"
    " CREATE TABLE obx_test.committed (id bigint PRIMARY KEY, topic text NOT NULL,"
    "   key text, payload bytea);"
    " CREATE FUNCTION obx_test.keep() RETURNS trigger LANGUAGE plpgsql AS $$"
    " BEGIN"
    "   INSERT INTO obx_test.committed VALUES (NEW.id, NEW.topic, NEW.key, NEW.payload)"
    "   ON CONFLICT (id) DO UPDATE SET topic = excluded.topic, key = excluded.key,"
    "     payload = excluded.payload;"
    "   RETURN NULL;"
    " END $$;"
    " CREATE TRIGGER obx_test_keep AFTER INSERT OR UPDATE OF topic, key, payload"
    "   ON outbox.events FOR EACH ROW EXECUTE FUNCTION obx_test.keep()";

static void keep_committed(struct h_env *e)
{
    PGconn *c = h_connect(e);
    h_sql(c, "%s", keep_committed_sql);
    PQfinish(c);
}

void h_schema_apply(struct h_env *e)
{
    apply_migrations(e);
    keep_committed(e);
}

/* Starts argv (the mock broker or the real cluster) with its control
 * stdin and stdout piped to us, and reads the lines it prints once ready:
 * "internal <list>" (the real cluster's) and last "bootstrap <list>". */
static void broker_spawn(struct h_env *e, char *const *argv)
{
    int in[2], out[2];
    char line[sizeof(e->bootstrap) + 32];
    char log[300];
    snprintf(log, sizeof(log), "%s/broker.log", e->dir);
    if (pipe(in) != 0 || pipe(out) != 0)
        fail_msg("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        fail_msg("fork: %s", strerror(errno));
    if (pid == 0) {
        child_prepare(NULL, SIGTERM);
        dup2(in[0], 0);
        dup2(out[1], 1);
        if (e->real_kafka) { /* its own words go to a file: the JVMs' to theirs */
            int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (fd >= 0)
                dup2(fd, 2);
        }
        close_inherited();
        execv(argv[0], argv);
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    e->broker_pid = pid;
    e->broker_in = fdopen(in[1], "w");
    e->broker_out = fdopen(out[0], "r");
    for (;;) {
        if (!fgets(line, sizeof(line), e->broker_out))
            fail_msg("%s did not start%s%s", argv[0], e->real_kafka ? "; see " : "",
                     e->real_kafka ? log : "");
        line[strcspn(line, "\r\n")] = '\0';
        if (strncmp(line, "internal ", 9) == 0)
            snprintf(e->internal, sizeof(e->internal), "%.*s", (int)sizeof(e->internal) - 1,
                     line + 9);
        if (strncmp(line, "bootstrap ", 10) == 0)
            break;
    }
    snprintf(e->bootstrap, sizeof(e->bootstrap), "%.*s", (int)sizeof(e->bootstrap) - 1, line + 10);
    if (!e->internal[0])
        snprintf(e->internal, sizeof(e->internal), "%s", e->bootstrap);
}

static void broker_start(struct h_env *e, const char *const *topics)
{
    char *argv[80];
    int argc = 0;

    argv[argc++] = OBX_BINARY_DIR "/tests/obx-mock-broker";
    /* OBX_MOCK_PLAIN=1: the bare mock, without its sequence checks, to see
     * what a test would let through against it. */
    if (getenv("OBX_MOCK_PLAIN") && strcmp(getenv("OBX_MOCK_PLAIN"), "1") == 0)
        argv[argc++] = "-P";
    for (int i = 0; topics && topics[i] && argc < 76; i++) {
        argv[argc++] = "-t";
        argv[argc++] = (char *)topics[i];
    }
    argv[argc] = NULL;
    broker_spawn(e, argv);
}

/* The real cluster, in DIR/kafka: its nodes' logs are DIR/kafka/n<i>/kafka.log. */
static void real_kafka_start(struct h_env *e, const char *const *topics)
{
    char *argv[100], nodes[8], dir[300];
    int argc = 0;
    snprintf(nodes, sizeof(nodes), "%d", e->kafka.nodes ? e->kafka.nodes : 3);
    snprintf(dir, sizeof(dir), "%s/kafka", e->dir);
    argv[argc++] = OBX_BINARY_DIR "/tests/obx-kafka-cluster";
    argv[argc++] = "-n";
    argv[argc++] = nodes;
    argv[argc++] = "-d";
    argv[argc++] = dir;
    if (e->kafka.proxy)
        argv[argc++] = "-x";
    if (e->kafka.sasl)
        argv[argc++] = "-s";
    for (int i = 0; i < 12 && e->kafka.settings[i]; i++) {
        argv[argc++] = "-o";
        argv[argc++] = (char *)e->kafka.settings[i];
    }
    for (int i = 0; topics && topics[i] && argc < 96; i++) {
        argv[argc++] = "-t";
        argv[argc++] = (char *)topics[i];
    }
    argv[argc] = NULL;
    broker_spawn(e, argv);
}

static bool broker_vcmd(struct h_env *e, char *reply, size_t len, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));

static bool broker_vcmd(struct h_env *e, char *reply, size_t len, const char *fmt, va_list ap)
{
    int64_t t0 = h_now_ms();
    char cmd[256];
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    fprintf(e->broker_in, "%s\n", cmd);
    fflush(e->broker_in);
    reply[0] = '\0';
    if (!fgets(reply, (int)len, e->broker_out))
        return false;
    reply[strcspn(reply, "\r\n")] = '\0';
    note_long_wait(t0, "broker", cmd);
    if (strncmp(reply, "ok", 2) != 0)
        print_message("broker: %s: %s\n", cmd, reply);
    return strncmp(reply, "ok", 2) == 0;
}

bool h_broker_cmd(struct h_env *e, const char *fmt, ...)
{
    char reply[512];
    va_list ap;
    va_start(ap, fmt);
    bool ok = broker_vcmd(e, reply, sizeof(reply), fmt, ap);
    va_end(ap);
    return ok;
}

/* A command's answer "ok <number>" into *out; false on an error. */
static bool broker_vnumber(struct h_env *e, long *out, char *reply, size_t len, const char *fmt,
                           va_list ap) __attribute__((format(printf, 5, 0)));
static bool broker_vnumber(struct h_env *e, long *out, char *reply, size_t len, const char *fmt,
                           va_list ap)
{
    char *end;
    if (!broker_vcmd(e, reply, len, fmt, ap))
        return false;
    *out = strtol(reply + 2, &end, 10);
    return end != reply + 2;
}

long h_broker_query(struct h_env *e, const char *fmt, ...)
{
    char reply[512];
    long v = 0;
    va_list ap;
    va_start(ap, fmt);
    bool ok = broker_vnumber(e, &v, reply, sizeof(reply), fmt, ap);
    va_end(ap);
    if (!ok)
        fail_msg("broker: no number in the answer \"%s\"", reply);
    return v;
}

bool h_broker_number(struct h_env *e, long *out, const char *fmt, ...)
{
    char reply[512];
    va_list ap;
    va_start(ap, fmt);
    bool ok = broker_vnumber(e, out, reply, sizeof(reply), fmt, ap);
    va_end(ap);
    return ok;
}

void h_broker_seq_stats(struct h_env *e, struct h_seq_stats *out)
{
    char line[256];
    memset(out, 0, sizeof(*out));
    fputs("stats\n", e->broker_in);
    fflush(e->broker_in);
    if (!fgets(line, sizeof(line), e->broker_out) ||
        sscanf(line,
               "seq-check batches %lu out-of-order %lu duplicates %lu fenced %lu unchecked %lu",
               &out->checked, &out->out_of_order, &out->duplicates, &out->fenced,
               &out->unchecked) != 5)
        fail_msg("broker stats: unexpected answer: %s", line);
    if (!fgets(line, sizeof(line), e->broker_out) || strncmp(line, "ok", 2) != 0)
        fail_msg("broker stats: no ok");
}

/* Every test starts from a cluster with the migrations applied; initdb and
 * psql cost over a second of CPU a test, so the first test keeps a stopped
 * copy in the build directory (copied as ourselves: the server user may not
 * read a checkout in a 0700 home) and the others copy that. The copy's name
 * carries a hash of what made it (sql/, the checker's trigger, the server
 * binary's path, size and time, and CLUSTER_RECIPE for the rest), so an
 * edited migration or an upgraded server is never served from an old copy;
 * it appears by rename, whole or not at all, so tests racing to make it are
 * harmless. */
#define CLUSTER_RECIPE "1: h_pg_start's initdb options" /* change with them */

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ULL;
    return h;
}

static void migrated_path(char *buf, size_t len)
{
    uint64_t h = fnv1a(1469598103934665603ULL, CLUSTER_RECIPE, sizeof(CLUSTER_RECIPE));
    h = fnv1a(h, PG_BINDIR, sizeof(PG_BINDIR));
    h = fnv1a(h, keep_committed_sql, sizeof(keep_committed_sql));
    struct stat st;
    if (stat(PG_BINDIR "/postgres", &st) == 0) {
        int64_t id[2] = {(int64_t)st.st_size, (int64_t)st.st_mtime};
        h = fnv1a(h, id, sizeof(id));
    }
    struct dirent **list;
    int n = scandir(OBX_SOURCE_DIR "/sql", &list, is_sql_file, name_cmp);
    for (int i = 0; i < n; i++) {
        char file[600];
        snprintf(file, sizeof(file), OBX_SOURCE_DIR "/sql/%s", list[i]->d_name);
        FILE *f = fopen(file, "rb");
        for (int c; f && (c = fgetc(f)) != EOF;) {
            unsigned char byte = (unsigned char)c;
            h = fnv1a(h, &byte, 1);
        }
        if (f)
            fclose(f);
        free(list[i]);
    }
    if (n >= 0)
        free(list);
    snprintf(buf, len, "%s/it-pgdata-%016llx", OBX_BINARY_DIR, (unsigned long long)h);
}

static void remove_tree(const char *path, const char *log)
{
    char *const rm[] = {"/bin/rm", "-rf", (char *)path, NULL};
    wait_exit(spawn(rm, NULL, NULL, SIGKILL, log), 60000);
}

static bool copy_migrated(struct h_env *e)
{
    char from[600], to[300], log[300];
    migrated_path(from, sizeof(from));
    snprintf(to, sizeof(to), "%s/pgdata", e->dir);
    snprintf(log, sizeof(log), "%s/postgres.log", e->dir);
    if (access(from, F_OK) != 0)
        return false;
    if (copy_tree(from, to, log) == 0)
        return true;
    remove_tree(to, log); /* half a copy: initdb starts again */
    return false;
}

static int is_migrated_copy(const struct dirent *d)
{
    return strncmp(d->d_name, "it-pgdata-", 10) == 0;
}

/* Whether `entry` is a copy to remove: one made for other migrations or
 * servers, or a partial one ("<name>.<pid>.<random>") whose test is gone. A racing
 * test's partial copy stays: removing it under its cp could leave a copy
 * that cp reports whole, and the race's loser then publishes it. */
static bool migrated_copy_stale(const char *entry, const char *name)
{
    size_t n = strlen(name);
    if (strncmp(entry, name, n) != 0)
        return true;
    if (entry[n] != '.')
        return false; /* the copy itself */
    long pid = strtol(entry + n + 1, NULL, 10);
    return pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

/* Removes stale copies (migrated_copy_stale). */
static void drop_old_migrated(const char *kept, const char *log)
{
    struct dirent **list;
    const char *name = strrchr(kept, '/') + 1;
    int n = scandir(OBX_BINARY_DIR, &list, is_migrated_copy, name_cmp);
    for (int i = 0; i < n; i++) {
        if (migrated_copy_stale(list[i]->d_name, name)) {
            char old[600];
            snprintf(old, sizeof(old), "%s/%s", OBX_BINARY_DIR, list[i]->d_name);
            remove_tree(old, log);
        }
        free(list[i]);
    }
    if (n >= 0)
        free(list);
}

static void keep_migrated(struct h_env *e)
{
    char kept[600], partial[700], data[300], log[300];
    migrated_path(kept, sizeof(kept));
    if (access(kept, F_OK) == 0)
        return;
    /* A name no other test, not even a killed one of our pid, has used:
     * mkdtemp makes it unique, then cp makes the directory anew. */
    snprintf(partial, sizeof(partial), "%s.%ld.XXXXXX", kept, (long)getpid());
    if (!mkdtemp(partial) || rmdir(partial) != 0)
        return;
    snprintf(data, sizeof(data), "%s/pgdata", e->dir);
    snprintf(log, sizeof(log), "%s/postgres.log", e->dir);
    drop_old_migrated(kept, log);
    h_pg_stop(e);
    char pidfile[320];
    snprintf(pidfile, sizeof(pidfile), "%s/postmaster.pid", data);
    bool clean = access(pidfile, F_OK) != 0; /* else every copy would start with recovery */
    char control[720];
    snprintf(control, sizeof(control), "%s/global/pg_control", partial);
    if (!clean || copy_tree(data, partial, log) != 0 || access(control, F_OK) != 0 ||
        rename(partial, kept) != 0)
        remove_tree(partial, log);
    h_pg_start(e);
}

void h_env_start(struct h_env *e, const char *const *topics)
{
    h_env_start_with(e, topics, 0);
}

static void env_start(struct h_env *e, const char *const *topics, unsigned flags,
                      const struct h_kafka *k);

void h_env_start_with(struct h_env *e, const char *const *topics, unsigned flags)
{
    const char *kafka = getenv("OBX_IT_KAFKA");
    const char *nodes = getenv("OBX_IT_KAFKA_NODES");
    struct h_kafka k = {.nodes = nodes && *nodes ? atoi(nodes) : 3};
    if (kafka && *kafka && strcmp(kafka, "real") != 0 && strcmp(kafka, "mock") != 0)
        fail_msg("OBX_IT_KAFKA is real or mock, not %s", kafka);
    bool real = (flags & H_REAL_KAFKA) || (kafka && strcmp(kafka, "real") == 0);
    env_start(e, topics, flags, real ? &k : NULL);
}

void h_env_start_real(struct h_env *e, const char *const *topics, unsigned flags,
                      const struct h_kafka *k)
{
    static const struct h_kafka defaults = {.nodes = 3};
    env_start(e, topics, flags, k ? k : &defaults);
}

static void print_log_tails(const char *dir);

/* The watchdog: ctest kills a test that overruns its TIMEOUT without a
 * word of where it was. OBX_IT_TIMEOUT (seconds, set for every test from
 * its TIMEOUT) arms a thread that, 15 s before, prints where the test's
 * main thread is (a backtrace, through SIGUSR2) and what the relays did
 * last, so a rare hang in CI comes with its place. */
static pthread_t watchdog_main_thread;
static struct h_env *watchdog_env;

static void watchdog_backtrace(int sig)
{
    static const char head[] = "watchdog: the test's main thread is in\n";
    void *frames[64];
    (void)sig;
    int n = backtrace(frames, 64);
    ssize_t w = write(STDERR_FILENO, head, sizeof(head) - 1);
    (void)w;
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
}

static void *watchdog_main(void *arg)
{
    int after_s = (int)(intptr_t)arg;
    h_sleep_ms(after_s * 1000);
    fprintf(stderr, "watchdog: the test still runs after %d s, and ctest stops it soon\n", after_s);
    if (watchdog_env && watchdog_env->dir[0]) {
        fprintf(stderr, "watchdog: its directory is %s\n", watchdog_env->dir);
        fflush(stderr);
        print_log_tails(watchdog_env->dir);
    }
    pthread_kill(watchdog_main_thread, SIGUSR2);
    return NULL;
}

/* Line-buffered from the start (ctest's pipe would buffer it whole): a
 * failure's message is out before a hang in the teardown that follows it. */
__attribute__((constructor)) static void stdout_by_line(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
}

static void watchdog_arm(struct h_env *e)
{
    static bool armed;
    watchdog_env = e;
    const char *v = getenv("OBX_IT_TIMEOUT");
    int timeout_s = v ? atoi(v) : 0;
    if (armed || timeout_s <= 30)
        return;
    armed = true;
    void *frames[1];
    backtrace(frames, 1); /* loads libgcc now, not in the signal handler */
    watchdog_main_thread = pthread_self();
    signal(SIGUSR2, watchdog_backtrace);
    pthread_t t;
    if (pthread_create(&t, NULL, watchdog_main, (void *)(intptr_t)(timeout_s - 15)) == 0)
        pthread_detach(t);
}

/* k NULL: the mock broker. */
static void env_start(struct h_env *e, const char *const *topics, unsigned flags,
                      const struct h_kafka *k)
{
    struct passwd *pw = server_user();
    memset(e, 0, sizeof(*e));
    if (k) {
        e->real_kafka = true;
        e->kafka = *k;
    }
    if (flags & H_PG_TCP) {
        e->pg_tcp = true;
        e->pg_port = h_free_port();
    }
    snprintf(e->dir, sizeof(e->dir), "/tmp/obx-it-XXXXXX");
    if (!mkdtemp(e->dir))
        fail_msg("mkdtemp: %s", strerror(errno));
    watchdog_arm(e);
    if (pw && chown(e->dir, pw->pw_uid, pw->pw_gid) != 0)
        fail_msg("chown %s: %s", e->dir, strerror(errno));
    chmod(e->dir, 0755);
    int64_t t0 = h_now_ms();
    if (!copy_migrated(e)) {
        h_pg_start(e);
        apply_migrations(e);
        keep_committed(e);
        keep_migrated(e);
    } else {
        h_pg_start(e);
    }
    note_long_wait(t0, "postgres", NULL);
    t0 = h_now_ms();
    if (e->real_kafka)
        real_kafka_start(e, topics);
    else
        broker_start(e, topics);
    note_long_wait(t0, e->real_kafka ? "real kafka" : "broker", NULL);
    e->http_port = h_free_port();
}

void h_wait_log(struct h_env *e, const char *needle, int timeout_ms)
{
    int64_t t0 = h_now_ms();
    int64_t deadline = t0 + timeout_ms;
    while (!h_relay_log_contains(e, needle) && h_now_ms() < deadline)
        h_sleep_ms(50);
    if (!h_relay_log_contains(e, needle))
        fail_msg("no '%s' in the relay log within %d ms", needle, timeout_ms);
    note_long_wait(t0, "log", needle);
}

int h_notify_socket(struct h_env *e, const char *name, char *var, size_t var_len)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%.80s/%.20s", e->dir, name);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
        fail_msg("notify socket %s: %s", addr.sun_path, strerror(errno));
    snprintf(var, var_len, "NOTIFY_SOCKET=%s", addr.sun_path);
    return fd;
}

bool h_recv_notify(int fd, char *buf, size_t len, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) != 1)
        return false;
    ssize_t n = recv(fd, buf, len - 1, 0);
    if (n < 0)
        return false;
    buf[n] = '\0';
    return true;
}

int h_free_port(void)
{
    /* The kernel may give the port it just gave again once the probe is
     * closed: two relays of one chaos schedule got the same http.listen
     * (seed 847965). So not one of the last few handed out. */
    static int recent[16];
    static unsigned n_recent;
    for (int attempt = 0; attempt < 100; attempt++) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        socklen_t len = sizeof(a);
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
            getsockname(fd, (struct sockaddr *)&a, &len) != 0)
            fail_msg("cannot find a free port: %s", strerror(errno));
        close(fd);
        int port = ntohs(a.sin_port);
        bool seen = false;
        for (unsigned i = 0; i < n_recent && i < 16; i++)
            seen = seen || recent[i] == port;
        if (!seen) {
            recent[n_recent++ % 16] = port;
            return port;
        }
    }
    fail_msg("cannot find a free port: the kernel keeps giving the same ones");
    return -1;
}

int h_http_raw(int port, const char *request, size_t request_len, char *body, size_t body_len,
               int timeout_ms)
{
    static char resp[1 << 20];
    size_t got = 0;
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (body && body_len)
        body[0] = '\0';
    if (fd < 0)
        return 0;
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return 0;
    }
    if (request_len > 0 && send(fd, request, request_len, MSG_NOSIGNAL) != (ssize_t)request_len) {
        close(fd);
        return 0;
    }
    int64_t deadline = h_now_ms() + timeout_ms;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int left = (int)(deadline - h_now_ms());
        if (left <= 0 || poll(&p, 1, left) <= 0)
            break;
        ssize_t n = recv(fd, resp + got, sizeof(resp) - 1 - got, 0);
        if (n <= 0)
            break;
        got += (size_t)n;
        if (got == sizeof(resp) - 1)
            break;
    }
    close(fd);
    resp[got] = '\0';
    int status = 0;
    if (sscanf(resp, "HTTP/1.%*d %d", &status) != 1)
        status = 0;
    const char *start = strstr(resp, "\r\n\r\n");
    if (body && body_len && start)
        snprintf(body, body_len, "%s", start + 4);
    return status;
}

int h_http_get(struct h_env *e, const char *path, char *body, size_t body_len)
{
    char req[512];
    int n = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", path);
    return h_http_raw(e->http_port, req, (size_t)n, body, body_len, 5000);
}

void h_wait_http(struct h_env *e, const char *path, int status, const char *needle, int timeout_ms,
                 char *body, size_t body_len)
{
    int64_t t0 = h_now_ms();
    int64_t deadline = t0 + timeout_ms;
    int got;
    do {
        got = h_http_get(e, path, body, body_len);
        if (got == status && (!needle || strstr(body, needle))) {
            note_long_wait(t0, path, needle);
            return;
        }
        h_sleep_ms(100);
    } while (h_now_ms() < deadline);
    fail_msg("GET %s: wanted %d with '%s', last answer %d: %.300s", path, status,
             needle ? needle : "", got, body);
}

double h_metric(const char *exposition, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = exposition; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, series, n) == 0 && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    }
    return -1;
}

/* Scrapes the relay's /metrics until `series` lies in [lo, hi] (a relay
 * not answering yet counts as not there); fails after timeout_ms. */
static void wait_metric_in(struct h_env *e, const char *series, double lo, double hi,
                           int timeout_ms)
{
    static char body[1 << 20]; /* the test's thread alone scrapes */
    int64_t t0 = h_now_ms();
    double got = -1;
    do {
        if (h_http_get(e, "/metrics", body, sizeof(body)) == 200) {
            got = h_metric(body, series);
            if (got >= lo && got <= hi) {
                note_long_wait(t0, "metric", series);
                return;
            }
        }
        h_sleep_ms(100);
    } while (h_now_ms() < t0 + timeout_ms);
    fail_msg("metric %s: wanted %g..%g within %d ms, last %g", series, lo, hi, timeout_ms, got);
}

void h_wait_metric(struct h_env *e, const char *series, double value, int timeout_ms)
{
    wait_metric_in(e, series, value, value, timeout_ms);
}

void h_wait_metric_min(struct h_env *e, const char *series, double min, int timeout_ms)
{
    wait_metric_in(e, series, min, 1e300, timeout_ms);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* Whether a file of a test's directory is a relay's log. */
static bool is_relay_log(const char *name)
{
    size_t nl = strlen(name);
    return nl > 4 && strcmp(name + nl - 4, ".log") == 0 && strcmp(name, "postgres.log") != 0 &&
           strcmp(name, "psql.log") != 0 && strcmp(name, "broker.log") != 0;
}

#define TAIL_LINES 30

/* The last lines of every relay log of DIR on stdout: ctest shows a test's
 * output only when it fails (--output-on-failure), and CI keeps no files,
 * so a failure there comes with what the relays did last. */
static void print_log_tails(const char *dir)
{
    struct dirent **list;
    int n = scandir(dir, &list, NULL, name_cmp);
    for (int i = 0; i < n; i++) {
        const char *name = list[i]->d_name;
        char path[600];
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        FILE *f = is_relay_log(name) ? fopen(path, "r") : NULL;
        if (f) {
            static char ring[TAIL_LINES][600];
            size_t seen = 0;
            char *line = ring[0];
            while (fgets(line = ring[seen % TAIL_LINES], sizeof(ring[0]), f)) {
                size_t l = strlen(line);
                if (l > 0 && line[l - 1] != '\n') { /* a long line: its start is kept */
                    int c;
                    while ((c = fgetc(f)) != EOF && c != '\n') {
                    }
                    line[l - 1] = '\n';
                }
                seen++;
            }
            fclose(f);
            printf("--- the last lines of %s ---\n", name);
            for (size_t k = seen > TAIL_LINES ? seen - TAIL_LINES : 0; k < seen; k++)
                fputs(ring[k % TAIL_LINES], stdout);
        }
        free(list[i]);
    }
    if (n > 0)
        free(list);
    fflush(stdout);
}

/* Lines no relay may ever log: a bug (OBX_BUG) or an event loop that did
 * not close. Returns the first one found in any relay log of DIR. */
static bool find_bug_line(const char *dir, char *found, size_t len)
{
    static const char *const needles[] = {"cannot happen: ",
                                          "event loop closed with handles still open"};
    struct dirent **list;
    int n = scandir(dir, &list, NULL, name_cmp);
    bool hit = false;
    for (int i = 0; i < n; i++) {
        const char *name = list[i]->d_name;
        if (!hit && is_relay_log(name)) {
            char path[600], line[4096];
            snprintf(path, sizeof(path), "%s/%s", dir, name);
            FILE *f = fopen(path, "r");
            while (f && !hit && fgets(line, sizeof(line), f))
                for (size_t k = 0; k < sizeof(needles) / sizeof(needles[0]); k++)
                    if (strstr(line, needles[k])) {
                        snprintf(found, len, "%s: %s", name, line);
                        hit = true;
                    }
            if (f)
                fclose(f);
        }
        free(list[i]);
    }
    if (n > 0)
        free(list);
    return hit;
}

void h_env_stop(struct h_env *e)
{
    char bug[4700];
    bool buggy = false;
    int64_t t0 = h_now_ms();
    if (e->relay_pid > 0) {
        kill(e->relay_pid, SIGKILL);
        wait_exit(e->relay_pid, 10000);
        e->relay_pid = 0;
    }
    if (e->broker_pid > 0) {
        kill(e->broker_pid, SIGTERM);
        if (wait_exit(e->broker_pid, 30000) == -1) {
            kill(e->broker_pid, SIGKILL);
            wait_exit(e->broker_pid, 5000);
        }
        e->broker_pid = 0;
    }
    if (e->broker_in)
        fclose(e->broker_in);
    if (e->broker_out)
        fclose(e->broker_out);
    e->broker_in = e->broker_out = NULL;
    if (e->copy_pid > 0) {
        kill(e->copy_pid, SIGINT); /* fast shutdown */
        if (wait_exit(e->copy_pid, 30000) == -1) {
            kill(e->copy_pid, SIGKILL);
            wait_exit(e->copy_pid, 5000);
        }
        e->copy_pid = 0;
    }
    for (int i = 0; i < 2; i++)
        h_pooler_stop(e, i);
    if (e->standby_pid > 0) {
        kill(e->standby_pid, SIGINT); /* fast shutdown */
        if (wait_exit(e->standby_pid, 30000) == -1) {
            kill(e->standby_pid, SIGKILL);
            wait_exit(e->standby_pid, 5000);
        }
        e->standby_pid = 0;
    }
    h_pg_stop(e);
    note_long_wait(t0, "env_stop", NULL);
    if (e->dir[0]) {
        buggy = find_bug_line(e->dir, bug, sizeof(bug));
        print_log_tails(e->dir);
    }
    if (e->dir[0]) {
        if (getenv("OBX_IT_KEEP") || buggy)
            fprintf(stderr, "keeping %s\n", e->dir);
        else
            nftw(e->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        e->dir[0] = '\0';
    }
    if (buggy)
        fail_msg("a relay logged what must never happen: %s", bug);
}

void h_relay_start(struct h_env *e, const char *failpoints, const char *const *xargs)
{
    char conf[300], log[300], text[2048];
    char *argv[64];
    char *envp[256];
    char fpvar[512];
    int argc = 0, envc = 0;

    const char *name = e->relay_name[0] ? e->relay_name : "relay";
    snprintf(conf, sizeof(conf), "%s/%s.conf", e->dir, name);
    h_relay_log_path(e, log, sizeof(log));
    /* OBX_IT_ON_SENT: the mode every relay of the suite runs in unless a
     * test says otherwise (-X overrides the file): the sanitizer pass runs
     * the integration tests in log mode. */
    const char *mode = getenv("OBX_IT_ON_SENT");
    if (!mode || !*mode)
        mode = "mark";
    snprintf(text, sizeof(text),
             "# written by the integration test harness\n"
             "postgres.conninfo = %s\n"
             "kafka.bootstrap.servers = %s\n"
             "postgres.reconnect_backoff_min = 50ms\n"
             "postgres.reconnect_backoff_max = 500ms\n"
             "relay.retry_backoff = 200ms\n"
             "shutdown.timeout = 20s\n"
             "http.listen = 127.0.0.1:%d\n"
             "log.level = info\n"
             "log.format = json\n" /* events carry names: h_relay_events */
             "relay.on_sent = %s\n",
             e->conninfo, e->bootstrap, e->http_port, mode);
    if (e->real_kafka) {
        /* What the idempotent producer takes anyway, said out loud: every
         * in-sync replica (min.insync.replicas 2 of 3) has each record. */
        size_t used = strlen(text);
        used += (size_t)snprintf(text + used, sizeof(text) - used, "kafka.acks = all\n");
        if (e->kafka.sasl)
            snprintf(text + used, sizeof(text) - used,
                     "kafka.security.protocol = SASL_PLAINTEXT\n"
                     "kafka.sasl.mechanisms = PLAIN\n"
                     "kafka.sasl.username = relay\n"
                     "kafka.sasl.password = relay-secret\n");
    }
    write_file(conf, text);

    /* OBX_RELAY_BINARY: the binary under test, e.g. an older build for a
     * before/after comparison (the chaos driver); ours by default. */
    const char *binary = getenv("OBX_RELAY_BINARY");
    argv[argc++] = (char *)(binary && *binary ? binary : OBX_BINARY_DIR "/outboxd");
    argv[argc++] = "--config";
    argv[argc++] = conf;
    for (int i = 0; xargs && xargs[i] && argc < 60; i++) {
        argv[argc++] = "-X";
        argv[argc++] = (char *)xargs[i];
    }
    argv[argc] = NULL;
    /* The child's environment: ours without OUTBOXD_*, plus the failpoints. */
    for (char **v = environ; *v && envc < 250; v++)
        if (strncmp(*v, "OUTBOXD_", 8) != 0)
            envp[envc++] = *v;
    if (failpoints) {
        snprintf(fpvar, sizeof(fpvar), "OUTBOXD_FAILPOINTS=%s", failpoints);
        envp[envc++] = fpvar;
    }
    for (int i = 0; i < 4 && e->relay_env[i] && envc < 254; i++)
        envp[envc++] = (char *)e->relay_env[i];
    envp[envc] = NULL;

    pid_t pid = spawn(argv, envp, NULL, SIGKILL, log);
    e->relay_pid = pid;
    e->relay_starts++;
}

int h_relay_wait(struct h_env *e, int timeout_ms)
{
    if (e->relay_pid <= 0)
        return -2;
    int rc = wait_exit(e->relay_pid, timeout_ms);
    if (rc == -1) {
        kill(e->relay_pid, SIGKILL);
        wait_exit(e->relay_pid, 5000);
    }
    e->relay_pid = 0;
    return rc;
}

int h_relay_stop(struct h_env *e, int sig, int timeout_ms)
{
    if (e->relay_pid <= 0)
        return -2;
    int64_t t0 = h_now_ms();
    kill(e->relay_pid, sig);
    int rc = h_relay_wait(e, timeout_ms);
    note_long_wait(t0, "relay_stop", NULL);
    return rc;
}

const char *h_relay_log_path(const struct h_env *e, char *buf, size_t len)
{
    snprintf(buf, len, "%s/%s.log", e->dir, e->relay_name[0] ? e->relay_name : "relay");
    return buf;
}

bool h_relay_log_contains(struct h_env *e, const char *needle)
{
    char path[300], line[4096];
    bool found = false;
    h_relay_log_path(e, path, sizeof(path));
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

long h_relay_events(struct h_env *e, const char *event, const char *detail)
{
    char path[300], line[4096], field[96];
    long n = 0;
    snprintf(field, sizeof(field), "\"event\":\"%s\"", event);
    FILE *f = fopen(h_relay_log_path(e, path, sizeof(path)), "r");
    while (f && fgets(line, sizeof(line), f))
        n += strstr(line, field) && (!detail || strstr(line, detail));
    if (f)
        fclose(f);
    return n;
}

void h_wait_event(struct h_env *e, const char *event, const char *detail, long n, int timeout_ms)
{
    int64_t t0 = h_now_ms();
    long seen;
    while ((seen = h_relay_events(e, event, detail)) < n) {
        if (h_now_ms() > t0 + timeout_ms)
            fail_msg("event %s%s%s seen %ld times in %s's log within %d ms, wanted %ld", event,
                     detail ? " with " : "", detail ? detail : "", seen,
                     e->relay_name[0] ? e->relay_name : "relay", timeout_ms, n);
        h_sleep_ms(50);
    }
    note_long_wait(t0, "event", event);
}

/* The lines of PATH that contain NEEDLE (0 when it cannot be read). */
static long count_lines(const char *path, const char *needle)
{
    char line[4096];
    long n = 0;
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof(line), f))
        n += strstr(line, needle) != NULL;
    if (f)
        fclose(f);
    return n;
}

long h_relay_log_count(struct h_env *e, const char *needle)
{
    char path[300];
    return count_lines(h_relay_log_path(e, path, sizeof(path)), needle);
}

long h_kafka_log_count(struct h_env *e, const char *needle)
{
    char path[400];
    long n = 0;
    for (int i = 1; e->real_kafka && i <= (e->kafka.nodes ? e->kafka.nodes : 3); i++) {
        snprintf(path, sizeof(path), "%s/kafka/n%d/kafka.log", e->dir, i);
        n += count_lines(path, needle);
    }
    return n;
}

/* h_relay_disconnects and h_relay_sessions match words, not events: the
 * chaos driver counts them for older binaries too (OBX_RELAY_BINARY). */
long h_relay_disconnects(struct h_env *e)
{
    char path[300], line[4096];
    long n = 0;
    FILE *f = fopen(h_relay_log_path(e, path, sizeof(path)), "r");
    while (f && fgets(line, sizeof(line), f))
        n += (strstr(line, "postgres: connection to ") && strstr(line, " lost")) ||
             strstr(line, "postgres: cannot connect");
    if (f)
        fclose(f);
    return n;
}

long h_relay_sessions(struct h_env *e)
{
    char path[300], line[4096];
    long n = 0;
    FILE *f = fopen(h_relay_log_path(e, path, sizeof(path)), "r");
    while (f && fgets(line, sizeof(line), f))
        n += strstr(line, "postgres: connected to ") != NULL;
    if (f)
        fclose(f);
    return n;
}

long h_relay_log_sum(struct h_env *e, const char *prefix)
{
    char path[300], line[4096];
    long sum = 0;
    h_relay_log_path(e, path, sizeof(path));
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f)) {
        const char *p = strstr(line, prefix);
        if (p)
            sum += strtol(p + strlen(prefix), NULL, 10);
    }
    fclose(f);
    return sum;
}

int h_relay_backend_waiting(PGconn *c, const char *query_prefix)
{
    int64_t deadline = h_now_ms() + 20000;
    while (h_now_ms() < deadline) {
        int64_t pid = h_sql_int(c,
                                "SELECT coalesce(max(pid), 0) FROM pg_stat_activity"
                                " WHERE application_name = 'outboxd' AND wait_event_type = 'Lock'"
                                " AND query LIKE '%s%%'",
                                query_prefix);
        if (pid > 0)
            return (int)pid;
        h_sleep_ms(50);
    }
    fail_msg("the relay never waited on the lock in '%s...'", query_prefix);
    return 0;
}

PGconn *h_connect(struct h_env *e)
{
    PGconn *c = PQconnectdb(e->conninfo);
    if (PQstatus(c) != CONNECTION_OK)
        fail_msg("connect: %s", PQerrorMessage(c));
    return c;
}

static PGresult *vexec(PGconn *c, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));
static PGresult *vexec(PGconn *c, const char *fmt, va_list ap)
{
    char sql[8192];
    vsnprintf(sql, sizeof(sql), fmt, ap);
    PGresult *r = PQexec(c, sql);
    ExecStatusType st = PQresultStatus(r);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
        fail_msg("SQL failed: %s\n  %s", PQresultErrorMessage(r), sql);
    return r;
}

void h_sql(PGconn *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PQclear(vexec(c, fmt, ap));
    va_end(ap);
}

int64_t h_sql_int(PGconn *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PGresult *r = vexec(c, fmt, ap);
    va_end(ap);
    int64_t v = 0;
    if (PQntuples(r) > 0 && !PQgetisnull(r, 0, 0))
        v = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    return v;
}

int64_t h_enqueue(PGconn *c, const char *topic, const char *key, const void *payload,
                  size_t payload_len, const char *headers_json)
{
    const char *values[4] = {topic, key, payload, headers_json ? headers_json : "{}"};
    int lengths[4] = {0, 0, (int)payload_len, 0};
    int formats[4] = {0, 0, 1, 0};
    PGresult *r = PQexecParams(c, "SELECT outbox.enqueue($1, $2, $3::bytea, $4::jsonb)", 4, NULL,
                               values, lengths, formats, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        fail_msg("enqueue failed: %s", PQresultErrorMessage(r));
    int64_t id = strtoll(PQgetvalue(r, 0, 0), NULL, 10);
    PQclear(r);
    return id;
}

bool h_wait_drained(struct h_env *e, int timeout_ms)
{
    PGconn *c = h_connect(e);
    int64_t t0 = h_now_ms();
    int64_t deadline = t0 + timeout_ms;
    bool drained = false;
    while (!drained && h_now_ms() < deadline) {
        drained = h_sql_int(c, "SELECT count(*) FROM outbox.unpublished") == 0; /* any mode */
        if (!drained)
            h_sleep_ms(100);
    }
    PQfinish(c);
    note_long_wait(t0, "drained", NULL);
    return drained;
}

static char *dup_bytes(const void *p, size_t n)
{
    char *d = malloc(n + 1);
    if (!d)
        fail_msg("out of memory");
    if (n)
        memcpy(d, p, n);
    d[n] = '\0';
    return d;
}

static void records_add(struct h_records *out, const rd_kafka_message_t *m)
{
    if (out->n == out->cap) {
        out->cap = out->cap ? out->cap * 2 : 1024;
        out->v = realloc(out->v, out->cap * sizeof(*out->v));
        if (!out->v)
            fail_msg("out of memory");
    }
    struct h_record *r = &out->v[out->n++];
    memset(r, 0, sizeof(*r));
    r->topic = strdup(rd_kafka_topic_name(m->rkt));
    r->partition = m->partition;
    r->offset = m->offset;
    r->key = m->key ? dup_bytes(m->key, m->key_len) : NULL;
    r->key_len = m->key_len;
    r->value = m->payload ? dup_bytes(m->payload, m->len) : NULL;
    r->value_len = m->len;
    r->outbox_id = -1;
    r->timestamp = rd_kafka_message_timestamp(m, NULL);
    rd_kafka_headers_t *hdrs;
    if (rd_kafka_message_headers(m, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR) {
        size_t cnt = rd_kafka_header_cnt(hdrs);
        r->headers = calloc(cnt ? cnt : 1, sizeof(*r->headers));
        const char *name;
        const void *val;
        size_t len;
        for (size_t i = 0; rd_kafka_header_get_all(hdrs, i, &name, &val, &len) == 0; i++) {
            r->headers[i].name = strdup(name);
            r->headers[i].value = val ? dup_bytes(val, len) : NULL;
            r->headers[i].value_len = len;
            r->nheaders++;
            /* The first outbox-id is the relay's (DESIGN 1.2). */
            if (strcmp(name, "outbox-id") == 0 && val && !r->has_id) {
                r->outbox_id = strtoll(r->headers[i].value, NULL, 10);
                r->has_id = true;
            }
        }
    }
}

/* A quiet client of the brokers' own listener, for the harness's looks
 * and changes; `what` names it in a failure. */
static rd_kafka_t *kafka_client(struct h_env *e, const char *what)
{
    char err[512];
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    rd_kafka_conf_set(conf, "bootstrap.servers", e->internal, err, sizeof(err));
    rd_kafka_conf_set(conf, "log_level", "3", err, sizeof(err));
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof(err));
    if (!rk)
        fail_msg("%s: %s", what, err);
    return rk;
}

int h_kafka_empty_partitions(struct h_env *e, const char *topic)
{
    rd_kafka_t *rk = kafka_client(e, "watermark reader");
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_topic_t *rkt = rd_kafka_topic_new(rk, topic, NULL);
    int empty = -1;
    if (rd_kafka_metadata(rk, 0, rkt, &md, 5000) == 0 && md->topic_cnt == 1 &&
        md->topics[0].err == 0) {
        empty = 0;
        for (int p = 0; p < md->topics[0].partition_cnt; p++) {
            int64_t low = 0, high = 0;
            if (rd_kafka_query_watermark_offsets(rk, topic, p, &low, &high, 5000) != 0 || high == 0)
                empty++;
        }
    }
    if (md)
        rd_kafka_metadata_destroy(md);
    rd_kafka_topic_destroy(rkt);
    rd_kafka_destroy(rk);
    if (empty < 0)
        fail_msg("no metadata for topic %s", topic);
    return empty;
}

void h_kafka_delete_records(struct h_env *e, const char *topic, int32_t partition, int64_t before)
{
    char what[512] = "";
    rd_kafka_t *rk = kafka_client(e, "admin client");
    rd_kafka_topic_partition_list_t *offsets = rd_kafka_topic_partition_list_new(1);
    rd_kafka_topic_partition_list_add(offsets, topic, partition)->offset = before;
    rd_kafka_DeleteRecords_t *del = rd_kafka_DeleteRecords_new(offsets);
    rd_kafka_topic_partition_list_destroy(offsets);
    rd_kafka_queue_t *q = rd_kafka_queue_new(rk);
    rd_kafka_DeleteRecords(rk, &del, 1, NULL, q);
    rd_kafka_DeleteRecords_destroy(del);
    rd_kafka_event_t *ev = rd_kafka_queue_poll(q, 30000);
    if (!ev) {
        snprintf(what, sizeof(what), "no answer in 30 s");
    } else if (rd_kafka_event_error(ev)) {
        snprintf(what, sizeof(what), "%s", rd_kafka_event_error_string(ev));
    } else {
        const rd_kafka_topic_partition_list_t *done =
            rd_kafka_DeleteRecords_result_offsets(rd_kafka_event_DeleteRecords_result(ev));
        if (!done || done->cnt != 1)
            snprintf(what, sizeof(what), "no result for the partition");
        else if (done->elems[0].err)
            snprintf(what, sizeof(what), "%s", rd_kafka_err2str(done->elems[0].err));
    }
    if (ev)
        rd_kafka_event_destroy(ev);
    rd_kafka_queue_destroy(q);
    rd_kafka_destroy(rk);
    if (what[0])
        fail_msg("deleting %s [%d] below offset %lld: %s", topic, partition, (long long)before,
                 what);
    e->kafka_trimmed = true;
}

void h_kafka_read_all(struct h_env *e, const char *const *topics, struct h_records *out)
{
    h_kafka_read_all_as(e, topics, true, out);
}

void h_kafka_read_all_as(struct h_env *e, const char *const *topics, bool committed,
                         struct h_records *out)
{
    char err[512];
    int64_t t0 = h_now_ms();
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    rd_kafka_conf_set(conf, "isolation.level", committed ? "read_committed" : "read_uncommitted",
                      err, sizeof(err));
    rd_kafka_conf_set(conf, "bootstrap.servers", e->internal, err, sizeof(err));
    rd_kafka_conf_set(conf, "group.id", "obx-it-reader", err, sizeof(err));
    rd_kafka_conf_set(conf, "enable.partition.eof", "true", err, sizeof(err));
    rd_kafka_conf_set(conf, "enable.auto.commit", "false", err, sizeof(err));
    rd_kafka_conf_set(conf, "fetch.wait.max.ms", "10", err, sizeof(err)); /* the end comes sooner */
    rd_kafka_conf_set(conf, "log_level", "3", err, sizeof(err));
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, err, sizeof(err));
    if (!rk)
        fail_msg("consumer: %s", err);
    rd_kafka_poll_set_consumer(rk);

    rd_kafka_topic_partition_list_t *parts = rd_kafka_topic_partition_list_new(16);
    for (int t = 0; topics[t]; t++) {
        const struct rd_kafka_metadata *md = NULL;
        rd_kafka_topic_t *rkt = rd_kafka_topic_new(rk, topics[t], NULL);
        int64_t deadline = h_now_ms() + 15000;
        for (;;) {
            rd_kafka_resp_err_t me = rd_kafka_metadata(rk, 0, rkt, &md, 5000);
            if (me == 0 && md->topic_cnt == 1 && md->topics[0].err == 0 &&
                md->topics[0].partition_cnt > 0)
                break;
            if (me == 0)
                rd_kafka_metadata_destroy(md);
            md = NULL;
            if (h_now_ms() > deadline)
                fail_msg("no metadata for topic %s", topics[t]);
            h_sleep_ms(100);
        }
        for (int p = 0; p < md->topics[0].partition_cnt; p++) {
            int64_t low = 0, high = 0;
            rd_kafka_resp_err_t we =
                rd_kafka_query_watermark_offsets(rk, topics[t], p, &low, &high, 10000);
            if (we != RD_KAFKA_RESP_ERR_NO_ERROR)
                fail_msg("watermarks of %s [%d]: %s", topics[t], p, rd_kafka_err2str(we));
            /* The mock keeps ~5 MiB per partition and drops older records:
             * a test that overflows it would see "lost" rows. */
            if (low > 0 && !e->kafka_trimmed)
                fail_msg("%s [%d]: the mock broker discarded offsets below %lld (its ~5 MiB per "
                         "partition limit); spread this test's volume",
                         topics[t], p, (long long)low);
            rd_kafka_topic_partition_list_add(parts, topics[t], p)->offset =
                RD_KAFKA_OFFSET_BEGINNING;
        }
        rd_kafka_metadata_destroy(md);
        rd_kafka_topic_destroy(rkt);
    }
    int total = parts->cnt;
    rd_kafka_assign(rk, parts);

    /* Read until every partition has reported its end. */
    char *at_eof = calloc((size_t)total, 1);
    int eofs = 0;
    int64_t deadline = h_now_ms() + 60000;
    while (eofs < total) {
        if (h_now_ms() > deadline)
            fail_msg("reading Kafka timed out (%d of %d partitions at end)", eofs, total);
        rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, 200);
        if (!m)
            continue;
        if (m->err == RD_KAFKA_RESP_ERR__PARTITION_EOF) {
            for (int i = 0; i < total; i++) {
                if (!at_eof[i] && parts->elems[i].partition == m->partition &&
                    strcmp(parts->elems[i].topic, rd_kafka_topic_name(m->rkt)) == 0) {
                    at_eof[i] = 1;
                    eofs++;
                }
            }
        } else if (m->err) {
            fprintf(stderr, "consumer: %s\n", rd_kafka_message_errstr(m));
        } else {
            records_add(out, m);
        }
        rd_kafka_message_destroy(m);
    }
    rd_kafka_topic_partition_list_destroy(parts);
    free(at_eof);
    rd_kafka_consumer_close(rk);
    rd_kafka_destroy(rk);
    note_long_wait(t0, "kafka_read_all", NULL);
}

void h_records_free(struct h_records *r)
{
    for (size_t i = 0; i < r->n; i++) {
        struct h_record *x = &r->v[i];
        free(x->topic);
        free(x->key);
        free(x->value);
        for (size_t j = 0; j < x->nheaders; j++) {
            free(x->headers[j].name);
            free(x->headers[j].value);
        }
        free(x->headers);
    }
    free(r->v);
    memset(r, 0, sizeof(*r));
}

const struct h_header *h_record_header(const struct h_record *r, const char *name)
{
    for (size_t i = 0; i < r->nheaders; i++)
        if (strcmp(r->headers[i].name, name) == 0)
            return &r->headers[i];
    return NULL;
}

static int cmp_record_id(const void *a, const void *b)
{
    const struct h_record *x = *(const struct h_record *const *)a;
    const struct h_record *y = *(const struct h_record *const *)b;
    return x->outbox_id < y->outbox_id ? -1 : x->outbox_id > y->outbox_id;
}

/* "ts":"2026-12-04T13:07:16.698Z" of a JSON log line, in ms; -1 if none. */
static int64_t log_line_ms(const char *line)
{
    const char *ts = strstr(line, "\"ts\":\"");
    struct tm tm = {0};
    int ms = 0;
    if (!ts || sscanf(ts + 6, "%4d-%2d-%2dT%2d:%2d:%2d.%3dZ", &tm.tm_year, &tm.tm_mon, &tm.tm_mday,
                      &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms) != 7)
        return -1;
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    return (int64_t)timegm(&tm) * 1000 + ms;
}

/* Whether the slot list "3,4,5 (" that follows "holds " names slot. */
static bool holds_slot(const char *list, int slot)
{
    while (*list >= '0' && *list <= '9') {
        char *end;
        long n = strtol(list, &end, 10);
        if (n == slot)
            return true;
        list = *end == ',' ? end + 1 : end;
    }
    return false;
}

int64_t h_recovery_high_watermark(struct h_env *e, const char *topic, int32_t partition,
                                  int64_t since_ms, int64_t until_ms, bool last, int slot,
                                  int64_t *at_ms)
{
    static const char took[] = "\"event\":\"slots_taken\"";
    char path[300], line[4096], what[300];
    snprintf(what, sizeof(what), "recovery: reading %s [%d] from offset ", topic, partition);
    FILE *f = fopen(h_relay_log_path(e, path, sizeof(path)), "r");
    int64_t hw = -1;
    bool held = slot < 0; /* the slot in the relay's last list of holdings */
    while (f && (last || hw < 0) && fgets(line, sizeof(line), f)) {
        const char *holds = slot >= 0 && strstr(line, took) ? strstr(line, "; holds ") : NULL;
        if (holds)
            held = holds_slot(holds + strlen("; holds "), slot);
        const char *m = held ? strstr(line, what) : NULL;
        const char *w = m ? strstr(m, "up to the high watermark ") : NULL;
        int64_t at = w ? log_line_ms(line) : -1;
        if (w && at >= since_ms && at <= until_ms) {
            hw = strtoll(w + strlen("up to the high watermark "), NULL, 10);
            if (at_ms)
                *at_ms = at;
        }
    }
    if (f)
        fclose(f);
    return hw;
}

/* Whether copy x of a row came before copy y: in one partition by offset;
 * a keyless row's copy in another partition by its timestamp (the
 * producer's create time here: the relay that made the first copy was
 * killed, so none of its copies was still queued when the pass read). */
static bool copy_before(const struct h_record *x, const struct h_record *y)
{
    if (x->partition == y->partition)
        return x->offset < y->offset;
    if (x->timestamp != y->timestamp)
        return x->timestamp < y->timestamp;
    return x->partition < y->partition;
}

size_t h_explain_duplicates(struct h_env *e, const struct h_records *recs)
{
    size_t explained = 0;
    for (size_t i = 0; i < recs->n; i++) {
        const struct h_record *first = &recs->v[i], *later = NULL;
        bool seen_before = false;
        for (size_t j = 0; j < recs->n; j++) {
            const struct h_record *x = &recs->v[j];
            if (j == i || x->outbox_id != first->outbox_id)
                continue;
            if (strcmp(x->topic, first->topic) != 0 ||
                (first->key && x->partition != first->partition))
                fail_msg("row %lld is in %s [%d] and in %s [%d]", (long long)first->outbox_id,
                         first->topic, first->partition, x->topic, x->partition);
            if (copy_before(x, first))
                seen_before = true;
            else
                later = x;
        }
        if (seen_before || !later)
            continue; /* not a first copy, or no duplicate */
        int64_t hw = h_recovery_high_watermark(e, first->topic, first->partition, first->timestamp,
                                               INT64_MAX, false, -1, NULL);
        if (hw < 0 && !h_relay_log_contains(e, "\"event\":\"recovery_read\""))
            fail_msg("row %lld was published twice (%s [%d] offsets %lld and %lld), and the "
                     "relay log has no recovery_read line at all: run the relays at "
                     "log.level=debug to tell the replication window",
                     (long long)first->outbox_id, first->topic, first->partition,
                     (long long)first->offset, (long long)later->offset);
        if (hw < 0 || hw > first->offset)
            fail_msg(
                "row %lld was published twice (%s [%d] offsets %lld and %lld), and the "
                "recovery pass after the first copy (created at %lld ms) %s",
                (long long)first->outbox_id, first->topic, first->partition,
                (long long)first->offset, (long long)later->offset, (long long)first->timestamp,
                hw < 0 ? "is not in the relay's log" : "could see it: not the replication window");
        explained++;
    }
    return explained;
}

size_t h_check_db_matches_kafka(struct h_env *e, const struct h_records *recs,
                                bool allow_duplicates)
{
    PGconn *c = h_connect(e);
    /* Every committed row (see keep_committed) but the dead-lettered ones. */
    PGresult *r =
        PQexecParams(c,
                     "SELECT id, topic, key, payload FROM obx_test.committed c"
                     " WHERE NOT EXISTS (SELECT FROM outbox.dead_letters d WHERE d.id = c.id)"
                     " ORDER BY id",
                     0, NULL, NULL, NULL, NULL, 1);
    if (PQresultStatus(r) != PGRES_TUPLES_OK)
        fail_msg("reading obx_test.committed: %s", PQresultErrorMessage(r));
    int nrows = PQntuples(r);

    /* Kafka records sorted by outbox id, to walk both in id order. */
    const struct h_record **byid = malloc((recs->n + 1) * sizeof(*byid));
    for (size_t i = 0; i < recs->n; i++) {
        if (!recs->v[i].has_id)
            fail_msg("a record in %s has no outbox-id header", recs->v[i].topic);
        byid[i] = &recs->v[i];
    }
    qsort(byid, recs->n, sizeof(*byid), cmp_record_id);

    size_t k = 0, dups = 0;
    for (int i = 0; i < nrows; i++) {
        const char *idp = PQgetvalue(r, i, 0);
        uint64_t bits = 0; /* big-endian bigint; ids may be below zero */
        for (int b = 0; b < 8; b++)
            bits = (bits << 8) | (unsigned char)idp[b];
        int64_t id = (int64_t)bits;
        while (k < recs->n && byid[k]->outbox_id < id)
            fail_msg("Kafka has a record for id %lld, which is not in outbox.events",
                     (long long)byid[k]->outbox_id);
        if (k >= recs->n || byid[k]->outbox_id != id)
            fail_msg("row %lld was not published (lost)", (long long)id);
        size_t copies = 0;
        for (; k < recs->n && byid[k]->outbox_id == id; k++, copies++) {
            const struct h_record *x = byid[k];
            const char *topic = PQgetvalue(r, i, 1);
            if (strcmp(x->topic, topic) != 0)
                fail_msg("row %lld: topic %s in Kafka, %s in Postgres", (long long)id, x->topic,
                         topic);
            bool key_null = PQgetisnull(r, i, 2);
            if (key_null != (x->key == NULL) ||
                (!key_null && ((size_t)PQgetlength(r, i, 2) != x->key_len ||
                               memcmp(PQgetvalue(r, i, 2), x->key, x->key_len) != 0)))
                fail_msg("row %lld: key differs", (long long)id);
            bool val_null = PQgetisnull(r, i, 3);
            if (val_null != (x->value == NULL) ||
                (!val_null && ((size_t)PQgetlength(r, i, 3) != x->value_len ||
                               memcmp(PQgetvalue(r, i, 3), x->value, x->value_len) != 0)))
                fail_msg("row %lld: payload differs", (long long)id);
        }
        if (copies > 1) {
            if (!allow_duplicates)
                fail_msg("row %lld was published %zu times", (long long)id, copies);
            dups += copies - 1;
        }
    }
    if (k < recs->n)
        fail_msg("Kafka has a record for id %lld, which is not in outbox.events",
                 (long long)byid[k]->outbox_id);

    /* Per-key order: records of one (topic, key) share a partition, and
     * their offsets increase with the id (byid is in id order). */
    for (size_t i = 0; i < recs->n; i++) {
        const struct h_record *a = byid[i];
        if (!a->key || (i > 0 && byid[i - 1]->outbox_id == a->outbox_id))
            continue; /* only the first copy of a duplicate counts for order */
        for (size_t j = i + 1; j < recs->n; j++) {
            const struct h_record *b = byid[j];
            if (!b->key || b->outbox_id == a->outbox_id || b->key_len != a->key_len ||
                memcmp(a->key, b->key, a->key_len) != 0 || strcmp(a->topic, b->topic) != 0)
                continue;
            if (b->partition != a->partition)
                fail_msg("key %s of %s is in partitions %d and %d", a->key, a->topic, a->partition,
                         b->partition);
            if (b->offset < a->offset)
                fail_msg("key %s: id %lld (offset %lld) comes after id %lld (offset %lld)", a->key,
                         (long long)b->outbox_id, (long long)b->offset, (long long)a->outbox_id,
                         (long long)a->offset);
            break; /* the next of this key is checked from there */
        }
    }
    free(byid);
    PQclear(r);
    PQfinish(c);
    return dups;
}

int h_run_suite(const char *group, const struct CMUnitTest *tests, size_t n, int argc, char **argv)
{
    if (argc > 1) {
        bool known = false;
        for (size_t i = 0; i < n && !known; i++)
            known = strcmp(tests[i].name, argv[1]) == 0;
        if (!known) {
            fprintf(stderr, "%s: no test named %s in this suite\n", argv[0], argv[1]);
            return 1;
        }
        cmocka_set_test_filter(argv[1]);
    }
    return _cmocka_run_group_tests(group, tests, n, NULL, NULL);
}

int h_run_outboxd(char *const argv[], char *const envp[], char *out, size_t outlen)
{
    int p[2];
    if (pipe(p) != 0)
        fail_msg("pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid == 0) {
        int devnull = open("/dev/null", O_RDONLY); /* stdin is no terminal */
        dup2(devnull, 0);
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        execve(OBX_BINARY_DIR "/outboxd", argv, envp);
        _exit(127);
    }
    close(p[1]);
    size_t used = 0;
    ssize_t r;
    while (used + 1 < outlen && (r = read(p[0], out + used, outlen - 1 - used)) > 0)
        used += (size_t)r;
    out[used] = '\0';
    close(p[0]);
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
