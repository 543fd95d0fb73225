// Server-side optimizers, applied lazily: only to the rows a push touched.
//
// Every optimizer works on a span of n floats (one table row, or one dense
// key's slice) with its own slots and its own step counter. The gradient is
// first scaled and clipped the way MXNet does it (g = clip(rescale_grad * g,
// +-clip_gradient)); then the update follows one reference formula:
//
//   kSgd      torch.optim.SGD (weight_decay, momentum, nesterov; dampening=0)
//   kAdagrad  torch.optim.Adagrad (lr_decay, weight_decay, eps,
//             initial_accumulator_value)
//   kAdam     torch.optim.Adam (L2 weight_decay added to the gradient)
//   kAdamW    torch.optim.AdamW (decoupled weight decay)
//   kRmsProp  torch.optim.RMSprop (alpha, eps, centered, momentum, weight_decay)
//   kFtrl     FTRL-proximal as tf.keras.optimizers.Ftrl / TF ApplyFtrl
//             (lr_power, l1, l2, beta, initial_accumulator_value); no
//             weight_decay (use l2).
//
// The step counter t passed to Update is 1 on a row's first update. Adam's
// bias correction and Adagrad's lr_decay use it.
//
//   kvsparse::OptimizerConfig config;
//   config.kind = kvsparse::OptimizerKind::kAdagrad;
//   config.learning_rate = 0.1;
//   kvsparse::Optimizer optimizer(config);
//   std::vector<float> slots(optimizer.num_slots() * dim);
//   optimizer.InitSlots(slots.data(), dim);
//   optimizer.Update(weights, slots.data(), grad, dim, /*step=*/1);
#ifndef KVSPARSE_OPTIMIZER_H_
#define KVSPARSE_OPTIMIZER_H_

#include <cstdint>

#include "status.h"

namespace kvsparse {

enum class OptimizerKind : int {
  kNone = 0,  // no updater: a push replaces the value (MXNet without updater)
  kSgd = 1,
  kAdagrad = 2,
  kAdam = 3,
  kAdamW = 4,
  kFtrl = 5,
  kRmsProp = 6,
};

// How Adam/AdamW count steps for bias correction.
enum class StepMode : int {
  kPerRow = 0,    // each row counts its own updates (default: truly lazy)
  kPerTable = 1,  // one counter per table, bumped once per push
                  // (torch.optim.SparseAdam, TF LazyAdam)
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kNone;
  double learning_rate = 0.01;
  double weight_decay = 0.0;
  double rescale_grad = 1.0;
  double clip_gradient = -1.0;  // <= 0: no clipping
  double momentum = 0.0;        // SGD, RMSProp
  bool nesterov = false;        // SGD
  double lr_decay = 0.0;        // Adagrad
  double epsilon = 1e-8;        // Adagrad (torch default 1e-10), Adam, RMSProp
  double initial_accumulator_value = 0.0;  // Adagrad, FTRL (TF default 0.1)
  double beta1 = 0.9;                      // Adam
  double beta2 = 0.999;                    // Adam
  double lr_power = -0.5;                  // FTRL
  double l1 = 0.0;                         // FTRL
  double l2 = 0.0;                         // FTRL
  double beta = 0.0;                       // FTRL
  double alpha = 0.99;                     // RMSProp smoothing
  bool centered = false;                   // RMSProp
  StepMode step_mode = StepMode::kPerRow;
  // Adam, Adagrad, RMSProp only: MXNet 1.x's formulas instead of torch.optim's, so
  // that MXNet's optimizers run unchanged on the servers (adapters/mxnet.py):
  //   Adam     g = clip(rescale*g + wd*w); w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)
  //   Adagrad  g = clip(rescale*g); h += g^2; w -= lr*(g/sqrt(h+eps) + wd*w)
  //   RMSProp  g = clip(rescale*g + wd*w); n = a*n + (1-a)*g^2;
  //            w -= lr*g/sqrt(n+eps), or centered (Graves) with momentum:
  //            buf = m*buf + g/sqrt(n - gavg^2 + eps); w -= lr*buf
  bool mxnet_formula = false;
  // Not read by Optimizer: a 16-bit EmbeddingTable keeps a float32 master copy of each
  // row that the optimizer updates, and stores it rounded (MXNet's multi_precision; issue
  // 12). The shard reads it for 16-bit dense keys. float32 tables ignore it.
  bool multi_precision = false;
};

Status ValidateOptimizer(const OptimizerConfig& config);

class Optimizer {
 public:
  explicit Optimizer(const OptimizerConfig& config);

  const OptimizerConfig& config() const { return config_; }
  // Number of per-element slot arrays (each n floats) this optimizer keeps.
  int num_slots() const { return num_slots_; }
  // Writes the initial slot values of a span of n elements.
  void InitSlots(float* slots, int64_t n) const;
  // Updates n weights with gradient g. slots holds num_slots() arrays of n
  // floats back to back. scratch must hold n floats.
  void Update(float* weights, float* slots, const float* g, int64_t n, int64_t step,
              float* scratch) const;

 private:
  OptimizerConfig config_;
  int num_slots_;
};

}  // namespace kvsparse

#endif  // KVSPARSE_OPTIMIZER_H_
