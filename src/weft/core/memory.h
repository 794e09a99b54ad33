// Process memory policy for training: a step frees and reallocates the same large buffers
// (activations, gradients, logits) every iteration. glibc serves blocks above its mmap threshold
// with fresh mappings and unmaps them on free, so each step page-faults and zero-fills them all
// again (about a tenth of a CPU step, measured). retain_freed_memory() makes malloc keep freed
// memory for reuse instead — the CPU analogue of a caching allocator; resident memory then stays
// at the step's peak rather than falling between steps.
#pragma once

namespace weft {

// Call once at startup, before large allocations. No-op outside glibc.
void retain_freed_memory();

}  // namespace weft
