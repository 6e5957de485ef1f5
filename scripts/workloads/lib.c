/* A distinct shared library per -DLIB_ID=N. */
int lib_fn(void) { return LIB_ID; }
