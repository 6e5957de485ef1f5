/*
 * fresh_flood TEMPLATE OFFSET DIR SECONDS [FILES]: for SECONDS (or, given FILES,
 * until it mapped FILES files: SECONDS then bounds a hang), write a fresh copy of
 * the ELF file TEMPLATE into DIR under a new name, with a build-id of its own
 * (the 8 bytes at OFFSET, inside its GNU build-id note's descriptor, replaced
 * by a counter and the pid), map it PROT_READ|PROT_EXEC, unmap it and unlink
 * it: every mapping is a fresh identity, a fresh build-id and a fresh path.
 * Prints the files mapped and the rate (files/s) on stdout.
 */
#include <fcntl.h>
#include <stdint.h>
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
	if (argc < 5) { fprintf(stderr, "usage: fresh_flood TEMPLATE OFFSET DIR SECONDS [FILES]\n"); return 2; }
	int tfd = open(argv[1], O_RDONLY);
	struct stat st;
	if (tfd < 0 || fstat(tfd, &st) < 0) { perror(argv[1]); return 1; }
	size_t size = st.st_size, off = strtoul(argv[2], NULL, 0);
	char *img = malloc(size);
	if (img == NULL || read(tfd, img, size) != (ssize_t)size || off + 8 > size) {
		fprintf(stderr, "%s: cannot read, or offset past its end\n", argv[1]);
		return 1;
	}
	close(tfd);
	if (chdir(argv[3]) < 0) { perror(argv[3]); return 1; }
	double seconds = atof(argv[4]), t0 = now();
	uint32_t pid = (uint32_t)getpid();
	long n = 0;
	char name[32];
	long files = argc > 5 ? atol(argv[5]) : 0;
	while (files > 0 ? n < files && now() - t0 < seconds : (n & 63) != 0 || now() - t0 < seconds) {
		uint64_t tag = ((uint64_t)pid << 40) ^ (uint64_t)n;
		memcpy(img + off, &tag, 8);
		snprintf(name, sizeof(name), "f%ld", n);
		int fd = open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0755);
		if (fd < 0) { perror(name); return 1; }
		if (write(fd, img, size) != (ssize_t)size) { perror("write"); return 1; }
		void *p = mmap(NULL, size, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
		if (p == MAP_FAILED) { perror("mmap"); return 1; }
		munmap(p, size);
		close(fd);
		unlink(name);
		n++;
	}
	double dt = now() - t0;
	printf("%ld %.0f\n", n, n / (dt > 0 ? dt : 1e-9));
	return 0;
}
