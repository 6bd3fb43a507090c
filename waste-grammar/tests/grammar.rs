//! Constraints driven by a "model" that picks uniformly among the allowed
//! tokens (the worst case for a grammar: nothing but the mask keeps it in
//! line). Every finished output must parse and satisfy its schema.

use serde_json::{json, Value};
use waste_grammar::{json_lark, tool_calls_lark, tool_section_lark, tool_section_trigger, Grammars};
use waste_tokenizer::TokenConstraint;
use waste_tokenizer::{xtml, Tokenizer};

fn tokenizer() -> Tokenizer {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("waste-grammar-tok-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    waste_synth::write_byte_tokenizer(&dir, 320).unwrap();
    let t = Tokenizer::from_container_dir(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir); // read into memory: nothing stays in the temp dir
    t
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Walk the constraint with uniform choices; the marked text (specials as
/// U+F8F2 name U+F8F3) until EOS, or None when `limit` tokens pass first.
fn walk(
    c: &mut dyn TokenConstraint,
    tok: &Tokenizer,
    eos: u32,
    seed: u64,
    limit: usize,
    free: &[u32],
) -> Option<String> {
    let mut rng = Rng(seed | 1);
    let mut mask = vec![false; 320];
    let mut out: Vec<u8> = Vec::new();
    let mut free = free.iter();
    for _ in 0..limit {
        mask.iter_mut().for_each(|m| *m = false);
        let constrained = c.allowed(&mut mask).unwrap();
        let id = if constrained {
            let allowed: Vec<u32> = (0..320u32).filter(|&i| mask[i as usize]).collect();
            assert!(!allowed.is_empty(), "the grammar allowed nothing");
            allowed[rng.below(allowed.len())]
        } else {
            *free.next().expect("unconstrained past the scripted tokens")
        };
        c.commit(id).unwrap();
        if id == eos {
            return Some(String::from_utf8(out).expect("the grammar keeps text UTF-8"));
        }
        if tok.is_special(id) {
            out.extend(format!("\u{F8F2}{}\u{F8F3}", tok.decode(&[id])).bytes());
        } else {
            out.extend(tok.token_bytes(id));
        }
    }
    None
}

fn schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"}},
      "required": ["name", "age", "kind", "ok"], "additionalProperties": false})
}

fn validates(v: &Value) -> bool {
    let o = v.as_object().unwrap();
    o.len() == 4
        && o["name"].as_str().is_some_and(|s| s.chars().count() <= 6)
        && o["age"].as_i64().is_some_and(|a| (0..=120).contains(&a))
        && ["cat", "dog"].contains(&o["kind"].as_str().unwrap_or(""))
        && o["ok"].is_boolean()
}

#[test]
fn plain_json_schema_outputs_validate() {
    let tok = tokenizer();
    let eos = tok.special_id("[EOS]").unwrap();
    let g = Grammars::new(&tok, 320, eos).unwrap();
    let mut finished = 0;
    for seed in 1..=12u64 {
        let mut c = g.constraint(&json_lark(Some(&schema()), false, false)).unwrap();
        if let Some(text) = walk(&mut c, &tok, eos, seed, 400, &[]) {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(validates(&v), "{text}");
            finished += 1;
        }
    }
    assert!(finished >= 10, "only {finished} of 12 walks finished");
}

#[test]
fn xtml_json_answer_closes_the_message() {
    let tok = tokenizer();
    let eos = tok.special_id(xtml::END_OF_MSG).unwrap();
    let g = Grammars::new(&tok, 320, eos).unwrap();
    let mut c = g.constraint(&json_lark(Some(&schema()), true, false)).unwrap();
    let text = walk(&mut c, &tok, eos, 5, 400, &[]).expect("finished");
    let mut p = xtml::OutputParser::new(false);
    let parts = p.push(&text);
    assert!(p.ended(), "{text:?}");
    let xtml::Part::Content(body) = &parts[0] else { panic!("{parts:?}") };
    assert!(validates(&serde_json::from_str(body).unwrap()), "{body}");
}

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"]}}}),
        json!({"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 5}}, "required": ["text"]}}}),
    ]
}

fn calls_of(text: &str) -> Vec<(String, Value)> {
    let mut p = xtml::OutputParser::new(false);
    let parts = p.push(text);
    assert!(p.ended(), "{text:?}");
    parts
        .into_iter()
        .filter_map(|x| match x {
            xtml::Part::ToolCall { name, arguments, .. } => Some((name, serde_json::from_str(&arguments).unwrap())),
            _ => None,
        })
        .collect()
}

#[test]
fn forced_calls_are_well_formed() {
    let tok = tokenizer();
    let eos = tok.special_id(xtml::END_OF_MSG).unwrap();
    let g = Grammars::new(&tok, 320, eos).unwrap();
    for seed in 1..=6u64 {
        let mut c = g.constraint(&tool_calls_lark(&tools(), None, true, false).unwrap()).unwrap();
        let text = walk(&mut c, &tok, eos, seed, 4000, &[]).expect("finished");
        let calls = calls_of(&text);
        assert!(!calls.is_empty());
        // numbered 1, 2, … as the template renders them
        for (k, _) in calls.iter().enumerate() {
            assert!(text.contains(&format!("index=\"{}\"\u{F8F2}", k + 1)), "{text}");
        }
        for (name, args) in calls {
            match name.as_str() {
                "get_weather" => {
                    assert!(["Paris", "Tokyo"].contains(&args["city"].as_str().unwrap()), "{args}");
                    assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
                }
                "note" => assert!(args["text"].as_str().unwrap().chars().count() <= 5),
                other => panic!("unknown tool {other}"),
            }
        }
    }
    // a named function without parallel calls: exactly one call, of it
    let mut c = g.constraint(&tool_calls_lark(&tools(), Some("note"), false, false).unwrap()).unwrap();
    let calls = calls_of(&walk(&mut c, &tok, eos, 9, 400, &[]).unwrap());
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, "note");
    assert!(tool_calls_lark(&tools(), Some("missing"), true, false).is_err());
}

#[test]
fn lazy_constraint_waits_for_the_tools_section() {
    let tok = tokenizer();
    let eos = tok.special_id(xtml::END_OF_MSG).unwrap();
    let g = Grammars::new(&tok, 320, eos).unwrap();
    let mut c = g.lazy(tool_section_trigger(), &tool_section_lark(&tools(), true).unwrap()).unwrap();
    let sp = |s: &str| tok.special_id(s).unwrap();
    // free text and the section opener, scripted; then the grammar takes over
    let mut free: Vec<u32> = tok.encode_plain("Hi.");
    free.extend([sp("<|close|>")]);
    free.extend(tok.encode_plain("response"));
    free.extend([sp("<|sep|>"), sp("<|open|>")]);
    free.extend(tok.encode_plain("tools"));
    free.push(sp("<|sep|>"));
    let text = walk(&mut c, &tok, eos, 3, 400, &free).expect("finished");
    assert!(c.active());
    let calls = calls_of(&text);
    assert!(!calls.is_empty());
}

/// A schema the engine refuses gets a message of readable size naming the
/// cause: the engine's listing repeated the whole schema (0.9 MB for this
/// one), which a server echoed into its 400 response.
#[test]
fn a_refused_schema_gets_a_short_message() {
    let tok = tokenizer();
    let eos = tok.special_id("[EOS]").unwrap();
    let g = Grammars::new(&tok, 320, eos).unwrap();
    // 2^14 leaves: beyond the engine's schema size limit
    let mut s = serde_json::json!({"type": "integer"});
    for _ in 0..14 {
        s = serde_json::json!({"anyOf": [s.clone(), {"type": "array", "items": s}]});
    }
    let e = g.constraint(&json_lark(Some(&s), false, false)).err().expect("refused").to_string();
    assert!(e.contains("schema too large"), "{}", &e[..e.len().min(300)]);
    assert!(e.len() < 2000, "{} bytes", e.len());
    let e = g.constraint(&json_lark(Some(&serde_json::json!({"type": "bogus"})), false, false)).err().unwrap();
    assert!(e.to_string().contains("Invalid type: bogus"), "{e}");
    // without the listing of the grammar written around the schema, or a
    // place in it: the user gave neither
    let e = e.to_string();
    assert!(!e.contains(" | ") && !e.contains("start:") && !e.starts_with("at "), "{e}");
    assert!(e.starts_with("failed to compile JSON schema"), "{e}");
}

/// A byte tokenizer with the K2 family's markers (Kimi-Linear's chat format).
fn k2_tokenizer() -> Tokenizer {
    use waste_tokenizer::k2::*;
    let dir = std::env::temp_dir().join(format!("waste-grammar-k2tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    waste_synth::write_byte_tokenizer(&dir, 320).unwrap();
    let names = [
        "[BOS]",
        IM_END,
        IM_USER,
        IM_ASSISTANT,
        IM_SYSTEM,
        IM_MIDDLE,
        SECTION_BEGIN,
        SECTION_END,
        CALL_BEGIN,
        ARGUMENT_BEGIN,
        CALL_END,
    ];
    let sp: Vec<Value> = names.iter().enumerate().map(|(i, t)| json!({"id": 256 + i, "text": t})).collect();
    std::fs::write(dir.join("specials.json"), Value::Array(sp).to_string()).unwrap();
    let t = Tokenizer::from_container_dir(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    t
}

/// The K2 calls in marked output: (id, name, arguments).
fn k2_calls_of(text: &str) -> Vec<(String, Value)> {
    use waste_tokenizer::xtml::Part;
    let mut p = waste_tokenizer::k2::OutputParser::new();
    p.push(text)
        .into_iter()
        .filter_map(|x| match x {
            Part::ToolCall { name, arguments, .. } => Some((name, serde_json::from_str(&arguments).unwrap())),
            _ => None,
        })
        .collect()
}

#[test]
fn k2_calls_are_well_formed_numbered_and_lazy_after_the_section_opens() {
    use waste_grammar::{k2_tool_calls_lark, k2_tool_section_lark, k2_tool_section_trigger};
    use waste_tokenizer::k2::IM_END;
    let tok = k2_tokenizer();
    let eos = tok.special_id(IM_END).unwrap();
    let g = Grammars::new(&tok, 320, eos).unwrap();
    let check = |name: &str, args: &Value| match name {
        "get_weather" => {
            assert!(["Paris", "Tokyo"].contains(&args["city"].as_str().unwrap()), "{args}");
            assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
        }
        "note" => assert!(args["text"].as_str().unwrap().chars().count() <= 5),
        other => panic!("unknown tool {other}"),
    };
    for seed in 1..=6u64 {
        // forced, parallel, after 3 calls earlier in the conversation
        let mut c = g.constraint(&k2_tool_calls_lark(&tools(), None, true, 3).unwrap()).unwrap();
        let text = walk(&mut c, &tok, eos, seed, 4000, &[]).expect("finished");
        let calls = k2_calls_of(&text);
        assert!(!calls.is_empty(), "{text}");
        for (k, (name, args)) in calls.iter().enumerate() {
            // numbered on from the conversation's calls, as the template numbers them
            assert!(text.contains(&format!("functions.{name}:{}\u{F8F2}", 3 + k)), "{text}");
            check(name, args);
        }
    }
    // named without parallel calls: exactly one, of it; an unknown name is refused
    let mut c = g.constraint(&k2_tool_calls_lark(&tools(), Some("note"), false, 0).unwrap()).unwrap();
    let calls = k2_calls_of(&walk(&mut c, &tok, eos, 9, 400, &[]).unwrap());
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, "note");
    assert!(k2_tool_calls_lark(&tools(), Some("missing"), true, 0).is_err());
    // auto: free text until the model opens the section, then held
    let mut c = g.lazy(k2_tool_section_trigger(), &k2_tool_section_lark(&tools(), true, 0).unwrap()).unwrap();
    let mut free: Vec<u32> = tok.encode_plain("Let me see.");
    free.push(tok.special_id(waste_tokenizer::k2::SECTION_BEGIN).unwrap());
    let text = walk(&mut c, &tok, eos, 5, 4000, &free).expect("finished");
    assert!(c.active());
    let calls = k2_calls_of(&text);
    assert!(!calls.is_empty(), "{text}");
    calls.iter().for_each(|(n, a)| check(n, a));
}
