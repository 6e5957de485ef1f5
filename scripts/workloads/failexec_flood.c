/*
 * failexec_flood MAX_SECONDS MIN_CALLS PATH...: call execve(PATH, (char **)1, NULL) on each PATH in
 * turn, from this one process (no fork), until it made MIN_CALLS calls and was sent SIGTERM (or
 * MAX_SECONDS passed: a bound on a hang).  Each call fails with EFAULT, but only after the kernel
 * opened the file for exec (a fanotify FAN_OPEN_EXEC event: what an exec pin costs), so one
 * unprivileged process makes tens of thousands of exec opens a second without running anything.
 * Prints "ready" on stdout once it made MIN_CALLS / 4 calls (the flood is at full rate), then at
 * the end the number of calls made and of those that failed other than with EFAULT.
 */
#include <errno.h>
#include <signal.h>
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

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
	(void)sig;
	stop = 1;
}

int main(int argc, char **argv)
{
	char **volatile bad_argv = (char **)1;	/* an address no process maps: EFAULT */
	double end;
	long calls = 0, other = 0, min_calls;
	int ready = 0;

	if (argc < 4) {
		fprintf(stderr, "usage: failexec_flood MAX_SECONDS MIN_CALLS PATH...\n");
		return 2;
	}
	signal(SIGTERM, on_term);
	end = now() + atof(argv[1]);
	min_calls = atol(argv[2]);
	while ((!stop || calls < min_calls) && now() < end) {
		for (int i = 3; i < argc; i++) {
			execve(argv[i], bad_argv, NULL);
			calls++;
			if (errno != EFAULT)
				other++;
		}
		if (!ready && calls >= min_calls / 4) {
			ready = 1;
			printf("ready\n");
			fflush(stdout);
		}
	}
	printf("%ld %ld\n", calls, other);
	return 0;
}
