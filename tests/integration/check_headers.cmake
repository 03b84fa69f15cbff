# cmake -DSOURCE_DIR=... -DCXX=... -DWORK_DIR=... -P check_headers.cmake
# Compiles each core header alone (-fsyntax-only) and checks, from the compiler's own list
# of included files (-H), that no core header reaches anything outside the standard library.
file(GLOB_RECURSE headers RELATIVE ${SOURCE_DIR}/include ${SOURCE_DIR}/include/deepclone/*.hpp)
list(FILTER headers EXCLUDE REGEX "/integrations/")
file(MAKE_DIRECTORY ${WORK_DIR})
set(failed "")
foreach(h IN LISTS headers)
  string(MAKE_C_IDENTIFIER ${h} id)
  set(src ${WORK_DIR}/${id}.cpp)
  file(WRITE ${src} "#include <${h}>\n#include <${h}>  // and include guards work\n")
  execute_process(COMMAND ${CXX} -std=c++20 -Wall -Wextra -Werror -fsyntax-only -H -I${SOURCE_DIR}/include ${src}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    list(APPEND failed ${h})
    message("${h} does not compile on its own:\n${err}")
    continue()
  endif()
  # -H prints one line per included file: ". path", ".. path", ...
  string(REGEX MATCHALL "\n\\.+ [^\n]+" included "\n${err}")
  foreach(line IN LISTS included)
    string(REGEX REPLACE "^\n\\.+ " "" path "${line}")
    get_filename_component(path "${path}" REALPATH)
    if(path MATCHES "^${SOURCE_DIR}/include/deepclone/")
      continue()
    endif()
    # The standard library and the C library it sits on: the compiler's own headers, libstdc++
    # / libc++, and the C headers directly in /usr/include or its per-architecture and kernel
    # folders. Anything else (boost, fmt, cuda, thrust, doctest, ...) is a dependency.
    if(NOT path MATCHES "^/usr/lib/(gcc|llvm)|/include/c\\+\\+/|^/usr/include/[A-Za-z_0-9+.-]+\\.h$|^/usr/include/(x86_64-linux-gnu|aarch64-linux-gnu|bits|sys|gnu|asm|asm-generic|linux)/")
      list(APPEND failed "${h} (reaches ${path})")
      message("${h} reaches a non-standard header: ${path}")
    endif()
  endforeach()
endforeach()
list(LENGTH headers n)
if(failed)
  message(FATAL_ERROR "header check failed for: ${failed}")
endif()
message(STATUS "${n} core headers compile on their own and include only the standard library")
