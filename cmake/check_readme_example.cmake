# Fails unless README.md quotes examples/consumer/main.cpp word for word (between the markers
# "<!-- example: examples/consumer/main.cpp -->" and the end of the code block that follows), so the
# usage example a reader copies is the one CI compiles and runs.
file(READ ${README} readme)
file(READ ${EXAMPLE} example)
set(marker "<!-- example: examples/consumer/main.cpp -->\n```cpp\n")
string(FIND "${readme}" "${marker}" start)
if(start EQUAL -1)
  message(FATAL_ERROR "README.md has no '<!-- example: examples/consumer/main.cpp -->' block")
endif()
string(LENGTH "${marker}" marker_length)
math(EXPR start "${start} + ${marker_length}")
string(SUBSTRING "${readme}" ${start} -1 rest)
string(FIND "${rest}" "```" end)
string(SUBSTRING "${rest}" 0 ${end} quoted)
if(NOT quoted STREQUAL example)
  message(FATAL_ERROR "README.md's usage example differs from examples/consumer/main.cpp: copy the file into it")
endif()
