/*
 * failexec_flood SECONDS PATH...: call execve(PATH, (char **)1, NULL) on each PATH in turn, for
 * SECONDS, from this one process (no fork).  Each call fails with EFAULT, but only after the kernel
 * opened the file for exec (a fanotify FAN_OPEN_EXEC event: what an exec pin costs), so one
 * unprivileged process makes tens of thousands of exec opens a second without running anything.
 * Prints the number of calls made on stdout.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
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
	char **volatile bad_argv = (char **)1;	/* an address no process maps: EFAULT */
	double end;
	long calls = 0, other = 0;

	if (argc < 3) {
		fprintf(stderr, "usage: failexec_flood SECONDS PATH...\n");
		return 2;
	}
	end = now() + atof(argv[1]);
	while (now() < end) {
		for (int i = 2; i < argc; i++) {
			execve(argv[i], bad_argv, NULL);
			calls++;
			if (errno != EFAULT)
				other++;
		}
	}
	printf("%ld %ld\n", calls, other);
	return 0;
}
