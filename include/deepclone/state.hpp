#pragma once
/// \file state.hpp
/// A training state as deepclone sees it: the user's own tensors, grouped into layers in
/// forward order, plus the replicated metadata. deepclone keeps pointers to the user's
/// tensor objects and reads or writes their bytes in place (no copy, no serialization).

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "error.hpp"
#include "layout.hpp"
#include "metadata.hpp"
#include "tensor.hpp"

namespace deepclone {

/// A tensor with its name inside a layer; built implicitly from {"weight", w}.
template <tensor T>
struct named {
  named(std::string n, T& t) : name(std::move(n)), ref(&t) {}
  std::string name;
  T* ref;
};

/// Layers of named user tensors plus metadata. Optimizer slots (momentum, Adam moments)
/// and non-trained buffers (batch-norm statistics) are tensors of their layer too: a
/// clone needs them to resume bit for bit.
///
///   deepclone::state<std::vector<float>> s;
///   s.add_layer("fc1", {{"weight", w1}, {"bias", b1}, {"weight.momentum", m1}});
template <tensor T>
class state {
 public:
  using tensor_type = T;

  /// Appends a layer. Layer order is forward order; the layer index is what the hooks
  /// and `wait_layer` take.
  std::size_t add_layer(std::string name, std::initializer_list<named<T>> tensors) {
    return add_layer(std::move(name), std::vector<named<T>>(tensors));
  }
  std::size_t add_layer(std::string name, std::vector<named<T>> tensors) {
    for (auto& t : tensors)
      if (t.ref == nullptr) throw error(errc::invalid_argument, "layer '" + name + "': tensor '" + t.name + "' is null");
    layers_.push_back({std::move(name), std::move(tensors)});
    return layers_.size() - 1;
  }

  std::size_t layer_count() const noexcept { return layers_.size(); }
  const std::string& layer_name(std::size_t l) const { return layers_.at(l).name; }
  std::vector<named<T>>& layer_tensors(std::size_t l) { return layers_.at(l).tensors; }

  /// The layout as of now (sizes and dtypes read through the traits).
  layout describe() const {
    std::vector<layer_desc> out;
    out.reserve(layers_.size());
    for (auto& l : layers_) {
      layer_desc d{l.name, {}};
      for (auto& t : l.tensors) {
        const T& ct = *t.ref;
        d.tensors.push_back({t.name, tensor_traits<T>::size_bytes(ct), tensor_dtype(ct), tensor_shape(ct)});
      }
      out.push_back(std::move(d));
    }
    return layout(std::move(out));
  }

  /// Bytes of the tensor with flat index `flat` (layer order, then tensor order).
  std::span<std::byte> bytes(std::size_t flat) { return tensor_bytes(*at(flat).ref); }
  memory_space space(std::size_t flat) const { return tensor_space(*at(flat).ref); }

  deepclone::metadata& metadata() noexcept { return meta_; }
  const deepclone::metadata& metadata() const noexcept { return meta_; }

 private:
  struct layer {
    std::string name;
    std::vector<named<T>> tensors;
  };
  const named<T>& at(std::size_t flat) const {
    for (auto& l : layers_) {
      if (flat < l.tensors.size()) return l.tensors[flat];
      flat -= l.tensors.size();
    }
    throw error(errc::invalid_argument, "tensor index out of range");
  }
  std::vector<layer> layers_;
  deepclone::metadata meta_;
};

}  // namespace deepclone
