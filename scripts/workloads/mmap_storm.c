/*
 * mmap_storm FILE COUNT [RATE]: map FILE PROT_READ|PROT_EXEC and unmap it COUNT
 * times; with RATE (maps/s) paced to that rate.  With MPROTECT=1 in the
 * environment each round maps PROT_READ and then mprotects to add PROT_EXEC.
 * Prints the achieved rate (maps/s) on stdout.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
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
	if (argc < 3) { fprintf(stderr, "usage: mmap_storm FILE COUNT [RATE]\n"); return 2; }
	int fd = open(argv[1], O_RDONLY);
	if (fd < 0) { perror(argv[1]); return 1; }
	long count = atol(argv[2]);
	double rate = argc > 3 ? atof(argv[3]) : 0;
	int use_mprotect = getenv("MPROTECT") && atoi(getenv("MPROTECT"));
	size_t len = 4096;
	double t0 = now();
	for (long i = 0; i < count; i++) {
		void *p = mmap(NULL, len, use_mprotect ? PROT_READ : PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
		if (p == MAP_FAILED) { perror("mmap"); return 1; }
		if (use_mprotect && mprotect(p, len, PROT_READ | PROT_EXEC)) { perror("mprotect"); return 1; }
		munmap(p, len);
		if (rate > 0 && (i & 63) == 63) {
			double ahead = (i + 1) / rate - (now() - t0);
			if (ahead > 0) usleep((useconds_t)(ahead * 1e6));
		}
	}
	double dt = now() - t0;
	printf("%.0f\n", count / (dt > 0 ? dt : 1e-9));
	return 0;
}
