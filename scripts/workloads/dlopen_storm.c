/* dlopen_storm ROUNDS LIB...: dlopen, call, dlclose every LIB, ROUNDS times. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv)
{
	if (argc < 3) { fprintf(stderr, "usage: dlopen_storm ROUNDS LIB...\n"); return 2; }
	long rounds = atol(argv[1]);
	for (long r = 0; r < rounds; r++)
		for (int i = 2; i < argc; i++) {
			void *h = dlopen(argv[i], RTLD_NOW | RTLD_LOCAL);
			if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
			int (*f)(void) = (int (*)(void))dlsym(h, "lib_fn");
			if (!f || f() < 0) return 1;
			dlclose(h);
		}
	return 0;
}
