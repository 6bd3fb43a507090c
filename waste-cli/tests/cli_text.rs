//! The text interface of `waste` on the anchor container: run from an
//! argument and from stdin, tokenize/detokenize, and a chat saved after two
//! turns and reloaded in a new process continuing with exactly the same text.

mod common;

use common::{anchor, waste};

#[test]
fn chat_state_saved_after_two_turns_continues_identically_in_a_new_process() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let f = std::env::temp_dir().join(format!("waste-chat-{}.state", std::process::id()));
    let fs = f.to_str().unwrap();
    let (code, out_a, err) = waste(
        &["chat", m, "-n", "10"],
        &format!("hello there\nwhat is the weather\n/save {fs}\ntell me about Paris\n"),
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("[saved"), "{err}");
    let (code, out_b, err) = waste(&["chat", m, "-n", "10"], &format!("/load {fs}\ntell me about Paris\n"));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("[loaded"), "{err}");
    assert!(out_b.len() > 1, "third turn produced no text");
    assert!(out_a.ends_with(&out_b), "uninterrupted:\n{out_a:?}\nreloaded:\n{out_b:?}");
    // the saved state held both earlier turns
    let n: usize = err.split("[loaded ").nth(1).and_then(|r| r.split(' ').next()).and_then(|x| x.parse().ok()).unwrap();
    assert!(n > 20, "{err}");
    std::fs::remove_file(&f).ok();
}

#[test]
fn run_reads_argument_or_stdin_and_prints_json() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let (code, out, err) = waste(&["run", m, "the weather in Paris", "-n", "6", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 6);
    let (code, out2, _) = waste(&["run", m, "-", "-n", "6", "--json"], "the weather in Paris");
    assert_eq!(code, 0);
    let v2: serde_json::Value = serde_json::from_str(&out2).unwrap();
    assert_eq!(v["tokens"], v2["tokens"]);
    // the issue-3 id interface still works
    let (code, out, _) = waste(&["run", m, "--ids", "305", "-n", "9", "--temp", "0", "--json"], "");
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tokens"], serde_json::json!([8, 119, 178, 172, 205, 117, 277, 272, 78]));
}

#[test]
fn tokenize_detokenize_roundtrip_and_modes() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let (code, out, _) = waste(&["tokenize", m, "<|open|>hello", "--json"], "");
    assert_eq!(code, 0);
    let plain: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(!plain["ids"].as_array().unwrap().contains(&serde_json::json!(308)));
    let (_, out, _) = waste(&["tokenize", m, "--text", "<|open|>hello", "--markup", "--json"], "");
    let markup: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(markup["ids"][0], 308);
    let ids: Vec<String> = plain["ids"].as_array().unwrap().iter().map(|x| x.to_string()).collect();
    let (_, out, _) = waste(&["detokenize", m, &ids.join(",")], "");
    assert_eq!(out.trim_end(), "<|open|>hello");
    // an id outside the vocabulary is an error, not silently less text
    let (code, out, err) = waste(&["detokenize", m, &format!("{},99999999", ids[0])], "");
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("token id 99999999 is not in the tokenizer's vocabulary"), "{err}");
    // stdin with `-`, and the standalone tiktoken form
    let (_, out2, _) = waste(&["tokenize", m, "-", "--json"], "<|open|>hello");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out2).unwrap(), plain);
    let o200k = anchor().join("../../tokenizers/o200k_base.tiktoken");
    let (code, out, err) =
        waste(&["tokenize", "--tiktoken", o200k.to_str().unwrap(), "--pattern", "o200k", "hello world", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let ids: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ids["ids"], serde_json::json!([24912, 2375]), "tiktoken's o200k ids for 'hello world'");
    let (code, _, err) = waste(&["tokenize", "--pattern", "nope", "--tiktoken", "/x"], "");
    assert_ne!(code, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn run_json_schema_is_enforced_and_thinking_goes_to_stderr() {
    let a = anchor();
    let m = a.to_str().unwrap();
    let schema = std::env::temp_dir().join(format!("waste-schema-{}.json", std::process::id()));
    std::fs::write(&schema, r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "k": {"enum": ["a", "b"]}}, "required": ["n", "k"], "additionalProperties": false}"#).unwrap();
    let sc = schema.to_str().unwrap();
    for seed in ["1", "2", "3"] {
        for raw in [false, true] {
            let mut args = vec![
                "run",
                m,
                "give me json",
                "--json-schema",
                sc,
                "--temp",
                "1",
                "--seed",
                seed,
                "-n",
                "200",
                "--json",
            ];
            if raw {
                args.push("--raw");
            }
            let (code, out, err) = waste(&args, "");
            assert_eq!(code, 0, "{err}");
            let r: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(r["finish_reason"], "stop", "{out}");
            let v: serde_json::Value =
                serde_json::from_str(r["text"].as_str().unwrap()).unwrap_or_else(|e| panic!("{out}: {e}"));
            assert!(
                (1..=9).contains(&v["n"].as_i64().unwrap()) && ["a", "b"].contains(&v["k"].as_str().unwrap()),
                "{v}"
            );
            assert_eq!(v.as_object().unwrap().len(), 2);
        }
    }
    std::fs::remove_file(&schema).ok();
    // thinking: the reasoning is apart from the answer (stderr when streamed)
    let (code, out, err) = waste(&["run", m, "hello", "--think", "-n", "12", "--json"], "");
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(!r["reasoning"].as_str().unwrap().is_empty(), "{out}");
    let (_, plain_out, plain_err) = waste(&["run", m, "hello", "--think", "-n", "12", "-q"], "");
    assert!(plain_err.contains(r["reasoning"].as_str().unwrap()), "{plain_err:?}");
    assert_eq!(plain_out.trim_end_matches('\n'), r["text"].as_str().unwrap());
    let (code, _, err) = waste(&["run", m, "hello", "--think", "huge"], "");
    assert_eq!(code, 2, "{err}");
}
