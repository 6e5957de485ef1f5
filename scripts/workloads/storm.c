/* storm N PROG [ARGS...]: fork+exec PROG N times, at most 4 alive at once. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc < 3) { fprintf(stderr, "usage: storm N PROG [ARGS]\n"); return 2; }
	long n = atol(argv[1]), alive = 0, failed = 0;
	for (long i = 0; i < n; i++) {
		if (alive >= 4) { int st; wait(&st); alive--; if (!WIFEXITED(st) || WEXITSTATUS(st)) failed++; }
		pid_t p = fork();
		if (p < 0) { perror("fork"); return 1; }
		if (p == 0) { execv(argv[2], argv + 2); _exit(127); }
		alive++;
	}
	while (alive-- > 0) { int st; wait(&st); if (!WIFEXITED(st) || WEXITSTATUS(st)) failed++; }
	return failed ? 1 : 0;
}
