//! The learner: the model (Llama, Qwen2, Qwen3 families) with its forward and backward on the
//! CPU kernels, the optimiser, checkpoints in Hugging Face layout, the tokenizer and the chat template.
//!
//! Owns: model configs, parameters and their on-disk format, training-step mathematics.
//! Never: opens sockets, spawns processes, or knows which pool or machine it runs on; never
//! panics on user input (configs, checkpoints, token ids): those are [`Error`]s that name the
//! file, tensor or value.

pub mod algo;
pub mod bench;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod critic;
pub mod engine;
pub mod error;
pub mod hub;
pub mod model;
pub mod optim;
pub mod params;
pub mod pjrt;
pub mod rl;
pub mod rng;
pub mod tokenizer;
pub mod wire;

pub use config::{Arch, ModelConfig};
pub use error::{Error, Result};
pub use model::{Attend, Batch, Model, Scores, Tape};
pub use params::{Params, ParamsIo, Tensor};
