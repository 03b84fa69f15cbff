# Included by the consumer projects: deepclone's headers must compile warning-free under
# -Wall -Wextra with g++ and clang, so the consumers build with -Werror.
function(deepclone_consumer_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
  endif()
endfunction()

# -DDEEPCLONE_EXPECTED_TARGETS=boost_mpi,fmt,...: the integration targets the build that
# produced this package had; each must exist here too.
function(deepclone_check_targets)
  string(REPLACE "," ";" expected "${DEEPCLONE_EXPECTED_TARGETS}")
  foreach(t IN LISTS expected)
    if(NOT TARGET deepclone::${t})
      message(FATAL_ERROR "deepclone::${t} exists in deepclone's build but not in this consumer")
    endif()
  endforeach()
  message(STATUS "consumer: deepclone::deepclone and the integration targets [${DEEPCLONE_EXPECTED_TARGETS}] exist")
endfunction()
