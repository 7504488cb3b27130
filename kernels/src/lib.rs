//! Numerical kernels for the native CPU engines: forward and backward of every op the model
//! uses, on f32 slices, threaded with rayon.
//!
//! Owns: GEMM (through `gemm`), norms, RoPE, attention, SwiGLU, embedding, the fused
//! log-softmax/log-prob/entropy head, AdamW and gradient-norm utilities.
//! Never: knows about models, checkpoints, configs, or anything asynchronous. Kernels take
//! slices and shapes and return results; allocation policy belongs to the caller.
