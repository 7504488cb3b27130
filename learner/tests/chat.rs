//! Chat prompts against transformers, token for token: for Llama-3-, Qwen2.5- and Mistral-style
//! checkpoints (`tests/data/chat/*`, made by `tests/data/chat/make.py` with transformers), the
//! checkpoint's template renders each conversation to the text `apply_chat_template` rendered,
//! and encoding it without added special tokens gives the ids `apply_chat_template(...,
//! tokenize=True)` gave — one BOS, the template's, never two. SFT answers encode as
//! `tokenizer(text, add_special_tokens=False)` and plain prompts as `tokenizer(text)`.

use learner::chat::{ChatTemplate, Message};
use learner::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::PathBuf;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn chat_prompts_match_transformers_token_for_token() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/chat");
    let mut checked = 0;
    let mut wrong = Vec::new();
    for family in ["llama3", "qwen2.5", "mistral"] {
        let dir = root.join(family);
        let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        let template = ChatTemplate::find(&dir, None).unwrap().unwrap();
        let cases: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap())
                .unwrap();
        for (i, c) in cases["chats"].as_array().unwrap().iter().enumerate() {
            let messages: Vec<Message> = serde_json::from_value(c["messages"].clone()).unwrap();
            let generation = c["add_generation_prompt"].as_bool().unwrap();
            let text = template.render(&messages, generation).unwrap();
            if text != c["text"].as_str().unwrap() {
                wrong.push(format!(
                    "{family} chat {i}: text {text:?}\n  want {}",
                    c["text"]
                ));
                continue;
            }
            let got = tok.encode_rendered(&text).unwrap();
            if got != ids(&c["ids"]) {
                wrong.push(format!(
                    "{family} chat {i}: ids {got:?}\n  want {}",
                    c["ids"]
                ));
            }
            checked += 1;
        }
        for (kind, special) in [("answers", false), ("prompts", true)] {
            for (i, c) in cases[kind].as_array().unwrap().iter().enumerate() {
                let text = c["text"].as_str().unwrap();
                let got = if special {
                    tok.encode(text).unwrap()
                } else {
                    tok.encode_rendered(text).unwrap()
                };
                if got != ids(&c["ids"]) {
                    wrong.push(format!("{family} {kind} {i}: {got:?}\n  want {}", c["ids"]));
                }
                checked += 1;
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(checked, 6 + 6 + 5 + 3 * (4 + 3), "every fixture case ran");
}
