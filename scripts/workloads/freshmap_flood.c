/*
 * freshmap_flood SECONDS TEMPLATE BID_OFFSET BID_LEN DEPTH: build a directory DEPTH levels deep
 * (each name 250 bytes) under the current directory, then for SECONDS write TEMPLATE (an ELF file)
 * there with fresh random bytes at BID_OFFSET (its GNU build-id's BID_LEN bytes), map it
 * PROT_READ|PROT_EXEC, unmap it and unlink it, as fast as it can: every mapping is a file the
 * recorder never met, with a build-id of its own and a path of about 251 * DEPTH bytes.
 * Prints the number of files mapped on stdout.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	static char buf[1 << 20];
	char name[251];
	long mapped = 0, off, blen;
	int fd, depth;
	ssize_t len;
	double end;

	if (argc != 6) {
		fprintf(stderr, "usage: freshmap_flood SECONDS TEMPLATE BID_OFFSET BID_LEN DEPTH\n");
		return 2;
	}
	fd = open(argv[2], O_RDONLY);
	if (fd < 0 || (len = read(fd, buf, sizeof(buf))) <= 0) {
		perror(argv[2]);
		return 1;
	}
	close(fd);
	off = atol(argv[3]);
	blen = atol(argv[4]);
	depth = atoi(argv[5]);
	if (off < 0 || blen <= 0 || off + blen > len) {
		fprintf(stderr, "build-id out of the file\n");
		return 2;
	}
	memset(name, 'd', 250);
	name[250] = 0;
	for (int i = 0; i < depth; i++) {
		if ((mkdir(name, 0755) && access(name, X_OK)) || chdir(name)) {
			perror("mkdir/chdir");
			return 1;
		}
	}
	srandom(getpid() ^ time(NULL));
	end = now() + atof(argv[1]);
	while (now() < end) {
		for (long i = 0; i < blen; i++)
			buf[off + i] = random() & 0xff;
		fd = open("f.so", O_RDWR | O_CREAT | O_TRUNC, 0755);
		if (fd < 0 || write(fd, buf, len) != len) {
			perror("f.so");
			return 1;
		}
		void *p = mmap(NULL, len, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
		if (p == MAP_FAILED) {
			perror("mmap");
			return 1;
		}
		munmap(p, len);
		close(fd);
		unlink("f.so");
		mapped++;
	}
	printf("%ld\n", mapped);
	return 0;
}
