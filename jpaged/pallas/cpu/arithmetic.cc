// The bfloat16 instructions the products multiply with on this CPU, for the engine's choice of dtype: built before
// the kernels (in a second), it is also the probe that the machine's compiler builds them at all (library.py).
#include "panels.h"

extern "C" const char* JpagedBfloat16Arithmetic() { return Bfloat16Arithmetic(); }
