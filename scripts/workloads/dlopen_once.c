/* dlopen_once PATH MS: dlopen PATH, live MS milliseconds, exit (the upgrade race's short-lived user). */
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc < 3 || !dlopen(argv[1], RTLD_NOW))
		return 1;
	usleep(atoi(argv[2]) * 1000);
	return 0;
}
