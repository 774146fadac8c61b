"""The jitted model's direct calls into native code on XLA:CPU (XLA FFI custom calls), one module per handler."""
