//! What constrained decoding costs per token on a real vocabulary: o200k
//! (200,019 tokens; K3's is 163,840), a JSON schema, a target document fed
//! token by token (each checked against the mask).
//!
//!     cargo run --release -p waste-grammar --example mask_bench [-- O200K_FILE]

use serde_json::json;
use std::time::Instant;
use waste_grammar::{json_lark, Grammars};
use waste_tokenizer::TokenConstraint;
use waste_tokenizer::{Pattern, Tokenizer};

fn main() {
    let path = std::env::args().nth(1).unwrap_or_else(|| "testdata/tokenizers/o200k_base.tiktoken".into());
    let tok = Tokenizer::from_files(std::path::Path::new(&path), None, Pattern::O200k).expect("o200k ranks");
    let vocab = tok.vocab_len() + 1;
    let rss = || {
        std::fs::read_to_string("/proc/self/statm")
            .ok()
            .and_then(|s| s.split_whitespace().nth(1).and_then(|x| x.parse::<u64>().ok()))
            .unwrap_or(0)
            * 4096
    };
    let rss0 = rss();
    let t0 = Instant::now();
    let g = Grammars::new(&tok, vocab, vocab as u32 - 1).expect("grammars");
    let build = t0.elapsed().as_secs_f64();
    let rss1 = rss();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}},
        "required": ["name", "age", "city", "tags", "address"], "additionalProperties": false});
    let doc = r#"{"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "city": "Paris", "tags": ["math", "engines", "poetry of science"], "address": {"street": "12 St James's Square", "zip": "75001"}}"#;
    let ids = tok.encode_plain(doc);
    let mut mask = vec![false; vocab];
    let mut times = Vec::new();
    for run in 0..5 {
        let t1 = Instant::now();
        let mut c = g.constraint(&json_lark(Some(&schema), false, false)).expect("grammar");
        let compile = t1.elapsed().as_secs_f64();
        let mut per = Vec::new();
        for &id in &ids {
            let t = Instant::now();
            mask.iter_mut().for_each(|m| *m = false);
            c.allowed(&mut mask).expect("mask");
            per.push(t.elapsed().as_secs_f64());
            assert!(mask[id as usize], "token {id} of the document not allowed");
            c.commit(id).expect("commit");
        }
        per.sort_by(f64::total_cmp);
        if run > 0 {
            times.push((
                compile,
                per[per.len() / 2],
                per[0],
                per[per.len() - 1],
                per.iter().sum::<f64>() / per.len() as f64,
            ));
        }
    }
    println!(
        "vocab {vocab}: trie + factory {:.1} ms, resident +{:.1} MiB; document {} tokens",
        build * 1e3,
        (rss1 as f64 - rss0 as f64) / 1048576.0,
        ids.len()
    );
    for (compile, med, lo, hi, mean) in times {
        println!(
            "grammar {:.2} ms | mask per token: median {:.3} ms, range {:.3}-{:.3} ms, mean {:.3} ms",
            compile * 1e3,
            med * 1e3,
            lo * 1e3,
            hi * 1e3,
            mean * 1e3
        );
    }
}
