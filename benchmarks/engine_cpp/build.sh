#!/usr/bin/env bash
# Builds engine_bench (kvsparse's disk engines against RocksDB's C++ API and the
# disk's limit) into benchmarks/engine_cpp/build/ (or $1).
#
# Needs RocksDB's headers and library, not a kvsparse dependency; the benchmark
# is run by hand, never by CI:
#   apt-get install -y librocksdb-dev        # Debian 12: RocksDB 7.8
#
# kvsparse's engines are compiled from csrc/ straight into the program; RunStore
# joins in when csrc/run_store.h exists (engine_bench.cc checks the same file).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
csrc="$here/../../csrc"
out="${1:-$here/build}"
mkdir -p "$out"

if [[ ! -f /usr/include/rocksdb/db.h ]]; then
  echo "build.sh: RocksDB headers missing: apt-get install -y librocksdb-dev" >&2
  exit 1
fi

sources=("$here/engine_bench.cc" "$csrc"/segment_*.cc "$csrc/file_io.cc" "$csrc/crc32c.cc")
if [[ -f "$csrc/run_store.h" ]]; then
  # RunStore's translation units: run_store.cc, run_merge.cc, run_manifest.cc.
  sources+=("$csrc"/run_*.cc)
fi

${CXX:-g++} -std=c++17 -O2 -DNDEBUG -Wall -Wextra -pthread \
  "${sources[@]}" -o "$out/engine_bench.tmp" \
  -lrocksdb -lsnappy -lz -lbz2 -llz4 -lzstd -lgflags -ldl
mv "$out/engine_bench.tmp" "$out/engine_bench"
echo "$out/engine_bench"
