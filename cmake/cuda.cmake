# CUDA kernels for Hopper (sm_90a). Compiled when nvcc is present
# (NUCLEUS_CUDA=AUTO) or required (ON); OFF builds the CPU engine only.
# The CUDA runtime is linked statically (it loads the driver only when a CUDA
# call is made, so the binary starts on machines without a GPU); cuBLASLt is
# linked dynamically from the toolkit.
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

if(NUCLEUS_HAVE_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90a)
  endif()
  enable_language(CUDA)
  # CMake 3.25 does not know nvcc 13's C++20 flag; tell it.
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  message(STATUS "nucleus: CUDA kernels for sm_${CMAKE_CUDA_ARCHITECTURES} with ${CMAKE_CUDA_COMPILER}")
else()
  message(STATUS "nucleus: CPU-only build (no CUDA compiler)")
endif()

# CUDA's usage requirements for an INTERFACE library `target` (what every
# engine source compiles and links with): NUCLEUS_HAVE_CUDA=1, the static CUDA
# runtime and cuBLASLt. Nothing without CUDA.
function(nucleus_add_cuda_usage target)
  if(NOT NUCLEUS_HAVE_CUDA)
    return()
  endif()
  target_compile_definitions(${target} INTERFACE NUCLEUS_HAVE_CUDA=1)
  target_link_libraries(${target} INTERFACE CUDA::cudart_static CUDA::cublasLt)
endfunction()

# nvcc options of `target`'s own CUDA sources. Nothing without CUDA.
function(nucleus_add_cuda_options target)
  if(NOT NUCLEUS_HAVE_CUDA)
    return()
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-Wno-unused-parameter>)
endfunction()
