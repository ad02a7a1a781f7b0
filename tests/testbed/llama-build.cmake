# Included after each project() of the llama-server build (CMAKE_PROJECT_INCLUDE,
# tests/testbed/setup.sh). The test bed compiles llama-server on 2 cores, on every new
# machine, and that compile was the long pole of a cold CI run. Its time goes to
# parsing and optimising llama.cpp's C++ around the kernels (the JSON and chat-template
# code, the server, the model loader); the tests wait on the kernels (ggml), which keep
# upstream's -O3. So, once every target is declared:
#   the library, common and server code: -O1; common and the server also as unity
#     builds (their files share one parse of the JSON and template headers);
#   mtmd (images and audio, which no test sends): -O0.
# Measured on the 2-core test machine, alone: 748 s of compiler time and 6 min 35 s
# before, 488 s and 4 min 34 s after; prompt processing and generation speed within
# the noise of paired runs (SmolLM2, a 2,907-token prompt, 128 tokens).
# The last -O on the command line wins, and target options come after -O3.
function(_testbed_lighter_flags)
  foreach(t llama llama-common server-context llama-server-impl cpp-httplib)
    if(TARGET ${t})
      set_property(TARGET ${t} APPEND PROPERTY COMPILE_OPTIONS -O1)
    endif()
  endforeach()
  foreach(t llama-common server-context llama-server-impl)
    if(TARGET ${t})
      set_property(TARGET ${t} PROPERTY UNITY_BUILD ON)
    endif()
  endforeach()
  if(TARGET mtmd)
    set_property(TARGET mtmd APPEND PROPERTY COMPILE_OPTIONS -O0)
  endif()
endfunction()
if(NOT _testbed_lighter_flags_deferred)
  set(_testbed_lighter_flags_deferred ON)
  cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL _testbed_lighter_flags)
endif()
