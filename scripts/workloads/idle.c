/* idle: a process that has mapped its libraries and waits until killed. */
#include <unistd.h>
int main(void) { for (;;) pause(); }
