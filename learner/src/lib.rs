//! The learner: the model, its forward and backward, the optimiser, RL losses and advantage
//! estimators, checkpoints in Hugging Face layout, and the `TrainingEngine` trait.
//!
//! Never: opens sockets, spawns processes, or knows which pool or machine it runs on.
