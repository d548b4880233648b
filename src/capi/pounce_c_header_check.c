/* Compiled as C99 by the test build: include/pounce/pounce_c.h must stay a C header. */
#include "pounce/pounce_c.h"

int pounce_c_header_check(void) { return POUNCE_C_ABI_VERSION + POUNCE_OK; }
