# Optional integration targets. Each one exists only when its dependency is found; the core
# target never depends on them. Including the matching header is the opt-in in code.
#   deepclone::boost_mpi  Boost.MPI + MPI          <deepclone/integrations/boost_mpi.hpp>
#   deepclone::fmt        fmt                      <deepclone/integrations/fmt.hpp>
#   deepclone::thrust_cpp Thrust on the CPU        <deepclone/integrations/thrust.hpp>
#   deepclone::cuda       CUDA Toolkit + Thrust    <deepclone/integrations/cuda.hpp>

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
