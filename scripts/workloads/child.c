/* The smallest dynamically linked program: exits at once (exec storm target). */
int main(void) { return 0; }
