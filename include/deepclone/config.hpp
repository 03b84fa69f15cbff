#pragma once
/// \file config.hpp
/// The one place where deepclone adapts to the compiler. `DEEPCLONE_HOST_DEVICE` marks the
/// few pure functions that a GPU must compute exactly like the CPU (the checksum's per-word
/// term): under nvcc they become `__host__ __device__`, elsewhere the macro is empty. The
/// core names no CUDA type; this is only a function attribute.

#if defined(__CUDACC__)
#define DEEPCLONE_HOST_DEVICE __host__ __device__
#else
#define DEEPCLONE_HOST_DEVICE
#endif
