/*
 * pagetouch: what touching memory costs after the thread slept (the machine's, not buildidd's).
 *
 * pagetouch [MAX_MS]: 8 MiB are written once; then, for each sleep length up to MAX_MS
 * (default 1000), the thread sleeps and
 * reads one byte of every page, 5 times; printed: "<sleep ms> <ns of thread
 * CPU per page>" per line.  On bare metal every line is some tens of ns.  On
 * a VM whose host takes back idle guest memory the cost grows with the sleep
 * (docs/benchmarks.md, "Memory after a sleep", has this machine's figures), so
 * any daemon that sleeps between steps pays per page it touches, in proportion
 * to how long it slept (the storm scenarios of scripts/bench print this line).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PAGES 2048
#define REPS 5

static double cpu_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
	return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv)
{
	static const int sleep_ms[] = {0, 1, 10, 50, 200, 1000};
	int max_ms = argc > 1 ? atoi(argv[1]) : 1000;
	char *b = malloc((size_t)PAGES * 4096);

	if (!b)
		return 1;
	memset(b, 1, (size_t)PAGES * 4096);
	for (unsigned k = 0; k < sizeof(sleep_ms) / sizeof(sleep_ms[0]) && sleep_ms[k] <= max_ms; k++) {
		double total = 0;

		for (int r = 0; r < REPS; r++) {
			volatile long sum = 0;
			double t;

			if (sleep_ms[k])
				usleep(sleep_ms[k] * 1000);
			t = cpu_ns();
			for (size_t p = 0; p < PAGES; p++)
				sum += b[p * 4096 + (r * 64) % 4096];
			total += cpu_ns() - t;
		}
		printf("%d %.0f\n", sleep_ms[k], total / REPS / PAGES);
	}
	return 0;
}
