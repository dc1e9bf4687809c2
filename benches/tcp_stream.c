/*
 * tcp_stream: the ceiling of a cold remote read on this machine. One process
 * streams SIZE bytes of a memfd (the way a daemon holds region memory) over
 * loopback TCP in 1 MiB writes; the other receives them into a 1 MiB
 * buffer, as a client would. Prints the receive rate in bytes per second.
 *
 *   tcp_stream SIZE_MIB
 *
 * No FUSE, no page cache, no protocol: what is left when every cost of
 * regions is taken away, measured in the same run as tmpfs.
 *
 *   tcp_stream --rtt ROUNDS
 *
 * The floor of one remote 4 KiB read: a 16-byte request answered with 4 KiB
 * of a memfd over loopback TCP (TCP_NODELAY), ROUNDS times; prints the
 * median round trip in microseconds.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define IO (1L << 20)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what) {
    fprintf(stderr, "tcp_stream: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* SIZE bytes of a memfd, mapped and touched (the way a daemon holds region memory). */
static char *memory(long size) {
    int fd = memfd_create("tcp_stream", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, size) != 0) die("memfd");
    char *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) die("mmap");
    for (long i = 0; i < size; i += 4096) mem[i] = (char)i;
    return mem;
}

/* A listening socket on a free loopback port; its address in *a. */
static int listen_loopback(struct sockaddr_in *a) {
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    *a = (struct sockaddr_in){.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof *a;
    if (ls < 0 || bind(ls, (void *)a, sizeof *a) || listen(ls, 1) ||
        getsockname(ls, (void *)a, &len))
        die("listen");
    return ls;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Reads exactly len bytes (0) or fails (-1). */
static int read_full(int fd, char *p, size_t len) {
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int write_full(int fd, const char *p, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int rtt(long rounds) {
    long size = 64L << 20;
    char *mem = memory(size);
    struct sockaddr_in a;
    int ls = listen_loopback(&a);
    int one = 1;
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        int c = accept(ls, NULL, NULL);
        if (c < 0) die("accept");
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        long req[2];
        while (read_full(c, (char *)req, sizeof req) == 0) {
            long off = req[0] % (size - 4096);
            if (write_full(c, mem + (off & ~4095L), 4096) != 0) die("reply");
        }
        _exit(0);
    }
    int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c < 0 || connect(c, (void *)&a, sizeof a)) die("connect");
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    double *us = malloc(sizeof(double) * rounds);
    char buf[4096];
    if (!us) die("malloc");
    unsigned long x = 88172645463325252UL;
    for (long i = 0; i < rounds; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        long req[2] = {(long)(x >> 1), 0};
        double t0 = now();
        if (write_full(c, (char *)req, sizeof req) != 0 || read_full(c, buf, sizeof buf) != 0)
            die("round trip");
        us[i] = (now() - t0) * 1e6;
    }
    close(c);
    int status;
    waitpid(child, &status, 0);
    qsort(us, rounds, sizeof(double), cmp_double);
    printf("%.2f\n", us[rounds / 2]);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--rtt") == 0 && atol(argv[2]) > 0)
        return rtt(atol(argv[2]));
    if (argc != 2 || atol(argv[1]) <= 0) {
        fprintf(stderr, "usage: tcp_stream SIZE_MIB | tcp_stream --rtt ROUNDS\n");
        return 2;
    }
    long size = atol(argv[1]) * IO;
    char *mem = memory(size);
    struct sockaddr_in a;
    int ls = listen_loopback(&a);
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        int c = accept(ls, NULL, NULL);
        if (c < 0) die("accept");
        for (long off = 0; off < size;) {
            ssize_t n = write(c, mem + off, (size - off) < IO ? (size - off) : IO);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) die("write");
            off += n;
        }
        _exit(0);
    }
    int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (c < 0 || connect(c, (void *)&a, sizeof a)) die("connect");
    char *buf = malloc(IO);
    if (!buf) die("malloc");
    memset(buf, 0, IO);
    double t0 = now();
    long got = 0;
    while (got < size) {
        ssize_t n = recv(c, buf, IO, MSG_WAITALL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) die("recv");
        got += n;
    }
    double t = now() - t0;
    int status;
    waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "tcp_stream: sender failed\n");
        return 1;
    }
    printf("%.0f\n", got / t);
    return 0;
}
