"""The C++ CPU kernels (attention and the model's matrix products), called through XLA's FFI and built on first
use with the machine's compiler (library.py)."""
