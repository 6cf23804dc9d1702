"""The CUDA backend: `tgt` kernels → PTX (llvmlite NVPTX) and cubins (ptxas), launch plans, a CPU emulator."""
