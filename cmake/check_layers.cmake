# Checks that every #include "<folder>/..." in src/<layer>/ names the layer
# itself or a layer below it (CMakeLists.txt's nucleus_add_layer DEPS,
# transitively), so that the layers link in one order.
#   cmake -DSRC=<source>/src -DLAYERS=<build>/layers.cmake -P check_layers.cmake
# Prints every include that goes the wrong way and fails if there is one.
cmake_minimum_required(VERSION 3.25)
include(${LAYERS})
set(bad 0)
foreach(layer ${NUCLEUS_LAYERS})
  file(GLOB_RECURSE files ${SRC}/${layer}/*.h ${SRC}/${layer}/*.cpp ${SRC}/${layer}/*.cu
       ${SRC}/${layer}/*.cuh ${SRC}/${layer}/*.inc)
  foreach(f ${files})
    file(STRINGS ${f} lines REGEX "^[ \t]*#[ \t]*include[ \t]+\"[A-Za-z0-9_]+/")
    foreach(line ${lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]+\"([A-Za-z0-9_]+)/.*" "\\1" folder "${line}")
      if(NOT folder IN_LIST NUCLEUS_LAYER_REACH_${layer})
        file(RELATIVE_PATH rel ${SRC} ${f})
        message("src/${rel}: ${line} (layer ${layer} may include only ${NUCLEUS_LAYER_REACH_${layer}})")
        math(EXPR bad "${bad} + 1")
      endif()
    endforeach()
  endforeach()
  list(LENGTH files n)
  message(STATUS "${layer}: ${n} files, may include ${NUCLEUS_LAYER_REACH_${layer}}")
endforeach()
if(bad GREATER 0)
  message(FATAL_ERROR "${bad} include(s) against the layer order")
endif()
