// Registration of a module's kernels, included by the generated source after the
// kernel code (build.py): for each name expression NVRTC would instantiate, a
// descriptor of its parameters (kind, size, constness and type of pointees) and an
// invoker that calls it with parameter i taken from slots[i].
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "cuda_cpu_abi.h"

struct __half;  // (the kernel source may include neither cuda_fp16.h nor cuda_bf16.h)
struct __nv_bfloat16;

namespace pnc_reg {

template <typename T> struct type_name { static constexpr const char* value = "?"; };
#define PNC_TYPE_NAME(T) \
  template <> struct type_name<T> { static constexpr const char* value = #T; }
PNC_TYPE_NAME(void);
PNC_TYPE_NAME(bool);
PNC_TYPE_NAME(char);
PNC_TYPE_NAME(signed char);
PNC_TYPE_NAME(unsigned char);
PNC_TYPE_NAME(short);
PNC_TYPE_NAME(unsigned short);
PNC_TYPE_NAME(int);
PNC_TYPE_NAME(unsigned int);
PNC_TYPE_NAME(long);
PNC_TYPE_NAME(unsigned long);
PNC_TYPE_NAME(long long);
PNC_TYPE_NAME(unsigned long long);
PNC_TYPE_NAME(float);
PNC_TYPE_NAME(double);
PNC_TYPE_NAME(__half);
PNC_TYPE_NAME(__nv_bfloat16);
#undef PNC_TYPE_NAME

template <typename T> constexpr int kind_of() {
  if constexpr (std::is_pointer<T>::value) return PNC_POINTER;
  else if constexpr (std::is_floating_point<T>::value) return PNC_FLOAT;
  else if constexpr (std::is_integral<T>::value && std::is_signed<T>::value) return PNC_SIGNED;
  else if constexpr (std::is_integral<T>::value) return PNC_UNSIGNED;
  else return PNC_OTHER;
}

template <typename T> constexpr int size_of() {
  if constexpr (std::is_void<T>::value) return 0;
  else return static_cast<int>(sizeof(T));
}

template <typename P> constexpr pnc_param describe() {
  if constexpr (std::is_pointer<P>::value) {
    using E = typename std::remove_pointer<P>::type;
    using U = typename std::remove_cv<E>::type;
    return pnc_param{PNC_POINTER, static_cast<int>(sizeof(P)), std::is_const<E>::value ? 1 : 0, kind_of<U>(),
                     size_of<U>(), type_name<U>::value};
  } else {
    using U = typename std::remove_cv<P>::type;
    return pnc_param{kind_of<U>(), static_cast<int>(sizeof(U)), 0, PNC_OTHER, 0, type_name<U>::value};
  }
}

template <typename F> struct signature;
template <typename... P> struct signature<void (*)(P...)> {
  static constexpr int count = sizeof...(P);
  static constexpr pnc_param params[sizeof...(P) > 0 ? sizeof...(P) : 1] = {describe<P>()...};

  template <void (*F)(P...), std::size_t... I> static void call(void** slots, std::index_sequence<I...>) {
    F(*static_cast<typename std::remove_cv<P>::type*>(slots[I])...);
  }
  template <void (*F)(P...)> static void invoke(void** slots) { call<F>(slots, std::index_sequence_for<P...>{}); }
};

template <auto F> constexpr pnc_kernel entry(const char* name, int max_threads, int min_blocks) {
  using S = signature<decltype(F)>;
  return pnc_kernel{name, max_threads, min_blocks, S::count, S::params, &S::template invoke<F>};
}

}  // namespace pnc_reg

// PNC_KERNEL(max_threads, min_blocks, name expression): the name expression may contain commas
#define PNC_KERNEL(MAX_THREADS, MIN_BLOCKS, ...) \
  pnc_reg::entry<&__VA_ARGS__>(#__VA_ARGS__, (MAX_THREADS), (MIN_BLOCKS))
