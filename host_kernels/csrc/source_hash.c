/* The SHA-256 of the sources this library was built from (setup.py defines it): host_kernels/native.py refuses a
 * library built from other sources — a stale build would be called with another signature. */
const char *native_source_hash(void) { return NATIVE_SOURCE_HASH; }
