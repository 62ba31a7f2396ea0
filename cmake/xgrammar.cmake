# xgrammar's C++ core (https://github.com/mlc-ai/xgrammar, Apache-2.0): the
# grammar engine behind structured output (response_format json_object /
# json_schema, vLLM's structured_outputs; src/runtime/structured_output.h).
#   NUCLEUS_XGRAMMAR=ON (default): the pinned sdist from PyPI is downloaded at
#     configure time (its sha256 checked) into <build>/_deps and its cpp/
#     sources built as the static library nucleus_xgrammar: no Python
#     bindings, no tvm-ffi, no cpptrace, no tests. A local copy of the
#     tarball can be given with -DNUCLEUS_XGRAMMAR_TARBALL=path (offline).
#   OFF: not built; structured-output requests are refused with a 400.
# Cost: a 2.8 MB download, and 29 sources of ~230 CPU-seconds at -O3 with
# GCC 12 (about 2 minutes on two cores; ccache keeps later builds free).
set(NUCLEUS_XGRAMMAR ON CACHE BOOL "Build structured output (xgrammar's C++ core, fetched from PyPI)")
set(NUCLEUS_XGRAMMAR_TARBALL "" CACHE FILEPATH "A local xgrammar-<version>.tar.gz (default: download from PyPI)")
set(NUCLEUS_HAVE_XGRAMMAR OFF)

if(NUCLEUS_XGRAMMAR)
  set(_xg_version 0.2.9)
  set(_xg_sha256 87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90)
  set(_xg_url "https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-${_xg_version}.tar.gz")
  set(_xg_deps ${CMAKE_BINARY_DIR}/_deps)
  set(_xg_dir ${_xg_deps}/xgrammar-${_xg_version})
  if(NOT EXISTS ${_xg_dir}/.nucleus-extracted)
    set(_xg_tar ${NUCLEUS_XGRAMMAR_TARBALL})
    if(NOT _xg_tar)
      set(_xg_tar ${_xg_deps}/xgrammar-${_xg_version}.tar.gz)
      message(STATUS "nucleus: downloading xgrammar ${_xg_version} from PyPI")
      file(DOWNLOAD ${_xg_url} ${_xg_tar} EXPECTED_HASH SHA256=${_xg_sha256} STATUS _xg_status TLS_VERIFY ON
           TIMEOUT 120)
      list(GET _xg_status 0 _xg_rc)
      if(NOT _xg_rc EQUAL 0)
        list(GET _xg_status 1 _xg_err)
        message(FATAL_ERROR "nucleus: could not download xgrammar ${_xg_version} (${_xg_url}): ${_xg_err}. "
                "Give a local copy with -DNUCLEUS_XGRAMMAR_TARBALL=path or build without structured output "
                "with -DNUCLEUS_XGRAMMAR=OFF.")
      endif()
    endif()
    file(SHA256 ${_xg_tar} _xg_actual)
    if(NOT _xg_actual STREQUAL _xg_sha256)
      message(FATAL_ERROR "nucleus: ${_xg_tar} has sha256 ${_xg_actual}, expected ${_xg_sha256} (xgrammar ${_xg_version})")
    endif()
    # Only what the C++ core needs: its sources, headers, picojson and dlpack.
    file(ARCHIVE_EXTRACT INPUT ${_xg_tar} DESTINATION ${_xg_deps}
         PATTERNS xgrammar-${_xg_version}/cpp xgrammar-${_xg_version}/include
                  xgrammar-${_xg_version}/3rdparty/picojson xgrammar-${_xg_version}/3rdparty/dlpack/include
                  xgrammar-${_xg_version}/LICENSE xgrammar-${_xg_version}/NOTICE)
    file(TOUCH ${_xg_dir}/.nucleus-extracted)
  endif()

  # The sources of upstream's `xgrammar` static target (its CMakeLists.txt
  # globs cpp/*.cc without tvm_ffi/; testing.cc is needed by the matcher).
  # Upstream's flags (-Werror, -flto) are not taken; warnings are its own.
  file(GLOB_RECURSE _xg_sources ${_xg_dir}/cpp/*.cc)
  list(FILTER _xg_sources EXCLUDE REGEX "/cpp/tvm_ffi/.*\\.cc$")
  add_library(nucleus_xgrammar STATIC ${_xg_sources})
  set_target_properties(nucleus_xgrammar PROPERTIES CXX_STANDARD 17 POSITION_INDEPENDENT_CODE ON)
  target_compile_options(nucleus_xgrammar PRIVATE -w)
  target_compile_definitions(nucleus_xgrammar PUBLIC XGRAMMAR_ENABLE_CPPTRACE=0)
  target_include_directories(nucleus_xgrammar SYSTEM PUBLIC
    ${_xg_dir}/include ${_xg_dir}/3rdparty/picojson ${_xg_dir}/3rdparty/dlpack/include)
  target_link_libraries(nucleus_xgrammar PUBLIC Threads::Threads)
  set(NUCLEUS_HAVE_XGRAMMAR ON)
  message(STATUS "nucleus: structured output with xgrammar ${_xg_version} (${_xg_dir})")
else()
  message(STATUS "nucleus: structured output off (NUCLEUS_XGRAMMAR=OFF): response_format other than text is refused")
endif()

# Links xgrammar into the INTERFACE library `target` and defines
# NUCLEUS_HAVE_XGRAMMAR there.
function(nucleus_add_xgrammar target)
  if(NUCLEUS_HAVE_XGRAMMAR)
    target_link_libraries(${target} INTERFACE nucleus_xgrammar)
    target_compile_definitions(${target} INTERFACE NUCLEUS_HAVE_XGRAMMAR=1)
  endif()
endfunction()
