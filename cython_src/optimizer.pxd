# Mirrors csrc/optimizer.h.
from libc.stdint cimport int64_t

from status cimport Status


cdef extern from "optimizer.h" namespace "kvsparse" nogil:
    cdef enum class OptimizerKind(int):
        kNone
        kSgd
        kAdagrad
        kAdam
        kAdamW
        kFtrl
        kRmsProp

    cdef enum class StepMode(int):
        kPerRow
        kPerTable

    cdef cppclass OptimizerConfig:
        OptimizerKind kind
        double learning_rate
        double weight_decay
        double rescale_grad
        double clip_gradient
        double momentum
        bint nesterov
        double lr_decay
        double epsilon
        double initial_accumulator_value
        double beta1
        double beta2
        double lr_power
        double l1
        double l2
        double beta
        double alpha
        bint centered
        StepMode step_mode
        bint mxnet_formula
        bint multi_precision

    Status ValidateOptimizer(const OptimizerConfig& config)

    cdef cppclass Optimizer:
        Optimizer(const OptimizerConfig& config)
        int num_slots()
        void InitSlots(float* slots, int64_t n)
        void Update(float* weights, float* slots, const float* g, int64_t n, int64_t step,
                    float* scratch)
