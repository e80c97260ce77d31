"""The memory model: what one capture allocates (programs, workloads, fitted traces) and
what a pool and the device hold (the allocator simulator and its two cores, the device items)."""
