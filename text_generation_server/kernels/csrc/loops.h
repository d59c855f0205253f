// Loops the CPU kernels share.
#pragma once

#include <cstdint>
#include <type_traits>

namespace tgis_cpu {

// group(std::integral_constant<int, G>{}, p) for items [begin, end) G at a time (panels side by
// side, a compile-time count), then group(std::integral_constant<int, 1>{}, p) for each one left
template <int G, typename Group>
inline void over_groups(int64_t begin, int64_t end, Group group) {
  int64_t p = begin;
  for (; p + G <= end; p += G) group(std::integral_constant<int, G>{}, p);
  for (; p < end; ++p) group(std::integral_constant<int, 1>{}, p);
}

}  // namespace tgis_cpu
