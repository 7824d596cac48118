// Reference for TestW2GeneratorDigests: librmm's random_allocations loop (benchmarks/
// random_allocations) driven by libstdc++'s own std::default_random_engine (minstd_rand0) and
// std::uniform_int_distribution, with an allocator that always succeeds. It prints the first six
// sizes and the FNV-1a-64 digest of the events, each event two little-endian 8-byte words:
// (1, size) for an allocation, (2, index after the modulo) for a free.
//
//   g++ -O2 -o oracle oracle.cpp && ./oracle
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

struct fnv1a64 {
  uint64_t h = 14695981039346656037ULL;
  void word(uint64_t x) {
    unsigned char b[8];
    std::memcpy(b, &x, 8);  // x86-64: little-endian
    for (unsigned char c : b) { h ^= c; h *= 1099511628211ULL; }
  }
};

int main() {
  const std::size_t cells[3][2] = {{1000, 4096}, {10000, 64}, {100000, 1}};
  for (auto const& c : cells) {
    std::size_t n = c[0], max_mib = c[1];
    std::default_random_engine gen;
    std::uniform_int_distribution<std::size_t> size_d(1, max_mib << 20);
    std::uniform_int_distribution<int> op_d(0, 99);
    std::uniform_int_distribution<int> index_d(0, int(n) - 1);
    std::vector<std::size_t> live;
    std::size_t live_bytes = 0, made = 0;
    fnv1a64 d;
    std::printf("N=%zu max=%zu MiB first sizes:", n, max_mib);
    for (std::size_t i = 0; i < 2 * n; i++) {
      std::size_t size = size_d(gen);
      if (i < 6) std::printf(" %zu", size);
      bool alloc = true;
      if (!live.empty()) {
        int chance = op_d(gen);
        alloc = chance < 73 && made < n && live_bytes + size < (std::size_t(16000) << 20);
      }
      if (alloc) {
        live.push_back(size); live_bytes += size; made++;
        d.word(1); d.word(size);
      } else if (!live.empty()) {
        std::size_t idx = std::size_t(index_d(gen)) % live.size();
        live_bytes -= live[idx];
        live[idx] = live.back();  // librmm's remove_at: swap with the last, pop
        live.pop_back();
        d.word(2); d.word(idx);
      }
    }
    std::printf(" digest %016llx\n", (unsigned long long)d.h);
  }
}
