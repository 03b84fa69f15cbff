# Optional integration targets. Each one exists only when its dependency is found; the core
# target never depends on them. Including the matching header is the opt-in in code.
#   deepclone::boost_mpi  Boost.MPI + MPI          <deepclone/integrations/boost_mpi.hpp>
#   deepclone::fmt        fmt                      <deepclone/integrations/fmt.hpp>
#   deepclone::xxhash     xxHash (header only)     <deepclone/integrations/xxhash.hpp>
#   deepclone::json       nlohmann-json            <deepclone/integrations/json.hpp>
#   deepclone::thrust_cpp Thrust on the CPU        <deepclone/integrations/thrust.hpp>
#   deepclone::cuda       CUDA Toolkit + Thrust    <deepclone/integrations/cuda.hpp>
#   deepclone::torch      LibTorch                 <deepclone/integrations/torch.hpp>
# Every target that exists is installed and exported (cmake/deepcloneInstall.cmake);
# deepcloneConfig.cmake finds its dependency again on the consumer's machine.

set(deepclone_integration_dir ${PROJECT_SOURCE_DIR}/include/deepclone/integrations)

find_package(MPI QUIET COMPONENTS CXX)
find_package(Boost 1.70 QUIET COMPONENTS mpi serialization)
if(MPI_CXX_FOUND AND Boost_MPI_FOUND AND EXISTS ${deepclone_integration_dir}/boost_mpi.hpp)
  add_library(deepclone_boost_mpi INTERFACE)
  add_library(deepclone::boost_mpi ALIAS deepclone_boost_mpi)
  set_target_properties(deepclone_boost_mpi PROPERTIES EXPORT_NAME boost_mpi)
  target_link_libraries(deepclone_boost_mpi INTERFACE deepclone Boost::mpi MPI::MPI_CXX)
  set(DEEPCLONE_HAVE_BOOST_MPI ON)
  message(STATUS "deepclone: Boost.MPI integration enabled")
else()
  set(DEEPCLONE_HAVE_BOOST_MPI OFF)
  message(STATUS "deepclone: Boost.MPI or MPI not found; the MPI integration and its tests are skipped")
endif()

find_package(fmt QUIET)
if(fmt_FOUND AND EXISTS ${deepclone_integration_dir}/fmt.hpp)
  add_library(deepclone_fmt INTERFACE)
  add_library(deepclone::fmt ALIAS deepclone_fmt)
  set_target_properties(deepclone_fmt PROPERTIES EXPORT_NAME fmt)
  target_link_libraries(deepclone_fmt INTERFACE deepclone fmt::fmt)
  set(DEEPCLONE_HAVE_FMT ON)
else()
  set(DEEPCLONE_HAVE_FMT OFF)
endif()

# deepclone::xxhash: the checksum policy checksum::xxh3. xxHash is used header-only
# (XXH_INLINE_ALL), so the target only brings the directory of xxhash.h (Debian: libxxhash-dev).
# The exported target carries no path: deepcloneConfig.cmake finds xxhash.h again.
find_path(DEEPCLONE_XXHASH_INCLUDE_DIR NAMES xxhash.h DOC "include directory of xxHash (xxhash.h)")
if(DEEPCLONE_XXHASH_INCLUDE_DIR AND EXISTS ${deepclone_integration_dir}/xxhash.hpp)
  add_library(deepclone_xxhash INTERFACE)
  add_library(deepclone::xxhash ALIAS deepclone_xxhash)
  set_target_properties(deepclone_xxhash PROPERTIES EXPORT_NAME xxhash)
  target_include_directories(deepclone_xxhash SYSTEM INTERFACE $<BUILD_INTERFACE:${DEEPCLONE_XXHASH_INCLUDE_DIR}>)
  target_link_libraries(deepclone_xxhash INTERFACE deepclone)
  set(DEEPCLONE_HAVE_XXHASH ON)
  message(STATUS "deepclone: xxHash found in ${DEEPCLONE_XXHASH_INCLUDE_DIR}; checksum::xxh3 enabled")
else()
  set(DEEPCLONE_HAVE_XXHASH OFF)
  message(STATUS "deepclone: xxhash.h not found (libxxhash-dev); the xxh3 checksum integration and its tests are skipped")
endif()

# deepclone::json: the report as JSON through nlohmann-json (Debian: nlohmann-json3-dev).
find_package(nlohmann_json 3.2 QUIET)
if(nlohmann_json_FOUND AND EXISTS ${deepclone_integration_dir}/json.hpp)
  add_library(deepclone_json INTERFACE)
  add_library(deepclone::json ALIAS deepclone_json)
  set_target_properties(deepclone_json PROPERTIES EXPORT_NAME json)
  target_link_libraries(deepclone_json INTERFACE deepclone nlohmann_json::nlohmann_json)
  set(DEEPCLONE_HAVE_JSON ON)
  message(STATUS "deepclone: nlohmann-json found; the JSON report integration is enabled")
else()
  set(DEEPCLONE_HAVE_JSON OFF)
  message(STATUS "deepclone: nlohmann-json not found (nlohmann-json3-dev); the JSON integration, its test and the benchmarks are skipped")
endif()

# --- Thrust on the CPU, and CUDA (integrations/thrust.hpp, integrations/cuda.hpp) --------
# deepclone::thrust_cpp: a host copy of Thrust (Debian's libthrust-dev in /usr/include) on
# its CPP back-end, so the Thrust code paths build and run without a GPU. find_package(Thrust)
# is avoided on purpose: it may find CUDA's CCCL copy first, which only works under nvcc.
find_path(DEEPCLONE_THRUST_INCLUDE_DIR NAMES thrust/version.h PATHS /usr/include /usr/local/include
          DOC "include directory of a host Thrust (not CUDA's cccl copy)")
if(DEEPCLONE_THRUST_INCLUDE_DIR AND NOT DEEPCLONE_THRUST_INCLUDE_DIR MATCHES "cccl|/cuda")
  add_library(deepclone_thrust_cpp INTERFACE)
  add_library(deepclone::thrust_cpp ALIAS deepclone_thrust_cpp)
  set_target_properties(deepclone_thrust_cpp PROPERTIES EXPORT_NAME thrust_cpp)
  # Exported without the path: deepcloneConfig.cmake finds thrust/version.h again.
  target_include_directories(deepclone_thrust_cpp SYSTEM INTERFACE $<BUILD_INTERFACE:${DEEPCLONE_THRUST_INCLUDE_DIR}>)
  target_compile_definitions(deepclone_thrust_cpp INTERFACE THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP)
  target_link_libraries(deepclone_thrust_cpp INTERFACE deepclone)
  set(DEEPCLONE_HAVE_THRUST_CPP ON)
  message(STATUS "deepclone: host Thrust found in ${DEEPCLONE_THRUST_INCLUDE_DIR} (CPP back-end)")
else()
  set(DEEPCLONE_HAVE_THRUST_CPP OFF)
  message(STATUS "deepclone: no host Thrust found; the Thrust CPU tests are skipped")
endif()

# deepclone::cuda: the CUDA runtime (cudart) for integrations/cuda.hpp. It exists whenever
# the CUDA Toolkit is found, vendored or not: DEEPCLONE_CUDA only decides whether deepclone's
# own CUDA tests and example are built, which needs a CUDA compiler (nvcc). Without one,
# configuring succeeds and says the CUDA parts are skipped.
option(DEEPCLONE_CUDA "Build deepclone's CUDA tests and example when a CUDA compiler is found" ${deepclone_IS_TOP_LEVEL})
set(DEEPCLONE_HAVE_CUDA OFF)
set(_deepclone_cuda_language OFF)
if(DEEPCLONE_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # H100/H200; one architecture keeps nvcc fast
    endif()
    enable_language(CUDA)
    if(CMAKE_VERSION VERSION_LESS 3.26)  # CMake 3.25 does not know nvcc's C++20 flag
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(_deepclone_cuda_language ON)
  endif()
endif()
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND)
  add_library(deepclone_cuda INTERFACE)
  add_library(deepclone::cuda ALIAS deepclone_cuda)
  set_target_properties(deepclone_cuda PROPERTIES EXPORT_NAME cuda)
  target_link_libraries(deepclone_cuda INTERFACE deepclone CUDA::cudart)
  if(_deepclone_cuda_language)
    set(DEEPCLONE_HAVE_CUDA ON)
    message(STATUS "deepclone: CUDA ${CMAKE_CUDA_COMPILER_VERSION} found; CUDA tests and example are built "
                   "for architectures ${CMAKE_CUDA_ARCHITECTURES}")
  endif()
endif()
if(NOT DEEPCLONE_HAVE_CUDA)
  message(STATUS "deepclone: no CUDA compiler (nvcc) found or DEEPCLONE_CUDA=OFF; the CUDA tests and example are skipped")
endif()

# deepclone::torch: LibTorch (Debian 12: libtorch-dev, 1.13.1, CPU) for integrations/torch.hpp.
find_package(Torch QUIET)
if(Torch_FOUND AND TARGET torch AND EXISTS ${deepclone_integration_dir}/torch.hpp)
  add_library(deepclone_torch INTERFACE)
  add_library(deepclone::torch ALIAS deepclone_torch)
  set_target_properties(deepclone_torch PROPERTIES EXPORT_NAME torch)
  target_link_libraries(deepclone_torch INTERFACE deepclone ${TORCH_LIBRARIES})
  set(DEEPCLONE_HAVE_TORCH ON)
  message(STATUS "deepclone: LibTorch ${Torch_VERSION} found; the torch integration, its tests and example are built")
else()
  set(DEEPCLONE_HAVE_TORCH OFF)
  message(STATUS "deepclone: LibTorch not found (libtorch-dev); the torch integration, its tests and example are skipped")
endif()
