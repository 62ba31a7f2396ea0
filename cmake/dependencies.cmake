# Third-party libraries, all from Debian packages (see tools/install_deps.sh).
# Everything non-CUDA is header-only or linked statically, so a binary built
# here runs unchanged on the GPU machine, which has other library versions.

find_package(nlohmann_json 3.10 REQUIRED)
find_package(Threads REQUIRED)

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
  nlohmann_json::nlohmann_json ${PCRE2_STATIC_LIB} Threads::Threads
  -static-libstdc++ -static-libgcc)
