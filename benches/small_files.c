/*
 * small_files.c - small-file metadata rates of a directory, for
 * benches/regionfs.sh (compiled there at run time with cc).
 *
 *   small_files DIR N SIZE PHASE[,PHASE...]
 *
 * One process, one file at a time, phases run in the order given:
 *
 *   create  open(O_CREAT|O_EXCL|O_WRONLY) + write SIZE bytes + close, for
 *           DIR/f0 .. DIR/f{N-1}; each file gets its own byte pattern
 *   read    open(O_RDONLY) + read + close of the same files; checks the
 *           size and every byte against the pattern
 *   unlink  unlink of the same files
 *
 * Prints one line of key=value pairs, files per second of each phase:
 *
 *   files=N size=SIZE create_per_s=.. read_per_s=.. unlink_per_s=..
 *
 * (only the phases run). Exits 1 on any error or content mismatch, after
 * saying which file and call failed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *call, const char *path)
{
	fprintf(stderr, "small_files: %s %s: %s\n", call, path, strerror(errno));
	exit(1);
}

static void fill(unsigned char *buf, long size, long i)
{
	unsigned x = 2654435761u * (unsigned)(i + 1);
	for (long j = 0; j < size; j++) {
		x = x * 1103515245u + 12345u;
		buf[j] = (unsigned char)(x >> 16);
	}
}

int main(int argc, char **argv)
{
	if (argc != 5 || atol(argv[2]) <= 0 || atol(argv[3]) < 0) {
		fprintf(stderr, "usage: small_files DIR N SIZE create|read|unlink[,...]\n");
		return 2;
	}
	const char *dir = argv[1];
	long n = atol(argv[2]), size = atol(argv[3]);
	unsigned char *want = malloc(size + 1), *got = malloc(size + 2);
	char path[4096];
	if (!want || !got) {
		fprintf(stderr, "small_files: out of memory\n");
		return 1;
	}
	printf("files=%ld size=%ld", n, size);
	char *phases = strdup(argv[4]), *save = NULL;
	for (char *ph = strtok_r(phases, ",", &save); ph; ph = strtok_r(NULL, ",", &save)) {
		int op = !strcmp(ph, "create") ? 0 : !strcmp(ph, "read") ? 1 : !strcmp(ph, "unlink") ? 2 : -1;
		if (op < 0) {
			fprintf(stderr, "small_files: unknown phase %s\n", ph);
			return 2;
		}
		double t0 = now();
		for (long i = 0; i < n; i++) {
			snprintf(path, sizeof path, "%s/f%ld", dir, i);
			if (op == 0) {
				fill(want, size, i);
				int fd = open(path, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
				if (fd < 0)
					die("open(O_CREAT)", path);
				if (size && write(fd, want, size) != size)
					die("write", path);
				if (close(fd) != 0)
					die("close", path);
			} else if (op == 1) {
				int fd = open(path, O_RDONLY | O_CLOEXEC);
				if (fd < 0)
					die("open", path);
				/* Ask for one byte more than the size: a short count proves the size. */
				ssize_t r = read(fd, got, size + 1);
				if (r < 0)
					die("read", path);
				if (close(fd) != 0)
					die("close", path);
				fill(want, size, i);
				if (r != size || memcmp(want, got, size) != 0) {
					fprintf(stderr, "small_files: %s: read %zd bytes, %s\n", path, r,
						r == size ? "content differs from what was written" : "wrong size");
					return 1;
				}
			} else {
				if (unlink(path) != 0)
					die("unlink", path);
			}
		}
		double dt = now() - t0;
		printf(" %s_per_s=%.0f", ph, dt > 0 ? n / dt : 0);
	}
	printf("\n");
	return 0;
}
