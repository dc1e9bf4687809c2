/*
 * list_build - builds a linked list and a hash table with rmalloc in a new
 * FIXVADDR region, and records them with rsetroot (Remote Regions paper, Fig. 14).
 * list_traverse walks them on another host by plain pointer chasing.
 *
 *   list_build REGION_PATH [N]        (N defaults to 100000)
 *
 * REGION_PATH is a new file under a regions mount; the calling thread's
 * default attributes (rsetdefaultattr) make it FIXVADDR and persistent, so it
 * outlives this program. Prints "checksum <hex>" and the region's address.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <regions.h>

#include "list.h"

static void die(const char *what)
{
	fprintf(stderr, "list_build: %s: %s\n", what, strerror(errno));
	exit(1);
}

int main(int argc, char **argv)
{
	if (argc < 2 || argc > 3) {
		fprintf(stderr, "usage: %s REGION_PATH [N]\n", argv[0]);
		return 2;
	}
	uint64_t n = argc == 3 ? strtoull(argv[2], NULL, 10) : 100000;

	/* Regions this thread creates from now on: fixed address, persistent. */
	if (rsetdefaultattr(RATTR_FIXVADDR, "1", 1) != 0)
		die("rsetdefaultattr(RATTR_FIXVADDR)");
	if (rsetdefaultattr(RATTR_PERSISTENT, "1", 1) != 0)
		die("rsetdefaultattr(RATTR_PERSISTENT)");
	int fd = open(argv[1], O_RDWR | O_CREAT | O_EXCL, 0644);
	if (fd < 0)
		die(argv[1]);
	char fix[8] = {0};
	if (fgetxattr(fd, "user.regions.fixvaddr", fix, sizeof fix - 1) < 0)
		die("fgetxattr(user.regions.fixvaddr)");
	if (fix[0] != '1') {
		fprintf(stderr, "list_build: %s is not FIXVADDR\n", argv[1]);
		return 1;
	}

	struct root *root = rmalloc(fd, sizeof *root);
	if (!root)
		die("rmalloc(root)");
	root->magic = LIST_MAGIC;
	root->n = n;
	root->nbuckets = 1;
	while (root->nbuckets < n / 2 + 1)
		root->nbuckets <<= 1;
	root->buckets = rmalloc(fd, root->nbuckets * sizeof(struct entry *));
	if (!root->buckets)
		die("rmalloc(buckets)");
	memset(root->buckets, 0, root->nbuckets * sizeof(struct entry *));

	/* The list, in order 0..n-1. */
	struct node **tail = &root->head;
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++) {
		struct node *node = rmalloc(fd, sizeof *node);
		if (!node)
			die("rmalloc(node)");
		node->value = value_of(i);
		node->next = NULL;
		*tail = node;
		tail = &node->next;
		sum = checksum_step(sum, node->value);
	}
	/* The hash table: key i -> value_of(i) ^ 1. */
	for (uint64_t i = 0; i < n; i++) {
		struct entry *e = rmalloc(fd, sizeof *e);
		if (!e)
			die("rmalloc(entry)");
		e->key = i;
		e->value = value_of(i) ^ 1;
		uint64_t b = bucket_of(i, root->nbuckets);
		e->next = root->buckets[b];
		root->buckets[b] = e;
	}
	for (uint64_t i = 0; i < n; i++)
		sum = checksum_step(sum, value_of(i) ^ 1);
	root->checksum = sum;
	if (rsetroot(fd, root) != 0)
		die("rsetroot");

	/* Make every byte visible to other hosts before exiting. */
	void *base = rmap(fd);
	struct stat st;
	if (!base || fstat(fd, &st) != 0)
		die("rmap/fstat");
	if (rmsync(base, st.st_size, MS_SYNC) != 0)
		die("rmsync");
	printf("built %llu nodes and %llu entries at %p (region %p, %lld bytes)\n",
	       (unsigned long long)n, (unsigned long long)n, (void *)root, base,
	       (long long)st.st_size);
	printf("checksum %016llx\n", (unsigned long long)sum);
	close(fd);
	return 0;
}
