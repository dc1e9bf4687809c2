/*
 * thread_attr - rsetdefaultattr is per thread (tests/tests/c_abi.rs).
 *
 *   thread_attr DIR
 * Thread A sets RATTR_PERSISTENT "0" and creates DIR/a; thread B, alive at
 * the same time, creates DIR/b without setting anything; then A clears its
 * default and creates DIR/c. Prints "a=<persistent> b=<persistent>
 * c=<persistent>".
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <regions.h>

static const char *dir;
static pthread_barrier_t step;
static char got[3][8];

static void create(const char *name, char *out)
{
	char path[4096];
	snprintf(path, sizeof path, "%s/%s", dir, name);
	int fd = open(path, O_RDWR | O_CREAT | O_EXCL, 0644);
	if (fd < 0) {
		fprintf(stderr, "thread_attr: create %s: %s\n", path, strerror(errno));
		exit(1);
	}
	ssize_t n = fgetxattr(fd, "user.regions.persistent", out, 7);
	if (n < 0) {
		fprintf(stderr, "thread_attr: fgetxattr %s: %s\n", path, strerror(errno));
		exit(1);
	}
	out[n] = 0;
	close(fd);
}

static void *thread_a(void *arg)
{
	(void)arg;
	if (rsetdefaultattr(RATTR_PERSISTENT, "0", 1) != 0) {
		fprintf(stderr, "thread_attr: rsetdefaultattr: %s\n", strerror(errno));
		exit(1);
	}
	create("a", got[0]);
	pthread_barrier_wait(&step); /* B creates b now */
	pthread_barrier_wait(&step);
	if (rsetdefaultattr(RATTR_PERSISTENT, NULL, 0) != 0) {
		fprintf(stderr, "thread_attr: clearing: %s\n", strerror(errno));
		exit(1);
	}
	create("c", got[2]);
	return NULL;
}

static void *thread_b(void *arg)
{
	(void)arg;
	pthread_barrier_wait(&step);
	create("b", got[1]);
	pthread_barrier_wait(&step);
	return NULL;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s DIR\n", argv[0]);
		return 2;
	}
	dir = argv[1];
	pthread_barrier_init(&step, NULL, 2);
	pthread_t a, b;
	pthread_create(&a, NULL, thread_a, NULL);
	pthread_create(&b, NULL, thread_b, NULL);
	pthread_join(a, NULL);
	pthread_join(b, NULL);
	printf("a=%s b=%s c=%s\n", got[0], got[1], got[2]);
	return 0;
}
