#include "optimizer.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace kvsparse {

namespace {

int SlotsFor(const OptimizerConfig& c) {
  switch (c.kind) {
    case OptimizerKind::kNone:
      return 0;
    case OptimizerKind::kSgd:
      return c.momentum > 0.0 ? 1 : 0;  // momentum buffer
    case OptimizerKind::kAdagrad:
      return 1;  // state_sum
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return 2;  // exp_avg, exp_avg_sq
    case OptimizerKind::kFtrl:
      return 2;  // z (linear), n (accumulator)
    case OptimizerKind::kRmsProp:
      return 1 + (c.momentum > 0.0 ? 1 : 0) + (c.centered ? 1 : 0);
  }
  return 0;
}

Status Invalid(const std::string& what) {
  return Status(StatusCode::kInvalidArgument, what);
}

}  // namespace

Status ValidateOptimizer(const OptimizerConfig& c) {
  if (!(c.learning_rate >= 0.0) || !std::isfinite(c.learning_rate))
    return Invalid("learning_rate must be a finite number >= 0");
  if (!(c.weight_decay >= 0.0)) return Invalid("weight_decay must be >= 0");
  if (!std::isfinite(c.rescale_grad)) return Invalid("rescale_grad must be finite");
  if (!(c.momentum >= 0.0)) return Invalid("momentum must be >= 0");
  if (c.nesterov && !(c.momentum > 0.0)) return Invalid("nesterov needs momentum > 0");
  if (!(c.epsilon >= 0.0)) return Invalid("epsilon must be >= 0");
  if (!(c.beta1 >= 0.0 && c.beta1 < 1.0)) return Invalid("beta1 must be in [0, 1)");
  if (!(c.beta2 >= 0.0 && c.beta2 < 1.0)) return Invalid("beta2 must be in [0, 1)");
  if (!(c.alpha >= 0.0)) return Invalid("alpha must be >= 0");
  if (!(c.initial_accumulator_value >= 0.0))
    return Invalid("initial_accumulator_value must be >= 0");
  if (c.mxnet_formula && c.kind != OptimizerKind::kAdam && c.kind != OptimizerKind::kAdagrad &&
      c.kind != OptimizerKind::kRmsProp)
    return Invalid("formula 'mxnet' exists for adam, adagrad and rmsprop only");
  if (c.mxnet_formula && c.kind == OptimizerKind::kAdagrad && c.lr_decay != 0.0)
    return Invalid("MXNet's AdaGrad has no lr_decay");
  if (c.kind == OptimizerKind::kFtrl) {
    if (!(c.lr_power <= 0.0)) return Invalid("FTRL lr_power must be <= 0");
    if (!(c.l1 >= 0.0) || !(c.l2 >= 0.0)) return Invalid("FTRL l1 and l2 must be >= 0");
    if (!(c.learning_rate > 0.0)) return Invalid("FTRL learning_rate must be > 0");
    if (c.weight_decay != 0.0) return Invalid("FTRL has no weight_decay; use l2");
    if (c.lr_power < 0.0 && c.initial_accumulator_value == 0.0 && c.lr_power != -0.5)
      return Invalid("FTRL with lr_power other than -0.5 needs initial_accumulator_value > 0");
  }
  return Status::Ok();
}

Optimizer::Optimizer(const OptimizerConfig& config)
    : config_(config), num_slots_(SlotsFor(config)) {}

void Optimizer::InitSlots(float* slots, int64_t n) const {
  const int64_t total = n * num_slots_;
  std::fill(slots, slots + total, 0.0f);
  const float accumulator = static_cast<float>(config_.initial_accumulator_value);
  if (config_.kind == OptimizerKind::kAdagrad) {
    std::fill(slots, slots + n, accumulator);
  } else if (config_.kind == OptimizerKind::kFtrl) {
    std::fill(slots + n, slots + 2 * n, accumulator);
  }
}

// An AVX2 clone (no FMA: same rounding as SSE2) is chosen at load time where the CPU has it (GCC ifunc);
// the default clone keeps the module runnable on any x86-64. The math is
// sqrt/div bound: 8 lanes instead of SSE2's 4.
// Not under ThreadSanitizer: it instruments the ifunc resolver, which runs
// while the module is being relocated, before the runtime can serve it (a
// jump to an unrelocated address at import).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
void Optimizer::Update(float* __restrict w, float* __restrict slots,
                       const float* __restrict grad, int64_t n, int64_t step,
                       float* __restrict g) const {
  const OptimizerConfig& c = config_;
  const float rescale = static_cast<float>(c.rescale_grad);
  const float clip = static_cast<float>(c.clip_gradient);
  const float lr = static_cast<float>(c.learning_rate);
  const float wd = static_cast<float>(c.weight_decay);
  // MXNet's Adam and RMSProp add weight decay before clipping.
  const bool wd_before_clip = c.mxnet_formula && c.kind != OptimizerKind::kAdagrad;
  // MXNet order: rescale, clip, then (for L2-style optimizers) weight decay.
  for (int64_t i = 0; i < n; ++i) {
    float x = grad[i] * rescale;
    if (wd_before_clip) x += wd * w[i];
    if (clip > 0.0f) x = std::min(std::max(x, -clip), clip);
    g[i] = x;
  }
  const bool l2_in_grad = !c.mxnet_formula && (c.kind == OptimizerKind::kSgd ||
                                               c.kind == OptimizerKind::kAdagrad ||
                                               c.kind == OptimizerKind::kAdam ||
                                               c.kind == OptimizerKind::kRmsProp);
  if (l2_in_grad && wd != 0.0f) {
    for (int64_t i = 0; i < n; ++i) g[i] += wd * w[i];
  }

  switch (c.kind) {
    case OptimizerKind::kNone:
      // No updater: the pushed value replaces the weight (MXNet semantics).
      std::copy(g, g + n, w);
      return;

    case OptimizerKind::kSgd: {
      if (c.momentum > 0.0) {
        const float m = static_cast<float>(c.momentum);
        float* buf = slots;
        for (int64_t i = 0; i < n; ++i) {
          buf[i] = m * buf[i] + g[i];
          const float d = c.nesterov ? g[i] + m * buf[i] : buf[i];
          w[i] -= lr * d;
        }
      } else {
        for (int64_t i = 0; i < n; ++i) w[i] -= lr * g[i];
      }
      return;
    }

    case OptimizerKind::kAdagrad: {
      const float clr =
          static_cast<float>(c.learning_rate / (1.0 + static_cast<double>(step - 1) * c.lr_decay));
      const float eps = static_cast<float>(c.epsilon);
      float* sum = slots;
      if (c.mxnet_formula) {
        for (int64_t i = 0; i < n; ++i) {
          sum[i] += g[i] * g[i];
          w[i] -= clr * (g[i] / std::sqrt(sum[i] + eps) + wd * w[i]);
        }
        return;
      }
      for (int64_t i = 0; i < n; ++i) {
        sum[i] += g[i] * g[i];
        w[i] -= clr * g[i] / (std::sqrt(sum[i]) + eps);
      }
      return;
    }

    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      if (c.kind == OptimizerKind::kAdamW && wd != 0.0f) {
        const float decay = 1.0f - lr * wd;
        for (int64_t i = 0; i < n; ++i) w[i] *= decay;
      }
      const float b1 = static_cast<float>(c.beta1);
      const float b2 = static_cast<float>(c.beta2);
      const double t = static_cast<double>(step);
      const float step_size = static_cast<float>(c.learning_rate / (1.0 - std::pow(c.beta1, t)));
      const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(c.beta2, t)));
      const float eps = static_cast<float>(c.epsilon);
      float* m = slots;
      float* v = slots + n;
      if (c.mxnet_formula) {
        // MXNet folds both corrections into the learning rate; eps stays uncorrected.
        const float corrected_lr = step_size * bc2_sqrt;
        for (int64_t i = 0; i < n; ++i) {
          m[i] = b1 * m[i] + (1.0f - b1) * g[i];
          v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
          w[i] -= corrected_lr * m[i] / (std::sqrt(v[i]) + eps);
        }
        return;
      }
      for (int64_t i = 0; i < n; ++i) {
        m[i] += (g[i] - m[i]) * static_cast<float>(1.0 - c.beta1);  // torch's lerp_
        v[i] = v[i] * b2 + static_cast<float>(1.0 - c.beta2) * g[i] * g[i];
        const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
        w[i] -= step_size * m[i] / denom;
      }
      return;
    }

    case OptimizerKind::kRmsProp: {
      const float alpha = static_cast<float>(c.alpha);
      const float eps = static_cast<float>(c.epsilon);
      const float mom = static_cast<float>(c.momentum);
      const float one_minus_alpha =
          c.mxnet_formula ? 1.0f - alpha : static_cast<float>(1.0 - c.alpha);
      float* square_avg = slots;
      float* next = slots + n;
      float* buf = nullptr;
      float* grad_avg = nullptr;
      if (c.momentum > 0.0) {
        buf = next;
        next += n;
      }
      if (c.centered) grad_avg = next;
      for (int64_t i = 0; i < n; ++i) {
        square_avg[i] = square_avg[i] * alpha + one_minus_alpha * g[i] * g[i];
        float avg;
        if (grad_avg != nullptr) {
          grad_avg[i] += (g[i] - grad_avg[i]) * one_minus_alpha;
          const float var = square_avg[i] - grad_avg[i] * grad_avg[i];
          avg = c.mxnet_formula ? std::sqrt(var + eps) : std::sqrt(var) + eps;
        } else {
          avg = c.mxnet_formula ? std::sqrt(square_avg[i] + eps) : std::sqrt(square_avg[i]) + eps;
        }
        if (buf != nullptr) {
          buf[i] = buf[i] * mom + g[i] / avg;
          w[i] -= lr * buf[i];
        } else {
          w[i] -= lr * g[i] / avg;
        }
      }
      return;
    }

    case OptimizerKind::kFtrl: {
      // TF ApplyFtrl: sigma uses the accumulator before and after this step.
      const double p = -c.lr_power;  // accumulator exponent, 0.5 by default
      const double l1 = c.l1;
      const double l2 = c.l2;
      const double beta = c.beta;
      const double eta = c.learning_rate;
      float* z = slots;
      float* acc = slots + n;
      for (int64_t i = 0; i < n; ++i) {
        const double gi = g[i];
        const double acc_old = acc[i];
        const double acc_new = acc_old + gi * gi;
        const double pow_new = p == 0.5 ? std::sqrt(acc_new) : std::pow(acc_new, p);
        const double pow_old = p == 0.5 ? std::sqrt(acc_old) : std::pow(acc_old, p);
        const double sigma = (pow_new - pow_old) / eta;
        const double zi = static_cast<double>(z[i]) + gi - sigma * static_cast<double>(w[i]);
        z[i] = static_cast<float>(zi);
        acc[i] = static_cast<float>(acc_new);
        const double quadratic = (beta + pow_new) / eta + 2.0 * l2;
        if (std::fabs(zi) > l1) {
          const double sign = zi > 0 ? 1.0 : -1.0;
          w[i] = static_cast<float>((sign * l1 - zi) / quadratic);
        } else {
          w[i] = 0.0f;
        }
      }
      return;
    }
  }
}

}  // namespace kvsparse
