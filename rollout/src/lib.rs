//! Rollout: the `InferenceEngine` trait and its engines, tasks, environments and rewards.
//!
//! Never: trains, or schedules work across engines beyond one pool's router.
