# Install + export: find_package(deepclone) then target_link_libraries(app deepclone::deepclone).
include(CMakePackageConfigHelpers)

set(deepclone_install_cmakedir ${CMAKE_INSTALL_LIBDIR}/cmake/deepclone)
set(deepclone_export_targets deepclone)
foreach(t deepclone_boost_mpi deepclone_fmt deepclone_xxhash deepclone_json deepclone_thrust_cpp deepclone_cuda
        deepclone_torch)
  if(TARGET ${t})
    list(APPEND deepclone_export_targets ${t})
  endif()
endforeach()

install(TARGETS ${deepclone_export_targets} EXPORT deepcloneTargets FILE_SET HEADERS)
# Integration headers are installed always; their targets exist only where the dependency was found.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/deepclone/integrations
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/deepclone OPTIONAL)
install(EXPORT deepcloneTargets NAMESPACE deepclone:: DESTINATION ${deepclone_install_cmakedir})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/deepcloneConfig.cmake.in
  ${PROJECT_BINARY_DIR}/deepcloneConfig.cmake INSTALL_DESTINATION ${deepclone_install_cmakedir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/deepcloneConfigVersion.cmake
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES ${PROJECT_BINARY_DIR}/deepcloneConfig.cmake ${PROJECT_BINARY_DIR}/deepcloneConfigVersion.cmake
        DESTINATION ${deepclone_install_cmakedir})
