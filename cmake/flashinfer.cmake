# FlashInfer's header-only MLA decode kernels: the "flashinfer" backend of the
# mla_decode op family (src/kernels/mla/flashinfer_mla.cu).
#   NUCLEUS_FLASHINFER=AUTO (default): fetch the pinned headers at configure
#     time (tools/fetch_flashinfer.sh, from the flashinfer-python wheel) into
#     NUCLEUS_FLASHINFER_DIR; on when they are there, off (with a message)
#     when they could not be fetched.
#   ON: as AUTO, but an error when the headers are missing.  OFF: not built.
# The headers (with the CUTLASS and CCCL headers they need, newer than the
# toolkit's CCCL) apply to that one source file only. Without them the file
# compiles to a stub and the backend refuses every call.
set(NUCLEUS_FLASHINFER AUTO CACHE STRING "Build the FlashInfer MLA decode backend: AUTO, ON or OFF")
set(NUCLEUS_FLASHINFER_DIR "${CMAKE_BINARY_DIR}/_deps/flashinfer" CACHE PATH
    "FlashInfer headers (filled by tools/fetch_flashinfer.sh)")
set(NUCLEUS_HAVE_FLASHINFER OFF)
if(NUCLEUS_HAVE_CUDA AND NOT NUCLEUS_FLASHINFER STREQUAL "OFF")
  set(_nucleus_fi_marker "${NUCLEUS_FLASHINFER_DIR}/include/flashinfer/attention/mla_hopper.cuh")
  execute_process(COMMAND ${CMAKE_SOURCE_DIR}/tools/fetch_flashinfer.sh ${NUCLEUS_FLASHINFER_DIR}
                  RESULT_VARIABLE _nucleus_fi_rc OUTPUT_QUIET ERROR_VARIABLE _nucleus_fi_err)
  if(EXISTS "${_nucleus_fi_marker}")
    set(NUCLEUS_HAVE_FLASHINFER ON)
    message(STATUS "nucleus: FlashInfer MLA decode backend from ${NUCLEUS_FLASHINFER_DIR}")
  elseif(NUCLEUS_FLASHINFER STREQUAL "ON")
    message(FATAL_ERROR "NUCLEUS_FLASHINFER=ON but tools/fetch_flashinfer.sh failed: ${_nucleus_fi_err}")
  else()
    message(STATUS "nucleus: FlashInfer headers unavailable, its MLA decode backend is off (${_nucleus_fi_err})")
  endif()
endif()

# Gives `target`'s flashinfer_mla.cu the FlashInfer include paths.
function(nucleus_add_flashinfer target)
  if(NOT NUCLEUS_HAVE_FLASHINFER)
    return()
  endif()
  set(dir ${NUCLEUS_FLASHINFER_DIR})
  set_source_files_properties(${CMAKE_SOURCE_DIR}/src/kernels/mla/flashinfer_mla.cu PROPERTIES
    INCLUDE_DIRECTORIES "${dir}/include;${dir}/cutlass/include;${dir}/cccl/libcudacxx/include;${dir}/cccl/cub;${dir}/cccl/thrust"
    COMPILE_DEFINITIONS "NUCLEUS_HAVE_FLASHINFER=1;NDEBUG"
    COMPILE_OPTIONS "-diag-suppress=177,550,946,20012,20013,20015;-Xcompiler=-Wno-unused-variable")
endfunction()
