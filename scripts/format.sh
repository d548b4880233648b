#!/usr/bin/env bash
# Formats every C++ and CUDA source with the repository's .clang-format; --check only reports (and fails on)
# files that differ, as CI does.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files 'src/*' 'include/*' 'experiments/*' 'examples/*' | grep -E '\.(h|cpp|cu|cuh)$')
if [ "${1:-}" = --check ]; then
  clang-format --dry-run --Werror $files
else
  clang-format -i $files
fi
