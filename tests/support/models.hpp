#pragma once
// Loads the reference model layouts (tests/models/*.csv, copied from the real state dicts
// of five models) into deepclone layouts, optionally with optimizer slots added the way a
// real optimizer would: one tensor per parameter for SGD with momentum, two for Adam.
#include <deepclone/layout.hpp>

#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace deepclone::testing {

enum class optimizer { none, momentum, adam };

inline const std::vector<std::string>& model_names() {
  static const std::vector<std::string> names{"mobilenet_v3_large", "resnet50", "vgg16", "vit_l_16", "bert_large"};
  return names;
}

inline dtype parse_dtype(const std::string& s) {
  static const std::map<std::string, dtype> m{{"float32", dtype::f32}, {"float16", dtype::f16}, {"bfloat16", dtype::bf16},
                                              {"float64", dtype::f64}, {"int64", dtype::i64},   {"int32", dtype::i32},
                                              {"uint8", dtype::u8},    {"int8", dtype::i8}};
  auto it = m.find(s);
  if (it == m.end()) throw std::runtime_error("unknown dtype in model CSV: " + s);
  return it->second;
}

/// Reads `dir/name.csv`. Layers keep the CSV's (forward) order; a param gets its optimizer
/// slots right after it in the same layer.
inline layout load_model(const std::string& dir, const std::string& name, optimizer opt = optimizer::none) {
  std::ifstream in(dir + "/" + name + ".csv");
  if (!in) throw std::runtime_error("cannot open model layout " + dir + "/" + name + ".csv");
  std::string line;
  std::getline(in, line);  // header
  std::vector<layer_desc> layers;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) f.push_back(cell);
    if (f.size() != 7) throw std::runtime_error("bad model CSV line: " + line);
    const std::string layer = f[0].empty() ? "(root)" : f[0];
    if (layers.empty() || layers.back().name != layer) layers.push_back({layer, {}});
    tensor_desc t{f[1], std::stoull(f[6]), parse_dtype(f[3]), {}};
    std::stringstream sh(f[4]);
    while (std::getline(sh, cell, 'x')) t.shape.push_back(std::stoll(cell));
    layers.back().tensors.push_back(t);
    if (f[2] == "param") {
      if (opt != optimizer::none) {
        auto slot = t;
        slot.name = t.name + (opt == optimizer::adam ? ".exp_avg" : ".momentum");
        layers.back().tensors.push_back(slot);
      }
      if (opt == optimizer::adam) {
        auto slot = t;
        slot.name = t.name + ".exp_avg_sq";
        layers.back().tensors.push_back(slot);
      }
    }
  }
  return layout(std::move(layers));
}

}  // namespace deepclone::testing
