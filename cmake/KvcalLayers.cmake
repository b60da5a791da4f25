# kvcal_forbid_link(<target> <forbidden>...): fails the configure when any
# target in <target>'s link closure is one of <forbidden>. Keeps the layering
# that docs/contributing.md describes enforced by the build, not by review:
# the client stands on the engine's types and statistics, never on its
# backends.
function(_kvcal_link_closure target out)
  set(seen "")
  set(todo ${target})
  while(todo)
    list(POP_FRONT todo t)
    if(NOT TARGET ${t} OR t IN_LIST seen)
      continue()
    endif()
    list(APPEND seen ${t})
    get_target_property(aliased ${t} ALIASED_TARGET)
    if(aliased)
      list(APPEND todo ${aliased})
    endif()
    get_target_property(type ${t} TYPE)
    set(deps "")
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      get_target_property(direct ${t} LINK_LIBRARIES)
      if(direct)
        list(APPEND deps ${direct})
      endif()
    endif()
    get_target_property(iface ${t} INTERFACE_LINK_LIBRARIES)
    if(iface)
      list(APPEND deps ${iface})
    endif()
    foreach(d IN LISTS deps)
      # $<LINK_ONLY:x> and other generator expressions around a target name.
      string(REGEX REPLACE "^\\$<[A-Z_]+:(.*)>$" "\\1" d "${d}")
      if(TARGET ${d})
        list(APPEND todo ${d})
      endif()
    endforeach()
  endwhile()
  set(${out} ${seen} PARENT_SCOPE)
endfunction()

# kvcal_forbid_include(<dir> <prefix>...): fails the configure when a source
# or header under <dir> (relative to the project) includes a path that starts
# with one of <prefix>, e.g. the service including the CUDA backend's headers
# instead of asking a backend for a capability.
function(kvcal_forbid_include dir)
  file(GLOB_RECURSE files "${PROJECT_SOURCE_DIR}/${dir}/*.cc"
       "${PROJECT_SOURCE_DIR}/${dir}/*.h")
  foreach(f IN LISTS files)
    file(STRINGS "${f}" includes REGEX "^#include \"")
    foreach(line IN LISTS includes)
      foreach(prefix IN LISTS ARGN)
        string(FIND "${line}" "#include \"${prefix}" at)
        if(at EQUAL 0)
          file(RELATIVE_PATH rel "${PROJECT_SOURCE_DIR}" "${f}")
          message(FATAL_ERROR
            "${rel}: ${line}: ${dir}/ must not include ${prefix}* "
            "(layering: docs/contributing.md)")
        endif()
      endforeach()
    endforeach()
  endforeach()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${files})
endfunction()

function(kvcal_forbid_link target)
  _kvcal_link_closure(${target} closure)
  foreach(forbidden IN LISTS ARGN)
    if(forbidden IN_LIST closure)
      message(FATAL_ERROR
        "${target} must not link ${forbidden}, directly or through another "
        "target (layering: kernels/CMakeLists.txt, client/CMakeLists.txt)")
    endif()
  endforeach()
endfunction()
