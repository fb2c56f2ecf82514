"""The CPU C kernels (csrc/) and their ctypes bindings, compiled on first use."""
