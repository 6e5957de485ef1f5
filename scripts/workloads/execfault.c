/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The failing-exec flood (tests/integration/test_pin_flood.py): execve(path, (char **)1, NULL)
 * over the paths listed in LIST (one a line, at most 8192), round after round, for SECONDS
 * seconds.  Each call fails with EFAULT (argv unreadable) only after the kernel opened the
 * file for exec, so each costs a FAN_OPEN_EXEC event; no process is made.
 * Prints "CALLS EFAULTS" at the end.
 *
 *   execfault LIST SECONDS
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PATHS_MAX 8192

int main(int argc, char **argv)
{
	static char *paths[PATHS_MAX];
	char line[4096];
	struct timespec t0, t;
	long calls = 0, efault = 0;
	double secs;
	int n = 0;
	FILE *f;

	if (argc != 3 || (f = fopen(argv[1], "r")) == NULL) {
		fprintf(stderr, "usage: execfault LIST SECONDS\n");
		return 2;
	}
	while (n < PATHS_MAX && fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = 0;
		if ((paths[n] = strdup(line)) != NULL)
			n++;
	}
	fclose(f);
	secs = atof(argv[2]);

	clock_gettime(CLOCK_MONOTONIC, &t0);
	do {
		for (int i = 0; i < n; i++) {
			syscall(SYS_execve, paths[i], (char **)1, NULL);	/* libc's prototype would warn */
			calls++;
			efault += errno == EFAULT;
		}
		clock_gettime(CLOCK_MONOTONIC, &t);
	} while ((t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) / 1e9 < secs);
	printf("%ld %ld\n", calls, efault);
	return 0;
}
