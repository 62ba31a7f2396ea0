# CUDA kernels (sm_90a). Compiled when nvcc is present; never required at run
# time by the CPU backend. Filled in by the CUDA backend.
set(NUCLEUS_HAVE_CUDA OFF)
if(NOT NUCLEUS_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(NUCLEUS_HAVE_CUDA ON)
  elseif(NUCLEUS_CUDA STREQUAL "ON")
    message(FATAL_ERROR "NUCLEUS_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

function(nucleus_add_cuda_sources target)
  if(NOT NUCLEUS_HAVE_CUDA)
    return()
  endif()
endfunction()
