#include "weft/core/memory.h"

#include <climits>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace weft {

void retain_freed_memory() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_MAX, 0);              // large blocks from the heap, not one mapping each
  mallopt(M_TRIM_THRESHOLD, INT_MAX);  // and freed memory kept for the next step
#endif
}

}  // namespace weft
