//! Model configuration read from a Hugging Face `config.json` (Llama, Qwen2 and Qwen3
//! families), validated, and written back.

use crate::error::{Error, Result};
use kernels::rope::Llama3Scaling;
use serde_json::{Map, Value, json};
use std::path::Path;

/// Which model family: decides biases and q/k norms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `model_type: llama` (also Mistral-style configs without sliding windows).
    Llama,
    /// `model_type: qwen2`: q/k/v projections carry biases.
    Qwen2,
    /// `model_type: qwen3`: RMSNorm on q and k per head, explicit `head_dim`.
    Qwen3,
}

impl Arch {
    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
    fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }
    /// Parses a `model_type` or `arch` name.
    pub fn parse(name: &str) -> Option<Arch> {
        match name.to_ascii_lowercase().as_str() {
            "llama" | "mistral" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }
}

/// A validated model configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// SwiGLU inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama-3 RoPE scaling, when configured.
    pub rope_scaling: Option<Llama3Scaling>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Whether `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest sequence the model accepts.
    pub max_position_embeddings: usize,
    /// Biases on q/k/v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Token that ends generation, when the config names one.
    pub eos_token_id: Option<u32>,
    /// The JSON this config was read from, kept so that saving writes back every field.
    pub raw: Value,
}

fn get<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(path, format!("invalid JSON: {e}")))?;
        Self::from_json(value, path)
    }

    /// Validates a config given as JSON (`origin` names it in errors).
    pub fn from_json(value: Value, origin: &Path) -> Result<Self> {
        let err = |msg: String| Error::config(origin, msg);
        let obj = value
            .as_object()
            .ok_or_else(|| err("expected a JSON object".into()))?;
        let usize_field = |key: &str| -> Result<Option<usize>> {
            match get(obj, key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| {
                        err(format!("field `{key}` must be a positive integer, got {v}"))
                    }),
            }
        };
        let required = |key: &str| -> Result<usize> {
            usize_field(key)?.ok_or_else(|| err(format!("missing field `{key}`")))
        };
        let float_field = |key: &str, v: &Value| -> Result<f64> {
            v.as_f64()
                .ok_or_else(|| err(format!("field `{key}` must be a number, got {v}")))
        };
        let model_type = get(obj, "model_type")
            .and_then(Value::as_str)
            .or_else(|| get(obj, "arch").and_then(Value::as_str))
            .ok_or_else(|| err("missing field `model_type` (one of llama, qwen2, qwen3)".into()))?;
        let arch = Arch::parse(model_type).ok_or_else(|| {
            err(format!("unknown architecture `{model_type}` in `model_type`: supported are llama, qwen2, qwen3"))
        })?;
        if let Some(act) = get(obj, "hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(err(format!(
                "field `hidden_act` is `{act}`: only `silu` is supported"
            )));
        }
        if get(obj, "use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(err(
                "field `use_sliding_window` is true: sliding-window attention is not supported"
                    .into(),
            ));
        }
        let hidden_size = required("hidden_size")?;
        let num_heads = required("num_attention_heads")?;
        let num_kv_heads = usize_field("num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads % num_kv_heads != 0 {
            return Err(err(format!(
                "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let head_dim = match usize_field("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(err(format!(
                    "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}); give `head_dim`"
                )));
            }
        };
        if head_dim % 2 != 0 {
            return Err(err(format!(
                "head_dim ({head_dim}) must be even for rotary embeddings"
            )));
        }
        // RoPE: transformers 5 nests it under rope_parameters; older configs keep it top level.
        let rope_params = get(obj, "rope_parameters").and_then(Value::as_object);
        let rope_theta = match rope_params
            .and_then(|p| get(p, "rope_theta"))
            .or_else(|| get(obj, "rope_theta"))
        {
            Some(v) => float_field("rope_theta", v)?,
            None => 10000.0,
        };
        let scaling_obj = get(obj, "rope_scaling")
            .and_then(Value::as_object)
            .or(rope_params);
        let rope_scaling = match scaling_obj {
            None => None,
            Some(s) => {
                let kind = get(s, "rope_type")
                    .or_else(|| get(s, "type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                match kind {
                    "default" => None,
                    "llama3" => {
                        let f = |k: &str| -> Result<f64> {
                            let v = get(s, k)
                                .ok_or_else(|| err(format!("rope scaling `llama3` needs `{k}`")))?;
                            float_field(k, v)
                        };
                        Some(Llama3Scaling {
                            factor: f("factor")?,
                            low_freq_factor: f("low_freq_factor")?,
                            high_freq_factor: f("high_freq_factor")?,
                            original_max_position_embeddings: f(
                                "original_max_position_embeddings",
                            )?,
                        })
                    }
                    other => {
                        return Err(err(format!(
                            "rope scaling type `{other}` is not supported (supported: default, llama3)"
                        )));
                    }
                }
            }
        };
        let rms_norm_eps = match get(obj, "rms_norm_eps") {
            Some(v) => float_field("rms_norm_eps", v)? as f32,
            None => 1e-6,
        };
        let attention_bias = get(obj, "attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let eos_token_id = match get(obj, "eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| v as u32),
            Some(Value::Array(a)) => a.first().and_then(Value::as_u64).map(|v| v as u32),
            _ => None,
        };
        let config = Self {
            arch,
            vocab_size: required("vocab_size")?,
            hidden_size,
            intermediate_size: required("intermediate_size")?,
            num_layers: required("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta,
            rope_scaling,
            rms_norm_eps,
            tie_word_embeddings: get(obj, "tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_position_embeddings: usize_field("max_position_embeddings")?.unwrap_or(4096),
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: arch != Arch::Qwen2 && attention_bias,
            eos_token_id,
            raw: Value::Null,
        };
        Ok(Self {
            raw: value,
            ..config
        })
    }

    /// The config as Hugging Face `config.json`: the original fields when it was read from one,
    /// completed with every field Trellis uses.
    pub fn to_hf_json(&self) -> Value {
        let mut obj = self.raw.as_object().cloned().unwrap_or_default();
        obj.remove("arch");
        let mut set = |k: &str, v: Value| {
            obj.insert(k.to_string(), v);
        };
        set("architectures", json!([self.arch.hf_class()]));
        set("model_type", json!(self.arch.model_type()));
        set("vocab_size", json!(self.vocab_size));
        set("hidden_size", json!(self.hidden_size));
        set("intermediate_size", json!(self.intermediate_size));
        set("num_hidden_layers", json!(self.num_layers));
        set("num_attention_heads", json!(self.num_heads));
        set("num_key_value_heads", json!(self.num_kv_heads));
        set("head_dim", json!(self.head_dim));
        set("rms_norm_eps", json!(self.rms_norm_eps));
        set("tie_word_embeddings", json!(self.tie_word_embeddings));
        set(
            "max_position_embeddings",
            json!(self.max_position_embeddings),
        );
        set("hidden_act", json!("silu"));
        if self.arch != Arch::Qwen2 {
            set("attention_bias", json!(self.o_bias));
        }
        if self.raw.get("rope_parameters").is_none_or(Value::is_null) {
            set("rope_theta", json!(self.rope_theta));
        }
        if let Some(eos) = self.eos_token_id {
            set("eos_token_id", json!(eos));
        }
        // f32, as the weights train (a checkpoint written in bf16 says so instead); both names
        // (transformers renamed it `dtype`).
        set("torch_dtype", json!("float32"));
        set("dtype", json!("float32"));
        Value::Object(obj)
    }

    /// Parameter count.
    pub fn num_params(&self) -> usize {
        let (h, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.num_heads * d, self.num_kv_heads * d);
        let mut layer = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * i;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.o_bias {
            layer += h;
        }
        if self.arch == Arch::Qwen3 {
            layer += 2 * d;
        }
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + self.num_layers * layer + h + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(v, Path::new("config.json"))
    }

    #[test]
    fn reads_the_fixture_config() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tiny-qwen2/checkpoint");
        let c = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        assert_eq!(
            (
                c.arch,
                c.hidden_size,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim
            ),
            (Arch::Qwen2, 64, 4, 2, 16)
        );
        assert_eq!(c.rope_theta, 10000.0);
        assert!(c.qkv_bias && !c.o_bias && !c.tie_word_embeddings);
        assert_eq!(c.eos_token_id, Some(0));
    }

    #[test]
    fn refuses_bad_configs_naming_the_field() {
        let base = json!({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                          "num_hidden_layers": 1, "num_attention_heads": 2});
        assert!(parse(base.clone()).is_ok());
        let with = |k: &str, v: Value| {
            let mut o = base.clone();
            o[k] = v;
            parse(o).unwrap_err().to_string()
        };
        assert!(with("model_type", json!("gpt2")).contains("unknown architecture `gpt2`"));
        assert!(
            with("hidden_size", json!(-3)).contains("`hidden_size` must be a positive integer")
        );
        assert!(with("num_key_value_heads", json!(3)).contains("multiple of num_key_value_heads"));
        assert!(
            with("rope_scaling", json!({"rope_type": "yarn", "factor": 2.0}))
                .contains("`yarn` is not supported")
        );
        let mut missing = base.clone();
        missing.as_object_mut().unwrap().remove("vocab_size");
        assert!(
            parse(missing)
                .unwrap_err()
                .to_string()
                .contains("missing field `vocab_size`")
        );
    }
}
