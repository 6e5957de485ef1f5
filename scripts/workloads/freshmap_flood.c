/*
 * freshmap_flood MAX_SECONDS MIN_FILES TEMPLATE BID_OFFSET BID_LEN DEPTH: build a directory DEPTH
 * levels deep (each name 250 bytes) under the current directory, then, until it mapped MIN_FILES files
 * and was sent SIGTERM (or MAX_SECONDS passed: a bound on a hang), write TEMPLATE (an ELF file)
 * there with fresh random bytes at BID_OFFSET (its GNU build-id's BID_LEN bytes), map it
 * PROT_READ|PROT_EXEC, unmap it and unlink it, as fast as it can: every mapping is a file the
 * recorder never met, with a build-id of its own and a path of about 251 * DEPTH bytes.
 * Prints "ready" on stdout once it mapped MIN_FILES / 4 files (the flood is at full rate), then at
 * the end the number of files mapped.
 */
#include <fcntl.h>
#include <signal.h>
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

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
	(void)sig;
	stop = 1;
}

int main(int argc, char **argv)
{
	static char buf[1 << 20];
	char name[251];
	long mapped = 0, off, blen, min_files;
	int fd, depth, ready = 0;
	ssize_t len;
	double end;

	if (argc != 7) {
		fprintf(stderr, "usage: freshmap_flood MAX_SECONDS MIN_FILES TEMPLATE BID_OFFSET BID_LEN DEPTH\n");
		return 2;
	}
	fd = open(argv[3], O_RDONLY);
	if (fd < 0 || (len = read(fd, buf, sizeof(buf))) <= 0) {
		perror(argv[3]);
		return 1;
	}
	close(fd);
	off = atol(argv[4]);
	blen = atol(argv[5]);
	depth = atoi(argv[6]);
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
	signal(SIGTERM, on_term);
	end = now() + atof(argv[1]);
	min_files = atol(argv[2]);
	while ((!stop || mapped < min_files) && now() < end) {
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
		if (!ready && mapped >= min_files / 4) {
			ready = 1;
			printf("ready\n");
			fflush(stdout);
		}
	}
	printf("%ld\n", mapped);
	return 0;
}
