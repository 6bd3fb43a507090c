//! Generation on the C WASTE's anchor container: stop strings across token
//! boundaries, seeded sampling, context-full signal, cancellation, state
//! save/load (exactness and validation).

mod common;

use std::path::{Path, PathBuf};
use waste_model::{Control, Finish, GenerateParams, Model, ModelOptions, SamplingParams};

fn anchor() -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
    base.join("anchor-tiny/kimi-linear-tiny.waste")
}

fn open(ctx: usize) -> Model {
    Model::open(anchor(), ModelOptions { ctx, threads: 1, ..ModelOptions::exact() }).unwrap()
}

fn params(n: usize) -> GenerateParams {
    GenerateParams { max_tokens: n, ..Default::default() }
}

/// An empty stop string would match before any text: refused before the
/// prompt is evaluated (the session stays where it was).
#[test]
fn an_empty_stop_string_is_refused() {
    let m = open(64);
    let mut s = m.session();
    let p = GenerateParams { stop_strings: vec!["x".into(), String::new()], ..params(4) };
    let e = s.generate(&[305, 12], &p, |_| Control::Continue).expect_err("empty stop accepted").to_string();
    assert!(e.contains("stop string is empty"), "{e}");
    assert_eq!(s.position(), 0);
}

#[test]
fn stop_strings_split_across_tokens_are_honoured_and_never_emitted() {
    let m = open(256);
    let tok = m.tokenizer().unwrap();
    let prompt = m.encode_raw("The city of Paris is").unwrap();
    let full = m.session().generate(&prompt, &params(40), |_| Control::Continue).unwrap();
    // a stop string made of the last char of one token and the first of the next
    let pieces: Vec<String> =
        full.tokens.iter().map(|&t| String::from_utf8_lossy(tok.token_bytes(t)).into_owned()).collect();
    let mut found = None;
    let mut at = 0;
    for i in 0..pieces.len() - 1 {
        at += pieces[i].len();
        let (a, b) = (&pieces[i], &pieces[i + 1]);
        if let (Some(x), Some(y)) = (a.chars().last(), b.chars().next()) {
            let s = format!("{x}{y}");
            if full.text.find(&s) == Some(at - x.len_utf8()) && x.is_ascii_graphic() && y.is_ascii_graphic() {
                found = Some(s);
                break;
            }
        }
    }
    let stop = found.expect("a stop string spanning two tokens");
    let p = GenerateParams { stop_strings: vec!["never-appears-xyz".into(), stop.clone()], ..params(40) };
    let mut streamed = String::new();
    let g = m
        .session()
        .generate(&prompt, &p, |ev| {
            streamed.push_str(&ev.piece);
            Control::Continue
        })
        .unwrap();
    let want = &full.text[..full.text.find(&stop).unwrap()];
    assert_eq!(g.finish, Finish::StopString(1));
    assert_eq!(g.text, want);
    assert_eq!(streamed, want, "the stream must never show the stop string");
    assert!(!streamed.contains(&stop));
}

#[test]
fn seeded_sampling_is_reproducible() {
    let m = open(256);
    let prompt = m.encode_raw("hello world").unwrap();
    let p = |seed| GenerateParams {
        sampling: SamplingParams { temperature: 1.0, top_p: 0.95, seed, ..Default::default() },
        ..params(24)
    };
    let a = m.session().generate(&prompt, &p(7), |_| Control::Continue).unwrap();
    let b = m.session().generate(&prompt, &p(7), |_| Control::Continue).unwrap();
    let c = m.session().generate(&prompt, &p(8), |_| Control::Continue).unwrap();
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(a.tokens, c.tokens);
}

#[test]
fn context_full_and_cancel_are_signalled() {
    let m = open(12);
    let g = m.session().generate(&[305, 1, 2, 3], &params(100), |_| Control::Continue).unwrap();
    assert_eq!(g.finish, Finish::ContextFull);
    assert_eq!(g.tokens.len(), 12 - 4 + 1);
    let mut n = 0;
    let g = open(64)
        .session()
        .generate(&[305], &params(100), |_| {
            n += 1;
            if n == 3 {
                Control::Cancel
            } else {
                Control::Continue
            }
        })
        .unwrap();
    assert_eq!((g.finish, g.tokens.len()), (Finish::Cancelled, 3));
}

#[test]
fn state_roundtrip_is_exact_and_bad_files_leave_the_session_untouched() {
    let m = open(128);
    let dir = std::env::temp_dir().join(format!("waste-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("s.state");
    let mut a = m.session();
    a.eval(&[305, 12, 40, 77, 256, 101]).unwrap();
    a.save_state(&f).unwrap();
    let cont = a.generate(&[33, 290], &params(10), |_| Control::Continue).unwrap();
    let mut b = m.session();
    b.eval(&[305, 9]).unwrap();
    let before = (b.position(), b.logits().to_vec());
    // damaged files: each refused, b unchanged
    let good = std::fs::read(&f).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", good[..good.len() - 4].to_vec()),
        ("extra", [good.clone(), vec![0; 4]].concat()),
        ("magic", [b"XXXX".to_vec(), good[4..].to_vec()].concat()),
        ("fingerprint", {
            let mut g = good.clone();
            g[8] ^= 1;
            g
        }),
        ("layer shape", {
            let mut g = good.clone();
            g[28 + 4] ^= 1;
            g
        }),
        ("empty", vec![]),
        ("a NaN logit", {
            let mut g = good.clone();
            let n = g.len();
            g[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
            g
        }),
        ("an infinite state value", {
            let mut g = good.clone();
            let n = g.len();
            g[n / 2 / 4 * 4..][..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
            g
        }),
    ];
    for (what, bytes) in cases {
        std::fs::write(&f, &bytes).unwrap();
        let e = b.load_state(&f).expect_err(what).to_string();
        if what.contains("NaN") || what.contains("infinite") {
            assert!(e.contains("is not finite"), "{what}: {e}");
        }
        assert_eq!((b.position(), b.logits().to_vec()), before, "{what} touched the session");
    }
    std::fs::write(&f, &good).unwrap();
    b.load_state(&f).unwrap();
    assert_eq!(b.position(), 6);
    let again = b.generate(&[33, 290], &params(10), |_| Control::Continue).unwrap();
    assert_eq!(again.tokens, cont.tokens);
    // a file that is neither a state nor a usage hotlist is never replaced
    // (`/save notes.txt` by mistake); a state file is
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, b"my notes").unwrap();
    let e = b.save_state(&notes).unwrap_err().to_string();
    assert!(e.contains("not a WASTE state file") && e.contains("nothing was written"), "{e}");
    let e = m.save_usage(&notes, 1).unwrap_err().to_string();
    assert!(e.contains("not a WASTE usage hotlist"), "{e}");
    assert_eq!(std::fs::read(&notes).unwrap(), b"my notes");
    b.save_state(&f).unwrap();
    let u = dir.join("u.waste");
    m.save_usage(&u, 1).unwrap();
    m.save_usage(&u, 2).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn snapshots_restore_exactly_and_refuse_what_does_not_fit() {
    let m = open(128);
    let mut a = m.session();
    a.eval(&[305, 12, 40, 77, 256, 101]).unwrap();
    let snap = a.snapshot();
    let cont = a.generate(&[33, 290], &params(10), |_| Control::Continue).unwrap();
    let mut b = m.session();
    b.restore_snapshot(&snap).unwrap();
    assert_eq!(b.position(), 6);
    assert_eq!(b.generate(&[33, 290], &params(10), |_| Control::Continue).unwrap().tokens, cont.tokens);
    // the same container opened with a context too small for the snapshot:
    // refused, the session unchanged (its cache is shorter than the
    // snapshot's positions)
    let small = open(4);
    let mut c = small.session();
    c.eval(&[305, 9]).unwrap();
    let before = (c.position(), c.logits().to_vec());
    let e = c.restore_snapshot(&snap).expect_err("a snapshot past ctx restored").to_string();
    assert!(e.contains("exceeds this session's ctx 4"), "{e}");
    assert_eq!((c.position(), c.logits().to_vec()), before);
    // another model
    let dir = std::env::temp_dir().join(format!("waste-snap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(anchor()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let mut man = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    man.push('\n'); // other manifest bytes, another fingerprint
    std::fs::write(dir.join("manifest.json"), man).unwrap();
    let other = Model::open(&dir, ModelOptions { ctx: 128, threads: 1, ..ModelOptions::exact() }).unwrap();
    let e = other.session().restore_snapshot(&snap).expect_err("another model's snapshot restored").to_string();
    assert!(e.contains("different model"), "{e}");
    drop(other);
    std::fs::remove_dir_all(&dir).ok();
}

/// Allows only the tokens of a fixed set, counting what it was told.
struct OnlySome {
    allowed: Vec<u32>,
    committed: Vec<u32>,
}

impl waste_model::TokenConstraint for OnlySome {
    fn allowed(&mut self, mask: &mut [bool]) -> Result<bool, waste_model::ConstraintError> {
        mask.fill(false);
        for &a in &self.allowed {
            mask[a as usize] = true;
        }
        Ok(true)
    }
    fn commit(&mut self, token: u32) -> Result<(), waste_model::ConstraintError> {
        self.committed.push(token);
        Ok(())
    }
}

#[test]
fn a_constraint_decides_every_token_and_leaves_logprobs_alone() {
    let m = open(256);
    let prompt = m.encode_raw("The city of Paris is").unwrap();
    let tok = m.tokenizer().unwrap();
    let allowed: Vec<u32> = tok.encode_plain(" ab");
    let mut c = OnlySome { allowed: allowed.clone(), committed: vec![] };
    let p = GenerateParams {
        sampling: SamplingParams { temperature: 1.0, seed: 3, ..Default::default() },
        top_logprobs: 1,
        ..params(12)
    };
    let mut lps = Vec::new();
    let g = m
        .session()
        .generate_constrained(&prompt, &p, Some(&mut c), |ev| {
            lps.push((ev.token, ev.logprob, ev.top.clone()));
            Control::Continue
        })
        .unwrap();
    assert_eq!(g.tokens.len(), 12);
    assert!(g.tokens.iter().all(|t| allowed.contains(t)), "{:?}", g.tokens);
    assert_eq!(c.committed, g.tokens);
    // logprobs are the model's own: the top alternative is the unconstrained argmax
    let free = m.session().generate(&prompt, &params(1), |_| Control::Continue).unwrap();
    assert_eq!(lps[0].2[0].0, free.tokens[0]);
    // nothing allowed is an error, not a silent pick
    let mut none = OnlySome { allowed: vec![], committed: vec![] };
    assert!(m.session().generate_constrained(&prompt, &params(2), Some(&mut none), |_| Control::Continue).is_err());
}

#[test]
fn marked_specials_are_distinguishable_from_lookalike_text() {
    let m = open(256);
    let tok = m.tokenizer().unwrap();
    let special = (0..tok.vocab_len() as u32)
        .find(|&i| tok.is_special(i) && !m.config().eos.contains(&i))
        .expect("the anchor has specials");
    let name = tok.decode(&[special]);
    let prompt = m.encode_raw("x").unwrap();
    // force: the special, then its text spelled with ordinary tokens
    let mut script: Vec<u32> = vec![special];
    script.extend(tok.encode_plain(&name));
    struct Script(Vec<u32>, usize);
    impl waste_model::TokenConstraint for Script {
        fn allowed(&mut self, mask: &mut [bool]) -> Result<bool, waste_model::ConstraintError> {
            mask.fill(false);
            mask[self.0[self.1] as usize] = true;
            Ok(true)
        }
        fn commit(&mut self, _: u32) -> Result<(), waste_model::ConstraintError> {
            self.1 += 1;
            Ok(())
        }
    }
    let n = script.len();
    let p = GenerateParams { mark_specials: true, ..params(n) };
    let g = m.session().generate_constrained(&prompt, &p, Some(&mut Script(script, 0)), |_| Control::Continue).unwrap();
    assert_eq!(g.text, format!("{}{name}{}{name}", waste_model::MARK_OPEN, waste_model::MARK_CLOSE));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// The `state_file` fuzz target's twin, on mutations of a *valid* state
    /// (past its magic and version, so the shape and length checks are
    /// reached): a loaded state or a precise error, never a panic; a failed
    /// load leaves the session exactly as it was.
    #[test]
    fn mutated_state_files_load_or_leave_the_session_untouched(
        edits in proptest::collection::vec((proptest::prelude::any::<u32>(), proptest::prelude::any::<u8>()), 1..5),
        cut in proptest::option::of(0usize..5000),
    ) {
        use std::sync::OnceLock;
        static M: OnceLock<(Model, Vec<u8>)> = OnceLock::new();
        let (m, good) = M.get_or_init(|| {
            let m = Model::open(anchor(), ModelOptions { ctx: 64, threads: 1, ..ModelOptions::exact() }).unwrap();
            let p = std::env::temp_dir().join(format!("waste-state-twin-{}.state", std::process::id()));
            {
                let mut s = m.session();
                s.eval(&[1, 2, 3, 4]).unwrap();
                s.save_state(&p).unwrap();
            }
            let b = std::fs::read(&p).unwrap();
            std::fs::remove_file(&p).ok();
            (m, b)
        });
        let mut b = good.clone();
        for &(pos, v) in &edits {
            let at = 8 + pos as usize % (b.len() - 8);
            b[at] = v;
        }
        if let Some(c) = cut {
            b.truncate(c.min(b.len()));
        }
        let mut s = m.session();
        s.eval(&[7, 8]).unwrap();
        let before = s.logits().to_vec();
        if s.load_state_bytes(&b, std::path::Path::new("mutated.state")).is_err() {
            proptest::prop_assert_eq!(s.position(), 2, "a failed load moved the session");
            // the session still continues as it would have
            let mut t = m.session();
            t.eval(&[7, 8]).unwrap();
            proptest::prop_assert_eq!(t.logits(), &before[..]);
            proptest::prop_assert_eq!(s.eval(&[9]).unwrap(), t.eval(&[9]).unwrap());
        }
    }
}

/// Text longer than the context can hold whatever its tokens (more than
/// ctx × the longest token's bytes) is refused before it is tokenized, by
/// every encoder a server or the C ABI reaches; text that may fit is
/// encoded as before.
#[test]
fn text_too_long_for_the_context_is_refused_before_tokenizing() {
    let m = open(16);
    let per = m.tokenizer().unwrap().max_token_bytes();
    assert!(per > 1, "the anchor's longest token has {per} bytes");
    let long = "a".repeat(16 * per + 1);
    let want = format!("the text is {} bytes: more than a context of 16 tokens can hold", long.len());
    let e = m.encode_raw(&long).unwrap_err().to_string();
    assert!(e.contains(&want), "{e}");
    let msgs = [waste_model::tokenizer::Message::new("user", &long)];
    let e = m.encode_chat(&msgs, true).unwrap_err().to_string();
    assert!(e.contains(&want), "{e}");
    let fits = "a".repeat(16 * per);
    assert!(!m.encode_raw(&fits).unwrap().is_empty());
}

#[test]
fn the_plan_counts_rendering_a_jinja_chat_template() {
    let plain = waste_model::plan(anchor(), 256).unwrap();
    assert_eq!(plain.template_bytes, 0, "the anchor's chat.json markup is tokenized as it is made");
    let copy = common::copy_container(&anchor(), "template-plan");
    let src = "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}";
    std::fs::write(copy.join("chat_template.jinja"), src).unwrap();
    let p = waste_model::plan(&*copy, 256).unwrap();
    // the template, its copy in a helper's request (≤ 6 bytes a byte), the markup bound
    let want = 7 * src.len() as u64 + waste_model::tokenizer::TEMPLATE_OUTPUT_BYTES as u64;
    assert_eq!(p.template_bytes, want);
    assert_eq!(p.floor_bytes, plain.floor_bytes + want, "in the floor");
    let m = Model::open(&*copy, ModelOptions { ctx: 256, ..ModelOptions::exact() }).unwrap();
    assert_eq!(m.plan().template_bytes, want, "the model's plan");
    assert_eq!(m.plan().floor_bytes, p.floor_bytes);
}

#[test]
fn the_plan_counts_tokenizing_the_longest_prompt_its_context_admits() {
    let tok = waste_tokenizer::Tokenizer::from_container_dir(&anchor()).unwrap();
    let mut last = 0;
    for ctx in [64usize, 4096, 65_536] {
        let p = waste_model::plan(anchor(), ctx).unwrap();
        // the longest text `encode_raw` accepts at this context
        let text = ctx * tok.max_token_bytes();
        assert_eq!(p.tokenize_bytes, tok.encode_working_bytes(text), "ctx {ctx}");
        assert!(p.tokenize_bytes > last, "ctx {ctx}: grows with the context");
        assert!(p.floor_bytes >= p.tokenizer_bytes + p.tokenize_bytes + p.trunk_bytes + p.state_bytes);
        last = p.tokenize_bytes;
        let m = Model::open(anchor(), ModelOptions { ctx, ..ModelOptions::exact() }).unwrap();
        assert_eq!(m.plan().tokenize_bytes, p.tokenize_bytes, "ctx {ctx}: the model's plan");
        let long = "a".repeat(text);
        assert!(m.encode_raw(&long).is_ok(), "ctx {ctx}: the longest text the plan counts is accepted");
        assert!(m.encode_raw(&(long + "a")).is_err(), "ctx {ctx}: one byte more is refused before tokenizing");
    }
}
