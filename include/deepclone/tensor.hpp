#pragma once
/// \file tensor.hpp
/// The tensor customization point. deepclone never owns or copies a user's tensor: it
/// reads and writes its bytes in place through `tensor_traits<T>`, which a user
/// specialises for types they do not own (a `torch::Tensor`, a framework buffer).
/// Specialising the trait is the explicit opt-in: nothing becomes a tensor by accident.

#include <array>
#include <complex>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace deepclone {

/// Element type of a tensor, carried in the layout so that clone and sources can prove
/// they agree before any byte moves.
enum class dtype : std::uint8_t {
  u8, i8, u16, i16, u32, i32, u64, i64, f16, bf16, f32, f64, c64, c128, bytes,
  boolean,  ///< one byte per element (C++ bool, at::kBool); added last to keep the encoding stable
};

/// Size of one element in bytes (1 for `dtype::bytes`).
constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::u8: case dtype::i8: case dtype::bytes: case dtype::boolean: return 1;
    case dtype::u16: case dtype::i16: case dtype::f16: case dtype::bf16: return 2;
    case dtype::u32: case dtype::i32: case dtype::f32: return 4;
    case dtype::u64: case dtype::i64: case dtype::f64: case dtype::c64: return 8;
    case dtype::c128: return 16;
  }
  return 1;
}

constexpr std::string_view dtype_name(dtype t) noexcept {
  constexpr std::array<std::string_view, 16> names{"uint8", "int8",    "uint16", "int16", "uint32",
                                                   "int32", "uint64",  "int64",  "float16", "bfloat16",
                                                   "float32", "float64", "complex64", "complex128", "bytes",
                                                   "bool"};
  auto i = static_cast<std::size_t>(t);
  return i < names.size() ? names[i] : std::string_view{"unknown"};
}

/// Where a tensor's bytes live. The core moves host memory; device memory is handled by
/// an integration (e.g. `integrations/cuda.hpp`) that stages it. No CUDA name appears here.
enum class memory_space : std::uint8_t { host, device };

/// Maps a C++ element type to its dtype. Specialise it for your own trivially copyable
/// element types to use them with the shipped container adapters.
template <class T>
struct element_dtype;  // no default: an unknown element type is not a tensor element

#define DEEPCLONE_ELEMENT_DTYPE(T, D) \
  template <> struct element_dtype<T> { static constexpr dtype value = dtype::D; }
DEEPCLONE_ELEMENT_DTYPE(std::uint8_t, u8);
DEEPCLONE_ELEMENT_DTYPE(std::int8_t, i8);
DEEPCLONE_ELEMENT_DTYPE(char, i8);
DEEPCLONE_ELEMENT_DTYPE(std::byte, bytes);
DEEPCLONE_ELEMENT_DTYPE(std::uint16_t, u16);
DEEPCLONE_ELEMENT_DTYPE(std::int16_t, i16);
DEEPCLONE_ELEMENT_DTYPE(std::uint32_t, u32);
DEEPCLONE_ELEMENT_DTYPE(std::int32_t, i32);
DEEPCLONE_ELEMENT_DTYPE(std::uint64_t, u64);
DEEPCLONE_ELEMENT_DTYPE(std::int64_t, i64);
DEEPCLONE_ELEMENT_DTYPE(float, f32);
DEEPCLONE_ELEMENT_DTYPE(double, f64);
DEEPCLONE_ELEMENT_DTYPE(std::complex<float>, c64);
DEEPCLONE_ELEMENT_DTYPE(std::complex<double>, c128);
#undef DEEPCLONE_ELEMENT_DTYPE

/// An element type the shipped adapters accept: trivially copyable with a known dtype.
template <class T>
concept tensor_element = std::is_trivially_copyable_v<T> && requires {
  { element_dtype<std::remove_cv_t<T>>::value } -> std::convertible_to<dtype>;
};

/// The customization point. A specialisation provides:
///   static std::byte*  data(T&);                  // first byte (host or device address)
///   static std::size_t size_bytes(const T&);
///   static dtype       element_type(const T&);
/// and optionally
///   static std::vector<std::int64_t> shape(const T&);   // default: {size/elem}
///   static memory_space space(const T&);                 // default: host
/// The bytes must be contiguous and stay at the same address while a source or clone
/// engine holds the tensor.
template <class T>
struct tensor_traits;  // primary template: not a tensor until specialised

/// A type opted in as a tensor: its traits expose contiguous bytes and a dtype.
template <class T>
concept tensor = requires(T& t, const T& ct) {
  { tensor_traits<T>::data(t) } -> std::same_as<std::byte*>;
  { tensor_traits<T>::size_bytes(ct) } -> std::convertible_to<std::size_t>;
  { tensor_traits<T>::element_type(ct) } -> std::convertible_to<dtype>;
};

/// A tensor whose traits also report a shape.
template <class T>
concept shaped_tensor = tensor<T> && requires(const T& ct) {
  { tensor_traits<T>::shape(ct) } -> std::convertible_to<std::vector<std::int64_t>>;
};

/// A tensor whose traits say where its memory lives (host or device).
template <class T>
concept placed_tensor = tensor<T> && requires(const T& ct) {
  { tensor_traits<T>::space(ct) } -> std::convertible_to<memory_space>;
};

/// Uniform access over the optional parts of the traits.
template <tensor T>
std::span<std::byte> tensor_bytes(T& t) {
  return {tensor_traits<T>::data(t), tensor_traits<T>::size_bytes(t)};
}
template <tensor T>
dtype tensor_dtype(const T& t) { return tensor_traits<T>::element_type(t); }
template <tensor T>
std::vector<std::int64_t> tensor_shape(const T& t) {
  if constexpr (shaped_tensor<T>) {
    return tensor_traits<T>::shape(t);
  } else {
    return {static_cast<std::int64_t>(tensor_traits<T>::size_bytes(t) / dtype_size(tensor_dtype(t)))};
  }
}
template <tensor T>
memory_space tensor_space(const T& t) {
  if constexpr (placed_tensor<T>) return tensor_traits<T>::space(t);
  else return memory_space::host;
}

/// A non-owning view of `count` elements at `data`, with an optional shape: the adapter
/// for raw pointers and for framework buffers that already expose a pointer and a length.
template <tensor_element T>
class raw_view {
 public:
  raw_view(T* data, std::size_t count, std::vector<std::int64_t> shape = {},
           memory_space space = memory_space::host)
      : data_(data), count_(count), shape_(std::move(shape)), space_(space) {
    if (shape_.empty()) shape_.push_back(static_cast<std::int64_t>(count));
  }
  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return count_; }
  const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
  memory_space space() const noexcept { return space_; }

 private:
  T* data_;
  std::size_t count_;
  std::vector<std::int64_t> shape_;
  memory_space space_;
};

template <tensor_element T>
struct tensor_traits<raw_view<T>> {
  static std::byte* data(raw_view<T>& v) { return reinterpret_cast<std::byte*>(v.data()); }
  static std::size_t size_bytes(const raw_view<T>& v) { return v.size() * sizeof(T); }
  static dtype element_type(const raw_view<T>&) { return element_dtype<T>::value; }
  static std::vector<std::int64_t> shape(const raw_view<T>& v) { return v.shape(); }
  static memory_space space(const raw_view<T>& v) { return v.space(); }
};

/// Contiguous host containers of tensor elements: std::vector, std::array, std::span.
template <tensor_element T, class A>
struct tensor_traits<std::vector<T, A>> {
  static std::byte* data(std::vector<T, A>& v) { return reinterpret_cast<std::byte*>(v.data()); }
  static std::size_t size_bytes(const std::vector<T, A>& v) { return v.size() * sizeof(T); }
  static dtype element_type(const std::vector<T, A>&) { return element_dtype<T>::value; }
};
template <tensor_element T, std::size_t N>
struct tensor_traits<std::array<T, N>> {
  static std::byte* data(std::array<T, N>& v) { return reinterpret_cast<std::byte*>(v.data()); }
  static std::size_t size_bytes(const std::array<T, N>&) { return N * sizeof(T); }
  static dtype element_type(const std::array<T, N>&) { return element_dtype<T>::value; }
};
template <tensor_element T, std::size_t E>
  requires(!std::is_const_v<T>)
struct tensor_traits<std::span<T, E>> {
  static std::byte* data(std::span<T, E>& v) { return reinterpret_cast<std::byte*>(v.data()); }
  static std::size_t size_bytes(const std::span<T, E>& v) { return v.size_bytes(); }
  static dtype element_type(const std::span<T, E>&) { return element_dtype<T>::value; }
};

}  // namespace deepclone
