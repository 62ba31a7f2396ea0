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

function(nucleus_add_cuda_sources target)
  if(NOT NUCLEUS_HAVE_CUDA)
    return()
  endif()
  file(GLOB_RECURSE cu_sources CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/*.cu)
  target_sources(${target} PRIVATE ${cu_sources})
  target_compile_definitions(${target} PUBLIC NUCLEUS_HAVE_CUDA=1)
  target_link_libraries(${target} PUBLIC CUDA::cudart_static CUDA::cublasLt)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo -Xcompiler=-Wno-unused-parameter>)
  nucleus_add_flashinfer(${target})
endfunction()
