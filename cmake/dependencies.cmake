# Third-party libraries, all from Debian packages (see tools/install_deps.sh).
# Everything non-CUDA is header-only or linked statically, so a binary built
# here runs unchanged on the GPU machine, which has other library versions;
# the exception, cpp-httplib, travels in <build>/lib (see the end of this file).

find_package(nlohmann_json 3.10 REQUIRED)
find_package(Threads REQUIRED)
# Boost.Beast's HTTP/1.1 parser (header-only) and zlib: the server's transport
# (src/server/http_transport.h).
find_package(Boost 1.74 REQUIRED)
find_package(ZLIB REQUIRED)

find_path(PCRE2_INCLUDE_DIR pcre2.h REQUIRED)
find_library(PCRE2_STATIC_LIB libpcre2-8.a REQUIRED)
find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
find_path(SPDLOG_INCLUDE_DIR spdlog/spdlog.h REQUIRED)
find_path(FMT_INCLUDE_DIR fmt/format.h REQUIRED)

add_library(nucleus_deps INTERFACE)
target_include_directories(nucleus_deps SYSTEM INTERFACE
  ${PCRE2_INCLUDE_DIR} ${XXHASH_INCLUDE_DIR} ${CLI11_INCLUDE_DIR}
  ${SPDLOG_INCLUDE_DIR} ${FMT_INCLUDE_DIR})
target_compile_definitions(nucleus_deps INTERFACE
  PCRE2_CODE_UNIT_WIDTH=8 PCRE2_STATIC
  SPDLOG_HEADER_ONLY FMT_HEADER_ONLY SPDLOG_FMT_EXTERNAL
  XXH_INLINE_ALL)
target_link_libraries(nucleus_deps INTERFACE
  nlohmann_json::nlohmann_json ${PCRE2_STATIC_LIB} Threads::Threads Boost::headers ZLIB::ZLIB
  -static-libstdc++ -static-libgcc)

# cpp-httplib (the HTTP server and the benchmark client). Debian ships it in
# split mode: httplib.h declares, libcpp-httplib.so implements (built with
# OpenSSL, zlib and brotli, whence the defines that pkg-config gives). It is
# the one shared library besides libc/libstdc++/OpenSSL/zlib: the build tree
# carries a copy of it and of the brotli libraries in <build>/lib, and every
# executable gets RUNPATH $ORIGIN/../lib, so bin/ and lib/ copied together
# run on a machine without these packages (OpenSSL 3 and zlib are assumed).
# RUNPATH covers only a binary's direct dependencies, so the brotli libraries
# that libcpp-httplib.so needs are linked directly as well.
find_package(PkgConfig REQUIRED)
pkg_check_modules(CPP_HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
find_library(CPP_HTTPLIB_LIB NAMES cpp-httplib REQUIRED HINTS ${CPP_HTTPLIB_LIBRARY_DIRS})
get_filename_component(CPP_HTTPLIB_LIB_DIR ${CPP_HTTPLIB_LIB} DIRECTORY)
set(NUCLEUS_BUNDLED_LIBS)
set(NUCLEUS_BROTLI_LIBS)
foreach(lib cpp-httplib brotlidec brotlienc brotlicommon)
  file(GLOB versions ${CPP_HTTPLIB_LIB_DIR}/lib${lib}.so.*)
  if(NOT versions)
    message(FATAL_ERROR "lib${lib}.so.* not found in ${CPP_HTTPLIB_LIB_DIR} (tools/install_deps.sh installs it)")
  endif()
  list(APPEND NUCLEUS_BUNDLED_LIBS ${versions})
  if(NOT lib STREQUAL "cpp-httplib")
    find_library(NUCLEUS_${lib}_LIB NAMES ${lib} REQUIRED HINTS ${CPP_HTTPLIB_LIB_DIR})
    list(APPEND NUCLEUS_BROTLI_LIBS ${NUCLEUS_${lib}_LIB})
  endif()
endforeach()
set(NUCLEUS_LIB_DIR ${CMAKE_BINARY_DIR}/lib)
set(bundled_outputs)
foreach(src ${NUCLEUS_BUNDLED_LIBS})
  get_filename_component(name ${src} NAME)
  # `copy` follows symlinks: every soname / version gets the library's bytes.
  add_custom_command(OUTPUT ${NUCLEUS_LIB_DIR}/${name}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${NUCLEUS_LIB_DIR}
    COMMAND ${CMAKE_COMMAND} -E copy ${src} ${NUCLEUS_LIB_DIR}/${name}
    DEPENDS ${src} VERBATIM)
  list(APPEND bundled_outputs ${NUCLEUS_LIB_DIR}/${name})
endforeach()
add_custom_target(nucleus_bundled_libs ALL DEPENDS ${bundled_outputs})
add_dependencies(nucleus_deps nucleus_bundled_libs)  # followed by every target linking nucleus_deps
target_link_libraries(nucleus_deps INTERFACE PkgConfig::CPP_HTTPLIB ${NUCLEUS_BROTLI_LIBS})
target_link_options(nucleus_deps INTERFACE "LINKER:--no-as-needed" "LINKER:--enable-new-dtags")
set(CMAKE_BUILD_RPATH "\$ORIGIN/../lib")
set(CMAKE_INSTALL_RPATH "\$ORIGIN/../lib")
